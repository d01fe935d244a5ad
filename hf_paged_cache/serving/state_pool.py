"""The recurrent / conv state of a hybrid model's running requests, in a pool of fixed-size slots allocated once.

A slot holds one sequence's state tensors of every per-request layer (`sequence_state`: their shapes and dtypes,
measured from the config). A request takes a slot when it is admitted and gives it back when it finishes, is
cancelled or preempted, so the generator's state memory is fixed up front, like its blocks. While it holds a
slot, its cache's linear-attention layers hold views of it: transformers' layers write their state in place (the
prefill's `copy_`, the one-token conv step's in-place update), so the model's own writes land in the slot, with
no copy. A swapped request's layers hold host copies instead, and a fresh slot takes them back when it resumes.

Slots come from a FIFO free queue: every slot is either in the queue or held by exactly one cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ..cache import PagedCache
from ..sequence_state import SequenceState, StateTensor, layer_states, sequence_state
from ..forwards import decoder_layers
from .recurrent import holds_state, state_bytes
from .state_checkpoints import Saved


class StatePool:
    """`num_slots` slots of the state tensors `state` names, each tensor on its layer's device (`devices`)."""

    def __init__(self, state: SequenceState, num_slots: int, devices: Mapping[int, torch.device]):
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"a state pool needs a positive int of slots (`max_num_seqs`), got {num_slots!r}")
        self.state = state
        self.num_slots = num_slots
        self.storage = {tensor: torch.zeros((num_slots, *tensor.shape[1:]), dtype=tensor.dtype,
                                            device=devices[tensor.layer]) for tensor in state.tensors}  # fmt: skip
        self._free = deque(range(num_slots))
        self._holders: dict[PagedCache, int] = {}  # cache -> its slot
        self._swapped: set[PagedCache] = set()  # caches whose layers hold host copies of their state

    @classmethod
    def of(cls, model: torch.nn.Module, template: PagedCache, num_slots: int) -> StatePool:
        """The pool of `num_slots` slots for `model` served with caches like `template` (slots of no tensors for a
        model without recurrent or conv layers: they count its running requests only)."""
        if not holds_state(template):
            return cls(SequenceState(), num_slots, {})
        state = sequence_state(model.config, model.dtype, type(model))
        modules = decoder_layers(model, len(template.layers))
        devices = {tensor.layer: next(modules[tensor.layer].parameters()).device for tensor in state.tensors}
        return cls(state, num_slots, devices)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def slot_bytes(self) -> int:
        return self.state.nbytes

    @property
    def pool_bytes(self) -> int:
        """Bytes the pool allocated (every slot)."""
        return self.num_slots * self.slot_bytes

    def slot_of(self, cache: PagedCache) -> int | None:
        return self._holders.get(cache)

    def usage(self, caches: list[PagedCache]) -> tuple[int, int, int]:
        """What the metrics count: the state bytes `caches` hold (their slots, and a hybrid layer's own K/V), the
        pool's slots and its bytes."""
        return sum(state_bytes(cache) for cache in caches), self.num_slots, self.pool_bytes

    # ------------------------------------------------------------------ slots
    def attach(self, cache: PagedCache, start: Saved | None = None) -> int:
        """Give `cache` the oldest free slot: zeroed, so its layers start a fresh sequence in it, or holding `start`
        (a state `saved` after a prefix its cache holds: its layers continue from there). Returns the slot."""
        if cache in self._swapped:
            raise ValueError("this cache's state is swapped out: `swap_in` brings it back")
        self._check_free(cache)
        slot = self._free.popleft()
        self._holders[cache] = slot
        for tensor, layer, states in self._states(cache):
            view = self.storage[tensor][slot : slot + 1]
            view.zero_() if start is None else view.copy_(start[tensor])
            _point(layer, tensor, states, view)
            layer.has_previous_state[tensor.index] = start is not None
        return slot

    def saved(self, cache: PagedCache) -> Saved:
        """A copy of the state in `cache`'s slot (for `StateCheckpoints`; `attach(..., start=)` takes it back)."""
        slot = self._holders[cache]
        return {tensor: pool[slot : slot + 1].clone() for tensor, pool in self.storage.items()}

    def detach(self, cache: PagedCache) -> None:
        """`cache` lets go of its state (its slot back to the free queue, or its host copies dropped): its layers
        hold nothing, so no later call on it can touch a slot another request holds. A cache that holds neither is
        left as it is."""
        if cache not in self._holders and cache not in self._swapped:
            return
        for tensor, layer, states in self._states(cache):
            states[tensor.index] = None
            _initialized(layer, tensor.kind)[tensor.index] = False
            layer.has_previous_state[tensor.index] = False
        self._swapped.discard(cache)
        if cache in self._holders:
            self._free.append(self._holders.pop(cache))

    # ------------------------------------------------------------------ swap
    def swap_out(self, cache: PagedCache) -> None:
        """Copy `cache`'s slot to host memory (its layers then hold the copies) and give the slot back."""
        slot = self._holders.get(cache)
        if slot is None:
            raise ValueError("this cache holds no state slot to swap out")
        for tensor, layer, states in self._states(cache):
            states[tensor.index] = self.storage[tensor][slot : slot + 1].to("cpu", copy=True)
        self._swapped.add(cache)
        self._free.append(self._holders.pop(cache))

    def swap_in(self, cache: PagedCache) -> int:
        """Copy a swapped cache's state into the oldest free slot, which its layers then view. Returns the slot."""
        if cache not in self._swapped:
            raise ValueError("this cache's state is not swapped out")
        self._check_free(cache)
        slot = self._free.popleft()
        for tensor, layer, states in self._states(cache):
            view = self.storage[tensor][slot : slot + 1]
            view.copy_(states[tensor.index])
            _point(layer, tensor, states, view)
        self._swapped.discard(cache)
        self._holders[cache] = slot
        return slot

    # ------------------------------------------------------------------ batches
    def gathered(self, caches: list[PagedCache]) -> GatheredStates:
        """The states of `caches` (each holding a slot, each past its first chunk) as one batch: copied out of their
        slots by one index per state tensor, into a transformers `Cache` that a recurrent layer steps as a batch of
        `len(caches)` sequences; `GatheredStates.scatter()` writes them back."""
        slots = [self._holders[cache] for cache in caches]
        return GatheredStates(self.storage, slots, max(tensor.layer for tensor in self.state.tensors) + 1)

    @property
    def batches_steps(self) -> bool:
        """Whether single-token steps of the per-request layers can run as one batch over gathered states: the
        layers hold state tensors and nothing else (a layer that also keeps its own K/V, as Falcon-H1's attention
        beside its Mamba mixer does, runs per request)."""
        return bool(self.state.tensors) and self.state.kv_bytes_per_token == 0

    # ------------------------------------------------------------------ helpers
    def _check_free(self, cache: PagedCache) -> None:
        if cache in self._holders:
            raise ValueError(f"this cache holds slot {self._holders[cache]} already")
        if not self._free:
            raise ValueError(f"every one of the {self.num_slots} state slots is held: at most `max_num_seqs` requests "
                             "run at once")  # fmt: skip

    def _states(self, cache: PagedCache) -> Iterator[tuple[StateTensor, LinearAttentionCacheLayerMixin, dict]]:
        for tensor in self.state.tensors:
            layer = cache.layers[tensor.layer]
            yield tensor, layer, layer_states(layer)[tensor.kind]


def _initialized(layer: LinearAttentionCacheLayerMixin, kind: str) -> dict[int, bool]:
    return layer.is_conv_states_initialized if kind == "conv" else layer.is_recurrent_states_initialized


def _point(layer: LinearAttentionCacheLayerMixin, tensor: StateTensor, states: dict, view: torch.Tensor) -> None:
    """Make `view` the layer's state `tensor` as its lazy initialization would have made its own tensor."""
    states[tensor.index] = view
    _initialized(layer, tensor.kind)[tensor.index] = True
    if tensor.kind == "conv":
        layer.conv_kernel_size[tensor.index] = tensor.shape[-1]
    if layer.device is None:
        layer.dtype, layer.device = view.dtype, view.device


class GatheredStates(Cache):
    """Several sequences' recurrent / conv states as one batch, for one packed forward's single-token steps: each
    recurrent layer reads and updates them in place through transformers' own linear-attention layer (its state
    getters and updates), and `scatter()` copies them back to the sequences' slots."""

    def __init__(self, storage: dict[StateTensor, torch.Tensor], slots: list[int], num_layers: int):
        super().__init__(layers=[LinearAttentionLayer() for _ in range(num_layers)])
        self.storage = storage
        self.indices: dict[torch.device, torch.Tensor] = {}
        for tensor, pool in storage.items():
            index = self.indices.setdefault(pool.device, torch.tensor(slots, device=pool.device))
            layer = self.layers[tensor.layer]
            _point(layer, tensor, layer_states(layer)[tensor.kind], pool.index_select(0, index))
            layer.has_previous_state[tensor.index] = True

    def scatter(self) -> None:
        """Write the batch's states back to the sequences' slots."""
        for tensor, pool in self.storage.items():
            state = layer_states(self.layers[tensor.layer])[tensor.kind][tensor.index]
            pool.index_copy_(0, self.indices[pool.device], state)
