"""Token removal: survivors move to the front of the row's own blocks, the rest of its blocks return to the
pool, and the logical length (hence every new token's position) does not change."""

from __future__ import annotations

import torch

from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.eviction.removal import check_evict, evict_tokens, unit_sizes


def _no_copy(_sources: list[int], _targets: list[int]) -> None:
    raise AssertionError("no block is shared in this test")


def test_survivors_move_to_the_front_and_the_freed_blocks_return():
    pool = BlockPool(16)
    tables = BlockTables("full", pool, block_size=4)
    tables.planner.apply_step(10, [0], _no_copy, _no_copy)  # one row of 10 tokens in 3 blocks
    used = pool.num_used
    slots = torch.zeros(pool.num_blocks * 4, dtype=torch.long)  # what each slot holds: the token's position
    for index, block in enumerate(tables.rows[0].blocks.ids):
        slots[block * 4 : block * 4 + 4] = torch.arange(index * 4, index * 4 + 4)

    def move(sources: torch.Tensor, targets: torch.Tensor) -> None:
        slots[targets] = slots[sources[0]]

    keep = torch.tensor([True, True, False, False, True, False, True, False, True, True])
    assert unit_sizes(tables, 0) == [1] * 10
    check_evict(tables, {0: keep})  # no shared block: nothing fresh is needed
    assert evict_tokens(tables, 0, keep, move) == 4
    assert pool.num_used == used - 1 and tables.stored_count(0) == 6 and tables.length == 10
    survivors = [0, 1, 4, 6, 8, 9]
    assert tables.stored_positions(0).tolist() == survivors
    ids = tables.rows[0].blocks.ids
    assert torch.cat([slots[block * 4 : block * 4 + 4] for block in ids])[:6].tolist() == survivors
