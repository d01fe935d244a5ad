"""Types the paged store does not hold: transformers' own layers serve them."""

from transformers import LlamaConfig
from transformers.cache_utils import LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionLayer

from hf_paged_cache import PagedCache
from hf_paged_cache.layer_types.registry import layer_type_for


def _config(first: str, **extra) -> LlamaConfig:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, **extra)  # fmt: skip
    config.layer_types = [first, "full_attention"]
    return config


def test_delegated_types_are_transformers_layers():
    cache = PagedCache(_config("linear_attention"))
    assert isinstance(cache.layers[0], LinearAttentionLayer) and not cache.layer_types[0].stored
    # The batch generator runs such layers once per request (it used to refuse them: "not stored in blocks").
    assert cache.layer_types[0].per_request and cache.layer_types[0].packing_refusal(cache.layers[0]) is None
    assert not cache.layer_types[1].per_request
    assert not layer_type_for("compressed_sparse_attention").paged_readable
    assert layer_type_for("linear_attention").paged_readable


def test_a_recurrent_layer_with_a_sliding_window_is_refused_by_the_packed_forward():
    cache = PagedCache(_config("hybrid_sliding", sliding_window=8))
    assert isinstance(cache.layers[0], LinearAttentionAndSlidingWindowAttentionLayer)
    assert "sliding-window attention in one layer" in cache.layer_types[0].packing_refusal(cache.layers[0])
