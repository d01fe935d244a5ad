"""A step's K/V written to a paged cache on the CPU in one C++ call (`cpu_write_ops.cpp`), keys and values together,
with the destinations of the tokens ahead prefetched: a decode step's rows lie far apart in storage untouched since
the layer's previous step, and torch's `index_copy_` waits on each of them in turn, once per tensor. Built with the CPU
attention kernel (`cpu_attention.available()` says whether it is); its reference is `write_kv_ref`, which it matches
bit for bit (a copy).
"""

from __future__ import annotations

import torch


def write_kv_cpu(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """Store token i of `key` / `value` `[tokens, kv_heads, d]` (any strides with a contiguous d; the caches' dtype) at
    slot `slot_mapping[i]` (int64; negative: skipped) of `k_cache` / `v_cache` `[num_blocks, block_size, kv_heads, d]`.
    A slot past the cache is refused before anything is written."""
    torch.ops.hf_paged_cache.write_kv_cpu(k_cache, v_cache, key, value, slot_mapping)
