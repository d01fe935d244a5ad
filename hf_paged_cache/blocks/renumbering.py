"""Renumbering to the front: the blocks in use of pools moved to ids 1..n in id order, so storage indexed by id can
shrink.

One mechanism for a cache trimming its own pool (`BlockTables.trim_pool`) and for defragmenting the pools of a
family of caches (`memory/defragment.py`): each caller names the pools with the copy of their storage, and the
holders of ids (tables, sealed-copy records, prefix-cache entries) that renumber themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from .pool import BlockPool

BlockCopier = Callable[[list[int], list[int]], None]  # copies block contents from source ids to target ids
Renumbering = Mapping[BlockPool, Mapping[int, int]]  # per pool, old id -> new id of every block in use
Holder = Callable[[Renumbering], None]  # a `remap` of something that holds block ids


def renumber_to_front(pools: Iterable[tuple[BlockPool, BlockCopier]], holders: Iterable[Holder]) -> Renumbering:
    """Move every pool's blocks in use to its front (with the copier of the storage it indexes) and renumber every holder. Holders run before
    the pools start new lifetimes (`BlockPool.remap`), so they can still tell their stale records from live ones."""
    pools = list(pools)
    renumbering = {pool: pool.front_renumbering() for pool, _copy in pools}
    for holder in holders:
        holder(renumbering)
    for pool, copy_blocks in pools:
        moved = {old: new for old, new in renumbering[pool].items() if old != new}
        if moved:
            copy_blocks(list(moved), list(moved.values()))
        pool.remap(renumbering[pool])
    return renumbering
