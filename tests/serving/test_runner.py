"""`packed_logits`: chunks of several caches in one forward give each chunk's logits of a forward alone."""

from __future__ import annotations

import pytest
import torch
from batch_workloads import random_prompts, tiny_model
from transformers import LlamaConfig

from hf_paged_cache import PagedCache, paged_attention
from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.layers.paged import PagedLayer
from hf_paged_cache.layers import quantized as quantized_layers
from hf_paged_cache.layers.quantized import QuantizedLayer
from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.serving.runner import layer_sliding, packed_logits
from hf_paged_cache.serving.prefix_cache import PrefixCache
from hf_paged_cache.read_paths import batched_decode, cascade, selector

pytestmark = pytest.mark.usefixtures("one_thread")


def counted_plans(monkeypatch, owner, name: str) -> list[int]:
    """Record how many plans each call of `owner.<name>(layer, plans, ...)` (a layer class's method, or a read path's
    function: a read or write of several sequences) took."""
    counts, method = [], getattr(owner, name)

    def counted(layer, plans, *args):
        counts.append(len(plans))
        return method(layer, plans, *args)

    monkeypatch.setattr(owner, name, counted)
    return counts


@pytest.fixture
def torch_decode(monkeypatch):
    """The torch path's reads of decode tokens (buckets, rows in place, shared prefixes), without the C++ kernel."""
    monkeypatch.setattr(cpu_attention, "available", lambda: False)


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
@pytest.mark.usefixtures("torch_decode")
def test_decode_tokens_attended_together_give_the_logits_of_each_alone(name, monkeypatch):
    """Decode tokens of several sequences (histories of different lengths, a window, soft-capping, sinks) attended in
    one call over their gathered histories, beside a prompt chunk, give each sequence's logits of a forward alone."""
    model = tiny_model(name)
    model.set_attn_implementation("paged")
    template = PagedCache(model.config, block_size=4, num_blocks=80)
    prompts = random_prompts((11, 12, 30, 6), seed=5)
    caches = [template.sibling() for _ in prompts]
    gathered = counted_plans(monkeypatch, batched_decode, "gather_rows")
    written = counted_plans(monkeypatch, PagedLayer, "write_rows")
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


@pytest.mark.usefixtures("torch_decode")
def test_long_decode_histories_are_read_in_place_and_give_the_logits_of_each_alone(monkeypatch):
    """A decode token whose full-precision history is at least `IN_PLACE_BYTES` attends alone over views of its
    blocks, while the shorter ones are still gathered into one batch; each gives its logits of a forward alone."""
    model = tiny_model("llama_gqa")
    model.set_attn_implementation("paged")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    monkeypatch.setattr(selector, "IN_PLACE_BYTES", 20 * 2 * config.num_key_value_heads * head_dim * 4)  # 20 tokens
    template = PagedCache(model.config, block_size=4, num_blocks=80)
    prompts = random_prompts((11, 12, 30), seed=5)
    caches = [template.sibling() for _ in prompts]
    gathered = counted_plans(monkeypatch, batched_decode, "gather_rows")
    with torch.no_grad():
        for cache, prompt in zip(caches, prompts):
            model(input_ids=torch.tensor([prompt[:-1]]), cache=cache)
        sliding = [layer.is_sliding for layer in template.layers]
        logits = packed_logits(model, [(cache, prompt[-1:], len(prompt) - 1) for cache, prompt in zip(caches, prompts)],
                               sliding)  # fmt: skip
        expected = [model(input_ids=torch.tensor([prompt]), cache=PagedCache(model.config, block_size=4)).logits[0, -1]
                    for prompt in prompts]  # fmt: skip
    assert gathered == [2] * len(template.layers)  # the histories of 10 and 11 together; the 29-token one in place
    for row, reference in zip(logits, expected):
        torch.testing.assert_close(row, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("name", ["llama_gqa", "gemma2", "gpt_oss"])
def test_decode_tokens_sharing_a_cached_prefix_read_it_once_and_give_the_logits_of_each_alone(name, kernel,
                                                                                               monkeypatch):  # fmt: skip
    """Decode tokens whose histories begin with the same cached blocks attend over that prefix in one call and over
    the rest of their own history apart, merged (soft-capping and a window included). Two prefixes that begin in the
    same block are read apart, and a sequence of neither prefix as before; each sequence gives its logits of a forward
    alone. Learned sinks take the other reads. With the C++ kernel built, both parts go through it (but under
    soft-capping, which it does not do)."""
    if kernel and not cpu_attention.available():
        pytest.skip("the CPU attention kernel could not be built here")
    if not kernel:
        monkeypatch.setattr(cpu_attention, "available", lambda: False)
    monkeypatch.setattr(selector, "SHARED_PREFIX_MIN_TOKENS", 8)
    monkeypatch.setattr(selector, "SHARED_PREFIX_MIN_REREAD", 12)
    calls, in_place = [], []  # every cascade read, in torch or the kernel; those in the kernel

    def counted(reader, *records):
        return lambda query, packed, read, *args: [record.append((len(read.parts), read.prefix))
                                                   for record in records] and reader(query, packed, read, *args)

    monkeypatch.setitem(paged_attention._READERS, selector.CASCADE, counted(cascade.attend, calls))
    monkeypatch.setitem(paged_attention._READERS, selector.CASCADE_KERNEL, counted(cascade.attend_in_kernel, calls,
                                                                                   in_place))  # fmt: skip
    model = tiny_model(name)
    first, second = random_prompts((12, 8), seed=6, prefix=4)  # prefixes of 16 and 12 tokens, one block in common
    tails = random_prompts((7, 2, 13, 5, 9, 20), seed=9)
    prompts = [second + tail for tail in tails[:2]] + [first + tail for tail in tails[2:5]] + tails[5:]
    # Both prompts computed in one step, as admission would not have them (the second waits for the first's block 0):
    # then neither's blocks are freed (a sliding layer's, out of its window) and taken by the other before it is cached.
    monkeypatch.setattr(PrefixCache, "computed_by_others", lambda *args: False)
    generator = BatchGenerator(model, max_new_tokens=1, block_size=4, num_blocks=120)
    generator.add_request(prompts[0])
    generator.add_request(prompts[2])
    generator.run()  # both prefixes are cached, in 3 and 4 blocks
    caches = [generator.template.sibling() for _ in prompts]
    with torch.no_grad():
        for cache, prompt in zip(caches, prompts):
            hit, _state = generator.prefix_cache.attach(cache, prompt[:-1])
            model(input_ids=torch.tensor([prompt[hit:-1]]), cache=cache)
        sliding = [layer.is_sliding for layer in generator.template.layers]
        logits = packed_logits(model, [(cache, prompt[-1:], len(prompt) - 1) for cache, prompt in zip(caches, prompts)],
                               sliding)  # fmt: skip
        expected = [model(input_ids=torch.tensor([prompt]), cache=PagedCache(model.config, block_size=4)).logits[0, -1]
                    for prompt in prompts]  # fmt: skip
    if name == "gpt_oss":
        assert calls == []
    else:  # every full layer: three sequences over the 16-token prefix, two over the 12-token one (gemma2's sliding
        # layers read an 8-token window, which holds no shared prefix of the minimum length)
        full = sum(not layer.is_sliding for layer in generator.template.layers)
        assert sorted(calls) == sorted([(3, 16), (2, 12)] * full)
    assert in_place == (calls if kernel and name == "llama_gqa" else [])
    for row, reference in zip(logits, expected):
        torch.testing.assert_close(row, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_attention.available(), reason="the CPU attention kernel could not be built here")
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding", "gemma2", "gpt_oss"])
def test_packed_queries_read_through_the_cpu_kernel_give_the_logits_of_each_alone(name, backend, monkeypatch):
    """With the C++ attention kernel built, every decode token of a forward (histories cut into several runs, windows
    starting mid-block) and a prompt chunk under plain causality are attended in one kernel call per layer over their
    blocks where they lie; a chunk in a sliding window keeps the torch path, and so do soft-capping (gemma2), sinks
    (gpt-oss) and `backend="torch"`. Each sequence gives its logits of a forward alone."""
    calls, kernel = [], cpu_attention.paged_attention_cpu

    def counted(query, *args):
        calls.append(query.shape[0])
        return kernel(query, *args)

    monkeypatch.setattr(cpu_attention, "paged_attention_cpu", counted)
    # Runs packed end to end (no gaps to grow into): rows growing in turns cut each other's runs.
    monkeypatch.setattr(BlockPool, "allocate_runs", lambda pool, counts: [pool.allocate(count) for count in counts])
    model = tiny_model(name)
    model.set_attn_implementation("paged")
    template = PagedCache(model.config, block_size=4, num_blocks=80, backend=backend)
    prompts = random_prompts((11, 12, 30, 6), seed=5)
    caches = [template.sibling() for _ in prompts]
    with torch.no_grad():
        for step in range(2):  # the three histories grow in turns: each one's blocks are cut into runs
            for cache, prompt in zip(caches[:3], prompts[:3]):
                part = prompt[: len(prompt) // 2] if step == 0 else prompt[len(prompt) // 2 : -1]
                model(input_ids=torch.tensor([part]), cache=cache)
        assert all(len(cache.layers[0].tables.plan.runs()[0]) > 1 for cache in caches[:3])
        sliding = [layer.is_sliding for layer in template.layers]
        chunks = [(cache, prompt[-1:], len(prompt) - 1) for cache, prompt in zip(caches[:3], prompts[:3])]
        logits = packed_logits(model, [*chunks, (caches[3], prompts[3], 0)], sliding)
        expected = [model(input_ids=torch.tensor([prompt]), cache=PagedCache(model.config, block_size=4)).logits[0, -1]
                    for prompt in prompts]  # fmt: skip
    # llama_gqa: three decode tokens and the 6-token chunk; mistral_sliding: the chunk is masked by its window
    per_layer = {"llama_gqa": 3 + 6, "mistral_sliding": 3}.get(name if backend == "auto" else None)
    assert calls == ([per_layer] * len(template.layers) if per_layer else [])
    for row, reference in zip(logits, expected):
        torch.testing.assert_close(row, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_tokens", [2048, 30])
@pytest.mark.parametrize("quant", ["int4", "int2", "fp8", "K2rV2r"])
def test_quantized_decode_tokens_attended_together_give_the_logits_of_each_alone(quant, chunk_tokens, monkeypatch,
                                                                                 torch_decode):  # fmt: skip
    """Decode tokens of sequences whose quantized histories differ in length (one not sealed yet, a rotated format)
    are read in one batch per bucket (their quantized blocks decoded together), written in one copy after the first
    layer, and give each sequence's logits of a decode alone through the quantized read. Histories longer than a
    chunk are read row by row, chunk by chunk (a batch's decoded copy stays within a chunk per row)."""
    monkeypatch.setattr(quantized_layers, "CHUNK_TOKENS", chunk_tokens)
    model = tiny_model("llama_gqa")
    model.set_attn_implementation("paged")
    options = dict(block_size=4, num_blocks=80, quant=quant, residual_length=4)
    template = PagedCache(model.config, **options)
    prompts = random_prompts((3, 21, 26, 33), seed=8)
    caches = [template.sibling() for _ in prompts]
    gathered = counted_plans(monkeypatch, batched_decode, "gather_rows")
    written = counted_plans(monkeypatch, PagedLayer, "write_rows")
    with torch.no_grad():
        references = []
        for cache, prompt in zip(caches, prompts):
            model(input_ids=torch.tensor([prompt[:-1]]), cache=cache)
            alone = PagedCache(model.config, **options)
            model(input_ids=torch.tensor([prompt[:-1]]), cache=alone)
            references.append(model(input_ids=torch.tensor([prompt[-1:]]), cache=alone).logits[0, -1])
        sliding = [layer.is_sliding for layer in template.layers]
        logits = packed_logits(model, [(cache, prompt[-1:], len(prompt) - 1) for cache, prompt in zip(caches, prompts)],
                               sliding)  # fmt: skip
    together = sum(len(prompt) <= chunk_tokens for prompt in prompts)  # 4, or 3 (all but the 33-token history)
    assert sum(gathered) == together * len(template.layers)  # every decode token that fits read in a batch
    assert len(gathered) < together * len(template.layers)
    later = len(template.layers) - 1  # a decode step seals none of its own tokens: its later layers write together
    assert written[-later:] == [4] * later
    for row, reference in zip(logits, references):
        torch.testing.assert_close(row, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_attention.available(), reason="the CPU attention kernel could not be built here")
@pytest.mark.parametrize("residual", [0, 6])
@pytest.mark.parametrize("quant", ["int4", "int8", "K4V2", "int2", "fp8"])
def test_quantized_rows_read_through_the_cpu_kernel_give_the_logits_of_each_alone(quant, residual, monkeypatch):
    """Decode tokens over sealed histories (one not sealed yet) and prompt chunks whose own blocks are sealed as they
    arrive, or read both ways before they are sealed (a chunk no longer than the residual window), go to one kernel
    call per layer for the formats it decodes (int8, int4, unrotated 2-bit values); rotated and fp8 formats keep the
    torch path. After the first layer, every sequence's new tokens are written in one copy per layer, the chunks'
    completed blocks sealed first. Each sequence gives its logits alone."""
    calls, kernel = [], cpu_attention.paged_attention_cpu
    written = counted_plans(monkeypatch, PagedLayer, "write_rows")

    def counted(query, *args):
        calls.append(query.shape[0])
        return kernel(query, *args)

    monkeypatch.setattr(cpu_attention, "paged_attention_cpu", counted)
    model = tiny_model("llama_gqa")
    model.set_attn_implementation("paged")
    options = dict(block_size=4, num_blocks=120, quant=quant, residual_length=residual)
    template = PagedCache(model.config, **options)
    prompts = random_prompts((3, 21, 26, 33, 19, 25), seed=8)
    caches = [template.sibling() for _ in prompts]
    with torch.no_grad():
        references = []
        for cache, prompt in zip(caches[:3], prompts[:3]):  # three decode tokens
            model(input_ids=torch.tensor([prompt[:-1]]), cache=cache)
            alone = PagedCache(model.config, **options)
            model(input_ids=torch.tensor([prompt[:-1]]), cache=alone)
            references.append(model(input_ids=torch.tensor([prompt[-1:]]), cache=alone).logits[0, -1])
        model(input_ids=torch.tensor([prompts[3][:7]]), cache=caches[3])  # a chunk after 7 tokens, one from scratch
        alone = PagedCache(model.config, **options)
        model(input_ids=torch.tensor([prompts[3][:7]]), cache=alone)
        references.append(model(input_ids=torch.tensor([prompts[3][7:]]), cache=alone).logits[0, -1])
        fresh = PagedCache(model.config, **options)
        references.append(model(input_ids=torch.tensor([prompts[4]]), cache=fresh).logits[0, -1])
        model(input_ids=torch.tensor([prompts[5][:20]]), cache=caches[5])  # then a chunk of 5
        alone = PagedCache(model.config, **options)
        model(input_ids=torch.tensor([prompts[5][:20]]), cache=alone)
        references.append(model(input_ids=torch.tensor([prompts[5][20:]]), cache=alone).logits[0, -1])
        calls.clear()
        sliding = [layer.is_sliding for layer in template.layers]
        parts = [(cache, prompt[-1:], len(prompt) - 1) for cache, prompt in zip(caches[:3], prompts[:3])]
        parts += [(caches[3], prompts[3][7:], 7), (caches[4], prompts[4], 0), (caches[5], prompts[5][20:], 20)]
        logits = packed_logits(model, parts, sliding)
        if residual:  # the last chunk reads its first stored blocks both ways, none sealed yet
            assert caches[5].layers[0].tables.plan.transition == [1] and not caches[5].layers[0].tables.plan.arrivals
    readable = quant in ("int4", "int8", "K4V2")
    assert calls == ([3 + 26 + 19 + 5] * len(template.layers) if readable else [])
    assert written == [6] * (len(template.layers) - 1)
    # The kernel sums in another order, and a later layer's K/V a last bit apart can round to the next code, which
    # moves a logit by up to ~1e-4 (each layer's output alone agrees within 1e-6): a looser bound than exact reads'.
    for row, reference in zip(logits, references):
        torch.testing.assert_close(row, reference, rtol=2e-4, atol=2e-4)
