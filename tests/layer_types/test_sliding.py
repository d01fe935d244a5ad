"""`sliding_attention`: a group per window, masks as transformers' sliding layer."""

from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.config import PagedCacheConfig
from hf_paged_cache.layer_types.base import LayerSpec
from hf_paged_cache.layer_types.registry import layer_type_for


def _spec(index=0, kwargs=None, **options) -> LayerSpec:
    return LayerSpec(index, kwargs or {}, PagedCacheConfig(**options), None, [])


def test_sliding_attention_groups_by_window_and_reads_the_last_window():
    sliding = layer_type_for("sliding_attention")
    assert sliding.window({"sliding_window": 8}) == 8
    assert sliding.group_name(_spec(kwargs={"sliding_window": 8})) == "sliding_attention[8]"
    tables = BlockTables("sliding_attention[8]", BlockPool(4), 4, 8)
    assert sliding.mask_sizes(tables, 10, 1) == (8, 3)  # DynamicSlidingWindowLayer: window - 1 past tokens + 1
    assert sliding.max_length(tables) == sliding.kernel_window(tables) == sliding.read_window(tables) == 8
    assert sliding.is_sliding and not sliding.evictable and sliding.kernels_read
