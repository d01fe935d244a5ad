"""Layers whose state runs along one sequence (linear attention, Mamba, convolutions) in a packed forward.

A packed forward concatenates many requests into one row. Attention layers split it by request in
`PackedCache.update`, but a recurrent or convolutional layer would carry its state across the requests'
boundaries. So each decoder layer whose type says `per_request` runs by request -- only its mixer where it has one
(the one child module that takes the cache: a short conv, a gated delta net, a Mamba mixer), so its norms and MLP
still run on the packed row; else the whole decoder layer: the requests that take one token
and continue their state (the decode steps) as one batch of single-token sequences, over their states gathered from
the state pool (`StatePool.gathered`: one index per state tensor each way, written back after the forward); every
other request (a prompt chunk) alone, on its slice of the hidden states and positions, with its own `PagedCache`
(which holds the layer's state, empty before its first chunk). The outputs go back to the requests' tokens.

A prompt chunk may be cut inside these layers (`StateCuts`): the layer runs on its pieces one after the other and
copies its state at each cut, so the prefix cache can keep a hybrid model's state at a block boundary inside a chunk
without the chunk ending there (which would cost the request a step).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from ..cache import PagedCache
from ..errors import UnsupportedModelError
from ..forwards import decoder_layers, swapped_forwards
from ..sequence_state import RESTARTS_STATE, StateTensor, layer_states

CACHE_KWARGS = ("cache", "past_key_values")  # the names transformers passes a layer or its mixer the cache by


class PerRequestLayers:
    """The decoder layers of `model` that a packed forward runs once per request (`indices`, from the cache's
    layer types), by their mixers where they have one (`runs`); `split(caches, spans)` makes them so for the
    forward it encloses."""

    def __init__(self, model: torch.nn.Module, indices: list[int], num_layers: int,
                 gather: Gather | None = None, tensors: tuple[StateTensor, ...] = ()):  # fmt: skip
        modules = decoder_layers(model, num_layers)
        # Once each, should a model reuse one module at several indices: the wrapper reads the cache it is given.
        self.layers = list({id(modules[index]): modules[index] for index in indices}.values())
        self.indices = indices
        self.gather = gather
        runs = {index: mixer(modules[index]) or modules[index] for index in indices}
        self.runs = list({id(module): module for module in runs.values()}.values())
        # What a cut copies: each layer's state tensors (`tensors`: a state pool's), by the module run per request.
        self.states_of = {runs[index]: [tensor for tensor in tensors if tensor.layer == index] for index in indices}
        self.cuts_states = bool(tensors) and len(self.runs) == len(indices)  # each module at one index

    @classmethod
    def of(cls, model: torch.nn.Module, template: PagedCache, gather: Gather | None = None,
           tensors: tuple[StateTensor, ...] = ()) -> PerRequestLayers | None:  # fmt: skip
        """The per-request layers of a model served with caches like `template`; None when it has none. `gather`
        (a state pool's): the states of several caches as one batch, for their single-token steps (None: every
        request runs alone); `tensors`: the state tensors a cut copies (none: chunks are not cut)."""
        indices = per_request_indices(template)
        if not indices:
            return None
        return cls(model, indices, len(template.layers), gather, tensors)

    def split(self, caches: list[PagedCache], spans: list[tuple[int, int]],
              cuts: StateCuts | None = None) -> AbstractContextManager[None]:  # fmt: skip
        """Within the block, the layers run by request (`caches[i]` takes tokens `spans[i]`): the single-token steps
        of caches that continue their state as one batch, the rest one request at a time, in pieces where `cuts`
        says (which then holds the states copied there; only where `cuts_states`)."""
        stepping = [index for index, (start, stop) in enumerate(spans)
                    if stop - start == 1 and self._continues(caches[index])] if self.gather is not None else []  # fmt: skip
        if len(stepping) < 2:
            stepping = []
        return self._run(caches, spans, stepping, cuts)

    @contextmanager
    def _run(self, caches: list[PagedCache], spans: list[tuple[int, int]], stepping: list[int],
             cuts: StateCuts | None) -> Iterator[None]:  # fmt: skip
        batch = self.gather([caches[index] for index in stepping]) if stepping else None
        step = _Step(spans, stepping, batch, cuts)
        with swapped_forwards(self.runs, [_per_request(module, module.forward, caches, step, self.states_of[module])
                                          for module in self.runs]):  # fmt: skip
            yield
        if batch is not None:  # a failed forward leaves the slots as they were before it
            batch.scatter()

    def _continues(self, cache: PagedCache) -> bool:
        """Whether `cache`'s per-request layers all hold a previous state (its next token is a single-token step)."""
        return all(all(cache.layers[index].has_previous_state.values()) for index in self.indices)


Gather = Callable[[list[PagedCache]], Cache]  # the states of several caches as one batch (`StatePool.gathered`)


class StateCuts:
    """Where a packed forward's chunks are cut inside the per-request layers (`at[i]`: offsets into chunk `i`, each
    strictly inside it), and the states each layer copied there: `taken[i][offset]`, one sequence's state tensors."""

    def __init__(self, at: list[list[int]]):
        self.at = at
        self.taken: list[dict[int, dict[StateTensor, torch.Tensor]]] = [{} for _ in at]


class _Step:
    """How one packed forward's tokens go through a per-request layer: the requests' spans, which of them step as
    one batch (`stepping`: one token each, at `index`) over `batch`, their gathered states; where chunks are cut."""

    def __init__(self, spans: list[tuple[int, int]], stepping: list[int], batch: Cache | None,
                 cuts: StateCuts | None = None):  # fmt: skip
        self.spans, self.batch, self.cuts = spans, batch, cuts
        batched = set(stepping)
        self.alone = [index for index in range(len(spans)) if index not in batched]
        self.starts = [spans[index][0] for index in stepping]
        self._index: dict[torch.device, torch.Tensor] = {}

    def pieces(self, request: int) -> Iterator[tuple[int, int, int | None]]:
        """Request `request`'s chunk as pieces (start, stop in the packed row, and the cut's offset at their end or
        None at the chunk's end)."""
        start, stop = self.spans[request]
        offsets = self.cuts.at[request] if self.cuts is not None else []
        for low, high in zip([0, *offsets], [*offsets, stop - start]):
            yield start + low, start + high, high if high < stop - start else None

    def index(self, device: torch.device) -> torch.Tensor:
        """The stepping requests' tokens in the packed row."""
        if device not in self._index:
            self._index[device] = torch.tensor(self.starts, device=device)
        return self._index[device]


def _per_request(module: torch.nn.Module, forward, caches: list[PagedCache], step: _Step,
                 states: list[StateTensor]):  # fmt: skip
    def run(hidden_states: torch.Tensor, *args, **kwargs):
        names = [name for name in CACHE_KWARGS if name in kwargs]
        if args or len(names) != 1:
            raise UnsupportedModelError(
                f"{type(module).__name__} is called with positional arguments after the hidden states, or without a "
                "`cache=` keyword, so the batch generator cannot run it per request: use `model.generate` with a "
                "`PagedCache` for this model"
            )
        parts = []  # (where the part's tokens go in the packed row, its output [1, tokens, d])
        if step.batch is not None:
            index = step.index(hidden_states.device)
            own = {key: _batch_slice(key, value, index) for key, value in kwargs.items()}
            own[names[0]] = step.batch
            parts.append((index, forward(hidden_states[:, index].transpose(0, 1), **own)))
        for request in step.alone:
            for start, stop, cut in step.pieces(request):
                own = {key: _request_slice(key, value, start, stop) for key, value in kwargs.items()}
                own[names[0]] = caches[request]
                parts.append((slice(start, stop), forward(hidden_states[:, start:stop], **own)))
                if cut is not None:  # the layer's state after the piece, for the prefix cache
                    taken = step.cuts.taken[request].setdefault(cut, {})
                    for tensor in states:
                        taken[tensor] = layer_states(caches[request].layers[tensor.layer])[tensor.kind][tensor.index].clone()
        rest = _rest(module, [out for _where, out in parts])  # what a layer returns beside its hidden states
        outs = [out[0] if isinstance(out, tuple) else out for _where, out in parts]
        if step.batch is None:
            joined = torch.cat(outs, dim=1)
        else:
            outs[0] = outs[0].transpose(0, 1)  # the batch's [sequences, 1, d] as its tokens of the packed row
            joined = outs[0].new_empty(1, hidden_states.shape[1], outs[0].shape[-1])
            for (where, _out), out in zip(parts, outs):
                joined[:, where] = out
        return joined if rest is None else (joined, *rest)

    return run


def _rest(module: torch.nn.Module, outs: list) -> tuple | None:
    """What the per-request calls of `module` returned beside their hidden states: None for a tensor each; for a
    tuple each (a one-tuple, or a mixer's output and its attention weights), the rest, which must be None (nothing
    else can be joined across requests)."""
    if not isinstance(outs[0], tuple):
        return None
    if any(part is not None for out in outs for part in out[1:]):
        raise UnsupportedModelError(f"{type(module).__name__} returns more than its hidden states, which the batch "
                                    "generator cannot join across requests: use `model.generate` with a `PagedCache`")
    return outs[0][1:]


def _batch_slice(key: str, value, index: torch.Tensor):
    """What a batch of single-token steps (the tokens at `index` of the packed row, one sequence each) gets of a
    decoder layer's keyword argument `key` of the packed call: as `_request_slice`, the sequences along the batch."""
    if key == "position_ids" and value is not None:
        return value[..., index.to(value.device)].transpose(-2, -1)  # [..., 1, n] -> [..., n, 1]
    if key == "position_embeddings" and value is not None:
        return tuple(part[..., index.to(part.device), :].transpose(-3, -2) for part in value)
    return _request_slice(key, value, 0, 0)


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


def mixer(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The one child of decoder `layer` whose forward takes the cache (its recurrent or conv mixer), or None where
    none or several do (Falcon-H1's Mamba mixer beside its attention): then the whole layer runs per request."""
    takes = [child for child in layer.children()
             if any(name in inspect.signature(type(child).forward).parameters for name in CACHE_KWARGS)]  # fmt: skip
    return takes[0] if len(takes) == 1 else None


def restarts_state(cache: PagedCache) -> bool:
    """Whether the recurrent layers of `cache`'s model start from an empty state at every multi-token chunk, so a
    prompt must be computed in one step (`RESTARTS_STATE`)."""
    return cache.model_config.model_type in RESTARTS_STATE and bool(per_request_indices(cache))


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
    """Whether `cache` has per-request layers: their state lives in the cache's own layers (views of a state-pool
    slot), not in blocks, so swap and prefix hits move or restore it beside the blocks."""
    return bool(per_request_indices(cache))
