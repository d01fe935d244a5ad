"""`QuantizedBlockTables`: which blocks a step seals, and when, follows positions, never step sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.sealing import QuantizedBlockTables
from hf_paged_cache.errors import OutOfBlocksError

BS = 4


def _tables(residual_length: int, sliding_window: int | None = None) -> QuantizedBlockTables:
    return QuantizedBlockTables("full/int8", BlockPool(100), BlockPool(100), BS, sliding_window, None, residual_length)


def _no_copy(_sources: list[int], _targets: list[int]) -> None:
    raise AssertionError("no block is shared in these tests")


def _seals(calls: list):
    return lambda sources, targets, keep: calls.append((list(sources), list(targets), list(keep)))


@settings(max_examples=60, deadline=None)
@given(residual=st.sampled_from([0, 1, 3, 4, 9]), steps=st.lists(st.integers(1, 14), min_size=1, max_size=8))
def test_a_row_seals_what_token_by_token_growth_would_have_sealed(residual, steps):
    """After a step from `start` to `length`: a step of at most R tokens seals what its first token reads
    quantized (as token-by-token growth to `start + 1`), a longer one what growth to `length` would."""
    tables, window = _tables(residual), max(residual, 1)
    for q_len in steps:
        start = tables.length
        demands = tables.planner.demands(q_len, [0], {})
        used = [pool.num_used for pool, _needed, _freed, _name in demands]
        calls = []
        plan = tables.planner.apply_step(q_len, [0], _no_copy, _seals(calls))
        for (pool, needed, freed, _name), before in zip(demands, used):
            assert pool.num_used == before + needed - freed
        reach = tables.length if q_len > window else start + 1
        sealed = max(reach - window, 0) // BS if start or q_len > window else 0
        assert len(tables.qtables[0]) == sealed == tables.qpool.num_used
        assert tables.stored_count(0) == tables.length == start + q_len
        assert len(tables.tables[0]) == -(-tables.stored_tokens(0) // BS) == tables.pool.num_used
        arrived = [block for _row, _first, _sources, _older, fresh in plan.arrivals for block in fresh]
        assert arrived == tables.qtables[0][len(tables.qtables[0]) - len(arrived) :]
        assert sum(len(targets) for _sources, targets, _keep in calls) + len(arrived) <= sealed


def test_demands_name_both_pools_and_the_quantized_one_as_such():
    tables = _tables(residual_length=2)
    tables.planner.apply_step(9, [0], _no_copy, _seals([]))
    (fp, fp_needed, _, fp_name), (quantized, needed, _, name) = tables.planner.demands(1, [0], {})
    assert (fp, fp_name) == (tables.pool, "full/int8") and (quantized, name) == (tables.qpool, "full/int8 (quantized)")
    assert tables.pools()[1] is tables.qpool


def test_a_crop_into_the_sealed_prefix_works_at_a_block_boundary_and_raises_elsewhere():
    tables = _tables(residual_length=2)
    for _ in range(12):
        tables.planner.apply_step(1, [0], _no_copy, _seals([]))
    assert len(tables.qtables[0]) == 2  # tokens 0..7 sealed, 8..11 in full precision
    with pytest.raises(RuntimeError, match="position 6 lies inside a quantized block"):
        tables.check_crop(6)
    tables.check_crop(4)
    tables.crop(4)
    assert tables.length == 4 and len(tables.qtables[0]) == 1 and tables.tables[0] == []
    assert tables.qpool.num_used == 1 and tables.pool.num_used == 0


def test_forks_share_one_sealed_copy_of_a_shared_block():
    tables = _tables(residual_length=1)
    tables.planner.apply_step(BS, [0], _no_copy, _seals([]))  # one full block, nothing sealed yet
    twin = tables.fork()
    calls = []
    tables.planner.apply_step(1, [0], _no_copy, _seals(calls))  # its first token reads block 0 quantized: sealed
    ((sources, targets, _keep),) = calls
    assert sources == [1] and tables.pool.ref_count(1) == 1  # the twin still holds the full-precision block
    twin_calls = []
    twin.planner.apply_step(1, [0], _no_copy, _seals(twin_calls))
    assert twin_calls == [], "the twin takes a reference to the copy, sealing nothing"
    assert twin.qtables[0] == tables.qtables[0] == targets and tables.qpool.ref_count(targets[0]) == 2
    assert tables.pool.num_used == 2  # block 1 went back: each side holds only its new block


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.tuples(st.integers(0, 8), st.integers(0, 8)),
    residual=st.sampled_from([1, 4, 6]),
    steps=st.lists(st.integers(1, 12), min_size=1, max_size=8),
)
def test_both_pools_either_fit_the_demand_or_the_step_raises_having_changed_nothing(sizes, residual, steps):
    tables = QuantizedBlockTables("full/int8", BlockPool(sizes[0]), BlockPool(sizes[1]), BS, None, None, residual)

    def state():
        rows = [(row.base, list(row.blocks.ids), list(row.quantized.ids)) for row in tables.rows]
        return tables.length, rows, tables.pool.free_ids(), tables.qpool.free_ids()

    for q_len in steps:
        before = state()
        try:
            for pool, needed, freed, name in tables.planner.demands(q_len, [0, 0], {}):
                pool.check_reserve(needed, group=name, block_size=BS, freed=freed)
        except OutOfBlocksError:
            assert state() == before
            continue
        tables.planner.apply_step(q_len, [0, 0], _no_copy, _seals([]))  # a demand met never runs a pool dry
