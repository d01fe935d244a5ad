"""A C++ decode attention for the CPU torch path: one query per row, read through the rows' block tables.

CPU attention otherwise needs each row's K/V contiguous: a row whose blocks are cut into several runs is copied
every step, and every row is one SDPA call. `paged_decode_cpu` reads every row's blocks where they lie, all rows in
one call (rows x KV heads spread over torch's threads). It is built on first use with torch's C++ extension loader
(a C++ compiler and ninja; `available()` says whether that worked) — without them the torch path runs as before.
Float32 only, no soft-cap and no sinks; `paged_decode_cpu_ref` is its torch reference.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from .reference import paged_decode_attention_ref

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")


@functools.cache
def available() -> bool:
    """Whether the C++ kernel is built and loaded (built once per machine into torch's extension cache)."""
    try:
        from torch.utils.cpp_extension import load

        flags = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for's threads are the pragmas in its header
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
            flags += ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]  # at::vec's AVX2 (Sleef) exp
        load(name="hf_paged_cache_cpu_decode", sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)  # fmt: skip
    except Exception as error:  # no compiler, no ninja, or a failed build: the torch path stays
        warnings.warn(f"hf_paged_cache: the CPU decode kernel was not built ({error}); using the torch path",
                      stacklevel=2)  # fmt: skip
        return False
    return True


def paged_decode_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, first_tokens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Row r's query `query[r]` `[heads, d]` over its tokens `first_tokens[r]` .. `seq_lens[r] - 1` (token t in block
    `block_tables[r, t // block_size]`) of `k_cache` / `v_cache` `[num_blocks, block_size, kv_heads, d]`: `[rows,
    heads, d]` (zeros for a row that reads nothing). Float32 CPU tensors; call `available()` first."""
    return torch.ops.hf_paged_cache.paged_decode_cpu(query, k_cache, v_cache, block_tables, seq_lens, first_tokens,
                                                     scale)  # fmt: skip


def paged_decode_cpu_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, first_tokens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Reference for `paged_decode_cpu`: the Triton kernels' reference, row by row, with a window of the row's read."""
    out = torch.zeros(*query.shape[:2], v_cache.shape[-1], dtype=query.dtype)
    for row, (first, stop) in enumerate(zip(first_tokens.tolist(), seq_lens.tolist())):
        if stop > first:
            out[row] = paged_decode_attention_ref(query[row : row + 1], k_cache, v_cache, block_tables[row : row + 1],
                                                  seq_lens[row : row + 1], scale, sliding_window=stop - first)[0]  # fmt: skip
    return out
