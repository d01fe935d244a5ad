"""Shared pytest setup.

Without a GPU the Triton kernels run under the interpreter; `TRITON_INTERPRET` must be set before
anything imports triton (transformers does, through `hf_paged_cache`), so it is set first of all.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import hf_paged_cache  # noqa: E402, F401  (registers the "paged" attention)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, above all on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
