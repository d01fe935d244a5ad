"""Copies of a cache: `fork()` / `copy.deepcopy` (sharing blocks by reference) and pickle round trips (fully
independent) of plain, quantized, evicted and sliding caches continue exactly like their original and leave
it as it was (the recipe transformers documents for reusing a prompt's cache). `copy.copy` is shallow, as for
every Python object: it shares the storage."""

from __future__ import annotations

import copy
import functools
import pickle

import pytest
import torch
from cache_state import cache_state, row_state
from tiny_models import MODELS_BY_NAME, VOCAB

from hf_paged_cache import H2O, PagedCache, StreamingLLM

PREFIX, PROMPT, STEPS = 10, 16, 6

CASES = {  # name: (model, attention, PagedCache options)
    "plain": ("llama_gqa", "sdpa", {}),
    "int8": ("llama_gqa", "sdpa", {"quant": "int8", "residual_length": 0}),
    "int4_paged": ("llama_gqa", "paged", {"quant": "int4", "residual_length": 4}),
    "streaming_llm": ("llama_gqa", "paged", {"eviction": StreamingLLM(budget=8, sinks=2, window=4)}),
    "h2o_int8": ("llama_gqa", "paged", {"eviction": H2O(budget=8, sinks=2, window=4), "quant": "int8", "residual_length": 4}),
    "mistral_sliding": ("mistral_sliding", "sdpa", {}),
    "qwen2_sliding_int8": ("qwen2_sliding", "paged", {"quant": "int8", "residual_length": 4}),
}

COPIERS = {
    "fork": PagedCache.fork,
    "deepcopy": copy.deepcopy,
    "pickle": lambda cache: pickle.loads(pickle.dumps(cache)),
}
SHARING = {"fork", "deepcopy"}  # the copy shares the original's pools: compare what each sees through its rows

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _continue(model, cache, ids: torch.Tensor) -> list[int]:
    """Feed the rest of the prompt after the cached prefix, then decode STEPS greedy tokens."""
    with torch.no_grad():
        logits = model(input_ids=ids[:, cache.get_seq_length() :], cache=cache).logits
        tokens = []
        for _ in range(STEPS):
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = model(input_ids=token, cache=cache).logits
    return tokens


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("case", CASES)
def test_copy_is_independent_and_continues_exactly(case, copier):
    name, attention, options = CASES[case]
    model = _model(name)
    model.set_attn_implementation(attention)
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))

    def prefilled() -> PagedCache:
        cache = PagedCache(model.config, block_size=4, **options)
        with torch.no_grad():
            model(input_ids=ids[:, :PREFIX], cache=cache)
        return cache

    reference = prefilled()
    expected = _continue(model, reference, ids)
    original = prefilled()
    if "eviction" in options:
        assert original.metrics().evicted_tokens > 0  # the copy is of an evicted cache
    state = row_state if copier in SHARING else cache_state
    before = state(original)
    copied = COPIERS[copier](original)
    assert state(copied) == before
    assert _continue(model, copied, ids) == expected
    if copier not in SHARING:
        assert copied.metrics() == reference.metrics()  # counts, bytes and the quantization error alike
    assert state(original) == before  # continuing the copy wrote nothing the original reads
    assert _continue(model, original, ids) == expected
    if copier not in SHARING:
        assert original.metrics() == reference.metrics()
    elif case == "plain":
        # Both continued: the prefix's full blocks are stored once. (Elsewhere they may be gone by now: blocks
        # that a quantized group seals or that eviction compacts after the fork are rewritten by each fork,
        # and a sliding window leaves the prefix behind.)
        assert original.metrics().blocks_used < 2 * reference.metrics().blocks_used


def test_deepcopy_of_a_quantized_prompt_cache_with_generate():
    """The issue's recipe: prefill a prefix, deep-copy, `generate()` the full prompt on the copy."""
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))

    def generate(cache):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=STEPS, do_sample=False)
        return out[0, PROMPT:].tolist()

    caches = []
    for _ in range(2):
        caches.append(PagedCache(model.config, block_size=4, quant="int8", residual_length=0))
        with torch.no_grad():
            model(input_ids=ids[:, :PREFIX], cache=caches[-1])
    prompt_cache, reference = caches
    expected = generate(reference)
    error = prompt_cache.metrics().quant_error
    assert generate(copy.deepcopy(prompt_cache)) == expected
    assert generate(copy.deepcopy(prompt_cache)) == expected
    assert prompt_cache.metrics().quant_error == error and prompt_cache.get_seq_length() == PREFIX
