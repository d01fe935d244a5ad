"""Variants of a policy as wrappers around it (kvpress's per-head and protecting presses), so that no policy
and no evictor branches on a flag: `EvictionPolicy.composed()` builds them from a policy's `per_head`,
`protect_novel` and `rotary` keywords, and they compose with any policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .novelty import check_novelty_options, key_novelty
from .selection import RowChoice, ScoreInputs, Selector, TakenFirst, choose_kept, choose_kept_per_head, novel_tokens


class Scorer(Protocol):
    """What `PerHead` needs of a policy: its scores, `[n]` or `[kv_heads, n]` (higher = keep)."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor: ...


@dataclass
class PerHead(Selector):
    """Each KV head keeps its own best tokens by its own scores, instead of the tokens whose scores averaged
    over the heads are best. Every head keeps as many (the head-shared choice sets the count and decides the
    sealed quantized blocks for all heads), so memory is the same and the row stays one rectangle of slots."""

    policy: Scorer

    def choose(self, row: RowChoice) -> torch.Tensor:
        scores = self.policy.score(row.inputs)  # once: a random policy's generator advances per call
        shared = choose_kept(row, row.reduce(scores))
        count = row.inputs.positions.shape[-1]
        return choose_kept_per_head(row, scores.float().cpu().expand(row.kv_heads, count), shared)


@dataclass
class ProtectNovel(Selector):
    """The fraction `fraction` of the budget first goes to the most novel tokens -- those whose keys have no
    near copy anywhere in the row (`key_novelty`, comparing rotary pairs as `rotary` says) -- before `inner`
    chooses the rest; under `PerHead`, each head takes its own most novel ones."""

    inner: Selector
    fraction: float
    rotary: str = "half"

    def __post_init__(self) -> None:
        check_novelty_options(type(self).__name__, self.fraction, self.rotary, fraction_name="fraction")

    def choose(self, row: RowChoice) -> torch.Tensor:
        novelty = key_novelty(row.inputs.keys, self.rotary)
        shared = novel_tokens(row, row.reduce(novelty), int(self.fraction * row.budget))
        return self.inner.choose(row.taking_first(TakenFirst(shared, novelty)))
