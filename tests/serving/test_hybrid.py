"""The batch generator on hybrid models (linear attention, convolutions, Mamba): packed forwards run their recurrent
layers once per request, so every request produces what it would alone with DynamicCache."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from batch_workloads import NEW, PRESSURE, alone, failing, random_prompts
from transformers import DynamicCache

from hf_paged_cache.serving.generator import BatchGenerator, generate_batch
from hf_paged_cache.serving.prefix_cache import PrefixCache
from hf_paged_cache.serving.recurrent import state_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "eval"))
import zoo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# Linear attention (gated delta net) + full attention; convolutions + full attention; Mamba-2, attention and MLP
# layers; Mamba-2 beside attention in every layer (nothing stored in blocks).
HYBRIDS = ["qwen3_next", "lfm2", "nemotron_h", "falcon_h1"]
WITH_BLOCKS = HYBRIDS[:3]  # falcon_h1 keeps its attention's K/V in its own layers: no pool to press


@functools.lru_cache(maxsize=None)
def hybrid(name: str):
    return zoo.build(name)[0]


def reference(name: str, prompts) -> list[list[int]]:
    return [alone(hybrid(name), prompt, DynamicCache(config=hybrid(name).config), "sdpa") for prompt in prompts]


@pytest.mark.parametrize("name", HYBRIDS)
def test_greedy_outputs_equal_each_prompt_alone_with_dynamic_cache(name):
    prompts = random_prompts((5, 17, 9, 30, 3, 12), seed=1)
    # Prompts computed in chunks continue their state; chunks share forwards with other requests' decode tokens.
    outputs = generate_batch(hybrid(name), prompts, max_new_tokens=NEW, block_size=4, max_batch_tokens=16,
                             max_num_seqs=3)  # fmt: skip
    assert all(output.error is None and output.finish_reason == "length" for output in outputs)
    assert [output.generated_tokens for output in outputs] == reference(name, prompts)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_a_quarter_pool_preempts_by_recompute_and_changes_nothing(name, preemption):
    """Swap moves blocks only, so a hybrid request, whose recurrent state is not in blocks, is recomputed."""
    prompts = random_prompts(PRESSURE, seed=9)
    options = dict(max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    ample = generate_batch(hybrid(name), prompts, num_blocks=256, **options)
    generator = BatchGenerator(hybrid(name), num_blocks=12, preemption=preemption, **options)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == [o.generated_tokens for o in ample]
    assert all(output.error is None for output in outputs)
    metrics = generator.metrics()
    assert metrics.preempted_recompute > 0 and metrics.preempted_swap == 0 and metrics.swap_out_blocks == 0


@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_cancel_frees_the_requests_state_and_blocks(name):
    generator = BatchGenerator(hybrid(name), max_new_tokens=20, block_size=4, num_blocks=64)
    first, second = (generator.add_request(prompt) for prompt in random_prompts((9, 6), seed=2))
    for _ in range(3):
        generator.step()
    held = {request.request_id: state_bytes(request.cache) for request in generator.running}
    assert generator.metrics().state_bytes == sum(held.values()) and all(held.values())
    assert generator.cancel_request(first)
    generator.step()
    assert generator.metrics().state_bytes == state_bytes(generator.running[0].cache) == held[second]
    assert generator.cancel_request(second)
    generator.step()
    assert generator.metrics().state_bytes == 0 and generator.metrics().blocks_used == 0
    assert not generator.has_work()


@pytest.mark.parametrize("name", HYBRIDS)
def test_prefix_caching_gives_no_hits_for_hybrid_models(name):
    """A hit would need the recurrent state at the cached prefix's end, which no block holds."""
    generator = BatchGenerator(hybrid(name), max_new_tokens=2, block_size=4, prefix_caching=True)
    assert not PrefixCache.supports(generator.template) and generator.prefix_cache is None
    shared = random_prompts((16, 16), seed=3, prefix=12)
    for prompt in shared:
        generator.add_request(prompt)
    assert all(output.prefix_hit_tokens == 0 for output in generator.run())


@pytest.mark.parametrize("model_type, match", [
    ("jamba", "cannot serve jamba: its Mamba mixer's multi-token path starts from an empty state"),
    ("deepseek_v32", r"Layer 0 is not stored in blocks \(DynamicIndexedLayer"),  # attention, not a recurrence
])  # fmt: skip
def test_layers_a_per_request_call_would_not_serve_exactly_are_refused_at_construction(model_type, match):
    with pytest.raises(ValueError, match=match):
        BatchGenerator(zoo.build(model_type)[0], max_new_tokens=2)


def test_a_memory_budget_for_a_model_with_nothing_in_blocks_is_refused_clearly():
    with pytest.raises(ValueError, match="no layer of this model stores K/V in blocks"):
        BatchGenerator(hybrid("falcon_h1"), max_memory="1MiB")


def test_a_forward_that_fails_in_a_recurrent_layer_is_rolled_back_and_changes_nothing():
    """The requests' states are dropped with their blocks (a recurrent layer may have written part of the step)."""
    model, prompts = hybrid("qwen3_next"), random_prompts((9, 14, 5), seed=4)
    options = dict(max_new_tokens=NEW, block_size=4, max_batch_tokens=8)
    expected = [o.generated_tokens for o in generate_batch(model, prompts, **options)]
    layer = model.get_decoder().layers[1]  # a recurrent layer; it fails once, at its 8th per-request call
    layer.forward = failing(layer.forward, 8, RuntimeError("interrupted"))
    try:
        generator = BatchGenerator(model, **options)
        for prompt in prompts:
            generator.add_request(prompt)
        with pytest.raises(RuntimeError, match="interrupted"):
            generator.run()
        assert not generator.running and all(request.cache is None for request in generator.waiting)
        assert [o.generated_tokens for o in generator.run()] == expected
    finally:
        del layer.forward
