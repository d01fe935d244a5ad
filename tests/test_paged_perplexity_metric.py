"""The `evaluate` metric in eval/metrics/paged_perplexity loads offline from its folder and scores texts
through any cache configuration; a lossless cache agrees with DynamicCache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, QuantizedCache

from hf_paged_cache import PagedCache, SnapKV, perplexity

evaluate = pytest.importorskip("evaluate")
METRIC = Path(__file__).resolve().parent.parent / "eval" / "metrics" / "paged_perplexity"
TEXTS = ["It is a truth universally acknowledged, that a single man", "However little known the feelings"]


class ByteTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def metric(tmp_path_factory):
    return evaluate.load(str(METRIC), cache_dir=str(tmp_path_factory.mktemp("evaluate")))


def test_lossless_caches_agree_and_match_the_library(model, metric):
    tokenizer = ByteTokenizer()
    paged = metric.compute(predictions=TEXTS, model=model, tokenizer=tokenizer, cache_options={"block_size": 8})
    dynamic = metric.compute(predictions=TEXTS, model=model, tokenizer=tokenizer, cache="dynamic")
    assert paged["perplexities"] == pytest.approx(dynamic["perplexities"], rel=1e-4)
    assert paged["mean_perplexity"] == pytest.approx(sum(paged["perplexities"]) / 2)
    ids = torch.tensor(tokenizer(TEXTS[0])["input_ids"])
    direct = perplexity(model, ids, PagedCache(model.config), prefill=1)
    assert paged["perplexities"][0] == pytest.approx(direct, rel=1e-5)
    assert dynamic["kv_bytes_per_token"] == [512.0, 512.0]  # 2 layers x K+V x 2 heads x 16 x fp32
    assert model.config._attn_implementation == "sdpa"  # restored after the paged run


def test_lossy_caches_cost_bytes_and_perplexity(model, metric):
    tokenizer, text = ByteTokenizer(), [TEXTS[0] * 2]  # 120 tokens: 64 prefilled, 55 scored
    full = metric.compute(predictions=text, model=model, tokenizer=tokenizer, prefill=64,
                          cache_options={"block_size": 8})  # fmt: skip
    int4 = metric.compute(predictions=text, model=model, tokenizer=tokenizer, prefill=64,
                          cache_options={"block_size": 8, "quant": "int4", "residual_length": 16})  # fmt: skip
    evicted = metric.compute(predictions=text, model=model, tokenizer=tokenizer, prefill=64,
                             cache_options={"block_size": 8, "eviction": SnapKV(budget=32, window=8)})  # fmt: skip
    pytest.importorskip("optimum.quanto")
    quanto = metric.compute(predictions=text, model=model, tokenizer=tokenizer, prefill=64,
                            cache=lambda config: QuantizedCache(config=config, backend="quanto", nbits=4,
                                                                residual_length=16, q_group_size=16))  # fmt: skip
    for lossy in (int4, evicted, quanto):
        assert lossy["kv_bytes_per_token"][0] < full["kv_bytes_per_token"][0]
        assert lossy["perplexities"][0] != full["perplexities"][0]
        assert lossy["perplexities"][0] == pytest.approx(full["perplexities"][0], rel=0.2)


def test_bad_arguments_say_what_to_do(model, metric):
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match="cache='bogus'"):
        metric.compute(predictions=TEXTS, model=model, tokenizer=tokenizer, cache="bogus")
    with pytest.raises(ValueError, match="cache_options are PagedCache options"):
        metric.compute(predictions=TEXTS, model=model, tokenizer=tokenizer, cache="dynamic",
                       cache_options={"quant": "int8"})  # fmt: skip
    with pytest.raises(ValueError, match=r"predictions\[0\] has 3 tokens"):
        metric.compute(predictions=["abc"], model=model, tokenizer=tokenizer, prefill=2)
    with pytest.raises(ValueError, match="tokenizer"):
        metric.compute(predictions=TEXTS, model=model)
