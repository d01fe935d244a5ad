"""A baseline: random scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..selection import ScoreInputs
from .base import EvictionPolicy


@dataclass
class RandomEviction(EvictionPolicy):
    """Random scores, seeded so that runs repeat (the generator's state is saved with the cache)."""

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._generator = torch.Generator().manual_seed(self.seed)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return torch.rand(inputs.positions.shape[-1], generator=self._generator)
