"""Teacher-forced scoring through a cache: every scored token is predicted by a forward that reads the
previous tokens' K/V from the cache (as decoding does), so a lossy cache shows its cost in perplexity."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def next_token_nll(
    model, ids: torch.Tensor, cache, start: int, tokens: int, progress: bool = False, label: str = "",
    after_step: Callable[[int], None] | None = None, step: int = 1,
) -> float:
    """Feed `ids[start + i]` for i < `tokens` through `cache` and return the summed negative log-likelihood
    of each next token `ids[start + i + 1]`. One forward per token (`step=1`) is decoding; a larger `step`
    feeds that many tokens per forward: faster, the same scores for lossless caches, nearly the same for
    quantized ones (a forward reads its own tokens in full precision, so up to `step` more recent tokens are
    exact), but not for eviction (chunks are evicted like prefill chunks). `after_step(fed)` runs after each
    forward, `fed` = tokens fed into the cache so far."""
    from tqdm.auto import tqdm

    if start + tokens >= len(ids):
        raise ValueError(f"start + tokens = {start + tokens} needs at least {start + tokens + 1} ids, got {len(ids)}")
    if step < 1:
        raise ValueError(f"step={step}: feed at least one token per forward")
    nll = 0.0
    with torch.inference_mode():
        chunks = range(start, start + tokens, step)
        for first in tqdm(chunks, desc=label, disable=not progress, leave=False, mininterval=1.0):
            stop = min(first + step, start + tokens)
            logits = model(input_ids=ids[None, first:stop], cache=cache, use_cache=True).logits[0].float()
            nll -= F.log_softmax(logits, dim=-1).gather(-1, ids[first + 1 : stop + 1, None]).sum().item()
            if after_step is not None:
                after_step(stop)
    return nll


def perplexity(model, ids: torch.Tensor, cache, prefill: int, tokens: int | None = None, step: int = 1) -> float:
    """Perplexity of `ids[prefill + 1 : prefill + 1 + tokens]` (default: to the end), each token predicted
    through `cache`: `ids[:prefill]` go in one forward, then the later tokens one forward each, as in
    decoding (or `step` per forward, see `next_token_nll`). `cache` must be fresh (empty)."""
    ids = torch.as_tensor(ids).flatten().to(model.device)
    tokens = len(ids) - 1 - prefill if tokens is None else tokens
    if prefill < 1 or tokens < 1:
        raise ValueError(f"prefill={prefill} and tokens={tokens} must be positive ({len(ids)} ids given)")
    if cache.get_seq_length() != 0:
        raise ValueError("perplexity() needs a fresh cache: call `cache.reset()` or build a new one")
    with torch.inference_mode():
        model(input_ids=ids[None, :prefill], cache=cache, use_cache=True, logits_to_keep=1)
    return math.exp(next_token_nll(model, ids, cache, prefill, tokens, step=step) / tokens)
