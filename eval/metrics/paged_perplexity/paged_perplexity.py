"""Perplexity through a KV cache, as an `evaluate` metric: every scored token is predicted by a forward that
reads the earlier tokens' K/V from the cache, so a lossy cache (quantized blocks, token eviction) shows
its cost. Load it offline from this folder:

    import evaluate
    from hf_paged_cache import SnapKV

    metric = evaluate.load("eval/metrics/paged_perplexity")
    metric.compute(predictions=texts, model=model, tokenizer=tokenizer)                          # PagedCache()
    metric.compute(predictions=texts, model=model, tokenizer=tokenizer, cache_options={"quant": "int4"})
    metric.compute(predictions=texts, model=model, tokenizer=tokenizer, cache="dynamic")        # the baseline
    metric.compute(predictions=texts, model=model, tokenizer=tokenizer, prefill=256,
                   cache_options={"eviction": SnapKV(budget=64)})         # compress a 256-token prompt, then score
"""

from __future__ import annotations

import math
from collections.abc import Callable

import datasets
import evaluate
import torch

from hf_paged_cache import PagedCache, cache_bytes, perplexity, register_paged_attention

_DESCRIPTION = """Teacher-forced perplexity of each text, with every scored token predicted through a KV cache:
the first `prefill` tokens are fed in one forward, then each following token in its own forward (as in
decoding). Any cache configuration: `PagedCache` options (`cache_options`), transformers' DynamicCache
(`cache="dynamic"`), or any callable building a cache from the model's config."""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts to score.
    model (PreTrainedModel or str): a causal LM, or a name / local path for `AutoModelForCausalLM`.
    tokenizer (optional): its tokenizer (loaded from `model` when that is a str); called as
        `tokenizer(text, add_special_tokens=False)["input_ids"]`.
    cache (str or callable): "paged" (default: `PagedCache(model.config, **cache_options)`), "dynamic",
        or a callable `config -> Cache`, e.g. `lambda config: QuantizedCache(config=config, backend="quanto", nbits=4)`.
    cache_options (dict, optional): `PagedCache` options, e.g. `{"quant": "int4", "block_size": 32}`.
    attn_implementation (str, optional): attention for the run (the model's own is restored afterwards).
        Default: "paged" for a PagedCache (it reads blocks in place; eviction needs it), else unchanged.
    prefill (int): tokens fed in one forward before scoring starts; tokens from index prefill + 1 on are
        scored, each predicted after a one-token forward through the cache (default 1).
    max_length (int, optional): score at most the first `max_length` tokens of each text.
Returns:
    perplexities (list of float), mean_perplexity (float), and kv_bytes_per_token (list of float: the bytes
    the cache's contents occupied after each text, per token it held).
Example:
    >>> metric = evaluate.load("eval/metrics/paged_perplexity")
    >>> metric.compute(predictions=["It is a truth universally acknowledged ..."], model=model, tokenizer=tok)
"""

CACHE_KINDS = ("paged", "dynamic")


class PagedPerplexity(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(
        self,
        predictions: list[str],
        model,
        tokenizer=None,
        cache: str | Callable = "paged",
        cache_options: dict | None = None,
        attn_implementation: str | None = None,
        prefill: int = 1,
        max_length: int | None = None,
    ) -> dict:
        if not callable(cache) and cache not in CACHE_KINDS:
            raise ValueError(f"cache={cache!r}: use one of {CACHE_KINDS} or a callable `config -> Cache`")
        if cache_options and cache != "paged":
            raise ValueError("cache_options are PagedCache options: give them with cache='paged' (the default)")
        if prefill < 1:
            raise ValueError(f"prefill={prefill}: at least the first token must be fed before scoring")
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model).eval()
        if tokenizer is None:
            raise ValueError("tokenizer: give the model's tokenizer (needed when `model` is a model object)")

        previous = model.config._attn_implementation
        attention = attn_implementation or ("paged" if cache == "paged" else previous)
        if attention == "paged":
            register_paged_attention()
        try:
            model.set_attn_implementation(attention)
            perplexities, bytes_per_token = [], []
            for index, text in enumerate(predictions):
                ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:max_length])
                if len(ids) < prefill + 2:
                    raise ValueError(f"predictions[{index}] has {len(ids)} tokens: at least prefill + 2 = "
                                     f"{prefill + 2} are needed to score one through the cache")  # fmt: skip
                kv_cache = self._new_cache(model, cache, cache_options or {})
                perplexities.append(perplexity(model, ids, kv_cache, prefill=prefill))
                bytes_per_token.append(cache_bytes(kv_cache)["kv_bytes"] / kv_cache.get_seq_length())
        finally:
            model.set_attn_implementation(previous)
        return {
            "perplexities": perplexities,
            "mean_perplexity": math.fsum(perplexities) / len(perplexities) if perplexities else math.nan,
            "kv_bytes_per_token": bytes_per_token,
        }

    @staticmethod
    def _new_cache(model, cache, options: dict):
        if callable(cache):
            return cache(model.config)
        if cache == "dynamic":
            from transformers import DynamicCache

            return DynamicCache(config=model.config)
        return PagedCache(model.config, **options)
