"""`BlockTables`: where each row's blocks go (runs readers view), and the planning of a step -- what it demands,
what it changes, and what windows, forks, crops and reorders do to the rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.blocks.pool import NULL_BLOCK, BlockPool
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.errors import OutOfBlocksError


def _no_copy(_sources: list[int], _targets: list[int]) -> None:
    raise AssertionError("no block is shared in these tests")


def _runs_as_slots(tables: BlockTables, plan) -> torch.Tensor:
    """Expand `StepPlan.runs` into the slot of every column of the logical read range (the null slot before a
    row's first run), the layout `StepPlan.gather_slots` computes token by token."""
    total = plan.new_len - plan.kv_offset
    slots = torch.full((len(tables.rows), total), NULL_BLOCK * tables.block_size, dtype=torch.long)
    for row, runs in enumerate(plan.runs()):
        for column, slot, count in runs:
            slots[row, column : column + count] = torch.arange(slot, slot + count)
    return slots


@pytest.mark.parametrize("window", [None, 7])
def test_runs_read_exactly_the_slots_of_the_token_by_token_gather(window):
    pool = BlockPool(64)
    tables = BlockTables("full", pool, block_size=4, reach=window)
    plan = tables.planner.apply_step(9, [0, 3, 8], _no_copy, _no_copy)
    strangers = []
    for step in range(14):
        if step % 3 == 1:  # another table takes blocks, so some rows' runs break
            strangers += pool.allocate(2, after=tables.rows[step % 3].blocks.ids[-1])
        plan = tables.planner.apply_step(1, [0, 0, 0], _no_copy, _no_copy)
        assert torch.equal(_runs_as_slots(tables, plan), plan.gather_slots())
    assert any(len(runs) > 1 for runs in plan.runs()), "the test should break some run"


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(1, 40), min_size=1, max_size=12, unique=True), data=st.data())
def test_slots_are_each_tokens_block_and_offset(ids, data):
    """`slots` builds one range per run of consecutive block ids: the same slots as token by token."""
    bs = 4
    pool = BlockPool(64)
    tables = BlockTables("full", pool, block_size=bs)
    tables.adopt(0, ids, len(ids) * bs)
    first = data.draw(st.integers(0, len(ids) * bs))
    count = data.draw(st.integers(0, len(ids) * bs - first))
    expected = [ids[token // bs] * bs + token % bs for token in range(first, first + count)]
    slots = tables.rows[0].blocks.slots(first, count, tables.block_size)
    assert slots.dtype == torch.long and slots.tolist() == expected


def test_rows_of_a_ragged_batch_keep_one_run_each_while_they_decode():
    bs, lengths = 4, [3, 8, 13, 20]
    blocks = sum(-(-length // bs) for length in lengths)
    pool = BlockPool(blocks + 12)  # room for three more blocks per row
    tables = BlockTables("full", pool, block_size=bs)
    tables.planner.apply_step(20, [20 - length for length in lengths], _no_copy, _no_copy)
    for _ in range(3 * bs - 1):
        plan = tables.planner.apply_step(1, [0] * 4, _no_copy, _no_copy)
        assert [len(runs) for runs in plan.runs()] == [1, 1, 1, 1]
    assert pool.num_used == sum(-(-(length + 3 * bs - 1) // bs) for length in lengths)  # no block more than needed


# ---------------------------------------------------------------------- planning: demands, then apply_step
def _state(tables: BlockTables) -> tuple:
    """Everything a step can change: the rows, the length, the pool's queue and reference counts."""
    rows = [(row.pads, row.base, list(row.blocks.ids), row.blocks.run_from) for row in tables.rows]
    return tables.length, rows, tables.pool.num_free, tables.pool.free_ids(), tables.pool.ref_counts()


def _record(calls: list) -> Callable[[list[int], list[int]], None]:
    return lambda sources, targets: calls.append((list(sources), list(targets)))


@settings(max_examples=60, deadline=None)
@given(
    window=st.sampled_from([None, 3, 6, 9]),
    pads=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    steps=st.lists(st.integers(1, 9), min_size=1, max_size=8),
)
def test_demands_say_exactly_what_apply_step_takes_and_change_nothing(window, pads, steps):
    tables = BlockTables("sliding", BlockPool(200), block_size=4, reach=window)
    for index, q_len in enumerate(steps):
        step_pads = [min(pad, q_len - 1) for pad in pads] if index == 0 else [0] * len(pads)
        before = _state(tables)
        ((pool, needed, freed, name),) = tables.planner.demands(q_len, step_pads, {})
        assert _state(tables) == before and pool is tables.pool and name == "sliding"
        used = pool.num_used
        start = tables.length
        tables.planner.apply_step(q_len, step_pads, _no_copy, _no_copy)
        assert pool.num_used == used + needed - freed
        for row in range(len(tables.rows)):  # what the rows hold: every stored token, within the window
            assert len(tables.rows[row].blocks) == -(-tables.stored_tokens(row) // 4)
            if window is not None and start > 0:  # it keeps the block its window starts in
                first, window_start = tables.first_stored(row), tables.read_offset(start)
                assert window_start - 4 < first <= max(window_start, tables.rows[row].pads)


def test_a_step_that_does_not_fit_a_fixed_pool_raises_before_anything_changes():
    tables = BlockTables("full", BlockPool(3), block_size=4)
    tables.planner.apply_step(10, [0], _no_copy, _no_copy)  # 3 blocks
    before = _state(tables)
    ((pool, needed, freed, name),) = tables.planner.demands(3, [0], {})
    assert (needed, freed) == (1, 0)
    with pytest.raises(OutOfBlocksError, match="for its full layers: this step needs 1 blocks but only 0 of 3"):
        pool.reserve(needed, group=name, block_size=tables.block_size, freed=freed)
    assert _state(tables) == before


def test_a_window_returns_the_blocks_it_leaves_and_a_recorded_past_keeps_them_until_trimmed():
    tables = BlockTables("sliding", BlockPool(20), block_size=4, reach=5)
    tables.record_past = True
    for _ in range(17):
        tables.planner.apply_step(1, [0], _no_copy, _no_copy)
    assert tables.first_stored(0) == 0 and tables.pool.num_used == 5
    tables.check_crop(3)  # the past is still there
    tables.record_past = False
    tables.trim_to_window()
    assert tables.first_stored(0) == 12 and tables.pool.num_used == 2  # the window [13, 17) starts in block 12..15
    with pytest.raises(RuntimeError, match="already dropped positions before 12"):
        tables.check_crop(3)


def test_a_write_into_a_shared_partly_filled_last_block_copies_it_first():
    tables = BlockTables("full", BlockPool(8), block_size=4)
    tables.planner.apply_step(6, [0], _no_copy, _no_copy)
    first, last = tables.tables[0]
    twin = tables.fork()
    assert tables.pool.ref_count(first) == tables.pool.ref_count(last) == 2
    ((_, needed, _, _),) = twin.planner.demands(1, [0], {})
    assert needed == 1  # the copy-on-write; the token fits the last block
    copies = []
    twin.planner.apply_step(1, [0], _record(copies), _no_copy)
    ((sources, targets),) = copies
    assert sources == [last] and twin.tables[0] == [first, targets[0]]
    assert tables.pool.ref_count(first) == 2 and tables.pool.ref_count(last) == 1
    ((_, needed, _, _),) = tables.planner.demands(1, [0], {})
    assert needed == 0  # the original's last block is its own again
    tables.planner.apply_step(1, [0], _no_copy, _no_copy)
    assert tables.tables[0] == [first, last]


def test_crop_frees_the_blocks_after_the_new_end_and_growth_resumes_there():
    tables = BlockTables("full", BlockPool(8), block_size=4)
    tables.planner.apply_step(13, [0], _no_copy, _no_copy)
    ids = list(tables.tables[0])
    tables.crop(9)
    assert tables.length == 9 and tables.tables[0] == ids[:3] and tables.pool.num_used == 3
    tables.crop(8)
    assert tables.tables[0] == ids[:2]
    plan = tables.planner.apply_step(1, [0], _no_copy, _no_copy)
    assert len(tables.tables[0]) == 3 and plan.read_stop == [9]
    tables.crop(0)
    assert tables.rows == [] and tables.length == 0 and tables.pool.num_used == 0


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(0, 12),
    window=st.sampled_from([None, 5]),
    batch=st.integers(1, 3),
    steps=st.lists(st.integers(1, 9), min_size=1, max_size=10),
)
def test_a_fixed_pool_either_fits_the_whole_demand_or_the_step_raises_having_changed_nothing(
    num_blocks, window, batch, steps
):
    tables = BlockTables("full", BlockPool(num_blocks), block_size=4, reach=window)
    for q_len in steps:
        before = _state(tables)
        try:
            for pool, needed, freed, name in tables.planner.demands(q_len, [0] * batch, {}):
                pool.check_reserve(needed, group=name, block_size=4, freed=freed)
        except OutOfBlocksError:
            assert _state(tables) == before
            continue
        tables.planner.apply_step(q_len, [0] * batch, _no_copy, _no_copy)  # a demand met never runs the pool dry
        assert tables.pool.num_used <= num_blocks
