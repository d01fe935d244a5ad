"""`chunked_attention`: its own group, which keeps only the current chunk's blocks; masks by chunk."""

import torch

from hf_paged_cache.attention.torch_path import chunked_mask
from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.reach import Chunks
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.config import PagedCacheConfig
from hf_paged_cache.layer_types.base import LayerSpec
from hf_paged_cache.layer_types.registry import layer_type_for


def _spec(index=0, kwargs=None, **options) -> LayerSpec:
    return LayerSpec(index, kwargs or {}, PagedCacheConfig(**options), None, [])


def test_chunked_attention_has_its_own_group_and_reach():
    chunked, sliding = layer_type_for("chunked_attention"), layer_type_for("sliding_attention")
    spec = _spec(kwargs={"sliding_window": 8})
    assert chunked.group_name(spec) == "chunked_attention[8]" != sliding.group_name(spec)
    assert chunked.reach(spec.kwargs) == Chunks(8) and chunked.is_sliding and not chunked.evictable
    assert chunked.packing_refusal(None) is None


def test_chunked_mask_sizes_are_transformers_sliding_layer_of_the_chunk_size():
    """transformers serves chunked layers with its sliding layer of the chunk size (`DynamicSlidingWindowLayer`):
    the read range holds every row's chunk, and its mask hides the rest."""
    chunked = layer_type_for("chunked_attention")
    tables = BlockTables("chunked_attention[8]", BlockPool(4), 4, Chunks(8))
    assert chunked.mask_sizes(tables, 10, 1) == (8, 3)
    assert chunked.max_length(tables) == 8


def test_chunked_mask_sees_only_the_queries_own_chunk():
    mask = chunked_mask(3, 6, 6, 4, torch.device("cpu"))[0, 0]  # keys at 6..11, queries at 9, 10, 11
    assert mask.tolist() == [
        [False, False, True, True, False, False],  # 9: chunk [8, 12)
        [False, False, True, True, True, False],
        [False, False, True, True, True, True],
    ]


def _grow(tables: BlockTables, steps: int, pads: list[int]):
    tables.planner.apply_step(3, pads, lambda src, dst: None, lambda *args: None)
    for _ in range(steps):
        tables.planner.apply_step(1, [0] * len(pads), lambda src, dst: None, lambda *args: None)


def test_blocks_leave_as_the_chunk_moves_on_counted_from_each_rows_first_real_token():
    tables = BlockTables("chunked_attention[8]", BlockPool(32, growable=True), 2, Chunks(8))
    _grow(tables, 6, [0, 2])  # length 9: the step at 9 reads chunk [8, 16) of row 0 and [2, 10) of row 1
    tables.planner.apply_step(1, [0, 0], lambda src, dst: None, lambda *args: None)
    assert [row.base for row in tables.rows] == [8, 2]
    assert tables.stored_tokens(0) == 2 and tables.stored_tokens(1) == 8
    tables.planner.apply_step(1, [0, 0], lambda src, dst: None, lambda *args: None)  # at 10 row 1's next chunk begins
    assert tables.rows[1].base == 10 and tables.stored_tokens(1) == 1


def test_a_rows_read_starts_at_its_chunk_where_blocks_straddle_chunk_boundaries():
    """Blocks of 3 in chunks of 8: the block holding position 8 begins at 6, so it keeps two tokens of the last chunk.
    A step at 10 reads the row from its chunk's start (8: stored index 2 of the block at 6), not from the window's
    (`kv_offset` 3), so a lone query needs no mask to see its own chunk alone; the window stays transformers'."""
    tables = BlockTables("chunked_attention[8]", BlockPool(32, growable=True), 3, Chunks(8))
    _grow(tables, 7, [0])  # 10 tokens
    plan = tables.planner.apply_step(1, [0], lambda src, dst: None, lambda *args: None)
    assert (plan.kv_offset, plan.read_from, tables.rows[0].base, plan.read_start) == (3, [8], 6, [2])
    tables.padding_exact = False  # where chunks start is unknown, the row reads the whole window
    plan = tables.planner.apply_step(1, [0], lambda src, dst: None, lambda *args: None)
    assert (plan.kv_offset, plan.read_from) == (4, [4])


def test_unknown_padding_keeps_the_window_of_the_chunk_size():
    tables = BlockTables("chunked_attention[8]", BlockPool(32, growable=True), 2, Chunks(8))
    tables.padding_exact = False
    _grow(tables, 7, [0])
    assert tables.rows[0].base == max(tables.length - 1 - 8 + 1, 0) // 2 * 2


def test_a_long_generation_holds_one_chunk_of_blocks_and_one_more_per_row():
    """Llama-4 (chunks of 8, blocks of 4) over 40 new tokens: DynamicCache's tokens, and the chunked group never
    holds more than ceil(8 / 4) + 1 blocks per row after a step."""
    from tiny_models import MODELS_BY_NAME, PAD_ID, padded_batch
    from transformers import DynamicCache

    from hf_paged_cache import PagedCache

    model, config = MODELS_BY_NAME["llama4_chunked"].build()  # a model of its own: its forward is wrapped below
    ids, mask = padded_batch((0, 3, 7), 12)

    def generate(cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=40, do_sample=False,
                                  pad_token_id=PAD_ID)  # fmt: skip

    expected = generate(DynamicCache(config=config))
    cache, held, forward = PagedCache(config, block_size=4), [], model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        held.extend(len(table) for table in cache.groups["chunked_attention[8]"].tables)
        return out

    model.forward = recording
    assert torch.equal(generate(cache), expected)
    assert max(held[3:]) <= 8 // 4 + 1  # after the prompt's step, which stores all of it
