"""`block_layout`, `kept_positions` and `cache_bytes`: what they report matches what the cache holds."""

import pytest
import torch
from transformers import DynamicCache

from hf_paged_cache import (PagedCache, StreamingLLM, block_layout, cache_bytes, kept_positions,
                            register_paged_attention)
from tiny_models import llama_gqa, padded_batch


def test_block_layout_of_a_left_padded_batch():
    model, config = llama_gqa()
    ids, mask = padded_batch((5, 0), length=12)
    cache = PagedCache(config, block_size=4)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() derives them: how the cache sees padding
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    (layout,) = block_layout(cache).values()
    assert (layout.name, layout.layers, layout.block_size) == ("full_attention", [0, 1], 4)
    assert layout.pads == [5, 0] and layout.stored_tokens == [7, 12]  # padding stores nothing
    assert [len(table) for table in layout.tables] == [2, 3] and layout.quantized_tables == [[], []]
    blocks = [block for table in layout.tables for block in table]
    assert len(set(blocks)) == 5 and 0 not in blocks  # distinct blocks; block 0 is the null block
    assert sum(map(len, layout.tables)) == cache.metrics().blocks_used
    layout.tables[0].clear()  # a copy: the cache is untouched
    assert len(block_layout(cache)["full_attention"].tables[0]) == 2


def test_block_layout_of_quantized_blocks():
    model, config = llama_gqa()
    cache = PagedCache(config, block_size=4, quant="int8", residual_length=4)
    with torch.no_grad():
        for chunk in torch.arange(3, 23).split(10):  # chunks longer than R seal their blocks as they arrive
            model(input_ids=chunk[None], cache=cache, use_cache=True)
    (layout,) = block_layout(cache).values()
    assert layout.name == "full_attention/int8" and layout.stored_tokens == [20]
    assert len(layout.quantized_tables[0]) == 4 and len(layout.tables[0]) == 1  # tokens 0-15 sealed, 16-19 not


def test_kept_positions_follow_eviction():
    model, config = llama_gqa()
    register_paged_attention()
    model.set_attn_implementation("paged")
    policy = StreamingLLM(budget=12, sinks=4, window=4)
    cache = PagedCache(config, block_size=4, eviction=policy, evict_every=10**9)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 43)[None], cache=cache, use_cache=True)
    for layer in (0, 1):  # the sinks and the most recent tokens
        assert kept_positions(cache, layer).tolist() == [0, 1, 2, 3] + list(range(32, 40))
    with pytest.raises(ValueError, match="layer_idx=2"):
        kept_positions(cache, 2)
    with pytest.raises(ValueError, match="row=1"):
        kept_positions(cache, 0, row=1)
    model.set_attn_implementation("sdpa")


def test_cache_bytes_measures_every_cache_alike():
    model, config = llama_gqa()
    ids = torch.arange(3, 23)[None]
    dynamic, paged = DynamicCache(config=config), PagedCache(config, block_size=16)
    with torch.no_grad():
        for cache in (dynamic, paged):
            model(input_ids=ids, cache=cache, use_cache=True)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K+V x KV heads x head dim x fp32
    assert cache_bytes(dynamic) == {"kv_bytes": 20 * per_token, "pool_bytes": 20 * per_token, "table_bytes": 0}
    metrics = paged.metrics()
    assert cache_bytes(paged) == {"kv_bytes": 32 * per_token, "pool_bytes": metrics.pool_bytes, "table_bytes": 8}
