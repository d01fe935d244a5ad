"""Unsharing: every row of a group given its own copy of each block another table also holds.

With `sharing=False` a reorder (beam search) must leave no block referenced twice, as `DynamicCache`'s reorder
copies its tensors. Check-before-act like step planning: `unshare_demand` says what the copies take before the
reorder, so a shortage is reported with nothing changed, and `unshare` makes them once the caller reserved them.
"""

from __future__ import annotations

from collections import Counter

from .renumbering import BlockCopier
from .pool import BlockPool
from .rows import Row
from .tables import BlockTables


def unshare_demand(tables: BlockTables, order: list[int]) -> list[tuple[BlockPool, int]]:
    """(pool, fresh blocks) that `unshare` takes after `tables.reorder(order)`: one per reference beyond the first
    (computed before the reorder)."""
    def holders(rows: list[Row]) -> Counter:
        return Counter((id(blocks.pool), block) for row in rows for blocks in row.block_lists()
                       for block in blocks.ids)  # fmt: skip

    pools = {id(pool): pool for pool in tables.pools() if pool is not None}
    before, after = holders(tables.rows), holders([tables.rows[source] for source in order])
    demand = Counter()
    for (pool, block), count in after.items():
        demand[pool] += max(pools[pool].ref_count(block) - before[(pool, block)] + count - 1, 0)
    return [(pools[pool], count) for pool, count in demand.items() if count]


def unshare(tables: BlockTables, copy_blocks: BlockCopier, copy_quantized: BlockCopier) -> None:
    """Give every row its own copy of each block another table also holds; the caller checked `unshare_demand`
    against the free blocks. `copy_blocks` copies full-precision blocks, `copy_quantized` sealed ones."""
    for blocks in (blocks for row in tables.rows for blocks in row.block_lists()):
        shared = [index for index, block in enumerate(blocks.ids) if blocks.pool.ref_count(block) > 1]
        if not shared:
            continue
        sources = [blocks.ids[index] for index in shared]
        fresh = blocks.pool.allocate(len(shared))
        (copy_blocks if blocks.pool is tables.pool else copy_quantized)(sources, fresh)
        blocks.pool.free(sources)
        ids = list(blocks.ids)
        for index, block in zip(shared, fresh):
            ids[index] = block
        blocks.replace(ids)
    tables.drop_plan()
