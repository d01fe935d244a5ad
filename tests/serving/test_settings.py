"""Per-request generation settings: checked at `add_request`, applied as `generate` applies them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from batch_workloads import NEW, clean_run, random_prompts, tiny_model
from test_smollm2 import needs_wheel
from tiny_models import VOCAB
from transformers import DynamicCache

from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.serving.settings import ARGMAX_CHUNK, row_argmax

pytestmark = pytest.mark.usefixtures("one_thread")


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
    prompts = random_prompts((5, 9), seed=11)
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    generator.add_request(prompts[0])
    with pytest.raises(ValueError, match=f"request 1: .*{match}"):
        generator.add_request(prompts[1], **bad)
    assert generator.add_request(prompts[1]) == 1  # the failed call took no id and queued nothing
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in clean_run(prompts, max_new_tokens=NEW)]


@pytest.mark.parametrize("prompt", ["123", [1.0, 2.0], [True, 5], [4, -1], [4, VOCAB], [2**70], 7, [[3, 4]],
                                    torch.ones(2, 3, dtype=torch.long), torch.tensor([1.5])])  # fmt: skip
def test_prompts_that_are_not_token_ids_are_refused_naming_the_request(prompt):
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=2, block_size=4)
    with pytest.raises(ValueError, match="request 0: `prompt_ids`"):
        generator.add_request(prompt)
    assert not generator.has_work()


def test_prompts_and_eos_ids_as_tensors_equal_lists():
    prompts = random_prompts((5, 9), seed=12)
    plain = clean_run(prompts, max_new_tokens=NEW)
    eos = plain[1].generated_tokens[2]  # request 1 stops there (request 0 may stop earlier if it makes it too)
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    for prompt in prompts:
        generator.add_request(torch.tensor(prompt), eos_token_id=torch.tensor(eos))
    outputs = generator.run()
    for output, expected in zip(outputs, plain):
        cut = expected.generated_tokens.index(eos) + 1 if eos in expected.generated_tokens else NEW
        assert output.generated_tokens == expected.generated_tokens[:cut]
        assert output.finish_reason == ("eos" if cut < NEW or eos in expected.generated_tokens else "length")


def test_a_generation_config_transformers_generate_batch_used_is_taken_as_it_meant_it():
    """transformers' continuous batching writes `eos_token_id=-1` ("no EOS") into a generation config that has none;
    passed on to ours, -1 means the same (in a list too), and ours changes nothing in the caller's config."""
    from transformers import GenerationConfig

    prompts = random_prompts((5, 9), seed=12)
    # As `ContinuousMixin.init_continuous_batching` leaves it ("Setting to -1 (disabled)").
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1)
    before = config.to_dict()
    expected = [o.generated_tokens for o in clean_run(prompts, max_new_tokens=NEW)]
    for eos in (-1, [-1], [-1, 300]):
        config.eos_token_id = eos
        kept = config.to_dict()
        if eos == [-1, 300]:  # another negative or out-of-range id is still refused
            with pytest.raises(ValueError, match=r"`eos_token_id`\[0\] = 300 is not a token id"):
                clean_run(prompts, generation_config=config)
            continue
        outputs = clean_run(prompts, generation_config=config)
        assert [o.generated_tokens for o in outputs] == expected and {o.finish_reason for o in outputs} == {"length"}
        assert config.to_dict() == kept
    config.eos_token_id = -1
    assert config.to_dict() == before


@pytest.mark.parametrize("options", [
    {"repetition_penalty": 1.5},
    {"max_length": 9 + 4},  # the longer prompt's 9 tokens and 4 new ones; max_length caps prompt + new tokens
    {"min_new_tokens": 5, "eos": 1},  # eos = the greedy second token: without the minimum it stops at once
], ids=["repetition_penalty", "max_length", "min_new_tokens"])  # fmt: skip
def test_honoured_options_give_the_tokens_of_model_generate(options):
    model = tiny_model("llama_gqa")
    prompts = random_prompts((7, 9), seed=13)
    options = dict(options)
    if "eos" in options:
        options["eos_token_id"] = clean_run(prompts[1:], max_new_tokens=NEW)[0].generated_tokens[options.pop("eos")]
    budget = {} if "max_length" in options else {"max_new_tokens": NEW}
    outputs = clean_run(prompts, **budget, **options)
    model.set_attn_implementation("sdpa")
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), do_sample=False,
                                  **budget, **options)[0, len(prompt) :].tolist()  # fmt: skip
        assert output.generated_tokens == expected
    if "max_length" in options:
        assert [len(o.prompt_ids) + len(o.generated_tokens) for o in outputs] == [13, 13]


def test_greedy_requests_picked_together_give_each_ones_tokens_alone():
    """A step takes the greedy requests' argmaxes in one op; a sampled and a penalised request beside them pick their
    own: each request's tokens are those it gets served alone."""
    prompts = random_prompts((7, 9, 5, 6), seed=15)
    options = [{}, {"do_sample": True, "seed": 3}, {"repetition_penalty": 1.5}, {}]
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=NEW, do_sample=False, block_size=4,
                               max_batch_tokens=16)  # fmt: skip
    for prompt, own in zip(prompts, options):
        generator.add_request(prompt, **own)
    together = sorted(generator.run(), key=lambda output: output.request_id)
    for prompt, own, output in zip(prompts, options, together):
        alone = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=NEW, do_sample=False, block_size=4)
        alone.add_request(prompt, **own)
        assert output.generated_tokens == alone.run()[0].generated_tokens


def test_a_max_length_the_prompt_fills_is_refused():
    generator = BatchGenerator(tiny_model("llama_gqa"), max_length=9, block_size=4)
    generator.add_request(random_prompts((8,))[0])  # room for one new token
    with pytest.raises(ValueError, match="request 1: `max_length`=9 .* 9-token prompt"):
        generator.add_request(random_prompts((9,))[0])
    assert [len(o.generated_tokens) for o in generator.run()] == [1]


def test_sampling_follows_generate_rules():
    prompts = random_prompts((7, 9), seed=14)
    greedy = clean_run(prompts, max_new_tokens=NEW)
    top1 = clean_run(prompts, max_new_tokens=NEW, do_sample=True, top_k=1, temperature=0.7)  # one candidate left
    assert [o.generated_tokens for o in top1] == [o.generated_tokens for o in greedy]
    # Greedy ignores the sampling settings, as `generate` does (it only warns).
    lenient = clean_run(prompts, max_new_tokens=NEW, temperature=0.0, top_p=1.5)
    assert [o.generated_tokens for o in lenient] == [o.generated_tokens for o in greedy]
    with pytest.raises(ValueError, match="the generation config: .*temperature"):
        BatchGenerator(tiny_model("llama_gqa"), do_sample=True, temperature=0.0)


@needs_wheel
def test_stop_strings_with_a_tokenizer_stop_where_generate_stops():
    from transformers import AutoTokenizer

    from hf_paged_cache.smollm2 import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir())  # the tiny model's ids are valid ids of this vocabulary
    model = tiny_model("llama_gqa")
    prompts = random_prompts((7, 9), seed=18)
    clean = clean_run(prompts, max_new_tokens=NEW)
    stop = tokenizer.decode(clean[1].generated_tokens[2:4])  # request 1 stops at its fourth token at the latest
    outputs = clean_run(prompts, max_new_tokens=NEW, stop_strings=stop, tokenizer=tokenizer)
    model.set_attn_implementation("sdpa")
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), do_sample=False,
                                  max_new_tokens=NEW, stop_strings=stop, tokenizer=tokenizer)  # fmt: skip
        assert output.generated_tokens == expected[0, len(prompt) :].tolist()
    assert outputs[1].finish_reason == "stop_string" and len(outputs[1].generated_tokens) <= 4


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.sampled_from([7, 4 * ARGMAX_CHUNK, 4 * ARGMAX_CHUNK + 1, 5 * ARGMAX_CHUNK - 1, 6000]),
       st.integers(1, 4), st.sampled_from([None, "nan", "-inf", "+inf"]), st.integers(0, 2**16))  # fmt: skip
def test_row_argmax_is_torch_argmax(rows, vocab, levels, special, seed):
    """The first index of each row's maximum, as `argmax` gives it: ties (a few distinct values, so many), NaN (above
    all), infinities, and vocabularies that end in a short chunk, a whole one, or are too short to chunk."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=generator).float()
    if special is not None:
        value = {"nan": float("nan"), "-inf": float("-inf"), "+inf": float("inf")}[special]
        picks = torch.randint(0, vocab, (rows, 3), generator=generator)
        logits.scatter_(1, picks, value)
    assert torch.equal(row_argmax(logits), logits.argmax(-1))
