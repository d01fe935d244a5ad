"""KeyNovelty: a token's key is compared with every other's by rotary-pair magnitudes, wherever it stands."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache import KeyNovelty
from hf_paged_cache.eviction import ScoreInputs


def _rotate(keys: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A rotary embedding of `keys` `[n, d]` at `positions` (transformers' `rotate_half`, or GPT-J's pairs)."""
    half = keys.shape[-1] // 2
    angles = positions[:, None].float() * (10000.0 ** (-torch.arange(half) / half))[None]
    cos, sin = angles.cos(), angles.sin()
    first, second = (keys[:, 0::2], keys[:, 1::2]) if interleaved else keys.chunk(2, dim=-1)
    rotated = (first * cos - second * sin, first * sin + second * cos)
    return torch.stack(rotated, dim=-1).flatten(1) if interleaved else torch.cat(rotated, dim=-1)


@pytest.mark.parametrize("rotary", ["half", "interleaved"])
def test_key_novelty_finds_copies_wherever_the_rotary_embedding_put_them(rotary):
    gen = torch.Generator().manual_seed(0)
    phrase = torch.randn(4, 16, generator=gen)
    fact = torch.randn(1, 16, generator=gen)
    keys = torch.cat([phrase, phrase, fact, phrase])  # a phrase said three times, one fact in between
    rotated = _rotate(keys, torch.arange(13) * 7 + 3, interleaved=rotary == "interleaved")
    inputs = ScoreInputs(torch.arange(13), 13, None, lambda: rotated[None])
    scores = KeyNovelty(budget=8, sinks=0, window=0, rotary=rotary).score(inputs)[0]
    torch.testing.assert_close(scores[torch.arange(13) != 8], torch.full((12,), -1.0))  # each has an exact copy
    assert scores[8] > -0.99  # the fact has none
    raw = KeyNovelty(budget=8, sinks=0, window=0, rotary="none").score(inputs)[0]
    assert bool((raw[torch.arange(13) != 8] > -0.99).any())  # compared as stored, the copies hide
    with pytest.raises(ValueError, match="rotary"):
        KeyNovelty(rotary="gptj")
