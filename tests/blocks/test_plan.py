"""`StepPlan`: the tensors a step's plan hands its layers, built once, agree with the tables' slots."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache.blocks.plan import ceil_div
from hf_paged_cache.blocks.pool import NULL_BLOCK, BlockPool
from hf_paged_cache.blocks.tables import BlockTables

BS = 4
CPU = torch.device("cpu")


def _no_copy(_sources: list[int], _targets: list[int]) -> None:
    raise AssertionError("no block is shared in these tests")


def _padded_plan():
    """Two rows of a 6-token prompt, the second left-padded by 2 (pads are not stored)."""
    tables = BlockTables("full", BlockPool(16), block_size=BS)
    return tables, tables.planner.apply_step(6, [0, 2], _no_copy, _no_copy)


def test_ceil_div_rounds_up():
    assert [ceil_div(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]


def test_padding_is_not_written_and_every_stored_token_has_its_slot():
    tables, plan = _padded_plan()
    assert plan.new_tokens == [6, 4] and plan.read_stop == [6, 4] and plan.base == [0, 2]
    assert plan.write_tokens.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]  # row 1's tokens 6, 7 are padding
    mapping = plan.tensor("slot_mapping", CPU)
    assert mapping[6:8].tolist() == [-1, -1]
    row_slots = [row.blocks.slots(0, count, tables.block_size) for row, count in zip(tables.rows, (6, 4))]
    stored = torch.cat(row_slots)
    assert torch.equal(mapping[mapping >= 0], stored) and torch.equal(plan.tensor("write_slots", CPU), stored)
    assert plan.tensor("query_lens", CPU).tolist() == [6, 4]
    assert plan.tensor("seq_lens", CPU).tolist() == [6, 4]  # a full-precision group: no quantized prefix
    assert plan.tensor("quantized_lens", CPU).tolist() == [0, 0]
    assert plan.tensor("quantized_block_tables", CPU).shape == (2, 0)


def test_block_tables_are_null_padded_and_the_gather_maps_unstored_positions_to_the_null_slot():
    tables, plan = _padded_plan()
    table = plan.tensor("block_tables", CPU)
    assert table.dtype == torch.int32 and table.tolist() == [tables.tables[0], tables.tables[1] + [NULL_BLOCK]]
    slots = plan.gather_slots()
    assert slots[1, :2].tolist() == [NULL_BLOCK * BS] * 2  # the padding
    row_slots = [row.blocks.slots(0, count, tables.block_size) for row, count in zip(tables.rows, (6, 4))]
    assert torch.equal(slots[1, 2:], row_slots[1]) and torch.equal(slots[0], row_slots[0])


def test_block_read_masks_each_slot_by_its_logical_position():
    tables, plan = _padded_plan()
    ids, positions, valid = plan.block_read()
    assert ids.tolist() == [tables.tables[0], tables.tables[1] + [NULL_BLOCK]]
    assert valid.sum(dim=1).tolist() == [6, 4]
    assert positions[0, valid[0]].tolist() == list(range(6)) and positions[1, valid[1]].tolist() == [2, 3, 4, 5]


def test_plan_tensors_are_built_once_per_device_and_unknown_names_raise():
    _tables, plan = _padded_plan()
    assert plan.tensor("slot_mapping", CPU) is plan.tensor("slot_mapping", CPU)
    assert plan.runs() is plan.runs()
    builds = []
    assert plan.cached("k", lambda: builds.append(1) or 7) == plan.cached("k", lambda: builds.append(1) or 8) == 7
    assert builds == [1]
    with pytest.raises(KeyError):
        plan.tensor("nothing", CPU)
