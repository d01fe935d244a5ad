"""The memory layout of K/V block storage, shared by the cache layers, the kernels and their tests.

Each of K and V has the logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the layout
FlashAttention and vLLM index by), stored head-major: it is a permuted view of a
``[num_kv_heads, num_blocks, block_size, head_dim]`` tensor (a slice of a ``[num_kv_heads, capacity, ...]``
allocation when room is reserved to grow into). A head's run of consecutive blocks is
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
    capacity: int | None = None,
) -> torch.Tensor:
    """Uninitialised (or `fill`-ed) storage of logical shape `[num_blocks, block_size, num_kv_heads, head_dim]`.
    `capacity` (at least `num_blocks`): the blocks the allocation has room for, each head's stretch followed by
    untouched room for the storage to grow into as a longer view (`layers/storage.py`)."""
    capacity = max(num_blocks, capacity or 0)
    storage = torch.empty((num_kv_heads, capacity, block_size, head_dim), dtype=dtype, device=device)[:, :num_blocks]
    if fill is not None:
        storage.fill_(fill)
    return storage.permute(1, 2, 0, 3)


def heads_first(blocks: torch.Tensor) -> torch.Tensor:
    """Storage `[num_blocks, block_size, kv_heads, d]` as the view `[kv_heads, slots, d]`: consecutive slots of a head
    are contiguous memory."""
    return blocks.permute(2, 0, 1, 3).flatten(1, 2)


def gather_blocks(blocks: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Whole blocks `ids` `[rows, width]` of storage `[num_blocks, block_size, kv_heads, d]`, as
    `[rows, kv_heads, width * block_size, d]`: one index per block, contiguous per head."""
    by_head = blocks.permute(2, 0, 1, 3)  # the [kv_heads, num_blocks, block_size, d] of the layout
    rows, width = ids.shape
    gathered = by_head.index_select(1, ids.reshape(-1))
    return gathered.view(by_head.shape[0], rows, width * blocks.shape[1], blocks.shape[-1]).transpose(0, 1)
