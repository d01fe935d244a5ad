"""Layers whose state runs along one sequence (linear attention, Mamba, convolutions) in a packed forward.

A packed forward concatenates many requests into one row. Attention layers split it by request in
`PackedCache.update`, but a recurrent or convolutional layer would carry its state across the requests'
boundaries. So each decoder layer whose type says `per_request` runs once per request: on that request's slice
of the hidden states and positions, with that request's own `PagedCache` (which holds the layer's state,
empty before its first chunk), and the outputs are concatenated back in order.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from ..cache import PagedCache
from ..errors import UnsupportedModelError
from ..forwards import decoder_layers, swapped_forwards

CACHE_KWARGS = ("cache", "past_key_values")  # the name transformers passes a decoder layer its cache by
# Models whose recurrent layers drop their state at a chunk of several tokens (only the one-token step continues
# it), so a prompt computed in chunks would silently differ.
RESTARTS_STATE = dict.fromkeys(("jamba", "mamba", "falcon_mamba", "zamba"),
                               "its Mamba mixer's multi-token path starts from an empty state")  # fmt: skip


class PerRequestLayers:
    """The decoder layers of `model` that a packed forward runs once per request (`indices`, from the cache's
    layer types); `split(caches, spans)` makes them so for the forward it encloses."""

    def __init__(self, model: torch.nn.Module, indices: list[int], num_layers: int):
        modules = decoder_layers(model, num_layers)
        # Once each, should a model reuse one module at several indices: the wrapper reads the cache it is given.
        self.layers = list({id(modules[index]): modules[index] for index in indices}.values())

    @classmethod
    def of(cls, model: torch.nn.Module, template: PagedCache) -> PerRequestLayers | None:
        """The per-request layers of a model served with caches like `template`; None when it has none."""
        indices = per_request_indices(template)
        if not indices:
            return None
        why = RESTARTS_STATE.get(template.model_config.model_type)
        if why is not None:
            raise ValueError(
                f"The batch generator cannot serve {template.model_config.model_type}: {why}, so prompts computed in "
                "chunks would differ; use `model.generate` with a `PagedCache` for this model"
            )
        return cls(model, indices, len(template.layers))

    def split(self, caches: list[PagedCache], spans: list[tuple[int, int]]) -> AbstractContextManager[None]:
        """Within the block, the layers run per request (`caches[i]` takes tokens `spans[i]`)."""
        return swapped_forwards(self.layers, [_per_request(module, module.forward, caches, spans)
                                              for module in self.layers])  # fmt: skip


def _per_request(module: torch.nn.Module, forward, caches: list[PagedCache], spans: list[tuple[int, int]]):
    def run(hidden_states: torch.Tensor, *args, **kwargs):
        names = [name for name in CACHE_KWARGS if name in kwargs]
        if args or len(names) != 1:
            raise UnsupportedModelError(
                f"{type(module).__name__} is called with positional arguments after the hidden states, or without a "
                "`cache=` keyword, so the batch generator cannot run it per request: use `model.generate` with a "
                "`PagedCache` for this model"
            )
        outs = []
        for cache, (start, stop) in zip(caches, spans):
            own = {key: _request_slice(key, value, start, stop) for key, value in kwargs.items()}
            own[names[0]] = cache
            outs.append(forward(hidden_states[:, start:stop], **own))
        if not isinstance(outs[0], tuple):
            return torch.cat(outs, dim=1)
        if len(outs[0]) != 1:
            raise UnsupportedModelError(f"{type(module).__name__} returns more than its hidden states, which the "
                                        "batch generator cannot join across requests: use `model.generate` with a "
                                        "`PagedCache`")  # fmt: skip
        return (torch.cat([out[0] for out in outs], dim=1),)  # some models' layers return a one-tuple

    return run


def _request_slice(key: str, value, start: int, stop: int):
    """What one request's call gets of a decoder layer's keyword argument `key` of the packed call."""
    if key.endswith("mask"):
        # One request alone has no padding and is causal: what transformers says with no mask, both to attention
        # (the "paged" attention then masks causally) and to recurrent layers (nothing to zero out).
        return None
    if key == "position_ids" and value is not None:
        return value[..., start:stop]
    if key == "position_embeddings" and value is not None:
        return tuple(part[..., start:stop, :] for part in value)
    if isinstance(value, torch.Tensor) and key not in CACHE_KWARGS:
        raise UnsupportedModelError(
            f"a decoder layer of this model takes the tensor {key!r}, which the batch generator does not know how to "
            "split by request: use `model.generate` with a `PagedCache` for this model"
        )
    return value


def per_request_indices(cache: PagedCache) -> list[int]:
    """Indices of the layers of `cache` that a packed forward runs per request."""
    return [index for index, layer_type in enumerate(cache.layer_types) if layer_type.per_request]


def state_bytes(cache: PagedCache) -> int:
    """Bytes held by the per-request layers of `cache` (recurrent and convolutional states, and the K/V a hybrid
    layer keeps beside them): memory outside the pools, allocated by transformers' layers as a request runs."""
    total = 0
    for index in per_request_indices(cache):
        layer = cache.layers[index]
        tensors = []
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors += [*layer.conv_states.values(), *layer.recurrent_states.values()]
        if isinstance(layer, CacheLayerMixin):
            tensors += [layer.keys, layer.values]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def holds_state(cache: PagedCache) -> bool:
    """Whether `cache` has per-request layers: their state lives in the cache's own layers, not in blocks, so swap
    and the prefix cache (which move and share blocks only) cannot serve it."""
    return bool(per_request_indices(cache))
