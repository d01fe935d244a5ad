"""Prefix caching in the batch generator: hits compute only the tail and change nothing."""

from __future__ import annotations

import pytest
import torch
from batch_workloads import NEW, random_prompts, tiny_model

from hf_paged_cache import PagedCache
from hf_paged_cache.serving.generator import BatchGenerator, generate_batch

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
def test_prefix_hits_compute_only_the_tail_and_change_nothing(name):
    model = tiny_model(name)
    prompts = random_prompts((5, 7, 2, 9), seed=3, prefix=21)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_num_seqs=1, num_blocks=60)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [o.prefix_hit_tokens for o in outputs] == [0, 20, 20, 20]  # whole blocks, one at a time
    assert generator.metrics().prefix_hit_rate > 0.5
    cold = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_num_seqs=1, prefix_caching=False)
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in cold]
    assert all(o.prefix_hit_tokens == 0 for o in cold)


def test_reset_prefix_cache_makes_later_prompts_compute_their_prefix_again_and_changes_no_result():
    model = tiny_model("llama_gqa")
    prompts = random_prompts((5, 7, 2), seed=3, prefix=21)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_num_seqs=1, num_blocks=60)
    generator.add_request(prompts[0])
    first = generator.run()
    generator.add_request(prompts[1])
    generator.step()  # prompts[1] runs, its prefix found in the cache
    generator.reset_prefix_cache()
    generator.add_request(prompts[2])
    rest = generator.run()
    assert [o.prefix_hit_tokens for o in first + rest] == [0, 20, 0]
    cold = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_num_seqs=1, prefix_caching=False)
    assert [o.generated_tokens for o in first + rest] == [o.generated_tokens for o in cold]
    generator.add_request(prompts[2])
    assert generator.run()[0].prefix_hit_tokens == 20  # cached again by the request after the reset
    plain = BatchGenerator(model, max_new_tokens=NEW, block_size=4, num_blocks=60, prefix_caching=False)
    plain.reset_prefix_cache()  # nothing cached: nothing to do
    assert plain.prefix_cache is None


def test_a_prefix_hit_gives_the_logits_of_a_cold_run():
    model = tiny_model("llama_gqa")
    (first, second) = random_prompts((3, 6), seed=4, prefix=16)
    generator = BatchGenerator(model, max_new_tokens=1, block_size=4, num_blocks=40)
    generator.add_request(first)
    generator.run()
    cache = generator.template.sibling()
    assert generator.prefix_cache.attach(cache, second) == (16, None)  # no recurrent state to restore
    with torch.no_grad():
        hit = model(input_ids=torch.tensor([second[16:]]), cache=cache).logits
        cold = model(input_ids=torch.tensor([second]), cache=PagedCache(model.config, block_size=4)).logits[:, 16:]
    torch.testing.assert_close(hit, cold, rtol=1e-5, atol=1e-5)


def test_prompts_sharing_a_prefix_wait_for_the_first_to_compute_it_rather_than_compute_it_again():
    """Admitted in the same step, every prompt would compute the shared blocks; deferred a step, they find them."""
    model = tiny_model("llama_gqa")
    prompts = random_prompts((5, 7, 2, 9), seed=3, prefix=21)
    prompts.insert(2, random_prompts((11,), seed=5)[0])  # shares nothing: admitted behind the waiting one
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=256, num_blocks=80)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [o.prefix_hit_tokens for o in outputs] == [0, 20, 0, 20, 20]
    assert generator.history[0].tokens_scheduled == len(prompts[0]) + len(prompts[2])  # the others wait a step
    cold = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_batch_tokens=256,
                          prefix_caching=False)  # fmt: skip
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in cold]
    assert cold[0].prefix_hit_tokens == 0


@pytest.mark.parametrize(
    ("others", "expected"),
    [
        ([([1] * 12, 0, [])], True),  # the other computes the next block (tokens 8-11) from the start
        ([([1] * 12, 4, [])], True),  # ... having computed one block so far
        ([([1] * 16, 12, [])], False),  # it holds the next block already (a hit would have found it)
        ([([1] * 8 + [2] * 4, 0, [])], False),  # its next block holds other tokens
        ([([1] * 10, 0, [])], False),  # it never computes a whole next block
        ([([2] * 12, 0, []), ([1] * 16, 6, [])], True),  # one of several
    ],
)
def test_computed_by_others_finds_a_running_prompt_that_computes_the_block_after_the_hit(others, expected):
    model = tiny_model("llama_gqa")
    prefix = BatchGenerator(model, max_new_tokens=1, block_size=4).prefix_cache
    assert prefix.computed_by_others([1] * 13, 8, others) is expected
    assert not prefix.computed_by_others([1] * 12, 8, others)  # a hit leaves a token to compute: nothing to wait for
