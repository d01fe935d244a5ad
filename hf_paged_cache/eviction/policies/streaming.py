"""StreamingLLM (Xiao et al. 2023): attention sinks + the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import ScoreInputs
from .base import EvictionPolicy


@dataclass
class StreamingLLM(EvictionPolicy):
    """Attention sinks + the most recent tokens: needs no scores, keeps the newest."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.positions.float()
