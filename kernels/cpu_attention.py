"""A C++ paged attention for the CPU torch path: each row's causal queries (a decode token, a prompt chunk) over that
row's blocks, read through its block table.

CPU attention otherwise needs each row's K/V contiguous: a row whose blocks are cut into several runs is copied every
step, every row is one SDPA call, and torch's CPU flash kernel runs a prompt chunk well below the matrix products'
rate. `paged_attention_cpu` reads every row's blocks where they lie, all rows of a layer in one call (query tiles x KV
heads spread over torch's threads; each tile scores all heads of a KV head's group against a chunk of keys at once). It
is built on first use with torch's C++ extension loader for the instruction set torch reports (a C++ compiler and
ninja; `available()` says whether that worked) — without them the torch path runs as before. Float32 only, no soft-cap
and no sinks; `paged_attention_cpu_ref` is its torch reference.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from .reference import attention_ref, row_kv

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")

# The instruction set torch's own CPU kernels use here, and the flags at::vec needs for it.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}  # fmt: skip


@functools.cache
def available() -> bool:
    """Whether the C++ kernel is built and loaded (built once per machine and instruction set into torch's extension
    cache)."""
    try:
        from torch.utils.cpp_extension import load

        capability = torch.backends.cpu.get_cpu_capability()
        flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(capability, [])]  # OpenMP: at::parallel_for's threads
        name = f"hf_paged_cache_cpu_attention_{capability.lower() if capability in _CAPABILITY_FLAGS else 'default'}"
        load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=False)  # fmt: skip
    except Exception as error:  # no compiler, no ninja, or a failed build: the torch path stays
        warnings.warn(f"hf_paged_cache: the CPU attention kernel was not built ({error}); using the torch path",
                      stacklevel=2)  # fmt: skip
        return False
    return True


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_starts: torch.Tensor, seq_lens: torch.Tensor, first_tokens: torch.Tensor,
                        scale: float) -> torch.Tensor:  # fmt: skip
    """Row r's queries `query[query_starts[r] : query_starts[r + 1]]` (`[n, heads, d]`) are the last n of its stored
    tokens `first_tokens[r]` .. `seq_lens[r] - 1` (token t in block `block_tables[r, t // block_size]`) of `k_cache` /
    `v_cache` `[num_blocks, block_size, kv_heads, d]`, each attending causally over them: `[tokens, heads, d]` (zeros
    for a row that reads nothing). Float32 CPU tensors; call `available()` first."""
    return torch.ops.hf_paged_cache.paged_attention_cpu(query, k_cache, v_cache, block_tables, query_starts, seq_lens,
                                                        first_tokens, scale)  # fmt: skip


def paged_attention_cpu_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor,
                            first_tokens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
    """Reference for `paged_attention_cpu`: the Triton kernels' dense reference, row by row, over the row's read
    range."""
    out = torch.zeros(*query.shape[:2], v_cache.shape[-1], dtype=query.dtype)
    bounds = query_starts.tolist()
    for row, (first, stop) in enumerate(zip(first_tokens.tolist(), seq_lens.tolist())):
        begin, end = bounds[row], bounds[row + 1]
        if stop > first and end > begin:
            keys, values = row_kv(k_cache, v_cache, block_tables, row, stop)
            positions = torch.arange(stop - (end - begin), stop) - first  # the queries' places in the read range
            out[begin:end] = attention_ref(query[begin:end], positions, keys[first:], values[first:], scale)
    return out
