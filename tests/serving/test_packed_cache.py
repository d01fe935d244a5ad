"""`packed_logits`: chunks of several caches in one forward give each chunk's logits of a forward alone."""

from __future__ import annotations

import pytest
import torch
from batch_workloads import random_prompts, tiny_model
from transformers import LlamaConfig

from hf_paged_cache import PagedCache
from hf_paged_cache.serving.packed_cache import layer_sliding, packed_logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
def test_packed_chunks_give_the_last_logits_of_each_chunk_alone(name):
    model = tiny_model(name)
    model.set_attn_implementation("paged")
    template = PagedCache(model.config, block_size=4, num_blocks=40)
    first, second = random_prompts((9, 5), seed=21)
    caches = [template.sibling(), template.sibling()]
    with torch.no_grad():
        model(input_ids=torch.tensor([first[:4]]), cache=caches[0])  # the first request is 4 tokens in
        sliding = [layer.is_sliding for layer in template.layers]
        logits = packed_logits(model, [(caches[0], first[4:], 4), (caches[1], second, 0)], sliding)
        expected = [model(input_ids=torch.tensor([prompt]), cache=PagedCache(model.config, block_size=4)).logits[0, -1]
                    for prompt in (first, second)]  # fmt: skip
    assert logits.shape[0] == 2
    for row, reference in zip(logits, expected):
        torch.testing.assert_close(row, reference, rtol=1e-5, atol=1e-5)
    assert [cache.get_seq_length() for cache in caches] == [9, 5]


def test_layer_sliding_is_false_for_layers_with_recurrent_state_only():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, sliding_window=8)  # fmt: skip
    config.layer_types = ["linear_attention", "sliding_attention", "full_attention"]
    assert layer_sliding(PagedCache(config)) == [False, True, False]
