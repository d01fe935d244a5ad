"""`BlockList` and `Row`: the one implementation of block-list edits, checked against the pool's counts."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.rows import BlockList, Row, blocks_freed


def _consecutive_from_run(blocks: BlockList) -> bool:
    ids = blocks.ids[blocks.run_from :]
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def test_extend_continues_the_run_and_marks_where_it_breaks():
    pool = BlockPool(8)
    first, second = BlockList(pool), BlockList(pool)
    assert first.extend(2) == [1, 2]
    assert second.extend(1) == [3]
    first.extend(2)  # block 3 is taken: the run breaks after [1, 2]
    assert first.ids == [1, 2, 4, 5] and first.run_from == 2
    assert _consecutive_from_run(first)


def test_replace_last_is_copy_on_write_of_a_shared_block():
    pool = BlockPool(8)
    blocks = BlockList(pool)
    blocks.extend(2)
    shared = blocks.fork()
    assert [pool.ref_count(b) for b in blocks.ids] == [2, 2]
    old, new = shared.replace_last()
    assert old == 2 and new not in blocks.ids and shared.ids == [1, new]
    assert pool.ref_count(2) == 1 and pool.ref_count(new) == 1


def test_drop_front_truncate_and_free_all_return_blocks():
    pool = BlockPool(8)
    blocks = BlockList(pool)
    blocks.extend(5)
    blocks.drop_front(2)
    assert blocks.ids == [3, 4, 5] and pool.num_used == 3
    blocks.truncate(1)
    assert blocks.ids == [3] and pool.num_used == 1
    blocks.free_all()
    assert blocks.ids == [] and pool.num_used == 0


def test_blocks_freed_counts_a_shared_block_only_when_every_reference_goes():
    pool = BlockPool(8)
    a = BlockList(pool)
    a.extend(2)
    b = a.fork()
    assert blocks_freed([(a, 1)]) == 0
    assert blocks_freed([(a, 1), (b, 1)]) == 1
    assert blocks_freed([(a, 2), (b, 2)]) == 2


def test_row_fork_shares_both_tables_and_release_returns_them():
    pool, qpool = BlockPool(8), BlockPool(8)
    row = Row(pads=2, base=2, blocks=BlockList(pool), quantized=BlockList(qpool), kept_positions=torch.arange(3))
    row.blocks.extend(2)
    row.quantized.extend(1)
    twin = row.fork()
    assert (twin.pads, twin.base, twin.blocks.ids, twin.quantized.ids) == (2, 2, [1, 2], [1])
    assert pool.ref_count(1) == 2 and qpool.ref_count(1) == 2
    row.release()
    assert pool.num_used == 2 and qpool.num_used == 1
    twin.release()
    assert pool.num_used == 0 and qpool.num_used == 0


def test_block_lists_are_the_full_precision_table_then_the_sealed_one_if_any():
    pool, qpool = BlockPool(4), BlockPool(4)
    plain = Row(pads=0, base=0, blocks=BlockList(pool))
    sealed = Row(pads=0, base=0, blocks=BlockList(pool), quantized=BlockList(qpool))
    assert plain.block_lists() == [plain.blocks]
    assert [blocks.pool for blocks in sealed.block_lists()] == [pool, qpool]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["extend", "fork", "cow", "drop", "truncate", "free"]),
                          st.integers(0, 3), st.integers(0, 4)), max_size=40))  # fmt: skip
def test_random_edits_keep_references_equal_to_table_entries(operations):
    """Every reference the pool counts belongs to exactly one table entry, and each table's run is right."""
    pool = BlockPool(64)
    lists = [BlockList(pool)]
    for operation, which, count in operations:
        blocks = lists[which % len(lists)]
        if operation == "extend" and count <= pool.num_free:
            blocks.extend(count)
        elif operation == "fork" and len(lists) < 4:
            lists.append(blocks.fork())
        elif operation == "cow" and blocks.ids and pool.num_free:
            blocks.replace_last()
        elif operation == "drop":
            blocks.drop_front(min(count, len(blocks)))
        elif operation == "truncate":
            blocks.truncate(count)
        elif operation == "free":
            blocks.free_all()
        entries: dict[int, int] = {}
        for table in lists:
            for block in table.ids:
                entries[block] = entries.get(block, 0) + 1
            assert _consecutive_from_run(table)
        assert all(pool.ref_count(block) == refs for block, refs in entries.items())
        assert pool.num_used == len(entries)
