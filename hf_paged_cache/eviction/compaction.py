"""Compaction: a row keeps only its surviving tokens, moved to the front of its blocks, and the blocks it
no longer needs go back to the pool.

Units: a sealed quantized block is kept or dropped whole (its tokens share scales and are never
re-quantized, so no data moves); full-precision tokens are single units. The logical length never
changes: the row's `base` becomes virtual (`length - stored tokens`), so new tokens keep their positions,
and the true positions of the survivors are remembered in `Row.kept_positions`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..block_tables import BlockTables, ceil_div
from ..errors import OutOfBlocksError

TokenMover = Callable[[torch.Tensor, torch.Tensor], None]  # (source slots, target slots), all reads first


def unit_sizes(group: BlockTables, row: int) -> list[int]:
    """Sizes of the units a row's stored tokens are evicted in, in stored order."""
    return [group.block_size] * (group.quantized_tokens(row) // group.block_size) + [1] * group.stored_tokens(row)


def check_compact(group: BlockTables, keeps: dict[int, torch.Tensor], growable: bool) -> None:
    """Make sure compacting rows `keeps` finds the fresh blocks it needs: a row's shared (copy-on-write)
    blocks cannot be written, so its survivors go to fresh ones. A growable pool grows by the shortfall;
    a fixed one raises, changing nothing."""
    fresh = 0
    for row, keep in keeps.items():
        needed = ceil_div(int(keep[group.quantized_tokens(row) :].sum()), group.block_size)
        fresh += sum(1 for block in group.rows[row].blocks.ids[:needed] if group.pool.ref_count(block) > 1)
    if fresh > group.pool.num_free:
        if not growable:
            raise OutOfBlocksError(group.name, fresh, group.pool.num_free, group.pool.num_blocks, group.block_size)
        group.pool.grow(fresh - group.pool.num_free)


def compact(group: BlockTables, row: int, keep: torch.Tensor, move_tokens: TokenMover) -> int:
    """Keep the row's stored tokens where `keep` (bool, stored order) is True; returns tokens evicted.
    `move_tokens` moves K/V in every layer of the group."""
    positions = group.stored_positions(row)
    split = group.quantized_tokens(row)
    if split:
        _drop_quantized(group, row, keep[:split])
    _compact_full_precision(group, row, keep[split:], move_tokens)
    group.rows[row].kept_positions = positions[keep]
    group.plan = None
    return int((~keep).sum())


def _drop_quantized(group: BlockTables, row: int, keep: torch.Tensor) -> None:
    """Free the sealed blocks `keep` leaves out (whole blocks: no data moves)."""
    quantized = group.rows[row].quantized
    kept = keep.view(-1, group.block_size).all(dim=1).tolist()
    quantized.pool.free([block for block, stays in zip(quantized.ids, kept) if not stays])
    quantized.replace([block for block, stays in zip(quantized.ids, kept) if stays])


def _compact_full_precision(group: BlockTables, row: int, keep: torch.Tensor, move_tokens: TokenMover) -> None:
    """Move the surviving full-precision tokens, in order, to the front of the row's blocks (blocks shared
    with other rows are not written: fresh ones take their survivors) and free the rest."""
    bs, blocks, pool = group.block_size, group.rows[row].blocks, group.pool
    sources = keep.nonzero().flatten()
    needed = ceil_div(len(sources), bs)
    reusable = [block if pool.ref_count(block) == 1 else None for block in blocks.ids[:needed]]
    pool.free([block for block in blocks.ids if block not in reusable])
    targets = [block if block is not None else pool.allocate(1)[0] for block in reusable]
    src = torch.tensor(blocks.ids, dtype=torch.long)[sources // bs] * bs + sources % bs if len(sources) else sources
    dst = torch.tensor(targets, dtype=torch.long).repeat_interleave(bs)[: len(sources)] * bs
    dst = dst + torch.arange(len(sources)) % bs
    moved = src != dst
    if bool(moved.any()):
        move_tokens(src[moved], dst[moved])
    blocks.replace(targets)
    group.rows[row].base = group.length - len(sources)
