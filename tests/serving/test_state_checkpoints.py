"""State checkpoints: a byte budget of saved states, the least recently used dropped first (a hypothesis model of an
LRU list checks every sequence of keeps and lookups)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hf_paged_cache.sequence_state import StateTensor
from hf_paged_cache.serving.state_checkpoints import StateCheckpoints

TENSOR = StateTensor(0, "conv", 0, (1, 2, 3), torch.float32)  # 24 bytes


def saved(value: float):
    return {TENSOR: torch.full(TENSOR.shape, value)}


def test_the_budget_holds_whole_states_and_the_least_recently_used_goes_first():
    checkpoints = StateCheckpoints(max_bytes=60, slot_bytes=TENSOR.nbytes)  # room for two
    assert checkpoints.capacity == 2
    checkpoints.keep(b"a", saved(1.0))
    checkpoints.keep(b"b", saved(2.0))
    assert checkpoints.restore(b"a")[TENSOR][0, 0, 0] == 1.0  # "a" used last: "b" is dropped next
    checkpoints.keep(b"c", saved(3.0))
    assert b"b" not in checkpoints and b"a" in checkpoints and b"c" in checkpoints
    assert (len(checkpoints), checkpoints.nbytes) == (2, 48)
    assert (checkpoints.stats.taken, checkpoints.stats.found, checkpoints.stats.dropped) == (3, 1, 1)
    assert checkpoints.restore(b"b") is None and checkpoints.stats.found == 1
    checkpoints.clear()
    assert len(checkpoints) == 0 and checkpoints.restore(b"a") is None


def test_a_key_kept_again_keeps_its_first_state_and_a_budget_below_one_state_keeps_none():
    checkpoints = StateCheckpoints(max_bytes=24, slot_bytes=24)
    checkpoints.keep(b"a", saved(1.0))
    checkpoints.keep(b"a", saved(5.0))  # the same prefix computed again: the same state
    assert checkpoints.restore(b"a")[TENSOR][0, 0, 0] == 1.0 and checkpoints.stats.taken == 1
    empty = StateCheckpoints(max_bytes=23, slot_bytes=24)
    empty.keep(b"a", saved(1.0))
    assert empty.capacity == 0 and len(empty) == 0
    with pytest.raises(ValueError, match="recurrent / conv state"):
        StateCheckpoints(max_bytes=100, slot_bytes=0)


@given(capacity=st.integers(0, 4), calls=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_it_behaves_as_an_lru_list_of_capacity_states(capacity, calls):
    checkpoints = StateCheckpoints(max_bytes=capacity * 24 + 23, slot_bytes=24)
    model: list[int] = []  # keys, least recently used first
    for keep, key in calls:
        if keep and capacity:
            if key in model:
                model.remove(key)
            elif len(model) == capacity:
                model.pop(0)
            model.append(key)
            checkpoints.keep(bytes([key]), saved(float(key)))
        elif not keep:
            found = checkpoints.restore(bytes([key]))
            assert (found is not None) == (key in model)
            if found is not None:
                assert found[TENSOR][0, 0, 0] == key
                model.remove(key)
                model.append(key)
        assert [k for k in range(7) if bytes([k]) in checkpoints] == sorted(model) and len(checkpoints) <= capacity
