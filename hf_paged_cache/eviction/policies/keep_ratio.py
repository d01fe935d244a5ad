"""Keep ratio: the fraction `budget` of tokens with the highest mean attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import ScoreInputs
from ..statistics import Accumulated, Statistic
from .base import EvictionPolicy


@dataclass
class KeepRatio(EvictionPolicy):
    """Keep the fraction `budget` of tokens with the highest mean attention: the attention a token
    received, summed over the queries that saw it, divided by how many did."""

    budget: int | float = 0.5
    per_head: bool = True

    @property
    def statistic(self) -> Statistic:
        return Accumulated()

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        observed = (inputs.length - inputs.positions).clamp(min=1).float()
        return inputs.attention / observed
