"""`chunked_attention`: stored like a sliding window, served by neither the kernels nor the batch generator."""

from hf_paged_cache.config import PagedCacheConfig
from hf_paged_cache.layer_types.base import LayerSpec
from hf_paged_cache.layer_types.registry import layer_type_for


def _spec(index=0, kwargs=None, **options) -> LayerSpec:
    return LayerSpec(index, kwargs or {}, PagedCacheConfig(**options), None, [])


def test_chunked_attention_is_stored_like_sliding_but_read_by_transformers_mask_only():
    chunked, sliding = layer_type_for("chunked_attention"), layer_type_for("sliding_attention")
    spec = _spec(kwargs={"sliding_window": 8})
    assert chunked.group_name(spec) == sliding.group_name(spec) and chunked.is_sliding
    assert not chunked.kernels_read and chunked.packing_refusal(None) == "chunked attention"
