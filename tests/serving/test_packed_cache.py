"""`packed_logits`: chunks of several caches in one forward give each chunk's logits of a forward alone."""

from __future__ import annotations

import pytest
import torch
from batch_workloads import random_prompts, tiny_model
from transformers import LlamaConfig

from hf_paged_cache import PagedCache
from hf_paged_cache.layers.paged import PagedLayer
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


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding", "gemma2", "gpt_oss"])
def test_decode_tokens_attended_together_give_the_logits_of_each_alone(name, monkeypatch):
    """Decode tokens of several sequences (histories of different lengths, a window, soft-capping, sinks) attended in
    one call over their gathered histories, beside a prompt chunk, give each sequence's logits of a forward alone."""
    model = tiny_model(name)
    model.set_attn_implementation("paged")
    template = PagedCache(model.config, block_size=4, num_blocks=80)
    prompts = random_prompts((11, 12, 30, 6), seed=5)
    caches = [template.sibling() for _ in prompts]
    gathered = []
    gather_rows = PagedLayer.gather_rows

    def counted(layer, plans, memo):
        gathered.append(len(plans))
        return gather_rows(layer, plans, memo)

    monkeypatch.setattr(PagedLayer, "gather_rows", counted)
    written, write_rows = [], PagedLayer.write_rows

    def writes(layer, plans, *args):
        written.append(len(plans))
        return write_rows(layer, plans, *args)

    monkeypatch.setattr(PagedLayer, "write_rows", writes)
    with torch.no_grad():
        for cache, prompt in zip(caches[:3], prompts[:3]):  # three sequences decode, the fourth starts its prompt
            model(input_ids=torch.tensor([prompt[:-1]]), cache=cache)
        sliding = [layer.is_sliding for layer in template.layers]
        chunks = [(cache, prompt[-1:], len(prompt) - 1) for cache, prompt in zip(caches[:3], prompts[:3])]
        logits = packed_logits(model, [*chunks, (caches[3], prompts[3], 0)], sliding)
        expected = [model(input_ids=torch.tensor([prompt]), cache=PagedCache(model.config, block_size=4)).logits[0, -1]
                    for prompt in prompts]  # fmt: skip
    # Every layer read the three decode tokens in one call per bucket of similar read lengths: histories of 10 and 11,
    # then 29, in a full-attention layer (a sliding window cuts all three to the same length: one call).
    layers, windowed = len(template.layers), sum(layer.is_sliding for layer in template.layers)
    assert sum(gathered) == 3 * layers and len(gathered) == windowed + 2 * (layers - windowed)
    # The layers after the first (which planned every group's step of every cache) wrote all four caches in one copy.
    assert written == [4] * (len(template.layers) - 1)
    for row, reference in zip(logits, expected):
        torch.testing.assert_close(row, reference, rtol=1e-5, atol=1e-5)
