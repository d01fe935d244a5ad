"""Per-request layers of a packed forward: each request's call gets its own slice, cache and no mask."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from hf_paged_cache import PagedCache
from hf_paged_cache.serving.recurrent import PerRequestLayers, holds_state, state_bytes


class Recording(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, hidden_states, cache=None, **kwargs):
        self.calls.append((hidden_states, cache, kwargs))
        return hidden_states * 2


class Decoder(torch.nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(Recording() for _ in range(count))


class Model(torch.nn.Module):
    def __init__(self, count: int = 2):
        super().__init__()
        self.decoder = Decoder(count)

    def get_decoder(self):
        return self.decoder


def _cache(first: str = "linear_attention") -> PagedCache:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config.layer_types = [first, "full_attention"]
    return PagedCache(config, block_size=4, num_blocks=8)


def test_each_request_gets_its_slice_its_cache_and_no_mask():
    model, template = Model(), _cache()
    layers = PerRequestLayers.of(model, template)
    caches, spans = [template.sibling(), template.sibling()], [(0, 3), (3, 5)]
    hidden, positions = torch.arange(10.0).reshape(1, 5, 2), torch.tensor([[4, 5, 6, 0, 1]])
    cos = torch.arange(15.0).reshape(1, 5, 3)
    with layers.split(caches, spans):
        out = model.decoder.layers[0](hidden, cache="packed", attention_mask=torch.ones(1, 1, 5, 5), use_cache=True,
                                      position_ids=positions, position_embeddings=(cos, cos))  # fmt: skip
    assert torch.equal(out, hidden * 2) and "forward" not in model.decoder.layers[0].__dict__
    calls = model.decoder.layers[0].calls
    for (states, cache, kwargs), own, (start, stop) in zip(calls, caches, spans):
        assert cache is own and kwargs["attention_mask"] is None and kwargs["use_cache"] is True
        assert torch.equal(states, hidden[:, start:stop])
        assert torch.equal(kwargs["position_ids"], positions[:, start:stop])
        assert torch.equal(kwargs["position_embeddings"][0], cos[:, start:stop])
    assert model.decoder.layers[1].calls == []  # attention layers are not split


def test_a_tensor_argument_it_cannot_split_is_refused_and_forward_is_restored():
    model, template = Model(), _cache()
    hooked = model.decoder.layers[0].forward
    model.decoder.layers[0].forward = hooked  # an instance-level forward (an accelerate hook) is put back as it was
    with pytest.raises(RuntimeError, match="'lengths', which the batch generator does not know how to split"):
        with PerRequestLayers.of(model, template).split([template.sibling()], [(0, 2)]):
            model.decoder.layers[0](torch.zeros(1, 2, 2), cache=None, lengths=torch.ones(2))
    assert model.decoder.layers[0].__dict__["forward"] == hooked


def test_models_without_recurrent_layers_need_no_split():
    assert PerRequestLayers.of(Model(), _cache("full_attention")) is None
    assert not holds_state(_cache("full_attention")) and holds_state(_cache())


def test_state_bytes_count_the_recurrent_and_conv_states():
    cache = _cache()
    assert state_bytes(cache) == 0
    layer = cache.layers[0]
    layer.update_conv_state(torch.zeros(1, 8, 3), conv_kernel_size=4)
    layer.update_recurrent_state(torch.zeros(1, 2, 4, 4))
    assert state_bytes(cache) == 4 * (8 * 4 + 2 * 4 * 4)
    cache.reset()
    assert state_bytes(cache) == 4 * (8 * 4 + 2 * 4 * 4)  # zeroed in place, freed with the cache
