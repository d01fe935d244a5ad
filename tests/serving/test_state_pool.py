"""State pool invariants: a hypothesis state machine drives attach / write / swap out / swap in / detach against a
model of which cache holds which slot and what its state holds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from transformers import LlamaConfig

from hf_paged_cache import PagedCache
from hf_paged_cache.sequence_state import SequenceState, StateTensor, layer_states
from hf_paged_cache.serving.state_pool import StatePool

STATE = SequenceState((StateTensor(0, "conv", 0, (1, 8, 3), torch.float32),
                       StateTensor(0, "recurrent", 0, (1, 2, 4, 4), torch.float32)))  # fmt: skip
SLOTS = 3


def template() -> PagedCache:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config.layer_types = ["linear_attention", "full_attention"]
    return PagedCache(config, block_size=4, num_blocks=8)


class StatePoolMachine(RuleBasedStateMachine):
    """`where[i]`: "slot", "host" or None for cache i; `values[i]`: the value its state tensors were last filled with
    (the model's in-place writes stand for it)."""

    def __init__(self):
        super().__init__()
        self.pool = StatePool(STATE, SLOTS, {0: torch.device("cpu")})
        base = template()
        self.caches = [base.sibling() for _ in range(5)]
        self.where: list[str | None] = [None] * 5
        self.values = [0.0] * 5
        self.kept = None  # (value, a state `saved` from a slot), for an attach that starts from it

    def _refused(self, call) -> None:
        before = self._snapshot()
        with pytest.raises(ValueError):
            call()
        assert self._snapshot() == before, "a refused call changed the pool"

    def _snapshot(self):
        return self.pool.num_free, [self.pool.slot_of(cache) for cache in self.caches]

    @rule(i=st.integers(0, 4), kept=st.booleans())
    def attach(self, i, kept):
        start = self.kept if kept else None
        if self.where[i] is not None or self.pool.num_free == 0:
            self._refused(lambda: self.pool.attach(self.caches[i], start and start[1]))
            return
        self.pool.attach(self.caches[i], start and start[1])
        self.where[i], self.values[i] = "slot", start[0] if start else 0.0  # a fresh sequence: zeroed
        assert all(self.caches[i].layers[0].has_previous_state.values()) == (start is not None)

    @rule(i=st.integers(0, 4))
    def save(self, i):
        """A checkpoint of a slot: a copy, which later writes to the slot leave as it was."""
        if self.where[i] == "slot":
            self.kept = (self.values[i], self.pool.saved(self.caches[i]))

    @rule(i=st.integers(0, 4), value=st.floats(1, 9))
    def write(self, i, value):
        if self.where[i] != "slot":
            return
        for tensor in STATE.tensors:
            layer_states(self.caches[i].layers[0])[tensor.kind][tensor.index].fill_(value)
        self.values[i] = value

    @rule(add=st.floats(1, 9), scatter=st.booleans())
    def step_as_a_batch(self, add, scatter):
        """The caches holding slots step as one batch: their states gathered, each row moved on in place through the
        batch's cache (as a recurrent layer does), written back only by `scatter` (a failed forward never does)."""
        held = [i for i, where in enumerate(self.where) if where == "slot"]
        if not held:
            return
        batch = self.pool.gathered([self.caches[i] for i in held])
        states = (batch.get_conv_state(0), batch.get_recurrent_state(0))
        for row, i in enumerate(held):
            assert all(torch.all(state[row] == self.values[i]) for state in states)  # gathered from its own slot
        batch.update_recurrent_state(states[1] + add, 0)
        states[0].add_(add)
        if scatter:
            batch.scatter()
            for i in held:  # as the float32 state holds it
                self.values[i] = torch.tensor(self.values[i], dtype=torch.float32).add(add).item()

    @rule(i=st.integers(0, 4))
    def swap_out(self, i):
        if self.where[i] != "slot":
            self._refused(lambda: self.pool.swap_out(self.caches[i]))
            return
        self.pool.swap_out(self.caches[i])
        self.where[i] = "host"

    @rule(i=st.integers(0, 4))
    def swap_in(self, i):
        if self.where[i] != "host" or self.pool.num_free == 0:
            self._refused(lambda: self.pool.swap_in(self.caches[i]))
            return
        self.pool.swap_in(self.caches[i])
        self.where[i] = "slot"

    @rule(i=st.integers(0, 4))
    def detach(self, i):
        self.pool.detach(self.caches[i])
        self.where[i] = None

    @invariant()
    def a_saved_state_keeps_its_value(self):
        if self.kept is not None:
            assert all(torch.all(tensor == self.kept[0]) for tensor in self.kept[1].values())

    @invariant()
    def slots_are_free_or_held_once_and_states_stay_their_own(self):
        held = [self.pool.slot_of(cache) for cache, where in zip(self.caches, self.where) if where == "slot"]
        assert None not in held and len(set(held)) == len(held)
        assert self.pool.num_free + len(held) == SLOTS
        for cache, where, value in zip(self.caches, self.where, self.values):
            states = layer_states(cache.layers[0])
            for tensor in STATE.tensors:
                state = states[tensor.kind][tensor.index]
                if where is None:
                    assert state is None and self.pool.slot_of(cache) is None
                    continue
                assert state.shape == tensor.shape and torch.all(state == value)
                if where == "slot":  # a view of its slot, which the model's in-place writes land in
                    assert state.data_ptr() == self.pool.storage[tensor][self.pool.slot_of(cache)].data_ptr()
                else:  # a host copy, which no slot shares
                    assert all(not _overlaps(state, storage) for storage in self.pool.storage.values())


def _overlaps(state: torch.Tensor, storage: torch.Tensor) -> bool:
    start, end = storage.data_ptr(), storage.data_ptr() + storage.numel() * storage.element_size()
    return start <= state.data_ptr() < end


TestStatePoolMachine = StatePoolMachine.TestCase
TestStatePoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_pool_needs_a_positive_slot_count_and_a_model_without_state_gets_slots_of_no_tensors():
    with pytest.raises(ValueError, match=r"positive int of slots \(`max_num_seqs`\), got 0"):
        StatePool(STATE, 0, {0: torch.device("cpu")})
    pool = StatePool(SequenceState(), 2, {})
    assert pool.pool_bytes == 0 and pool.storage == {}
    assert pool.slot_bytes == 0 and pool.num_free == 2
