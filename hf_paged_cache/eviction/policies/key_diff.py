"""KeyDiff (Park et al. 2025): keep the keys least like their KV head's mean key."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..selection import ScoreInputs
from .base import EvictionPolicy


@dataclass
class KeyDiff(EvictionPolicy):
    """Keep the keys least similar (cosine) to their KV head's mean key. Needs no attention and no question:
    in repetitive text a distinctive token -- a name, a number -- stands apart from the mean direction, so it
    survives before the question that will ask for it has been read."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        keys = F.normalize(inputs.keys, dim=-1)
        anchor = F.normalize(keys.mean(dim=1, keepdim=True), dim=-1)
        return -(keys * anchor).sum(dim=-1)
