"""Variants as wrappers: a policy's keywords compose them once, and each changes only how survivors are chosen."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache import H2O, KeepRatio, KeyNorm
from hf_paged_cache.eviction import PerHead, ProtectNovel, RowChoice, ScoreInputs, choose_kept, choose_kept_per_head


def _row(keys: torch.Tensor, budget: int = 8) -> RowChoice:
    """A row of `keys` `[kv_heads, n, d]`, no padding, two sinks and a window of two."""
    count = keys.shape[1]
    inputs = ScoreInputs(torch.arange(count), count, None, lambda: keys)
    return RowChoice(inputs, first_real=0, budget=budget, sinks=2, window=2, kv_heads=keys.shape[0])


def test_keywords_compose_the_variants_once():
    plain = KeyNorm()
    assert plain.composed() is plain
    h2o = H2O()  # per head by default
    assert h2o.composed() == PerHead(h2o)
    both = KeepRatio(per_head=True, protect_novel=0.5, rotary="interleaved")
    assert both.composed() == ProtectNovel(PerHead(both), 0.5, rotary="interleaved")
    novel = KeyNorm(protect_novel=0.25)
    assert novel.composed() == ProtectNovel(novel, 0.25)
    with pytest.raises(ValueError, match="ProtectNovel: `fraction` is a fraction of the budget"):
        ProtectNovel(plain, 1.0)
    with pytest.raises(ValueError, match="rotary"):
        ProtectNovel(plain, 0.5, rotary="gptj")


def test_per_head_chooses_by_each_heads_scores_with_the_shared_count():
    keys = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0))
    policy = KeyNorm(budget=8, sinks=2, window=2)
    row, scores = _row(keys), policy.score(_row(keys).inputs)
    shared = policy.choose(row)
    assert torch.equal(shared, choose_kept(row, scores.mean(0)))
    keep = PerHead(policy).choose(row)
    assert torch.equal(keep, choose_kept_per_head(row, scores, shared))
    assert keep.shape == (2, 16) and not torch.equal(keep[0], keep[1])


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
def test_protect_novel_keeps_a_one_off_key_the_policy_would_drop(per_head):
    gen = torch.Generator().manual_seed(1)
    phrase = torch.randn(2, 3, 8, generator=gen)
    keys = phrase.repeat(1, 6, 1)[:, :16].clone()  # a phrase said over and over ...
    keys[:, 7] = 10 * torch.randn(2, 8, generator=gen)  # ... and one fact, whose large key norm KeyNorm dislikes
    policy = KeyNorm(budget=8, sinks=2, window=2, rotary="none")
    inner = PerHead(policy) if per_head else policy
    assert not inner.choose(_row(keys))[..., 7].any()
    keep = ProtectNovel(inner, 0.25, rotary="none").choose(_row(keys))
    assert keep[..., 7].all() and keep.sum(-1).max() <= 8
