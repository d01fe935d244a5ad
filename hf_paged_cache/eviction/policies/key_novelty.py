"""Key novelty as a policy: redundancy scoring, as in R-KV, made blind to position (`novelty.key_novelty`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..novelty import key_novelty
from ..selection import ScoreInputs
from .base import EvictionPolicy


@dataclass
class KeyNovelty(EvictionPolicy):
    """Keep the tokens least like any other stored token of their KV head. Text that repeats (filler,
    boilerplate) finds a near copy and goes first; a one-off fact -- a number, a name -- has none and stays,
    before any question has asked for it (docs/BENCHMARKS.md: question-agnostic pass keys). Set `rotary` to
    the model's pairing."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return key_novelty(inputs.keys, self.rotary)
