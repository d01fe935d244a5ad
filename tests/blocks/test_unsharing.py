"""Unsharing (`sharing=False`): after a reorder every row gets its own copy of each shared block, taking exactly
what `unshare_demand` said before the reorder."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.blocks.unsharing import unshare, unshare_demand


def _no_copy(_sources: list[int], _targets: list[int]) -> None:
    raise AssertionError("no sealed block is shared in these tests")


def _record(calls: list) -> Callable[[list[int], list[int]], None]:
    return lambda sources, targets: calls.append((list(sources), list(targets)))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), data=st.data())
def test_reorder_shares_blocks_by_reference_and_unshare_takes_what_unshare_demand_said(lengths, data):
    tables = BlockTables("full", BlockPool(100), block_size=4)
    longest = max(lengths)
    tables.planner.apply_step(longest, [longest - length for length in lengths], _no_copy, _no_copy)
    order = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=5))
    expected = [list(tables.tables[source]) for source in order]
    demand = unshare_demand(tables, order)
    tables.reorder(order)
    assert tables.tables == expected
    holders = Counter(block for table in tables.tables for block in table)
    assert all(tables.pool.ref_count(block) == count for block, count in holders.items())
    assert tables.pool.num_used == len(holders)
    used = tables.pool.num_used
    copies = []
    unshare(tables, _record(copies), _no_copy)
    assert tables.pool.num_used == used + sum(count for _pool, count in demand)
    assert tables.pool.num_used == sum(len(table) for table in tables.tables)
    assert all(tables.pool.ref_count(block) == 1 for table in tables.tables for block in table)
