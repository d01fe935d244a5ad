"""The `"paged"` attention applying its keyword contract: what it honours is exact (learned sinks), what it cannot
honour is refused clearly (from the config alone where it shows there: `check_model_features`), and the cache is
unchanged."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import MODELS_BY_NAME, VOCAB, ProducerlessGemma3nConfig
from transformers import DynamicCache

from hf_paged_cache import PagedCache, UnsupportedAttentionError
from hf_paged_cache.attention.contract import caches_latents, latent_key_shape
from hf_paged_cache.paged_attention import check_model_features

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 5


def _prompt(length: int = 6) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))


def _generate(model, implementation: str, cache, ids: torch.Tensor) -> list[int]:
    model.set_attn_implementation(implementation)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=NEW, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def _state(cache: PagedCache) -> tuple:
    metrics = cache.metrics()
    return cache.get_seq_length(), metrics.blocks_used, metrics.tokens_stored


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_reads_its_gathered_history_and_a_refusal_leaves_the_cache_as_it_was(name):
    """Multi-head latent attention expands the cached latents into K/V after `update()`: under "paged" the cache
    hands back the gathered latents and the logits are DynamicCache's (prefill, then decode); a keyword or a dropout
    the paged attention cannot honour, shown after the first layer wrote, is refused and the step taken back."""
    model, config = MODELS_BY_NAME[name].build()
    ids, step = _prompt(), torch.tensor([[7]])
    model.set_attn_implementation("sdpa")
    reference = DynamicCache(config=config)
    expected = [model(ids, cache=reference).logits, model(step, cache=reference).logits]
    model.set_attn_implementation("paged")
    cache = PagedCache(config, block_size=4)
    before = _state(cache)
    hook = model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda _module, args, kwargs: (args, {**kwargs, "position_bias": torch.zeros(1)}), with_kwargs=True)
    with pytest.raises(UnsupportedAttentionError, match=r"uses `position_bias`.*additive attention"):
        model(ids, cache=cache)
    hook.remove()
    assert _state(cache) == before
    # Training dropout shows only at the attention call, after the first layer wrote: the handle takes it back.
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(UnsupportedAttentionError, match=r"Attention uses dropout=0.1"):
        model(ids, cache=cache)
    model.eval()
    assert _state(cache) == before
    actual = [model(ids, cache=cache).logits, model(step, cache=cache).logits]
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gpt_oss", "granitemoe_swa"])
def test_learned_sinks_are_honoured_exactly(name):
    """`s_aux` joins every softmax (sliding and full layers, prefill, chunked prefill and decode): the paged
    attention gives eager's logits with the model's sinks, and other logits once the sinks change."""
    model, config = MODELS_BY_NAME[name].build()
    ids = _prompt(10)

    def logits(implementation: str, **options) -> torch.Tensor:
        model.set_attn_implementation(implementation)
        cache = PagedCache(config, block_size=4) if implementation == "paged" else DynamicCache(config=config)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=NEW,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, **options)  # fmt: skip
        return torch.stack(out.logits)

    expected = logits("eager")
    torch.testing.assert_close(logits("paged"), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits("paged", prefill_chunk_size=3), expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.add_(1.0)
    assert (logits("paged") - expected).abs().max() > 1e-2


def test_a_refusal_after_a_prefill_takes_the_step_back():
    """A sink the paged attention cannot apply (not one per head) shows only at the attention call, after the
    first layer wrote: that step is taken back."""
    model, config = MODELS_BY_NAME["gpt_oss"].build()
    ids = _prompt()
    cache = PagedCache(config, block_size=4)
    model.set_attn_implementation("eager")
    model(ids, cache=cache)
    before = _state(cache)
    model.set_attn_implementation("paged")
    attention, sinks = model.model.layers[1].self_attn, model.model.layers[1].self_attn.sinks
    attention.sinks = torch.nn.Parameter(sinks.detach()[:, None].expand(-1, 2).clone())
    with pytest.raises(UnsupportedAttentionError, match=r"uses `s_aux` of shape \(4, 2\).*one per query head \(4\)"):
        model(torch.tensor([[7]]), cache=cache)
    attention.sinks = sinks
    assert _state(cache) == before
    model.set_attn_implementation("eager")
    logits = model(torch.tensor([[7]]), cache=cache).logits
    reference = DynamicCache(config=config)
    model(ids, cache=reference)
    torch.testing.assert_close(logits, model(torch.tensor([[7]]), cache=reference).logits)


def test_an_unknown_keyword_and_training_dropout_are_refused_before_anything_is_written():
    model, config = MODELS_BY_NAME["llama_gqa"].build()
    model.set_attn_implementation("paged")
    cache = PagedCache(config, block_size=4)
    before = _state(cache)
    with pytest.raises(UnsupportedAttentionError, match=r"Llama model uses `position_bias`.*additive attention"):
        model(_prompt(), cache=cache, position_bias=torch.zeros(1))
    assert _state(cache) == before
    # Shown by the second layer only, after the first one wrote: the cache takes that write back.
    hook = model.model.layers[1].self_attn.register_forward_pre_hook(
        lambda _module, args, kwargs: (args, {**kwargs, "position_bias": torch.zeros(1)}), with_kwargs=True)
    with pytest.raises(UnsupportedAttentionError, match="`position_bias`"):
        model(_prompt(), cache=cache)
    hook.remove()
    assert _state(cache) == before
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(UnsupportedAttentionError, match=r"LlamaAttention uses dropout=0.1"):
        model(_prompt(), cache=cache)
    assert _state(cache) == before


def test_latent_attention_in_a_heterogeneous_config_is_found_per_layer():
    """Per-layer attributes of a heterogeneous config can only be read from its layers' configs: the latent check
    reads them there (reading them globally raised transformers' AmbiguousGlobalPerLayerAttributeError from inside
    the check, e.g. for dots3_note_text), so a model with latents in some layers is served by the gathered history."""
    _model, config = MODELS_BY_NAME["deepseek_v3"].build()
    plain = {**config.to_dict(), "kv_lora_rank": 0, "v_head_dim": 24}  # no latents, values as wide as keys
    assert not caches_latents(transformers.DeepseekV3Config(**plain))
    layered = transformers.DeepseekV3Config(**plain, per_layer_config={1: {"kv_lora_rank": 8}})  # latents in layer 1
    assert layered.is_heterogeneous
    check_model_features(layered)  # nothing to refuse
    assert caches_latents(layered) and latent_key_shape(layered) == (1, 8)


def test_compressed_attention_layers_are_refused():
    """DeepSeek-V4 concatenates its compressor's K/V onto what `update()` returns: the paged attention, reading the
    blocks, would drop them (the zoo saw its tokens differ silently), so the config is refused."""
    config = transformers.DeepseekV4Config()  # a config only: no weights are built
    with pytest.raises(UnsupportedAttentionError, match=r"compressed attention layers \(compressed_sparse_attention"):
        check_model_features(config)
    check_model_features(MODELS_BY_NAME["llama_gqa"].build()[1])  # plain layers: nothing to refuse


def test_kv_shared_layers_read_their_producers_blocks_and_a_refusal_there_takes_the_step_back():
    """Gemma-3n's last layers reuse an earlier layer's `update()` result: under "paged" they attend over that layer's
    blocks (the tokens of DynamicCache + SDPA), and a keyword refused at such a layer's attention (after every
    storing layer wrote) takes the step back: the cache continues with DynamicCache's logits."""
    model, config = MODELS_BY_NAME["gemma3n"].build()
    ids = _prompt(11)  # longer than the sliding window (8)
    reference = DynamicCache(config=config)
    expected = _generate(model, "sdpa", reference, ids)
    cache = PagedCache(config, block_size=4)
    assert _generate(model, "paged", cache, ids) == expected
    consumer = model.model.layers[3].self_attn  # reuses layer 1's K/V and calls no `update()`
    hook = consumer.register_forward_pre_hook(
        lambda _module, args, kwargs: (args, {**kwargs, "position_bias": torch.zeros(1)}), with_kwargs=True)
    with pytest.raises(UnsupportedAttentionError, match="`position_bias`"), torch.no_grad():
        model(torch.tensor([[7]]), cache=cache)
    hook.remove()
    assert cache.get_seq_length() == reference.get_seq_length()
    with torch.no_grad():
        logits = model(torch.tensor([[7]]), cache=cache).logits
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(logits, model(torch.tensor([[7]]), cache=reference).logits)


def test_kv_shared_layers_without_a_producer_are_refused():
    _model, config = MODELS_BY_NAME["gemma3n"].build()
    check_model_features(config)  # the real Gemma-3n layout is served
    producerless = ProducerlessGemma3nConfig(**config.to_dict())
    with pytest.raises(UnsupportedAttentionError, match=r"layers \[2, 3\] reuse K/V without an earlier \"store\""):
        check_model_features(producerless)
