"""transformers' "dummy" layers: a KV-shared consumer reads its producer, any other stores nothing."""

from transformers import Gemma3TextConfig
from transformers.cache_utils import DummyLayer

from hf_paged_cache import PagedCache


def test_a_dummy_layer_without_a_producer_stores_nothing():
    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8)  # fmt: skip
    config.layer_types = ["moe", "full_attention"]
    cache = PagedCache(config)
    assert isinstance(cache.layers[0], DummyLayer) and cache.layer_types[0].name == "dummy"
    # The batch generator serves it packed (it used to refuse it): it touches no cache (Nemotron-H's MLP layers).
    assert cache.layer_types[0].packing_refusal(cache.layers[0]) is None and not cache.layer_types[0].per_request
