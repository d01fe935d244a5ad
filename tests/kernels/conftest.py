"""Kernel tests: Triton kernels against their torch references, under the interpreter without a GPU.

TRITON_INTERPRET is read by ``@triton.jit`` when a kernel module is imported, so it is set here,
before any test module imports a kernel. Shapes stay tiny: the interpreter costs ~10 ms per program
per key tile. Shared helpers live in ``kernel_testing.py``.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))  # `import kernel_testing` under any pytest import mode

import pytest  # noqa: E402
from kernel_testing import DEVICE, PagedKV  # noqa: E402


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(0)


@pytest.fixture
def make_paged(generator):
    """``make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype) -> PagedKV``."""
    return lambda *args: PagedKV(*args, generator)


@pytest.fixture
def randn(generator):
    """``randn(*shape, dtype=...)``: seeded standard normal on the test device."""
    return lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)
