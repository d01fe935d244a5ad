"""`perplexity` scores every token through the cache: a lossless cache matches the model's own
full-sequence log-likelihoods, and misuse fails with a clear message."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_paged_cache import PagedCache, perplexity
from hf_paged_cache.scoring import next_token_nll
from tiny_models import llama_gqa


def test_perplexity_through_the_cache_equals_one_full_forward():
    model, config = llama_gqa()
    ids = torch.randint(3, 128, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        log_probs = F.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
    nll = -log_probs[torch.arange(10, 29), ids[11:30]]  # tokens 11..29: each after a one-token forward
    expected = math.exp(nll.mean().item())
    assert perplexity(model, ids, PagedCache(config, block_size=4), prefill=10) == pytest.approx(expected, rel=1e-4)
    assert perplexity(model, ids, DynamicCache(config=config), prefill=10) == pytest.approx(expected, rel=1e-4)
    chunked = perplexity(model, ids, PagedCache(config, block_size=4), prefill=10, step=7)  # 7 + 7 + 5 tokens
    assert chunked == pytest.approx(expected, rel=1e-4)
    steps = []
    nll_sum = next_token_nll(model, ids, DynamicCache(config=config), 0, 5, after_step=steps.append)
    assert nll_sum == pytest.approx(-log_probs[torch.arange(5), ids[1:6]].sum().item(), rel=1e-4)
    assert steps == [1, 2, 3, 4, 5]


def test_perplexity_rejects_misuse():
    model, config = llama_gqa()
    ids = torch.arange(3, 13)
    with pytest.raises(ValueError, match="prefill=10 and tokens=-1"):
        perplexity(model, ids, PagedCache(config), prefill=10)
    cache = PagedCache(config)
    perplexity(model, ids, cache, prefill=4)
    with pytest.raises(ValueError, match="fresh cache"):
        perplexity(model, ids, cache, prefill=4)
    with pytest.raises(ValueError, match="step=0"):
        next_token_nll(model, ids, DynamicCache(config=config), 0, 5, step=0)
    with pytest.raises(ValueError, match="needs at least 11 ids"):
        next_token_nll(model, ids, DynamicCache(config=config), 5, 5)
