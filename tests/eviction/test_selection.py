"""Choosing survivors from scores: padding goes, sinks and the window stay, units stay whole, tokens taken
first come first, and every head keeps as many tokens as the others."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache import H2O
from hf_paged_cache.eviction import RowChoice, ScoreInputs, TakenFirst, choose_kept, choose_kept_per_head, novel_tokens


def _row(policy, positions: torch.Tensor, first_real: int, length: int, budget: int, **options) -> RowChoice:
    inputs = ScoreInputs(positions, length, None)
    return RowChoice(inputs, first_real=first_real, budget=budget, sinks=policy.sinks, window=policy.window, **options)


def test_choose_kept_protects_sinks_and_window_drops_padding_and_keeps_units_whole():
    policy = H2O(budget=8, sinks=2, window=2)
    positions = torch.arange(3, 19)  # 16 stored tokens; positions 3, 4 are padding (first real is 5)
    scores = torch.zeros(16)
    scores[[0, 1]] = 100.0  # padding scores high but must go
    scores[[8, 9, 10, 11]] = torch.tensor([5.0, 5.0, 5.0, -9.0])  # a unit of 4 (mean 1.5)
    scores[12] = 3.0
    units = [1] * 8 + [4] + [1] * 4
    keep = choose_kept(_row(policy, positions, 5, 19, 8, unit_sizes=units), scores)
    assert not keep[:2].any()  # padding
    assert keep[2:4].all() and keep[-2:].all()  # sinks (positions 5, 6) and window (17, 18)
    assert bool(keep[8]) == bool(keep[9]) == bool(keep[10]) == bool(keep[11])  # a unit is all or nothing
    assert int(keep.sum()) <= 8


def test_novel_tokens_are_protected_before_the_policy_chooses():
    policy = H2O(budget=8, sinks=2, window=2, protect_novel=0.25)
    positions = torch.arange(3, 19)  # first real token at 5: stored indices 0, 1 are padding
    novelty = torch.zeros(16)
    novelty[[0, 2, 15]] = 9.0  # padding, a sink and the window: never counted among the novel
    novelty[[6, 11]] = torch.tensor([2.0, 3.0])
    row = _row(policy, positions, 5, 19, 8)
    novel = novel_tokens(row, novelty, count=2)
    assert novel.nonzero().flatten().tolist() == [6, 11]
    scores = torch.arange(16.0)  # the policy itself prefers the newest tokens
    keep = choose_kept(row.taking_first(TakenFirst(novel, novelty[None])), scores)
    assert keep[[6, 11]].all() and int(keep.sum()) == 8
    assert keep.nonzero().flatten().tolist() == [2, 3, 6, 11, 12, 13, 14, 15]
    heads = novel_tokens(row, torch.stack([novelty, novelty.flip(0)]), count=2)
    assert heads.sum(1).tolist() == [2, 2] and heads[1].nonzero().flatten().tolist() == [4, 13]
    with pytest.raises(ValueError, match="protect_novel"):
        H2O(protect_novel=1.0)


def test_choose_kept_per_head_keeps_each_heads_best_and_the_same_count():
    policy = H2O(budget=8, sinks=2, window=2, per_head=True)
    positions = torch.arange(3, 19)  # 16 stored tokens; the first 4 (padding 3, 4 and sinks 5, 6) are sealed
    scores = torch.rand(2, 16, generator=torch.Generator().manual_seed(0))
    scores[1, 4:] = scores[1, 4:].flip(0)  # the heads rank the full-precision tokens differently
    row = _row(policy, positions, 5, 19, 8, kv_heads=2, unit_sizes=[4] + [1] * 12, split=4)
    shared = choose_kept(row, scores.mean(0))
    keep = choose_kept_per_head(row, scores, shared)
    assert keep.shape == (2, 16) and keep.sum(1).tolist() == [int(shared.sum())] * 2
    assert torch.equal(keep[:, :4], shared[:4].expand(2, -1))  # the sealed unit: decided for both heads
    for head in range(2):
        tail = keep[head, 4:]
        assert tail[-2:].all()  # the recent window
        free = torch.ones(12, dtype=torch.bool)
        free[-2:] = False
        chosen, dropped = scores[head, 4:][free & tail], scores[head, 4:][free & ~tail]
        assert chosen.min() >= dropped.max()  # the head's own best
    assert not torch.equal(keep[0], keep[1])
