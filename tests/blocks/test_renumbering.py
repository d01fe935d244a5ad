"""`renumber_to_front` and the `remap` / `state_dict` / `load_state_dict` of the classes that hold block ids (`BlockList`, `Row`,
`BlockTables`, `QuantizedBlockTables`' sealed-copy records, `PrefixCache`)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from hf_paged_cache.blocks.renumbering import renumber_to_front
from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.rows import BlockList, Row
from hf_paged_cache.blocks.sealing import QuantizedBlockTables
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.serving.prefix_cache import PrefixCache


def _scattered(pool: BlockPool, ids: list[int]) -> BlockList:
    """A table holding exactly `ids` of `pool` (the others freed again)."""
    taken = pool.allocate(max(ids))
    pool.free([block for block in taken if block not in ids])
    blocks = BlockList(pool)
    blocks.replace(list(ids))
    return blocks


def test_packing_maps_the_blocks_in_use_to_the_low_ids_in_order():
    pool = BlockPool(8)
    _scattered(pool, [2, 5, 7])
    assert pool.front_renumbering() == {2: 1, 5: 2, 7: 3}
    assert pool.remapped_epoch(1) == pool.epoch(1) + 1
    epochs = [pool.remapped_epoch(block) for block in range(1, 9)]
    pool.remap(pool.front_renumbering())
    assert [pool.epoch(block) for block in range(1, 9)] == epochs


def test_pack_copies_the_moved_blocks_and_renumbers_every_holder_before_the_pool():
    pool = BlockPool(8)
    blocks = _scattered(pool, [2, 5, 7])
    copies, seen = [], []

    def holder(renumbering):
        seen.append((dict(renumbering[pool]), pool.ref_count(7)))  # the pool is not remapped yet
        blocks.remap(renumbering[pool])

    renumber_to_front([(pool, lambda sources, targets: copies.append((sources, targets)))], [holder])
    assert copies == [([2, 5, 7], [1, 2, 3])]
    assert seen == [({2: 1, 5: 2, 7: 3}, 1)]
    assert blocks.ids == [1, 2, 3] and [pool.ref_count(b) for b in range(1, 5)] == [1, 1, 1, 0]


def test_remap_keeps_the_read_path_or_takes_the_new_runs():
    pool = BlockPool(8)
    kept, rerun = _scattered(pool, [2, 4]), BlockList(pool, [2, 4], 1)
    mapping = {2: 1, 4: 2}
    kept.remap(mapping)
    rerun.remap(mapping, keep_runs=False)
    assert (kept.ids, kept.run_from) == ([1, 2], 1)
    assert (rerun.ids, rerun.run_from) == ([1, 2], 0)


def test_a_row_renumbers_only_its_tables_in_the_packed_pools():
    pool, qpool, host = BlockPool(8), BlockPool(8), BlockPool(8)
    row = Row(0, 0, _scattered(pool, [3, 6]), _scattered(host, [4]))
    row.remap({pool: {3: 1, 6: 2}, qpool: {}})
    assert row.blocks.ids == [1, 2] and row.quantized.ids == [4]


def test_repoint_moves_a_table_to_another_pool():
    device, host = BlockPool(4), BlockPool(4)
    blocks = _scattered(device, [2, 3])
    blocks.repoint(host, host.allocate(2))
    assert blocks.pool is host and blocks.ids == [1, 2] and device.num_free == 4


def test_tables_round_trip_through_their_state():
    pool = BlockPool(16)
    tables = BlockTables("full_attention", pool, 4)
    tables.rows = [Row(1, 1, _scattered(pool, [2, 3, 7])), Row(0, 0, BlockList(pool, [9], 0), None,
                                                                torch.tensor([0, 2, 5]))]  # fmt: skip
    pool.take(9)
    tables.length, tables.record_past = 10, True
    state = tables.state_dict()
    twin = BlockTables("full_attention", pool, 4)
    twin.load_state_dict(state)
    assert twin.state_dict()["rows"][0] == state["rows"][0]
    assert torch.equal(twin.rows[1].kept_positions, state["rows"][1]["kept_positions"])
    assert (twin.length, twin.record_past, twin.padding_exact, twin.tables) == (10, True, True, [[2, 3, 7], [9]])
    assert twin.rows[0].blocks.run_from == tables.rows[0].blocks.run_from == 2


def test_sealed_copy_records_and_prefix_entries_follow_a_pack_and_forget_stale_ones():
    pool, qpool = BlockPool(8), BlockPool(8)
    tables = QuantizedBlockTables("full_attention", pool, qpool, 4, None, None, 0)
    fp, sealed = _scattered(pool, [3, 6]), _scattered(qpool, [5])
    tables.rows = [Row(0, 0, fp, sealed)]
    tables.sealed_copies.update({3: (pool.epoch(3), 5, qpool.epoch(5)), 6: (pool.epoch(6) - 1, 5, qpool.epoch(5))})
    prefix = PrefixCache(SimpleNamespace(options=SimpleNamespace(block_size=4)))
    prefix.entries = {b"a": {"full_attention": (6, pool.epoch(6))}, b"b": {"full_attention": (2, pool.epoch(2))}}
    holders = [tables.remap, tables.remap_sealed_copies,
               functools.partial(prefix.remap, pools={"full_attention": pool})]  # fmt: skip
    renumber_to_front([(pool, lambda *_: None), (qpool, lambda *_: None)], holders)
    assert tables.tables == [[1, 2]] and tables.qtables == [[1]]
    assert tables.sealed_copies == {1: (pool.epoch(1), 1, qpool.epoch(1))}
    assert prefix.entries == {b"a": {"full_attention": (2, pool.epoch(2))}}
