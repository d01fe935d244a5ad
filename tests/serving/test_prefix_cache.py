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


def test_a_prefix_hit_gives_the_logits_of_a_cold_run():
    model = tiny_model("llama_gqa")
    (first, second) = random_prompts((3, 6), seed=4, prefix=16)
    generator = BatchGenerator(model, max_new_tokens=1, block_size=4, num_blocks=40)
    generator.add_request(first)
    generator.run()
    cache = generator.template.sibling()
    assert generator.prefix_cache.attach(cache, second) == 16
    with torch.no_grad():
        hit = model(input_ids=torch.tensor([second[16:]]), cache=cache).logits
        cold = model(input_ids=torch.tensor([second]), cache=PagedCache(model.config, block_size=4)).logits[:, 16:]
    torch.testing.assert_close(hit, cold, rtol=1e-5, atol=1e-5)
