"""A hybrid sequence's state, measured on the meta device from the config alone, against what a real tiny model's
layers hold after a forward (shapes, dtypes, bytes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny_models import MODELS_BY_NAME
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from hf_paged_cache.sequence_state import SequenceState, layer_states, sequence_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import zoo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = 7


def held(model, tokens: int) -> tuple[list[tuple], int]:
    """The state tensors (layer, kind, number, shape, dtype) a `DynamicCache` holds after a `tokens`-token forward,
    and every byte of its linear-attention layers (states, and the K/V of those that keep both)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + tokens)[None], cache=cache, use_cache=True)
    found, total = [], 0
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for kind, states in layer_states(layer).items():
            for number, state in states.items():
                if state is not None:
                    found.append((index, kind, number, tuple(state.shape), state.dtype))
                    total += state.numel() * state.element_size()
        if isinstance(layer, CacheLayerMixin):
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return found, total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "nemotron_h", "falcon_h1"])
def test_the_measured_state_is_what_the_model_holds_after_a_forward(name, dtype):
    """In bfloat16 the gated delta net's and Mamba-2's recurrent states stay float32: the measure sees it."""
    model = zoo.build(name)[0].to(dtype)
    state = sequence_state(model.config, dtype)
    found, total = held(model, TOKENS)
    assert [(t.layer, t.kind, t.index, t.shape, t.dtype) for t in state.tensors] == found
    assert state.bytes_at(TOKENS) == total and state.nbytes > 0
    assert (state.kv_bytes_per_token > 0) == (name == "falcon_h1")  # its layers keep attention K/V of their own


def test_a_model_without_recurrent_layers_holds_no_state_and_a_failed_measure_names_the_model():
    _model, config = MODELS_BY_NAME["llama_gqa"].build()
    assert sequence_state(config, torch.float32) == SequenceState() and SequenceState().bytes_at(100) == 0
    config = zoo.tiny_config("granitemoehybrid")  # every layer Mamba: DynamicCache itself cannot run it
    with pytest.raises(ValueError, match="Could not measure the recurrent state of one granitemoehybrid sequence"):
        sequence_state(config, torch.float32)
