"""The registry: every transformers layer type resolves, an unknown one is refused, a registered one is used."""

import pytest
from transformers import LlamaConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

from hf_paged_cache import PagedCache
from hf_paged_cache.layer_types.base import LayerType
from hf_paged_cache.layer_types.full import FullAttention
from hf_paged_cache.layer_types.registry import is_known, layer_type_for, register_layer_type


def _config(**kwargs) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **kwargs)  # fmt: skip


@pytest.mark.parametrize("name", sorted(DYNAMIC_LAYER_TYPE_MAPPING))
def test_every_transformers_layer_type_resolves(name):
    layer_type = layer_type_for(name)
    assert isinstance(layer_type, LayerType) and layer_type.name == name and is_known(name)


def test_an_unknown_layer_type_is_refused_with_a_clear_error():
    assert not is_known("no_such_attention")
    with pytest.raises(ValueError, match="does not know the layer type 'no_such_attention'.*register_layer_type"):
        layer_type_for("no_such_attention")
    config = _config()
    config.layer_types = ["no_such_attention", "full_attention"]
    with pytest.raises(ValueError, match="no_such_attention"):
        PagedCache(config)


def test_register_takes_layer_type_classes_only():
    with pytest.raises(TypeError, match="LayerType subclass"):
        register_layer_type("not_a_type", dict)


def test_a_registered_throwaway_type_is_picked_up():
    class RecordedAttention(FullAttention):
        def group_name(self, spec):
            return f"recorded[{spec.index}]"

    register_layer_type("recorded_attention", RecordedAttention)
    config = _config()
    config.layer_types = ["recorded_attention", "full_attention"]
    cache = PagedCache(config, block_size=4, num_blocks=8)
    assert isinstance(cache.layer_types[0], RecordedAttention) and cache.layer_types[0].name == "recorded_attention"
    assert cache.layers[0].layer_type is cache.layer_types[0]
    assert list(cache.groups) == ["recorded[0]", "full_attention"]
