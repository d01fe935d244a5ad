"""The continuous batch generator: packed forwards of many requests equal each request run alone."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from test_smollm2 import PROMPTS, needs_wheel
from tiny_models import MODELS_BY_NAME, VOCAB, ProducerlessGemma3nConfig
from transformers import DynamicCache

from hf_paged_cache import PagedCache, StreamingLLM, UnsupportedAttentionError
from hf_paged_cache.serving.generator import BatchConfig, BatchGenerator, generate_batch
from hf_paged_cache.memory.copy_stream import CopyStream
from hf_paged_cache.serving.settings import RequestSettings
from hf_paged_cache.smollm2 import load_smollm2

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 6


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _prompts(lengths, seed: int = 0, prefix: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (prefix,), generator=generator).tolist()
    return [shared + torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _alone(model, prompt: list[int], cache, attention: str) -> list[int]:
    model.set_attn_implementation(attention)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", [
    "llama_gqa", "llama_mqa", "qwen3", "mistral_sliding", "qwen2_sliding", "gemma2", "gemma3n", "gpt_oss",
    "granitemoe_swa", "deepseek_v3", "deepseek_v2", "mimo_v2_flash",
])  # fmt: skip
def test_greedy_outputs_equal_each_prompt_alone_with_dynamic_cache(name):
    model = _model(name)
    prompts = _prompts((5, 17, 9, 30, 3, 12), seed=1)
    # A small token budget splits prompts into chunks that share forwards with other requests' decode tokens.
    outputs = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_batch_tokens=16, max_num_seqs=3)
    assert [o.request_id for o in outputs] == list(range(len(prompts)))
    for prompt, output in zip(prompts, outputs):
        assert output.finish_reason == "length" and output.error is None
        assert output.generated_tokens == _alone(model, prompt, DynamicCache(), MODELS_BY_NAME[name].gather_impl)


@pytest.mark.parametrize("options", [
    {"quant": "int8", "residual_length": 4},
    {"eviction": StreamingLLM(budget=12, sinks=2, window=6)},
], ids=["int8", "streaming_llm"])  # fmt: skip
def test_cache_options_apply_per_request(options):
    model = _model("llama_gqa")
    prompts = _prompts((25, 17, 40), seed=2)
    # A budget that takes every prompt whole: eviction between the chunks of a prompt would (rightly) keep
    # other tokens than one prefill does.
    outputs = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_batch_tokens=128, **options)
    for prompt, output in zip(prompts, outputs):
        expected = _alone(model, prompt, PagedCache(model.config, block_size=4, **options), "paged")
        assert output.generated_tokens == expected


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
def test_prefix_hits_compute_only_the_tail_and_change_nothing(name):
    model = _model(name)
    prompts = _prompts((5, 7, 2, 9), seed=3, prefix=21)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_num_seqs=1, num_blocks=60)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [o.prefix_hit_tokens for o in outputs] == [0, 20, 20, 20]  # whole blocks, one at a time
    assert generator.metrics().prefix_hit_rate > 0.5
    cold = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_num_seqs=1, prefix_caching=False)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in cold]
    assert all(o.prefix_hit_tokens == 0 for o in cold)


def test_a_prefix_hit_gives_the_logits_of_a_cold_run():
    model = _model("llama_gqa")
    (first, second) = _prompts((3, 6), seed=4, prefix=16)
    generator = BatchGenerator(model, max_new_tokens=1, block_size=4, num_blocks=40)
    generator.add_request(first)
    generator.run()
    cache = generator.template.sibling()
    assert generator.prefix_cache.attach(cache, second) == 16
    with torch.no_grad():
        hit = model(input_ids=torch.tensor([second[16:]]), cache=cache).logits
        cold = model(input_ids=torch.tensor([second]), cache=PagedCache(model.config, block_size=4)).logits[:, 16:]
    torch.testing.assert_close(hit, cold, rtol=1e-5, atol=1e-5)


def test_cancelling_a_request_frees_its_blocks_and_streaming_returns_the_others():
    model = _model("llama_gqa")
    generator = BatchGenerator(model, max_new_tokens=50, block_size=4, num_blocks=80, prefix_caching=False)
    first, second = (generator.add_request(prompt) for prompt in _prompts((20, 11), seed=5))
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
    model = _model("llama_gqa")
    prompts = _prompts((6, 60, 5), seed=6)
    outputs = generate_batch(model, prompts, max_new_tokens=3, block_size=4, num_blocks=8)
    assert outputs[1].finish_reason == "error"
    assert "num_blocks" in outputs[1].error and "max_batch_tokens" in outputs[1].error
    assert [len(outputs[i].generated_tokens) for i in (0, 2)] == [3, 3]


def test_admission_waits_for_free_blocks_and_metrics_track_it():
    model = _model("llama_gqa")
    prompts = _prompts((14, 14, 14, 14), seed=7)
    generator = BatchGenerator(model, max_new_tokens=8, block_size=4, num_blocks=16, prefix_caching=False)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert all(len(o.generated_tokens) == 8 for o in outputs)
    assert max(m.running for m in generator.history) < 4  # not all four fit in 16 blocks at once
    assert all(0.0 <= m.usage_ratio <= 1.0 and 0.0 < m.batch_efficiency <= 1.0 for m in generator.history)
    assert generator.history[-1].finished == 4


def test_sharing_off_still_serves_from_one_pool():
    model = _model("llama_gqa")
    prompts = _prompts((14, 14, 14), seed=9)
    generator = BatchGenerator(model, max_new_tokens=4, block_size=4, num_blocks=10, sharing=False)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert generator.prefix_cache is None and all(len(o.generated_tokens) == 4 for o in outputs)
    assert max(m.running for m in generator.history) < 3  # admission saw the one pool fill up


def test_a_max_memory_budget_is_one_pool_shared_by_all_requests():
    model = _model("llama_gqa")
    generator = BatchGenerator(model, max_new_tokens=4, block_size=4, max_memory="40KiB")
    pool = generator.template.groups["full_attention"].pool
    assert pool is not None and generator.template.options.num_blocks == pool.num_blocks
    for prompt in _prompts((14, 14, 14), seed=10):
        generator.add_request(prompt)
    outputs = generator.run()
    assert all(len(o.generated_tokens) == 4 for o in outputs)


def test_seeded_sampling_is_reproducible():
    model = _model("llama_gqa")
    prompts = _prompts((7, 9), seed=8)
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
        BatchGenerator(_model("llama_gqa"), swap_compression="int3")
    with pytest.raises(ValueError, match="swap_copies"):
        BatchConfig(swap_copies="later")
    with pytest.raises(ValueError, match="needs a model on CUDA"):
        BatchGenerator(_model("llama_gqa"), swap_copies="async")
    with pytest.raises(ValueError, match="prompt_ids"):
        BatchGenerator(_model("llama_gqa")).add_request([])
    model = _model("gpt_neox")  # calls update() without attention kwargs
    with pytest.raises(RuntimeError, match="without attention kwargs"):
        generate_batch(model, _prompts((4,)), max_new_tokens=2)



def test_a_model_that_ignores_attn_implementation_is_refused_at_construction():
    """XGLM's attention is its own code: the "paged" attention can never be selected, and the packed forward needs it
    (it used to fail at the first step with a raw KeyError); the model is left as it was."""
    config = transformers.XGLMConfig(vocab_size=VOCAB, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128)
    torch.manual_seed(0)
    model = transformers.XGLMForCausalLM(config).eval()
    ids = torch.tensor([_prompts((6,))[0]])
    before = model.config._attn_implementation, model(ids).logits
    with pytest.raises(UnsupportedAttentionError, match="XGLMForCausalLM ignores `attn_implementation`"):
        BatchGenerator(model, max_new_tokens=2)
    assert model.config._attn_implementation == before[0]
    torch.testing.assert_close(model(ids).logits, before[1], rtol=0, atol=0)


PRESSURE = (20, 33, 12, 41, 27, 18)  # with 12 new tokens in blocks of 4: 58 blocks in all, the largest 14


def _unconstrained(name: str, prefix: int = 0, **options) -> tuple[tuple[int, ...], ...]:
    outputs = generate_batch(_model(name), _prompts(PRESSURE, seed=9, prefix=prefix), max_new_tokens=12, block_size=4,
                             max_batch_tokens=16, **options)  # fmt: skip
    return tuple(tuple(o.generated_tokens) for o in outputs)


@pytest.mark.parametrize("name,options", [
    ("llama_gqa", {"preemption": "swap"}),
    ("llama_gqa", {"preemption": "swap", "victim_policy": "weighted"}),
    ("llama_gqa", {"preemption": "recompute"}),
    ("llama_gqa", {"preemption": "auto", "swap_threshold": 0.8}),
    # Recompute with prefix caching: requests that come back re-attach their own cached blocks.
    ("gemma2", {"preemption": "recompute", "prefix_caching": True}),
    ("llama_gqa", {"preemption": "swap", "quant": "int8", "residual_length": 4}),
    ("deepseek_v3", {"preemption": "swap"}),  # swapped blocks of latents, keys wider than values
], ids=["swap-lru", "swap-weighted", "recompute", "auto-threshold", "recompute-prefix-gemma2",
        "swap-int8", "swap-latents"])  # fmt: skip
def test_a_pool_for_a_quarter_of_the_demand_gives_the_unconstrained_outputs(name, options):
    cache_options = {key: options[key] for key in ("quant", "residual_length") if key in options}
    options = {"prefix_caching": False, **options}
    generator = BatchGenerator(_model(name), max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=15,
                               **options)  # fmt: skip
    for prompt in _prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    outputs = generator.run()
    assert tuple(tuple(o.generated_tokens) for o in outputs) == _unconstrained(name, **cache_options)
    last = generator.metrics()
    if options["preemption"] == "recompute":
        assert last.preempted_recompute > 0 and last.preempted_swap == 0 and last.recomputed_tokens > 0
        assert last.swap_out_blocks == 0
    if options["preemption"] == "swap":
        assert last.preempted_swap > 0 and last.swap_out_blocks > 0
        assert last.swap_in_blocks == last.swap_out_blocks and last.swap_in_bytes == last.swap_out_bytes > 0
    # Preempted, but not over and over: a request with nothing below it to preempt waits (or takes a smaller
    # prompt chunk) instead of preempting itself into the same shortage at every step.
    assert 0 < last.preempted_swap + last.preempted_recompute <= len(PRESSURE) and last.stalled == 0
    assert any(m.stalled for m in generator.history)  # swapped out, or waiting for blocks while others ran
    if options["prefix_caching"]:  # each request counted once in the hit rate, however often it attached
        assert generator.prefix_cache.stats.lookups == len(PRESSURE)
    assert generator.template.metrics().blocks_used == 0 and not generator.swapped


def _pressure_run(name: str = "llama_gqa", check=None, **options) -> tuple[BatchGenerator, tuple]:
    """The pressure workload with the pool at a quarter of its demand; `check(generator, batch)` runs before every
    forward."""
    generator = BatchGenerator(_model(name), max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=15,
                               prefix_caching=False, preemption="swap", **options)  # fmt: skip
    if check is not None:
        forward = generator._forward
        generator._forward = lambda batch: (check(generator, batch), forward(batch))
    for prompt in _prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    return generator, tuple(tuple(o.generated_tokens) for o in generator.run())


@pytest.mark.parametrize("options", [{}, {"quant": "int8", "residual_length": 4}, {"swap_threshold": 0.8}],
                         ids=["full", "int8", "threshold"])  # fmt: skip
def test_deferred_copies_keep_the_ordering_rules_and_the_outputs(options):
    """Each copy runs only when a fence or a wait needs it. At every forward no copy out is pending (the victims'
    freed blocks may be written by it) and no request in the batch has a copy in pending; requests swapped in at
    this step (a step ahead of running) may."""
    prefetched_during = []

    def check(generator, batch):
        flights = [generator.swap.in_flight(r.cache) for r in [*generator.running, *generator.swapped]]
        assert "out" not in flights and all(generator.swap.in_flight(r.cache) is None for r, _ in batch)
        prefetched_during.append(flights.count("in"))

    generator, outputs = _pressure_run(check=check, swap_copies="deferred", **options)
    cache_options = {key: options[key] for key in ("quant", "residual_length") if key in options}
    assert outputs == _unconstrained("llama_gqa", **cache_options)
    last = generator.metrics()
    assert last.swap_in_blocks == last.swap_out_blocks > 0 and last.swap_stall_seconds == last.swap_copy_seconds > 0
    if "swap_threshold" not in options:  # at 80% of this pool, swapped requests come back only into an idle one
        assert sum(prefetched_during) > 0 and 0 < last.swap_prefetched <= last.preempted_swap


def test_deferred_compressed_copies_match_synchronous_ones():
    """fp8 host copies are lossy, so the reference is the same run with synchronous copies: encoding before the
    copy out and decoding after the copy in do not depend on when the copies land."""
    (_, deferred), (generator, sync) = (_pressure_run(swap_copies=copies, swap_compression="fp8")
                                        for copies in ("deferred", "sync"))  # fmt: skip
    assert deferred == sync and generator.metrics().preempted_swap > 0


def test_without_the_fence_deferred_copies_change_the_outputs(monkeypatch):
    """The test above can fail: without the fence, forwards write freed blocks before their copy out read them and
    read swapped-in blocks before their copy in landed."""
    monkeypatch.setattr(CopyStream, "fence", lambda self: None)
    generator, outputs = _pressure_run(swap_copies="deferred")
    assert generator.metrics().preempted_swap > 0 and outputs != _unconstrained("llama_gqa")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="asynchronous copies need CUDA")
def test_cuda_side_stream_copies_give_the_synchronous_outputs():
    model, _config = MODELS_BY_NAME["llama_gqa"].build()  # not the cached CPU model: it moves to the GPU
    model.to("cuda")
    runs = {}
    for copies in ("sync", "async"):
        generator = BatchGenerator(model, max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=15,
                                   prefix_caching=False, preemption="swap", swap_copies=copies)  # fmt: skip
        for prompt in _prompts(PRESSURE, seed=9):
            generator.add_request(prompt)
        runs[copies] = ([o.generated_tokens for o in generator.run()], generator.metrics())
    (sync, _), (overlapped, last) = runs["sync"], runs["async"]
    assert overlapped == sync and last.preempted_swap > 0 and last.swap_prefetched > 0 and last.swap_copy_seconds > 0
    assert generator.swap.copies.mode == "async"


def test_shared_prefix_blocks_survive_swapping():
    model = _model("llama_gqa")
    generator = BatchGenerator(model, max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=18,
                               preemption="swap")  # fmt: skip
    for prompt in _prompts(PRESSURE, seed=9, prefix=8):
        generator.add_request(prompt)
    outputs = generator.run()
    assert tuple(tuple(o.generated_tokens) for o in outputs) == _unconstrained("llama_gqa", prefix=8)
    last = generator.metrics()
    assert last.preempted_swap > 0 and last.prefix_hit_tokens > 0
    assert last.prompt_tokens == sum(len(o.prompt_ids) for o in outputs)


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


def _alone_smollm2(model, prompt: list[int]) -> list[int]:
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), max_new_tokens=8,
                         do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _clean(prompts, **options) -> list:
    return generate_batch(_model("llama_gqa"), prompts, block_size=4, max_batch_tokens=16, **options)


@pytest.mark.parametrize("bad,match", [
    ({"do_sample": True, "top_p": -0.5}, "top_p"),
    ({"do_sample": True, "top_p": 1.5}, "top_p"),
    ({"do_sample": True, "top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"temperature": "hot"}, "temperature"),
    ({"do_sample": True, "temperature": 0.0}, "temperature"),
    ({"do_sample": True, "temperature": -1}, "temperature"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"repetition_penalty": 0.0}, "penalty"),
    ({"min_new_tokens": -2}, "min_new_tokens"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"eos_token_id": "125"}, "eos_token_id"),
    ({"eos_token_id": torch.tensor([2.0])}, "eos_token_id"),
    ({"eos_token_id": [3, VOCAB]}, "eos_token_id"),
    ({"num_beams": 4}, "beam search"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"stop_strings": ["\n"]}, "tokenizer"),
    ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
    ({"max_num_seq": 2}, "unknown generation option"),
    ({"seed": 1.5}, "seed"),
], ids=lambda value: str(value) if isinstance(value, str) else None)  # fmt: skip
def test_bad_request_settings_are_refused_at_add_request_and_change_nothing(bad, match):
    prompts = _prompts((5, 9), seed=11)
    generator = BatchGenerator(_model("llama_gqa"), max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    generator.add_request(prompts[0])
    with pytest.raises(ValueError, match=f"request 1: .*{match}"):
        generator.add_request(prompts[1], **bad)
    assert generator.add_request(prompts[1]) == 1  # the failed call took no id and queued nothing
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in _clean(prompts, max_new_tokens=NEW)]


@pytest.mark.parametrize("prompt", ["123", [1.0, 2.0], [True, 5], [4, -1], [4, VOCAB], [2**70], 7, [[3, 4]],
                                    torch.ones(2, 3, dtype=torch.long), torch.tensor([1.5])])  # fmt: skip
def test_prompts_that_are_not_token_ids_are_refused_naming_the_request(prompt):
    generator = BatchGenerator(_model("llama_gqa"), max_new_tokens=2, block_size=4)
    with pytest.raises(ValueError, match="request 0: `prompt_ids`"):
        generator.add_request(prompt)
    assert not generator.has_work()


def test_prompts_and_eos_ids_as_tensors_equal_lists():
    prompts = _prompts((5, 9), seed=12)
    plain = _clean(prompts, max_new_tokens=NEW)
    eos = plain[1].generated_tokens[2]  # request 1 stops there (request 0 may stop earlier if it makes it too)
    generator = BatchGenerator(_model("llama_gqa"), max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    for prompt in prompts:
        generator.add_request(torch.tensor(prompt), eos_token_id=torch.tensor(eos))
    outputs = generator.run()
    for output, expected in zip(outputs, plain):
        cut = expected.generated_tokens.index(eos) + 1 if eos in expected.generated_tokens else NEW
        assert output.generated_tokens == expected.generated_tokens[:cut]
        assert output.finish_reason == ("eos" if cut < NEW or eos in expected.generated_tokens else "length")


@pytest.mark.parametrize("options", [
    {"repetition_penalty": 1.5},
    {"max_length": 9 + 4},  # the longer prompt's 9 tokens and 4 new ones; max_length caps prompt + new tokens
    {"min_new_tokens": 5, "eos": 1},  # eos = the greedy second token: without the minimum it stops at once
], ids=["repetition_penalty", "max_length", "min_new_tokens"])  # fmt: skip
def test_honoured_options_give_the_tokens_of_model_generate(options):
    model = _model("llama_gqa")
    prompts = _prompts((7, 9), seed=13)
    options = dict(options)
    if "eos" in options:
        options["eos_token_id"] = _clean(prompts[1:], max_new_tokens=NEW)[0].generated_tokens[options.pop("eos")]
    budget = {} if "max_length" in options else {"max_new_tokens": NEW}
    outputs = _clean(prompts, **budget, **options)
    model.set_attn_implementation("sdpa")
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), do_sample=False,
                                  **budget, **options)[0, len(prompt) :].tolist()  # fmt: skip
        assert output.generated_tokens == expected
    if "max_length" in options:
        assert [len(o.prompt_ids) + len(o.generated_tokens) for o in outputs] == [13, 13]


def test_a_max_length_the_prompt_fills_is_refused():
    generator = BatchGenerator(_model("llama_gqa"), max_length=9, block_size=4)
    generator.add_request(_prompts((8,))[0])  # room for one new token
    with pytest.raises(ValueError, match="request 1: `max_length`=9 .* 9-token prompt"):
        generator.add_request(_prompts((9,))[0])
    assert [len(o.generated_tokens) for o in generator.run()] == [1]


def test_sampling_follows_generate_rules():
    prompts = _prompts((7, 9), seed=14)
    greedy = _clean(prompts, max_new_tokens=NEW)
    top1 = _clean(prompts, max_new_tokens=NEW, do_sample=True, top_k=1, temperature=0.7)  # one candidate left
    assert [o.generated_tokens for o in top1] == [o.generated_tokens for o in greedy]
    # Greedy ignores the sampling settings, as `generate` does (it only warns).
    lenient = _clean(prompts, max_new_tokens=NEW, temperature=0.0, top_p=1.5)
    assert [o.generated_tokens for o in lenient] == [o.generated_tokens for o in greedy]
    with pytest.raises(ValueError, match="the generation config: .*temperature"):
        BatchGenerator(_model("llama_gqa"), do_sample=True, temperature=0.0)


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


def _failing(method, fails_at, error, when=lambda *args: True):
    """`method` that raises `error` at its `fails_at`-th call for which `when(*args)` holds, once."""
    calls = []

    def wrapper(*args, **kwargs):
        if when(*args):
            calls.append(None)
            if len(calls) == fails_at:
                raise error
        return method(*args, **kwargs)

    return wrapper


def test_a_request_whose_sampling_fails_finishes_with_error_and_the_others_go_on(monkeypatch):
    prompts = _prompts((5, 9, 12), seed=15)
    clean = _clean(prompts, max_new_tokens=NEW)
    original = RequestSettings.next_token
    bad_prompt = prompts[1]
    monkeypatch.setattr(RequestSettings, "next_token", _failing(original, 3, ValueError("bad logits"),
                        when=lambda self, logits, tokens: tokens[: len(bad_prompt)] == bad_prompt))  # fmt: skip
    generator = BatchGenerator(_model("llama_gqa"), max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert outputs[1].finish_reason == "error" and "bad logits" in outputs[1].error
    assert outputs[1].generated_tokens == clean[1].generated_tokens[:2]
    assert [outputs[i].generated_tokens for i in (0, 2)] == [clean[i].generated_tokens for i in (0, 2)]
    assert generator.template.metrics().blocks_used == 0 and not generator.has_work()


def test_an_interrupt_during_sampling_rolls_the_step_back(monkeypatch):
    """Every request samples (seeded): the draws made in the interrupted step are undone too."""
    prompts = _prompts((5, 9, 12), seed=16)
    options = {"max_new_tokens": NEW, "do_sample": True, "top_k": 0}
    clean = _clean(prompts, **options)
    last = prompts[2]
    monkeypatch.setattr(RequestSettings, "next_token", _failing(RequestSettings.next_token, 2, KeyboardInterrupt(),
                        when=lambda self, logits, tokens: tokens[: len(last)] == last))  # fmt: skip
    generator = BatchGenerator(_model("llama_gqa"), block_size=4, max_batch_tokens=16, **options)
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
    """The second layer raises (once) while the first has written the step: the generator stays usable and every
    request then produces exactly the tokens of a run without the failure."""
    model = _model("llama_gqa")
    prompts = _prompts((5, 17, 9), seed=17, prefix=4)
    clean = _clean(prompts, max_new_tokens=NEW)
    layer = model.model.layers[1]
    layer.forward = _failing(layer.forward, fails_at, RuntimeError("device lost"))
    try:
        generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
        for prompt in prompts:
            generator.add_request(prompt)
        with pytest.raises(RuntimeError, match="device lost"):
            generator.run()
        outputs = generator.run()
    finally:
        del layer.forward
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in clean]
    assert generator.template.metrics().blocks_used == 0 and not generator.has_work()
    assert generator.metrics().prompt_tokens == sum(map(len, prompts))  # requeued, not admitted twice


@needs_wheel
def test_stop_strings_with_a_tokenizer_stop_where_generate_stops():
    from transformers import AutoTokenizer

    from hf_paged_cache.smollm2 import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir())  # the tiny model's ids are valid ids of this vocabulary
    model = _model("llama_gqa")
    prompts = _prompts((7, 9), seed=18)
    clean = _clean(prompts, max_new_tokens=NEW)
    stop = tokenizer.decode(clean[1].generated_tokens[2:4])  # request 1 stops at its fourth token at the latest
    outputs = _clean(prompts, max_new_tokens=NEW, stop_strings=stop, tokenizer=tokenizer)
    model.set_attn_implementation("sdpa")
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), do_sample=False,
                                  max_new_tokens=NEW, stop_strings=stop, tokenizer=tokenizer)  # fmt: skip
        assert output.generated_tokens == expected[0, len(prompt) :].tolist()
    assert outputs[1].finish_reason == "stop_string" and len(outputs[1].generated_tokens) <= 4

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
    prompts = _prompts((5, 9), seed=2)
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
