"""Statistics: which of a step's queries each one observes."""

from __future__ import annotations

from hf_paged_cache.eviction import Accumulated, LastQuery, ObservationWindow


def test_observation_window_ignores_decode_steps_and_last_query_observes_one():
    assert ObservationWindow(size=32).observed_queries(1) is None
    assert ObservationWindow(size=32).observed_queries(100) == 32
    assert LastQuery().observed_queries(100) == 1
    assert Accumulated().observed_queries(100) == 100
