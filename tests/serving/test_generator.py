"""The continuous batch generator: packed forwards of many requests equal each request run alone."""

from __future__ import annotations

import pytest
import torch
import transformers
from batch_workloads import NEW, alone, clean_run, failing, random_prompts, tiny_model
from test_smollm2 import PROMPTS, needs_wheel
from tiny_models import MODELS_BY_NAME, VOCAB, ProducerlessGemma3nConfig
from transformers import DynamicCache

from hf_paged_cache import PagedCache, StreamingLLM, UnsupportedAttentionError, UnsupportedModelError
from hf_paged_cache.serving.generator import BatchConfig, BatchGenerator, generate_batch
from hf_paged_cache.serving.settings import RequestSettings
from hf_paged_cache.smollm2 import load_smollm2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", [
    "llama_gqa", "llama_mqa", "qwen3", "mistral_sliding", "qwen2_sliding", "gemma2", "gemma3n", "gpt_oss",
    "granitemoe_swa", "deepseek_v3", "deepseek_v2", "mimo_v2_flash", "llama4_chunked",
])  # fmt: skip
def test_greedy_outputs_equal_each_prompt_alone_with_dynamic_cache(name):
    model = tiny_model(name)
    prompts = random_prompts((5, 17, 9, 30, 3, 12), seed=1)
    # A small token budget splits prompts into chunks that share forwards with other requests' decode tokens.
    outputs = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_batch_tokens=16, max_num_seqs=3)
    assert [o.request_id for o in outputs] == list(range(len(prompts)))
    for prompt, output in zip(prompts, outputs):
        assert output.finish_reason == "length" and output.error is None
        assert output.generated_tokens == alone(model, prompt, DynamicCache(), MODELS_BY_NAME[name].gather_impl)


@pytest.mark.parametrize("block_size", [3, 4, 6, 8, 16], ids=lambda size: f"block{size}")
@pytest.mark.parametrize("quant", [None, "int4"])
@pytest.mark.parametrize("name", ["llama4_chunked", "mistral_sliding", "gemma3"])
def test_windows_and_chunks_equal_each_prompt_alone_at_every_block_size(name, quant, block_size):
    """Chunks and windows of 8 with blocks that divide them (4, 8), do not (3, 6) or are larger (16): a block then
    straddles a chunk's start, and a lone decode query must still read its own chunk alone. Prompts share a prefix
    (prefix caching on) and are chunked by a small token budget."""
    model = tiny_model(name)
    prompts = random_prompts((5, 17, 9, 30, 3, 12), seed=1, prefix=11)
    options = {} if quant is None else {"quant": quant, "residual_length": 0}
    outputs = generate_batch(model, prompts, max_new_tokens=NEW, block_size=block_size, max_batch_tokens=16,
                             **options)  # fmt: skip
    for prompt, output in zip(prompts, outputs):
        reference = (DynamicCache() if quant is None else PagedCache(model.config, block_size=block_size, **options))
        implementation = MODELS_BY_NAME[name].gather_impl if quant is None else "paged"
        assert output.error is None and output.generated_tokens == alone(model, prompt, reference, implementation)


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_chunked_attention_under_preemption_equals_each_prompt_alone(preemption):
    """Llama-4's chunked layers (chunks of 8) in a pool for a quarter of the demand: requests preempted and resumed
    across chunk boundaries give the tokens of one-by-one `generate` with DynamicCache; their chunked group holds
    at most the chunk's blocks and one more."""
    model = tiny_model("llama4_chunked")
    prompts = random_prompts((20, 33, 12, 41, 27, 18), seed=9)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=16, num_blocks=15,
                               prefix_caching=False, preemption=preemption)  # fmt: skip
    held, fed = [], {}

    def after_decode_steps(generator, batch):  # blocks held once the request's last step fed one token
        for request in generator.requests.running:
            if request.cache is not None and request.fed == fed.get(request.request_id, -1) + 1:
                held.extend(len(table) for name, group in request.cache.groups.items()
                            if name.startswith("chunked_attention") for table in group.tables)  # fmt: skip
            fed[request.request_id] = request.fed

    generator.before_forward.append(lambda batch: after_decode_steps(generator, batch))
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    metrics = generator.metrics()
    assert metrics.preempted_swap + metrics.preempted_recompute > 0
    for prompt, output in zip(prompts, outputs):
        assert output.generated_tokens == alone(model, prompt, DynamicCache(), "sdpa")
    assert held and max(held) <= 8 // 4 + 1


@pytest.mark.parametrize("options", [
    {"quant": "int8", "residual_length": 4},
    {"quant": "int4", "residual_length": 0},
    {"eviction": StreamingLLM(budget=12, sinks=2, window=6)},
], ids=["int8", "int4", "streaming_llm"])  # fmt: skip
def test_cache_options_apply_per_request(options):
    model = tiny_model("llama_gqa")
    prompts = random_prompts((25, 17, 40), seed=2)
    # A budget that takes every prompt whole: eviction between the chunks of a prompt would (rightly) keep
    # other tokens than one prefill does.
    outputs = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_batch_tokens=128, **options)
    for prompt, output in zip(prompts, outputs):
        expected = alone(model, prompt, PagedCache(model.config, block_size=4, **options), "paged")
        assert output.generated_tokens == expected


def test_cancelling_a_request_frees_its_blocks_and_streaming_returns_the_others():
    model = tiny_model("llama_gqa")
    generator = BatchGenerator(model, max_new_tokens=50, block_size=4, num_blocks=80, prefix_caching=False)
    first, second = (generator.add_request(prompt) for prompt in random_prompts((20, 11), seed=5))
    generator.step()
    generator.step()
    used = generator.template.metrics().blocks_used
    assert generator.cancel_request(first)
    assert generator.template.metrics().blocks_used < used
    cancelled = generator.get_result()
    assert cancelled.request_id == first and cancelled.finish_reason == "cancelled"
    done = generator.get_result()
    assert done.request_id == second and len(done.generated_tokens) == 50
    assert generator.get_result() is None and not generator.cancel_request(second)
    assert generator.template.metrics().blocks_used == 0


def test_a_request_that_can_never_fit_gets_a_clear_error_and_the_others_finish():
    model = tiny_model("llama_gqa")
    prompts = random_prompts((6, 60, 5), seed=6)
    outputs = generate_batch(model, prompts, max_new_tokens=3, block_size=4, num_blocks=8)
    assert outputs[1].finish_reason == "error"
    assert "num_blocks" in outputs[1].error and "max_batch_tokens" in outputs[1].error
    assert [len(outputs[i].generated_tokens) for i in (0, 2)] == [3, 3]


def test_admission_waits_for_free_blocks_and_metrics_track_it():
    model = tiny_model("llama_gqa")
    prompts = random_prompts((14, 14, 14, 14), seed=7)
    generator = BatchGenerator(model, max_new_tokens=8, block_size=4, num_blocks=16, prefix_caching=False)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert all(len(o.generated_tokens) == 8 for o in outputs)
    assert max(m.running for m in generator.history) < 4  # not all four fit in 16 blocks at once
    assert all(0.0 <= m.usage_ratio <= 1.0 and 0.0 < m.batch_efficiency <= 1.0 for m in generator.history)
    assert generator.history[-1].finished == 4


def test_sharing_off_still_serves_from_one_pool():
    model = tiny_model("llama_gqa")
    prompts = random_prompts((14, 14, 14), seed=9)
    generator = BatchGenerator(model, max_new_tokens=4, block_size=4, num_blocks=10, sharing=False)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert generator.prefix_cache is None and all(len(o.generated_tokens) == 4 for o in outputs)
    assert max(m.running for m in generator.history) < 3  # admission saw the one pool fill up


def test_a_max_memory_budget_is_one_pool_shared_by_all_requests():
    model = tiny_model("llama_gqa")
    generator = BatchGenerator(model, max_new_tokens=4, block_size=4, max_memory="40KiB")
    pool = generator.template.groups["full_attention"].pool
    assert pool is not None and generator.template.options.num_blocks == pool.num_blocks
    for prompt in random_prompts((14, 14, 14), seed=10):
        generator.add_request(prompt)
    outputs = generator.run()
    assert all(len(o.generated_tokens) == 4 for o in outputs)


def test_seeded_sampling_is_reproducible():
    model = tiny_model("llama_gqa")
    prompts = random_prompts((7, 9), seed=8)
    runs = [generate_batch(model, prompts, max_new_tokens=NEW, do_sample=True, top_k=0, block_size=4) for _ in range(2)]
    assert [o.generated_tokens for o in runs[0]] == [o.generated_tokens for o in runs[1]]


def test_bad_knobs_and_unsupported_models_fail_clearly():
    with pytest.raises(ValueError, match="max_num_seqs"):
        BatchConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="preemption"):
        BatchConfig(preemption="drop")
    with pytest.raises(ValueError, match="victim_policy"):
        BatchConfig(victim_policy="fifo")
    with pytest.raises(ValueError, match="swap_threshold"):
        BatchConfig(swap_threshold=1.5)
    with pytest.raises(ValueError, match="swap_compression"):
        BatchGenerator(tiny_model("llama_gqa"), swap_compression="int3")
    with pytest.raises(ValueError, match="swap_copies"):
        BatchConfig(swap_copies="later")
    with pytest.raises(ValueError, match="needs a model on CUDA"):
        BatchGenerator(tiny_model("llama_gqa"), swap_copies="async")
    with pytest.raises(ValueError, match="prompt_ids"):
        BatchGenerator(tiny_model("llama_gqa")).add_request([])
    model = tiny_model("gpt_neox")  # calls update() without attention kwargs
    with pytest.raises(UnsupportedModelError, match="without attention kwargs"):  # the model's, not a request's
        generate_batch(model, random_prompts((4,)), max_new_tokens=2)



def test_a_model_that_ignores_attn_implementation_is_refused_at_construction():
    """XGLM's attention is its own code: the "paged" attention can never be selected, and the packed forward needs it
    (it used to fail at the first step with a raw KeyError); the model is left as it was."""
    config = transformers.XGLMConfig(vocab_size=VOCAB, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128)
    torch.manual_seed(0)
    model = transformers.XGLMForCausalLM(config).eval()
    ids = torch.tensor([random_prompts((6,))[0]])
    before = model.config._attn_implementation, model(ids).logits
    with pytest.raises(UnsupportedAttentionError, match="XGLMForCausalLM ignores `attn_implementation`"):
        BatchGenerator(model, max_new_tokens=2)
    assert model.config._attn_implementation == before[0]
    torch.testing.assert_close(model(ids).logits, before[1], rtol=0, atol=0)


@pytest.mark.slow
@needs_wheel
def test_smollm2_batch_equals_one_by_one():
    """SmolLM2-135M: three prompts of different lengths, packed with a small token budget (chunks mixed with
    decode tokens), give the tokens of one-by-one `generate` with DynamicCache."""
    model, tokenizer = load_smollm2()
    prompts = [tokenizer(" ".join(PROMPTS[: n + 1]))["input_ids"] for n in range(3)]
    outputs = generate_batch(model, prompts, max_new_tokens=8, do_sample=False, max_batch_tokens=24)
    for prompt, output in zip(prompts, outputs):
        assert output.generated_tokens == _alone_smollm2(model, prompt)


@pytest.mark.slow
@needs_wheel
@pytest.mark.parametrize("quant", ["int2", "fp8"])
def test_smollm2_serves_every_format_with_default_settings(quant):
    """The issue's repro: two prompts of 300 and 200 tokens through the fused Llama layers, whose last layer reads
    the sealed blocks of a chunk for its last token alone, give each prompt's tokens alone with the same format."""
    model, _tokenizer = load_smollm2()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40_000, (n,), generator=generator).tolist() for n in (300, 200)]
    outputs = generate_batch(model, prompts, max_new_tokens=8, quant=quant)
    model.set_attn_implementation("paged")
    for prompt, output in zip(prompts, outputs):
        assert output.error is None
        ids = torch.tensor([prompt])
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), cache=PagedCache(model.config, quant=quant),
                               max_new_tokens=8, do_sample=False)  # fmt: skip
        assert output.generated_tokens == alone[0, len(prompt) :].tolist()
    model.set_attn_implementation("sdpa")


def _alone_smollm2(model, prompt: list[int]) -> list[int]:
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), max_new_tokens=8,
                         do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_unknown_options_and_configs_fail_before_the_model_changes():
    model, _config = MODELS_BY_NAME["llama_gqa"].build()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['max_num_seq'\].*max_num_seqs"):
        BatchGenerator(model, max_num_seq=2)
    with pytest.raises(ValueError, match="GenerationConfig"):
        BatchGenerator(model, {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="num_beams"):
        BatchGenerator(model, num_beams=4)
    with pytest.raises(ValueError, match="swap_copies"):
        BatchGenerator(model, swap_copies="async")
    assert model.config._attn_implementation == before


def test_a_request_whose_sampling_fails_finishes_with_error_and_the_others_go_on(monkeypatch):
    """The requests sample (one candidate left: greedy's tokens), so each picks its own token."""
    prompts = random_prompts((5, 9, 12), seed=15)
    options = {"max_new_tokens": NEW, "do_sample": True, "top_k": 1}
    clean = clean_run(prompts, **options)
    original = RequestSettings.next_token
    bad_prompt = prompts[1]
    monkeypatch.setattr(RequestSettings, "next_token", failing(original, 3, ValueError("bad logits"),
                        when=lambda self, logits, tokens: tokens[: len(bad_prompt)] == bad_prompt))  # fmt: skip
    generator = BatchGenerator(tiny_model("llama_gqa"), block_size=4, max_batch_tokens=16, **options)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert outputs[1].finish_reason == "error" and "bad logits" in outputs[1].error
    assert outputs[1].generated_tokens == clean[1].generated_tokens[:2]
    assert [outputs[i].generated_tokens for i in (0, 2)] == [clean[i].generated_tokens for i in (0, 2)]
    assert generator.template.metrics().blocks_used == 0 and not generator.has_work()


def test_an_interrupt_during_sampling_rolls_the_step_back(monkeypatch):
    """Every request samples (seeded): the draws made in the interrupted step are undone too."""
    prompts = random_prompts((5, 9, 12), seed=16)
    options = {"max_new_tokens": NEW, "do_sample": True, "top_k": 0}
    clean = clean_run(prompts, **options)
    last = prompts[2]
    monkeypatch.setattr(RequestSettings, "next_token", failing(RequestSettings.next_token, 2, KeyboardInterrupt(),
                        when=lambda self, logits, tokens: tokens[: len(last)] == last))  # fmt: skip
    generator = BatchGenerator(tiny_model("llama_gqa"), block_size=4, max_batch_tokens=16, **options)
    for prompt in prompts:
        generator.add_request(prompt)
    with pytest.raises(KeyboardInterrupt):
        generator.run()
    steps = len(generator.history)
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in clean]
    assert all(o.finish_reason == "length" for o in outputs) and len(generator.history) > steps
    assert generator.template.metrics().blocks_used == 0


@pytest.mark.parametrize("fails_at", [2, 5])
def test_a_forward_that_fails_after_some_layers_wrote_is_rolled_back(fails_at):
    """The second layer raises (once) while the first has written the step: the step is rolled back, its requests
    run alone from then on, and every request produces exactly the tokens of a run without the failure."""
    model = tiny_model("llama_gqa")
    prompts = random_prompts((5, 17, 9), seed=17, prefix=4)
    clean = clean_run(prompts, max_new_tokens=NEW)
    layer = model.model.layers[1]
    layer.forward = failing(layer.forward, fails_at, RuntimeError("device lost"))
    try:
        generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
        for prompt in prompts:
            generator.add_request(prompt)
        outputs = generator.run()
    finally:
        del layer.forward
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in clean]
    assert all(o.error is None for o in outputs)
    assert generator.template.metrics().blocks_used == 0 and not generator.has_work()
    assert generator.metrics().prompt_tokens == sum(map(len, prompts))  # requeued, not admitted twice


def test_a_request_whose_forward_keeps_failing_fails_alone_and_the_others_go_on(monkeypatch):
    """A forward fails whenever one request's cache holds 12 tokens or more (a state only it reaches, as a format
    that could not read its sealed blocks once did): the shared step is rolled back, each of its requests runs alone,
    that one finishes with the error, and the others give the tokens of a clean run; every later step works."""
    from hf_paged_cache.serving import generator as generator_module

    prompts = random_prompts((5, 17, 9), seed=18)
    clean = clean_run(prompts, max_new_tokens=NEW)
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    bad = [generator.add_request(prompt) for prompt in prompts][1]
    real = generator_module.packed_logits

    def failing_for_bad(model, chunks, *args):
        caches = {id(request.cache): request.request_id for request in generator.requests.running}
        if any(caches.get(id(cache)) == bad and fed >= 12 for cache, _tokens, fed in chunks):
            raise RuntimeError("cannot read its blocks")
        return real(model, chunks, *args)

    monkeypatch.setattr(generator_module, "packed_logits", failing_for_bad)
    outputs = generator.run()
    assert outputs[bad].finish_reason == "error" and "RuntimeError: cannot read its blocks" in outputs[bad].error
    assert outputs[bad].generated_tokens == clean[bad].generated_tokens[: len(outputs[bad].generated_tokens)]
    assert [outputs[i].generated_tokens for i in (0, 2)] == [clean[i].generated_tokens for i in (0, 2)]
    assert generator.template.metrics().blocks_used == 0 and not generator.has_work()
    later = generator.add_request(prompts[0])
    assert generator.run()[0].generated_tokens == clean[0].generated_tokens and later == 3


def test_a_refusal_of_the_models_code_is_raised_not_charged_to_the_requests(monkeypatch):
    """An `UnsupportedModelError` from inside the forward (here: the recurrent layers' per-request call) is the model's,
    so it propagates with the step taken back, rather than failing the step's requests one by one."""
    from hf_paged_cache.serving import generator as generator_module

    def refusing(*args, **kwargs):
        raise UnsupportedModelError("this decoder layer cannot be called per request")

    monkeypatch.setattr(generator_module, "packed_logits", refusing)
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=NEW, block_size=4)
    for prompt in random_prompts((5, 9), seed=2):
        generator.add_request(prompt)
    with pytest.raises(UnsupportedModelError, match="cannot be called per request"):
        generator.step()
    assert not generator.requests.running and len(generator.requests.waiting) == 2 and not generator.finished
    assert not any(request.isolated for request in generator.requests.waiting)


def test_models_the_paged_attention_cannot_serve_are_refused_at_construction():
    model, config = MODELS_BY_NAME["gemma3n"].build()
    model.config = ProducerlessGemma3nConfig(**config.to_dict())
    implementation = model.config._attn_implementation
    with pytest.raises(UnsupportedAttentionError, match=r"layers \[2, 3\] reuse K/V without an earlier"):
        BatchGenerator(model)
    assert model.config._attn_implementation == implementation  # refused before the model was switched


@pytest.mark.parametrize("name", ["llama_gqa", "deepseek_v3"])
def test_a_keyword_refused_at_the_first_step_leaves_every_request_intact(name):
    """A keyword only the attention call shows: the step's writes are taken back, the requests stay queued to run
    (also when the attention is handed the gathered history of a model that caches latents)."""
    model, _config = MODELS_BY_NAME[name].build()
    prompts = random_prompts((5, 9), seed=2)
    expected = [o.generated_tokens for o in generate_batch(model, prompts, max_new_tokens=NEW, block_size=4)]
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4)
    for prompt in prompts:
        generator.add_request(prompt)
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda _module, args, kwargs: (args, {**kwargs, "position_bias": torch.zeros(1)}), with_kwargs=True)
        for layer in model.model.layers]  # fmt: skip
    with pytest.raises(UnsupportedAttentionError, match="Attention uses `position_bias`"):
        generator.step()
    for hook in hooks:
        hook.remove()
    assert generator.template.metrics().blocks_used == 0  # the requests' caches share the template's pools
    assert [o.generated_tokens for o in generator.run()] == expected
