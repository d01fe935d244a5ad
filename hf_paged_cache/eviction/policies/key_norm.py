"""Key norm (Devoto et al. 2024): low-norm keys draw high attention, so they are kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import ScoreInputs
from .base import EvictionPolicy


@dataclass
class KeyNorm(EvictionPolicy):
    """Keep the keys of smallest L2 norm; needs no attention at all."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return -inputs.keys.norm(dim=-1)
