"""`BlockTables` reads by runs: where each row's blocks go, and the runs readers copy or view."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache.blocks.pool import NULL_BLOCK, BlockPool
from hf_paged_cache.blocks.tables import BlockTables


def _no_copy(_sources: list[int], _targets: list[int]) -> None:
    raise AssertionError("no block is shared in these tests")


def _runs_as_slots(tables: BlockTables, plan) -> torch.Tensor:
    """Expand `read_runs` into the slot of every column of the logical read range (the null slot before a
    row's first run), the layout `gather_slots` computes token by token."""
    total = plan.new_len - plan.kv_offset
    slots = torch.full((len(tables.rows), total), NULL_BLOCK * tables.block_size, dtype=torch.long)
    for row, runs in enumerate(tables.read_runs(plan)):
        for column, slot, count in runs:
            slots[row, column : column + count] = torch.arange(slot, slot + count)
    return slots


@pytest.mark.parametrize("window", [None, 7])
def test_runs_read_exactly_the_slots_of_the_token_by_token_gather(window):
    pool = BlockPool(64)
    tables = BlockTables("full", pool, block_size=4, sliding_window=window)
    plan = tables.apply_step(9, [0, 3, 8], _no_copy, _no_copy)
    strangers = []
    for step in range(14):
        if step % 3 == 1:  # another table takes blocks, so some rows' runs break
            strangers += pool.allocate(2, after=tables.rows[step % 3].blocks.ids[-1])
        plan = tables.apply_step(1, [0, 0, 0], _no_copy, _no_copy)
        assert torch.equal(_runs_as_slots(tables, plan), tables.gather_slots(plan.kv_offset, plan.new_len))
    assert any(len(runs) > 1 for runs in tables.read_runs(plan)), "the test should break some run"


def test_rows_of_a_ragged_batch_keep_one_run_each_while_they_decode():
    bs, lengths = 4, [3, 8, 13, 20]
    blocks = sum(-(-length // bs) for length in lengths)
    pool = BlockPool(blocks + 12)  # room for three more blocks per row
    tables = BlockTables("full", pool, block_size=bs)
    tables.apply_step(20, [20 - length for length in lengths], _no_copy, _no_copy)
    for _ in range(3 * bs - 1):
        plan = tables.apply_step(1, [0] * 4, _no_copy, _no_copy)
        assert [len(runs) for runs in tables.read_runs(plan)] == [1, 1, 1, 1]
    assert pool.num_used == sum(-(-(length + 3 * bs - 1) // bs) for length in lengths)  # no block more than needed
