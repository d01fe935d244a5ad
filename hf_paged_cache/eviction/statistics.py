"""Attention statistics a policy can name: which queries it observes and how their attention mass folds
into a running score per stored key. A new statistic is one small class here; `attention_stats.py`
computes the mass and keeps the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class Statistic:
    """Which queries a policy observes, and how a step's attention mass updates the running scores."""

    def observed_queries(self, q_len: int) -> int | None:
        """How many of a step's last queries are observed (None: the step leaves the scores alone)."""
        raise NotImplementedError

    def fold(self, scores: torch.Tensor, mass: torch.Tensor) -> None:
        """Update `scores` `[kv_heads, n]` in place with this step's `mass` `[kv_heads, n]`."""
        raise NotImplementedError


@dataclass(frozen=True)
class Accumulated(Statistic):
    """Attention summed over every query since the key was stored (H2O); with `decay`, the running sum is
    multiplied by `decay` before each step's mass is added (the scores decay, never the K/V)."""

    decay: float | None = None

    def observed_queries(self, q_len: int) -> int:
        return q_len

    def fold(self, scores: torch.Tensor, mass: torch.Tensor) -> None:
        if self.decay is not None:
            scores.mul_(self.decay)
        scores.add_(mass)


@dataclass(frozen=True)
class LastQuery(Statistic):
    """The most recent query's attention only (TOVA)."""

    def observed_queries(self, q_len: int) -> int:
        return 1

    def fold(self, scores: torch.Tensor, mass: torch.Tensor) -> None:
        scores.copy_(mass)


@dataclass(frozen=True)
class ObservationWindow(Statistic):
    """The last `size` queries of the latest multi-token step (SnapKV); decode steps leave the scores alone."""

    size: int = 32

    def observed_queries(self, q_len: int) -> int | None:
        return None if q_len == 1 else min(self.size, q_len)

    def fold(self, scores: torch.Tensor, mass: torch.Tensor) -> None:
        scores.copy_(mass)
