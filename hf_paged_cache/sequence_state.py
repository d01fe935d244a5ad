"""What one sequence of a hybrid model holds outside the blocks: each recurrent / conv layer's state tensors, and
the K/V per token a layer that keeps both (a "hybrid" layer) stores beside them.

The sizes follow from the model's code as much as from its config (a gated delta net keeps its recurrent state in
float32 whatever the model's dtype; each model names its conv and state widths its own way), so they are measured
rather than restated: the model is built from its config on the meta device (no memory, no weights) and run on
one token with a `DynamicCache`, whose layers are the transformers layers a `PagedCache` delegates these types to;
their states then have the shape and dtype the real model gives them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs

from .layer_types.registry import layer_type_for


# Models whose recurrent layers (Mamba-1 mixers) drop their state at a chunk of several tokens (only the one-token
# step continues it), so a prompt computed in chunks would silently differ: the generator computes their prompts whole.
RESTARTS_STATE = frozenset(("jamba", "mamba", "falcon_mamba", "zamba"))


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of one sequence: layer `layer`'s `kind` state number `index`, `shape` with the batch
    dimension (1) first."""

    layer: int
    kind: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class SequenceState:
    """Every state tensor of one sequence, and the bytes per token of the K/V its per-request layers keep themselves."""

    tensors: tuple[StateTensor, ...] = ()
    kv_bytes_per_token: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state tensors (a state pool's slot)."""
        return sum(tensor.nbytes for tensor in self.tensors)

    def checkpointable(self, model_type: str) -> bool:
        """Whether a copy of one sequence's slot restores it after a prefix (the batch generator's prefix hits): its
        state is these tensors alone (no K/V of a layer's own, as Falcon-H1's) and its prompts may be cut (not a
        model of `RESTARTS_STATE`, whose prompts are computed whole)."""
        return self.kv_bytes_per_token == 0 and model_type not in RESTARTS_STATE

    def bytes_at(self, tokens: int) -> int:
        """Bytes outside the blocks of one sequence of `tokens` stored tokens: its state and its layers' own K/V."""
        return self.nbytes + tokens * self.kv_bytes_per_token


def layer_states(layer: LinearAttentionCacheLayerMixin) -> dict[str, dict[int, torch.Tensor | None]]:
    """A transformers linear-attention layer's state tensors by kind and state number (None: not initialized)."""
    return {"conv": layer.conv_states, "recurrent": layer.recurrent_states}


def sequence_state(config: PretrainedConfig, dtype: torch.dtype, model_class: type | None = None) -> SequenceState:
    """The state one sequence of a model of `config` in `dtype` holds outside the blocks (empty for a model without
    recurrent or conv layers). `model_class` builds the model (default: `AutoModelForCausalLM`'s for the config)."""
    names = get_layer_types_and_kwargs(config.get_text_config(decoder=True))[0]
    if not any(layer_type_for(name).per_request for name in names):
        return SequenceState()
    key = (config.to_json_string(), dtype, model_class)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(copy.deepcopy(config), names, dtype, model_class)  # building sets `config.dtype`
    return _MEASURED[key]


_MEASURED: dict[tuple, SequenceState] = {}  # one meta-device run per config, dtype and model class


def _measure(config: PretrainedConfig, names: list[str], dtype: torch.dtype, model_class: type | None) -> SequenceState:
    build = AutoModelForCausalLM.from_config if model_class is None else model_class._from_config
    try:
        with torch.device("meta"), torch.no_grad():
            # Experts as batched matmuls: the meta device has no float32 grouped matmul (and the MLP holds no state).
            model = build(config, dtype=dtype, experts_implementation="batched_mm")
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.zeros((1, 1), dtype=torch.long), cache=cache, use_cache=True)
    except Exception as error:  # noqa: BLE001 -- re-raised with what it was for
        raise ValueError(
            f"Could not measure the recurrent state of one {config.model_type} sequence: its model run on one token "
            f"on the meta device failed ({type(error).__name__}: {error})"
        ) from error
    tensors, kv_per_token = [], 0
    for index, (name, layer) in enumerate(zip(names, cache.layers)):
        if not layer_type_for(name).per_request:
            continue
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for kind, states in layer_states(layer).items():
                tensors += [StateTensor(index, kind, number, tuple(state.shape), state.dtype)
                            for number, state in states.items() if state is not None]  # fmt: skip
        if isinstance(layer, CacheLayerMixin) and layer.is_initialized:  # K/V of its own: one token's so far
            kv_per_token += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return SequenceState(tuple(tensors), kv_per_token)
