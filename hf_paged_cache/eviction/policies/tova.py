"""TOVA (Oren et al. 2024): keep the tokens the latest query attends to most."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import ScoreInputs
from ..statistics import LastQuery, Statistic
from .base import EvictionPolicy


@dataclass
class TOVA(EvictionPolicy):
    """The latest query's attention, per KV head."""

    @property
    def statistic(self) -> Statistic:
        return LastQuery()

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.attention
