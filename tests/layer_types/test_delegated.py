"""Types the paged store does not hold: transformers' own layers serve them."""

from transformers import LlamaConfig
from transformers.cache_utils import LinearAttentionLayer

from hf_paged_cache import PagedCache
from hf_paged_cache.layer_types.registry import layer_type_for


def test_delegated_types_are_transformers_layers():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config.layer_types = ["linear_attention", "full_attention"]
    cache = PagedCache(config)
    assert isinstance(cache.layers[0], LinearAttentionLayer) and not cache.layer_types[0].stored
    assert "not stored in blocks (LinearAttentionLayer" in cache.layer_types[0].packing_refusal(cache.layers[0])
    assert not layer_type_for("compressed_sparse_attention").paged_readable
    assert layer_type_for("linear_attention").paged_readable
