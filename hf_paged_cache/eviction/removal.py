"""Token removal: a row keeps only its surviving tokens, moved to the front of its blocks, and the blocks it
no longer needs go back to the pool (unlike `memory/defragment.py`, which packs whole blocks within a pool).

Units: a sealed quantized block is kept or dropped whole (its tokens share scales and are never
re-quantized, so no data moves); full-precision tokens are single units. The logical length never
changes: the row's `base` becomes virtual (`length - stored tokens`), so new tokens keep their positions,
and the true positions of the survivors are remembered in `Row.kept_positions`.

Per-head eviction (`keep` of shape `[kv_heads, n]`): every head keeps as many tokens, so each head's
survivors are moved to the front of the same blocks and the row stays one rectangle of slots; only the
positions differ by head (`kept_positions` `[kv_heads, n]`). Sealed blocks are kept or dropped for all
heads at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..blocks.plan import ceil_div
from ..blocks.tables import BlockTables

# (source slots `[1 or kv_heads, k]`, target slots `[k]`): every head's token k moves to target k, all reads first
TokenMover = Callable[[torch.Tensor, torch.Tensor], None]


def unit_sizes(group: BlockTables, row: int) -> list[int]:
    """Sizes of the units a row's stored tokens are evicted in, in stored order."""
    return [group.block_size] * (group.quantized_tokens(row) // group.block_size) + [1] * group.stored_tokens(row)


def check_evict(group: BlockTables, keeps: dict[int, torch.Tensor]) -> None:
    """Make sure evicting from rows `keeps` finds the fresh blocks it needs: a row's shared (copy-on-write)
    blocks cannot be written, so its survivors go to fresh ones. The pool reserves them (`BlockPool.reserve`:
    a growable pool grows, a fixed one raises, changing nothing)."""
    fresh = 0
    for row, keep in keeps.items():
        needed = ceil_div(kept_per_head(keep[..., group.quantized_tokens(row) :]), group.block_size)
        fresh += sum(1 for block in group.rows[row].blocks.ids[:needed] if group.pool.ref_count(block) > 1)
    group.pool.reserve(fresh, group=group.name, block_size=group.block_size)


def kept_per_head(keep: torch.Tensor) -> int:
    """Tokens each head keeps under `keep` (`[n]`, or `[kv_heads, n]` with the same count in every head)."""
    return int(keep.sum(dim=-1).flatten()[0]) if keep.numel() else 0


def evict_tokens(group: BlockTables, row: int, keep: torch.Tensor, move_tokens: TokenMover) -> int:
    """Keep the row's stored tokens where `keep` (bool `[n]` in stored order, or `[kv_heads, n]` per head) is
    True; returns the tokens evicted (per head). `move_tokens` moves K/V in every layer of the group."""
    heads_keep = keep if keep.dim() == 2 else keep[None]
    positions = group.stored_positions(row).expand(heads_keep.shape[0], -1)
    split = group.quantized_tokens(row)
    if split:
        _drop_quantized(group, row, heads_keep[0, :split])
    _move_survivors(group, row, heads_keep[:, split:], move_tokens)
    kept = positions[heads_keep].view(heads_keep.shape[0], -1)
    group.rows[row].kept_positions = kept if keep.dim() == 2 else kept[0]
    group.plan = None
    return keep.shape[-1] - kept_per_head(keep)


def _drop_quantized(group: BlockTables, row: int, keep: torch.Tensor) -> None:
    """Free the sealed blocks `keep` leaves out (whole blocks: no data moves)."""
    quantized = group.rows[row].quantized
    kept = keep.view(-1, group.block_size).all(dim=1).tolist()
    quantized.pool.free([block for block, stays in zip(quantized.ids, kept) if not stays])
    quantized.replace([block for block, stays in zip(quantized.ids, kept) if stays])


def _move_survivors(group: BlockTables, row: int, keep: torch.Tensor, move_tokens: TokenMover) -> None:
    """Move each head's surviving full-precision tokens (`keep` `[1 or kv_heads, m]`), in order, to the front
    of the row's blocks (blocks shared with other rows are not written: fresh ones take their survivors) and
    free the rest."""
    bs, blocks, pool = group.block_size, group.rows[row].blocks, group.pool
    heads, count = keep.shape[0], kept_per_head(keep)
    sources = keep.nonzero()[:, 1].view(heads, count)  # stored index of each head's survivors, in order
    needed = ceil_div(count, bs)
    reusable = [block if pool.ref_count(block) == 1 else None for block in blocks.ids[:needed]]
    pool.free([block for block in blocks.ids if block not in reusable])
    targets = [block if block is not None else pool.allocate(1)[0] for block in reusable]
    src = torch.tensor(blocks.ids, dtype=torch.long)[sources // bs] * bs + sources % bs if count else sources
    dst = torch.tensor(targets, dtype=torch.long).repeat_interleave(bs)[:count] * bs + torch.arange(count) % bs
    moved = (src != dst[None]).any(dim=0)
    if bool(moved.any()):
        move_tokens(src[:, moved], dst[moved])
    blocks.replace(targets)
    group.rows[row].base = group.length - count
