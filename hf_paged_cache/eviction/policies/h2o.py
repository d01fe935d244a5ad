"""H2O (Zhang et al. 2023): heavy hitters, the tokens that received the most attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import ScoreInputs
from ..statistics import Accumulated, Statistic
from .base import EvictionPolicy


@dataclass
class H2O(EvictionPolicy):
    """The accumulated attention each token received, plus the recent window. `decay` < 1 weights recent
    attention more (the running sum is multiplied by `decay` before each step adds its mass); evicting while
    decoding long texts, prefer it (e.g. 0.99): pure sums favour the oldest tokens (docs/BENCHMARKS.md,
    decode-time eviction)."""

    decay: float | None = None
    per_head: bool = True  # measured better per head (docs/BENCHMARKS.md); so are SnapKV and KeepRatio

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decay is not None and not 0.0 < self.decay <= 1.0:
            raise ValueError(f"H2O: `decay` must be in (0, 1] or None, got {self.decay!r}")

    @property
    def statistic(self) -> Statistic:
        return Accumulated(self.decay)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.attention
