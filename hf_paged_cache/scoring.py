"""Teacher-forced scoring through a cache: every scored token is predicted by a forward that reads the
previous tokens' K/V from the cache (as decoding does), so a lossy cache shows its cost in perplexity."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def next_token_nll(
    model, ids: torch.Tensor, cache, start: int, tokens: int, progress: bool = False, label: str = "",
    after_step: Callable[[int], None] | None = None,
) -> float:
    """Feed `ids[start + i]` for i < `tokens`, one forward each through `cache`, and return the summed
    negative log-likelihood of each next token `ids[start + i + 1]`. `after_step(fed)` runs after each
    forward, `fed` = tokens fed into the cache so far (`start + i + 1`)."""
    from tqdm.auto import tqdm

    if start + tokens >= len(ids):
        raise ValueError(f"start + tokens = {start + tokens} needs at least {start + tokens + 1} ids, got {len(ids)}")
    nll = 0.0
    with torch.inference_mode():
        positions = tqdm(range(start, start + tokens), desc=label, disable=not progress, leave=False, mininterval=1.0)
        for position in positions:
            logits = model(input_ids=ids[None, position : position + 1], cache=cache, use_cache=True).logits
            nll -= F.log_softmax(logits[0, -1].float(), dim=-1)[ids[position + 1]].item()
            if after_step is not None:
                after_step(position + 1)
    return nll


def perplexity(model, ids: torch.Tensor, cache, prefill: int, tokens: int | None = None) -> float:
    """Perplexity of `ids[prefill + 1 : prefill + 1 + tokens]` (default: to the end), each token predicted
    through `cache`: `ids[:prefill]` go in one forward, then every later token in its own forward, as in
    decoding. `cache` must be fresh (empty)."""
    ids = torch.as_tensor(ids).flatten().to(model.device)
    tokens = len(ids) - 1 - prefill if tokens is None else tokens
    if prefill < 1 or tokens < 1:
        raise ValueError(f"prefill={prefill} and tokens={tokens} must be positive ({len(ids)} ids given)")
    if cache.get_seq_length() != 0:
        raise ValueError("perplexity() needs a fresh cache: call `cache.reset()` or build a new one")
    with torch.inference_mode():
        model(input_ids=ids[None, :prefill], cache=cache, use_cache=True, logits_to_keep=1)
    return math.exp(next_token_nll(model, ids, cache, prefill, tokens) / tokens)
