"""`FusedDecoderLayers`: Llama-code decoder layers run fused in packed forwards (C++ norm and rotary, residuals added
in the oneDNN products, the last layer's queries, attention and what follows only for the kept tokens) give the
logits of the layers' own forwards, and every layer the fused forward would change keeps its own."""

from __future__ import annotations

import pytest
import torch
from batch_workloads import NEW, alone, random_prompts, tiny_model
from tiny_models import MODELS_BY_NAME
from transformers import DynamicCache, Ernie4_5Config, Ernie4_5ForCausalLM

from hf_paged_cache import PagedCache, paged_attention
from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.layers.handle import PackedPagedKV
from hf_paged_cache.cpu_runtime import fused_layers
from hf_paged_cache.cpu_runtime.fused_layers import FusedDecoderLayers
from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.cpu_runtime.onednn import OneDnnLinears, onednn_available
from hf_paged_cache.serving.runner import layer_sliding, packed_logits

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not (onednn_available() and cpu_attention.available()),
                       reason="needs oneDNN and the C++ CPU kernels"),  # fmt: skip
]


@pytest.fixture
def fused_calls(monkeypatch):
    """The layers each fused forward ran for, in order."""
    calls = []
    real = fused_layers._fused_forward

    def counted(layer, *args, **kwargs):
        calls.append(layer)
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(fused_layers, "_fused_forward", counted)
    return calls


def _fused(model) -> FusedDecoderLayers | None:
    return FusedDecoderLayers.of(model, model.config.num_hidden_layers, OneDnnLinears(model))


def test_every_llama_layer_is_fused_and_the_last_reads_only_its_kept_tokens():
    model = tiny_model("llama_gqa")
    fused = _fused(model)
    assert fused.layers == list(model.model.layers) and fused.last is model.model.layers[-1]


@pytest.mark.parametrize("name", ["mistral_sliding", "gemma3"])
def test_layers_of_other_code_are_not_fused(name):
    """Mistral's attention passes its window to the attention function; Gemma's layers norm four times."""
    assert _fused(tiny_model(name)) is None


def _ernie():
    torch.manual_seed(0)
    config = Ernie4_5Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    return Ernie4_5ForCausalLM(config).eval()


def test_llama_bytecode_calling_another_helper_is_not_fused():
    """Ernie 4.5's attention is Llama's bytecode, but the `apply_rotary_pos_emb` it calls (its module's own) rotates
    interleaved channel pairs: fused, it would silently run Llama's rotation. Not fused, it gives the tokens of each
    prompt alone."""
    model = _ernie()
    assert _fused(model) is None
    prompts = random_prompts((7, 12), seed=5)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    assert generator.fused is None
    for prompt in prompts:
        generator.add_request(prompt)
    for prompt, output in zip(prompts, generator.run()):
        assert output.generated_tokens == alone(model, prompt, DynamicCache(), "sdpa")


@pytest.mark.parametrize("narrowed", [True, False])
def test_a_fused_packed_forward_gives_the_logits_of_the_unfused_one(fused_calls, monkeypatch, narrowed):
    """Prompt chunks after stored tokens and from scratch, and decode tokens, in one packed forward: the kept tokens'
    logits of the layers' own forwards (the norm's mean sums in another order), and the same K/V stored. The last
    layer's attention takes the kept tokens' queries alone; where the handle cannot narrow to them (`narrowed=False`),
    every token's, and it keeps the kept tokens' outputs."""
    queries = []
    attend_packed = paged_attention._attend_packed
    monkeypatch.setattr(paged_attention, "_attend_packed",
                        lambda query, *args: queries.append(query.shape[2]) or attend_packed(query, *args))  # fmt: skip
    if not narrowed:
        monkeypatch.setattr(PackedPagedKV, "last_tokens", lambda self, device: None)
    model = tiny_model("llama_gqa")
    model.set_attn_implementation("paged")
    fused = _fused(model)
    prompts = random_prompts((9, 5, 12), seed=21)
    logits, stored = [], []
    for use in (None, fused):
        template = PagedCache(model.config, block_size=4, num_blocks=60)
        caches = [template.sibling() for _ in prompts]
        with torch.no_grad():
            for cache, prompt in zip(caches[:2], prompts):
                model(input_ids=torch.tensor([prompt[:4]]), cache=cache)
            chunks = [(caches[0], prompts[0][4:], 4), (caches[1], prompts[1][4:5], 4), (caches[2], prompts[2], 0)]
            logits.append(packed_logits(model, chunks, layer_sliding(template), fused=use))
        stored.append([cache.layers[0].gather(cache.layers[0].tables.plan)[0] for cache in caches])
    assert fused_calls == list(model.model.layers)  # the fused forward ran, once per layer
    layers, tokens = model.config.num_hidden_layers, len(prompts[0]) - 4 + 1 + len(prompts[2])
    assert queries == [tokens] * (2 * layers - 1) + [3 if narrowed else tokens]  # unfused, then fused
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(*stored):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_the_batch_generator_fuses_and_gives_the_tokens_of_each_prompt_alone(fused_calls):
    model = tiny_model("llama_gqa")
    prompts = random_prompts((5, 17, 9, 30), seed=3)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    assert generator.fused is not None
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert fused_calls
    for prompt, output in zip(prompts, outputs):
        assert output.generated_tokens == alone(model, prompt, DynamicCache(), MODELS_BY_NAME["llama_gqa"].gather_impl)
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_no_fused_layers_without_onednn_or_with_compiled_modules():
    model = tiny_model("llama_gqa")
    assert BatchGenerator(model, max_new_tokens=NEW, onednn=False).fused is None
    assert BatchGenerator(model, max_new_tokens=NEW, compile=True).fused is None


def test_a_layer_hooked_after_the_generator_was_built_runs_its_own_forward(fused_calls):
    """Hooks can come at any time: a layer with a hook on any of its modules, or every layer under a global hook,
    runs as the model has it (the hook runs), the others stay fused."""
    model = tiny_model("llama_gqa")
    generator = BatchGenerator(model, max_new_tokens=2, block_size=4)
    seen = []
    handle = model.model.layers[0].input_layernorm.register_forward_hook(lambda *args: seen.append("norm"))
    try:
        generator.add_request([5, 6, 7])
        generator.run()
    finally:
        handle.remove()
    assert seen == ["norm", "norm"] and model.model.layers[0] not in fused_calls and fused_calls
    fused_calls.clear()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        generator.add_request([5, 6, 7])
        generator.run()
    finally:
        handle.remove()
    assert fused_calls == []


def test_a_layer_in_training_mode_runs_its_own_forward():
    model = tiny_model("llama_gqa")
    layer = model.model.layers[0]
    hidden = torch.randn(1, 5, model.config.hidden_size)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(5)[None])
    linears = OneDnnLinears(model)
    layer.train()
    try:
        with torch.no_grad():
            got = fused_layers._fused_forward(layer, linears, None, hidden, position_embeddings=position_embeddings)
            expected = layer(hidden, position_embeddings=position_embeddings)
    finally:
        layer.eval()
    assert torch.equal(got, expected)


def test_only_modules_outside_the_fused_layers_swap_their_forwards():
    """A packed forward swaps the oneDNN forward into the linears it calls through their modules (the LM head, a
    hooked layer's), not into those of the layers that run fused, whose forwards nothing calls; all are put back."""
    model = tiny_model("llama_gqa")
    linears = OneDnnLinears(model)
    fused = FusedDecoderLayers.of(model, model.config.num_hidden_layers, linears)
    first, last = model.model.layers[0], model.model.layers[-1]
    handle = first.input_layernorm.register_forward_hook(lambda *args: None)
    try:
        with fused.active(torch.tensor([0])) as inside, linears.active(skip=inside):
            assert first not in inside and last.self_attn.q_proj in inside
            swapped = [module for module in linears.modules if "forward" in module.__dict__]
            assert model.lm_head in swapped and first.self_attn.q_proj in swapped and first.mlp in swapped
            assert last.self_attn.q_proj not in swapped and last.mlp not in swapped
    finally:
        handle.remove()
    assert not any("forward" in module.__dict__ for module in model.modules())
