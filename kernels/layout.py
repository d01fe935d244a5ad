"""The memory layout of K/V block storage, shared by the cache layers, the kernels and their tests.

Each of K and V has the logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the layout
FlashAttention and vLLM index by), stored head-major: it is a permuted view of a contiguous
``[num_kv_heads, num_blocks, block_size, head_dim]`` tensor. A head's run of consecutive blocks is
then one contiguous stretch of memory, so the torch path reads it as a plain view and attention streams
it at full bandwidth, and a kernel program that owns one KV head loads each block as one contiguous
``[block_size, head_dim]`` tile. Kernels take every stride explicitly; only ``head_dim`` must be
contiguous.
"""

from __future__ import annotations

import torch


def allocate_kv_blocks(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    fill: float | None = None,
) -> torch.Tensor:
    """Uninitialised (or `fill`-ed) storage of logical shape `[num_blocks, block_size, num_kv_heads, head_dim]`."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    storage = torch.empty(shape, dtype=dtype, device=device) if fill is None else torch.full(shape, fill, dtype=dtype, device=device)
    return storage.permute(1, 2, 0, 3)
