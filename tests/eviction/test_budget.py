"""Budgets: token counts and ratios, per-layer schedules, and the floor of tokens never evicted."""

from __future__ import annotations

import pytest

from hf_paged_cache import H2O, TOVA, StreamingLLM, pyramid_budgets


def test_budgets_ratios_and_pyramid_schedules():
    assert H2O(budget=100, sinks=4, window=8).budget_for(1000, 0) == 100
    assert H2O(budget=0.25, sinks=4, window=8).budget_for(1000, 0) == 250
    assert H2O(budget=0.01, sinks=4, window=8).budget_for(1000, 0) == 12  # never below sinks + window
    schedule = pyramid_budgets(4, ratio=3.0)
    assert schedule[0] / schedule[-1] == pytest.approx(3.0) and sum(schedule) == pytest.approx(4.0)
    policy = TOVA(budget=100, sinks=0, window=0, layer_budgets=schedule)
    assert [policy.budget_for(1000, layer) for layer in range(4)] == [int(100 * m) for m in schedule]
    with pytest.raises(ValueError, match="one multiplier per layer"):
        policy.budget_for(1000, 4)


def test_a_token_budget_below_sinks_plus_window_is_refused():
    with pytest.raises(ValueError, match=r"StreamingLLM: the budget is 16 tokens, fewer than the 4 `sinks` \+ 32 "
                       r"`window` tokens that are never evicted: raise `budget` or lower `sinks` / `window`"):  # fmt: skip
        StreamingLLM(budget=16)
    with pytest.raises(ValueError, match=r"TOVA: the budget at the layer of the smallest `layer_budgets` multiplier is 3"):
        TOVA(budget=8, sinks=2, window=2, layer_budgets=[1.6, 0.4])
    assert TOVA(budget=8, sinks=2, window=2, layer_budgets=[1.5, 0.5]).budget_for(100, 1) == 4
    assert StreamingLLM(budget=36).budget_for(1000, 0) == 36
