"""`full_attention`: one group (one per layer under eviction), every token kept."""

from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.config import PagedCacheConfig
from hf_paged_cache.layer_types.base import LayerSpec
from hf_paged_cache.eviction import SnapKV
from hf_paged_cache.layer_types.registry import layer_type_for


def _spec(index=0, kwargs=None, **options) -> LayerSpec:
    return LayerSpec(index, kwargs or {}, PagedCacheConfig(**options), None, [])


def test_full_attention_keeps_everything_in_one_group_unless_evicting():
    full = layer_type_for("full_attention")
    assert full.group_name(_spec(3)) == "full_attention"
    assert full.group_name(_spec(3, eviction=SnapKV(budget=64))) == "full_attention@3"
    tables = BlockTables("full_attention", BlockPool(4), 4)
    assert full.window({}) is None and full.mask_sizes(tables, 10, 2) == (12, 0) and full.max_length(tables) == -1
    assert full.kernel_window(tables) == 0 and full.read_window(tables) is None
    assert full.evictable and full.stored and not full.is_sliding
