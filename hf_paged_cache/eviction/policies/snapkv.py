"""SnapKV (Li et al. 2024): what the prompt's last queries attend to, pooled over neighbouring tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..selection import ScoreInputs
from ..statistics import ObservationWindow, Statistic
from .base import EvictionPolicy


@dataclass
class SnapKV(EvictionPolicy):
    """The attention of the last `observation_window` prompt queries, average pooled over `kernel_size`
    neighbouring tokens, per KV head."""

    observation_window: int = 32
    per_head: bool = True
    kernel_size: int = 5

    @property
    def statistic(self) -> Statistic:
        return ObservationWindow(self.observation_window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        pad = self.kernel_size // 2
        pooled = F.avg_pool1d(inputs.attention[:, None], self.kernel_size, stride=1, padding=pad, count_include_pad=False)
        return pooled[:, 0, : inputs.attention.shape[-1]]
