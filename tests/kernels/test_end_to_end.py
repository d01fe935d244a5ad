"""generate() with the "paged" attention routed through the Triton kernels (the interpreter on CPU,
compiled on CUDA) gives DynamicCache's tokens: cache writes, prefill, chunked prefill on a warm cache,
decode, sliding windows, soft-capping and learned sinks all run in the kernels."""

import pytest
import torch
from batch_workloads import alone, random_prompts, tiny_model
from kernel_testing import DEVICE
from tiny_models import deepseek_v3, gemma3n, mimo_v2_flash
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from hf_paged_cache import PagedCache
from hf_paged_cache import generate_batch, kernels

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, pad_token_id=0)  # fmt: skip



def _gpt_oss():
    """Sliding and full layers with learned sinks (`s_aux`), drawn wide enough to matter."""
    model = GptOssForCausalLM(GptOssConfig(**COMMON, sliding_window=6, num_local_experts=2, num_experts_per_tok=1,
                                           layer_types=["sliding_attention", "full_attention"]))  # fmt: skip
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "mistral-window6": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=6)),
    "gemma2-softcap": lambda: Gemma2ForCausalLM(
        Gemma2Config(**COMMON, sliding_window=6, attn_logit_softcapping=20.0, final_logit_softcapping=None)
    ),
    "gpt-oss-sinks": _gpt_oss,
}
# Its last layers read the blocks of earlier ones; chunked only (it covers both kernels) to keep the interpreter short.
KV_SHARED = {"gemma3n-kv-shared": lambda: gemma3n()[0]}


pytestmark = pytest.mark.usefixtures("one_thread")


def _record_kernel_calls(monkeypatch) -> list[int]:
    """The query length of every call of the kernels' attention (1 for decode), recorded from now on."""
    kernel_calls = []
    decode, prefill = kernels.paged_decode_attention, kernels.paged_prefill_attention
    monkeypatch.setattr(kernels, "paged_decode_attention",
                        lambda *args, **kw: kernel_calls.append(1) or decode(*args, **kw))  # fmt: skip
    monkeypatch.setattr(kernels, "paged_prefill_attention",
                        lambda query, *args, **kw: kernel_calls.append(query.shape[1]) or prefill(query, *args, **kw))  # fmt: skip
    return kernel_calls


@pytest.mark.parametrize(("name", "chunked"), [
    *(pytest.param(name, chunked, id=f"{name}-{'chunked' if chunked else 'prefill'}")
      for name in MODELS for chunked in (False, True)),
    *(pytest.param(name, True, id=f"{name}-chunked") for name in KV_SHARED),
])  # fmt: skip
def test_generate_through_kernels_matches_dynamic_cache(name, chunked, monkeypatch):
    torch.manual_seed(0)
    model = (MODELS | KV_SHARED)[name]().to(DEVICE).eval()
    ids = torch.randint(1, 96, (2, 9)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # fewer pads than a chunk, so padding is known exactly and the kernels may read
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True, eos_token_id=None)  # fmt: skip
    if chunked:
        settings["prefill_chunk_size"] = 4
    model.set_attn_implementation("eager")
    expected = model.generate(**settings, cache=DynamicCache(config=model.config))

    kernel_calls = _record_kernel_calls(monkeypatch)
    model.set_attn_implementation("paged")
    actual = model.generate(**settings, cache=PagedCache(model.config, block_size=4, backend="triton"))
    assert 1 in kernel_calls and any(q > 1 for q in kernel_calls), "decode and prefill kernels were not both used"
    assert torch.equal(actual.sequences, expected.sequences)
    for got, want in zip(actual.scores, expected.scores):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "name, quant",
    [("llama", "int4"), ("llama", "K4V2"), ("llama", "fp8_e4m3"), ("llama", "int2"), ("gpt-oss-sinks", "int8")],
)  # int2: rotated values
def test_quantized_generate_through_kernels_matches_the_torch_path(name, quant, monkeypatch):
    """Sealing (`quantize_blocks`) and the quantized decode / prefill variants, interpreted, give the
    torch path's tokens and scores, with a quantized prefix that grows while generating (sinks included)."""
    torch.manual_seed(0)
    model = MODELS[name]().to(DEVICE).eval()
    ids = torch.randint(1, 96, (2, 13)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True, eos_token_id=None, prefill_chunk_size=8)  # fmt: skip
    options = dict(block_size=4, quant=quant, residual_length=4)
    model.set_attn_implementation("paged")
    expected = model.generate(**settings, cache=PagedCache(model.config, backend="torch", **options))
    calls = []  # the quantized tokens each kernel call read

    def spy(kernel):
        def call(*args, quantized=None, **kw):
            calls.append(0 if quantized is None else int(quantized.lens.sum()))
            return kernel(*args, quantized=quantized, **kw)

        return call

    for name in ("paged_decode_attention", "paged_prefill_attention"):
        monkeypatch.setattr(kernels, name, spy(getattr(kernels, name)))
    cache = PagedCache(model.config, backend="triton", **options)
    actual = model.generate(**settings, cache=cache)
    assert any(calls), "no kernel call read a quantized prefix"
    assert cache.metrics().quantized_tokens > 0
    assert torch.equal(actual.sequences, expected.sequences)
    for got, want in zip(actual.scores, expected.scores):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize(("build", "gather"), [(deepseek_v3, "sdpa"), (mimo_v2_flash, "eager")], ids=["latents", "mimo"])
def test_values_narrower_than_keys_on_the_kernel_backend_match_dynamic_cache(build, gather, quant):
    """Values narrower than keys (DeepSeek's cached latents: the latent as keys, the positional key as values;
    MiMo-V2-Flash's heads) do not fit the kernels, which take one head dim: those layers take the torch paths, so
    `backend="triton"` serves the model exactly under either attention (int8: as the torch backend does with it).
    """
    model, config = build()
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                    output_scores=True, return_dict_in_generate=True, eos_token_id=None)  # fmt: skip
    options = dict(block_size=4, quant=quant, residual_length=4)
    for implementation in (gather, "paged"):
        model.set_attn_implementation(gather if quant is None else implementation)
        expected = model.generate(**settings, cache=DynamicCache(config=config) if quant is None else
                                  PagedCache(config, backend="torch", **options))  # fmt: skip
        model.set_attn_implementation(implementation)
        actual = model.generate(**settings, cache=PagedCache(config, backend="triton", **options))
        assert torch.equal(actual.sequences, expected.sequences), implementation
        for got, want in zip(actual.scores, expected.scores):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_chunked_attention_through_kernels_in_the_batch_generator(monkeypatch):
    """Llama-4's chunked layers read by the kernels (decode and prefill, chunks of 8 crossed by prompts and by
    decoding) in packed forwards: the tokens of each prompt alone with DynamicCache."""
    model = tiny_model("llama4_chunked")
    prompts = random_prompts((11, 19), seed=3)
    expected = [alone(model, prompt, DynamicCache(), "sdpa") for prompt in prompts]
    kernel_calls = _record_kernel_calls(monkeypatch)
    outputs = generate_batch(model, prompts, max_new_tokens=6, block_size=4, max_batch_tokens=12, backend="triton")
    assert 1 in kernel_calls and any(q > 1 for q in kernel_calls), "decode and prefill kernels were not both used"
    assert [output.generated_tokens for output in outputs] == expected
