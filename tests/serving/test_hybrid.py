"""The batch generator on hybrid models (linear attention, convolutions, Mamba): packed forwards run their recurrent
layers by request (decode steps as one batch over gathered states, prompt chunks alone), each request's state in a
slot of the state pool, so every request produces what it would alone with DynamicCache."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from batch_workloads import NEW, PRESSURE, alone, failing, random_prompts
from transformers import DynamicCache

from hf_paged_cache.accounting import blocks_in_budget
from hf_paged_cache.errors import UnsupportedModelError
from hf_paged_cache.sequence_state import layer_states, sequence_state
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
    model = hybrid(name)
    attention = "sdpa" if model._supports_sdpa else "eager"  # a model without attention (Mamba) has no SDPA
    return [alone(model, prompt, DynamicCache(config=model.config), attention) for prompt in prompts]


def slot_checked(generator: BatchGenerator) -> BatchGenerator:
    """Before every forward: each running request's state tensors are views of its own slot, one slot each (the
    model wrote into the slot in place at the step before: no layer rebound its state)."""

    def check(batch):
        slots = [generator.states.slot_of(request.cache) for request in generator.requests.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert generator.states.num_free == generator.states.num_slots - len(slots)
        for request, slot in zip(generator.requests.running, slots):
            for tensor, storage in generator.states.storage.items():
                state = layer_states(request.cache.layers[tensor.layer])[tensor.kind][tensor.index]
                assert state.data_ptr() == storage[slot].data_ptr() and state.shape == tensor.shape

    generator.before_forward.append(check)
    return generator


@pytest.mark.parametrize("name", [*HYBRIDS, "zaya"])  # zaya: its mixer returns (output, None)
def test_greedy_outputs_equal_each_prompt_alone_with_dynamic_cache(name):
    """More requests than slots: the others wait for a slot. Prompts computed in chunks continue their state;
    chunks share forwards with other requests' decode tokens."""
    prompts = random_prompts((5, 17, 9, 30, 3, 12), seed=1)
    generator = slot_checked(BatchGenerator(hybrid(name), max_new_tokens=NEW, block_size=4, max_batch_tokens=16,
                                            max_num_seqs=3))  # fmt: skip
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert all(output.error is None and output.finish_reason == "length" for output in outputs)
    assert [output.generated_tokens for output in outputs] == reference(name, prompts)
    slot = sequence_state(hybrid(name).config, torch.float32).nbytes
    assert max(m.running for m in generator.history) == 3 and max(m.waiting for m in generator.history) >= 3
    assert {(m.state_slots, m.state_pool_bytes) for m in generator.history} == {(3, 3 * slot)}
    assert generator.states.num_free == 3


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_a_quarter_pool_preempts_and_changes_nothing(name, preemption):
    """A swapped request's state slot goes to host memory with its blocks and comes back into another slot."""
    prompts = random_prompts(PRESSURE, seed=9)
    options = dict(max_new_tokens=NEW, block_size=4, max_batch_tokens=16)
    generator = slot_checked(BatchGenerator(hybrid(name), num_blocks=12, preemption=preemption, **options))
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == reference(name, prompts)
    assert all(output.error is None for output in outputs)
    metrics = generator.metrics()
    assert metrics.preempted[preemption] > 0 and sum(metrics.preempted.values()) == metrics.preempted[preemption]
    assert (metrics.swap_out_blocks > 0) == (preemption == "swap") and generator.states.num_free == 32



def test_state_swaps_stay_exact_when_block_copies_land_late():
    """`swap_copies="deferred"`: block copies wait until a step needs them; a slot is copied to host at once,
    before another request can take it and zero it."""
    prompts = random_prompts(PRESSURE, seed=9)
    generator = slot_checked(BatchGenerator(hybrid("qwen3_next"), num_blocks=12, preemption="swap",
                                            swap_copies="deferred", max_new_tokens=NEW, block_size=4,
                                            max_batch_tokens=16))  # fmt: skip
    for prompt in prompts:
        generator.add_request(prompt)
    assert [o.generated_tokens for o in generator.run()] == reference("qwen3_next", prompts)
    assert generator.metrics().preempted_swap > 0

@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_cancel_frees_the_requests_state_and_blocks(name):
    generator = BatchGenerator(hybrid(name), max_new_tokens=20, block_size=4, num_blocks=64)
    first, second = (generator.add_request(prompt) for prompt in random_prompts((9, 6), seed=2))
    for _ in range(3):
        generator.step()
    held = {request.request_id: state_bytes(request.cache) for request in generator.requests.running}
    assert generator.metrics().state_bytes == sum(held.values()) and all(held.values())
    cache = generator.requests.running[0].cache
    assert generator.states.num_free == generator.states.num_slots - 2
    assert generator.cancel_request(first)
    assert generator.states.num_free == generator.states.num_slots - 1 and generator.states.slot_of(cache) is None
    assert state_bytes(cache) == 0  # its layers let go of the slot: nothing of it can write there again
    generator.step()
    assert generator.metrics().state_bytes == state_bytes(generator.requests.running[0].cache) == held[second]
    assert generator.cancel_request(second)
    generator.step()
    assert generator.metrics().state_bytes == 0 and generator.metrics().blocks_used == 0
    assert not generator.has_work() and generator.states.num_free == generator.states.num_slots


@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_prefix_hits_restore_the_state_kept_after_the_shared_prefix_and_change_nothing(name):
    """The first request's recurrent layers stop where its prompt stops sharing with the queued ones (12 tokens) and
    copy their state there, its prompt computed in one chunk all the same; the others wait for it, then start from
    its blocks and that state."""
    prompts = random_prompts((4, 4, 8, 1, 18, 4), seed=3, prefix=12)
    generator = slot_checked(BatchGenerator(hybrid(name), max_new_tokens=NEW, block_size=4, max_batch_tokens=64))
    chunks = []
    generator.before_forward.append(lambda batch: chunks.append([(r.request_id, r.fed, q) for r, q in batch]))
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == reference(name, prompts)
    assert [o.prefix_hit_tokens for o in outputs] == [0, 12, 12, 12, 12, 12]
    assert chunks[0] == [(0, 0, 16)]  # the others wait for the shared part's state
    metrics = generator.metrics()
    assert metrics.prefix_hit_tokens == 60 and 0 < metrics.state_checkpoints <= generator.states.num_slots
    assert metrics.state_checkpoint_bytes == metrics.state_checkpoints * generator.states.slot_bytes


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2"])
def test_a_prompt_seen_again_keeps_its_state_where_its_cached_blocks_end_and_is_found_from_then_on(name):
    """The second time, its blocks are cached but no state: it computes its prompt and keeps the state where its
    cached blocks end; the third time, and a conversation's next turn (the prompt, its answer and more), start there."""
    (prompt,) = random_prompts((18,), seed=7)
    generator = BatchGenerator(hybrid(name), max_new_tokens=NEW, block_size=4)
    outputs = []
    for _ in range(3):
        generator.add_request(prompt)
        outputs += generator.run()
    turn = prompt + outputs[0].generated_tokens + random_prompts((5,), seed=8)[0]
    generator.add_request(turn)
    outputs += generator.run()
    assert [o.prefix_hit_tokens for o in outputs] == [0, 0, 16, 16]
    assert [o.generated_tokens for o in outputs] == reference(name, [prompt, prompt, prompt, turn])


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_prefix_hits_under_preemption_change_nothing(preemption):
    prompts = random_prompts((20, 33, 12, 41, 27, 18), seed=9, prefix=8)
    generator = slot_checked(BatchGenerator(hybrid("qwen3_next"), num_blocks=20, preemption=preemption,
                                            max_new_tokens=NEW, block_size=4, max_batch_tokens=16))  # fmt: skip
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [o.generated_tokens for o in outputs] == reference("qwen3_next", prompts)
    assert generator.metrics().preempted[preemption] > 0 and sum(o.prefix_hit_tokens for o in outputs) > 0


def test_the_checkpoint_budget_drops_the_least_recently_used_states_and_zero_turns_hits_off():
    model = hybrid("lfm2")
    prompts = random_prompts((4, 4), seed=3, prefix=12) + random_prompts((4, 4), seed=4, prefix=12)
    slot = sequence_state(model.config, model.dtype).nbytes
    one = BatchGenerator(model, max_new_tokens=NEW, block_size=4, checkpoint_memory=slot)
    for prompt in prompts:
        one.add_request(prompt)
    assert [o.generated_tokens for o in one.run()] == reference("lfm2", prompts)
    assert one.metrics().state_checkpoints == 1 and one.prefix_cache.checkpoints.stats.dropped > 0
    assert BatchGenerator(model, max_new_tokens=NEW, checkpoint_memory=0).prefix_cache is None


@pytest.mark.parametrize("name", ["falcon_h1", "jamba"])
def test_hybrids_whose_state_a_checkpoint_cannot_restore_get_no_prefix_cache(name):
    """Falcon-H1's layers keep their own K/V beside the state; Jamba's mixers compute a prompt whole."""
    generator = BatchGenerator(hybrid(name), max_new_tokens=2, block_size=4, prefix_caching=True)
    assert not PrefixCache.supports(generator.template, generator.states.state) and generator.prefix_cache is None
    for prompt in random_prompts((16, 16), seed=3, prefix=12):
        generator.add_request(prompt)
    assert all(output.prefix_hit_tokens == 0 for output in generator.run())


@pytest.mark.parametrize("name", ["jamba", "mamba", "falcon_mamba"])
def test_mamba1_models_compute_each_prompt_whole_and_equal_each_prompt_alone(name):
    """Their mixers start from an empty state at every multi-token chunk, so a prompt is computed in one step: beyond
    `max_batch_tokens` when it runs alone, else at a step whose budget holds it; the decode steps continue it."""
    model = hybrid(name)
    prompts = random_prompts((5, 17, 9, 30, 3, 12), seed=5)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=8, max_num_seqs=3)
    chunks = []
    generator.before_forward.append(lambda batch: chunks.extend(
        (request.fed, q, len(request.tokens)) for request, q in batch))
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    assert [output.generated_tokens for output in outputs] == reference(name, prompts)
    assert all(q == tokens for fed, q, tokens in chunks if fed == 0)  # every first step takes the whole prompt
    assert any(q > 8 for _fed, q, _tokens in chunks)  # beyond the budget, alone


def test_layers_a_per_request_call_would_not_serve_exactly_are_refused_at_construction():
    with pytest.raises(ValueError, match=r"Layer 0 is not stored in blocks \(DynamicIndexedLayer"):
        BatchGenerator(zoo.build("deepseek_v32")[0], max_new_tokens=2)  # attention, not a recurrence


@pytest.mark.parametrize("name", ["zamba", "zamba2"])
def test_layers_called_with_positional_arguments_are_refused_at_the_first_forward(name):
    """Zamba's hybrid layers hand their mixer's inputs positionally: no call per request can be made of them."""
    with pytest.raises(UnsupportedModelError, match="called with positional arguments"):
        generate_batch(hybrid(name), random_prompts((5, 7), seed=6), max_new_tokens=2, block_size=4)


def test_a_memory_budget_for_a_model_with_nothing_in_blocks_is_refused_clearly():
    with pytest.raises(ValueError, match="no layer of this model stores K/V in blocks"):
        BatchGenerator(hybrid("falcon_h1"), max_memory="1MiB")


def test_a_memory_budget_holds_the_state_pool_first_and_blocks_in_the_rest():
    model = hybrid("qwen3_next")
    slots = 4 * sequence_state(model.config, model.dtype).nbytes
    generator = BatchGenerator(model, max_memory=2**20, max_num_seqs=4, block_size=4)  # as many bytes of checkpoints
    assert generator.template.options.num_blocks == blocks_in_budget(model.config, 2**20 - 2 * slots, 4, model.dtype)
    assert generator.states.pool_bytes == slots
    plain = BatchGenerator(model, max_memory=2**20, max_num_seqs=4, block_size=4, prefix_caching=False)
    assert plain.template.options.num_blocks == blocks_in_budget(model.config, 2**20 - slots, 4, model.dtype)
    with pytest.raises(ValueError, match=r"cannot hold the recurrent state of `max_num_seqs`=4 requests"):
        BatchGenerator(model, max_memory=2 * slots, max_num_seqs=4)


def test_a_forward_that_fails_in_a_recurrent_layer_is_rolled_back_and_changes_nothing():
    """The requests' states are dropped with their blocks (a recurrent layer may have written part of the step)."""
    model, prompts = hybrid("qwen3_next"), random_prompts((9, 14, 5), seed=4)
    options = dict(max_new_tokens=NEW, block_size=4, max_batch_tokens=8)
    expected = [o.generated_tokens for o in generate_batch(model, prompts, **options)]
    layer = model.get_decoder().layers[1]  # a recurrent layer; it fails once, at its 8th per-request call
    calls, fails = [], failing(layer.forward, 8, RuntimeError("interrupted"))
    layer.forward = lambda *args, **kwargs: calls.append(None) or fails(*args, **kwargs)
    try:
        generator = BatchGenerator(model, **options)
        for prompt in prompts:
            generator.add_request(prompt)
        while len(calls) < 8:  # up to the step whose forward failed (its requests then run alone)
            generator.step()
        assert not generator.requests.running and all(request.cache is None for request in generator.requests.waiting)
        assert generator.states.num_free == generator.states.num_slots
        outputs = generator.run()
        assert [o.generated_tokens for o in outputs] == expected and all(o.error is None for o in outputs)
    finally:
        del layer.forward


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "nemotron_h"])
def test_decode_steps_go_through_each_recurrent_layer_as_one_batch(name):
    """A step's single-token steps of every request that continues its state run a recurrent mixer once, as a batch
    of sequences over their gathered states (written back to their slots); prompt chunks run alone; outputs as
    alone. (Each mixer call is seen at its first linear layer: the mixer's own call is the packed one.)"""
    model = hybrid(name)
    mixers = [module for module in model.modules() if type(module).__name__.endswith(("ShortConv", "GatedDeltaNet",
                                                                                       "Mamba2Mixer"))]  # fmt: skip
    calls = []
    firsts = [next(child for child in mixer.children() if isinstance(child, torch.nn.Linear)) for mixer in mixers]
    hooks = [first.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[:2])) for first in firsts]
    try:
        prompts = random_prompts((5, 17, 9, 12), seed=2)
        outputs = generate_batch(model, prompts, max_new_tokens=NEW, block_size=4, max_batch_tokens=64,
                                 prefix_caching=False)  # no prompt cut in pieces where a checkpoint is kept
    finally:
        for hook in hooks:
            hook.remove()
    assert [output.generated_tokens for output in outputs] == reference(name, prompts)
    batched = [shape for shape in calls if shape[0] > 1]
    assert mixers and batched and all(shape[1] == 1 for shape in batched)
    # Every decode step of the four requests is one call per mixer: no single-token call of one sequence is left
    # once all four run (prompts are computed whole in the first step, with max_batch_tokens 64).
    assert len(batched) == (NEW - 1) * len(mixers) and not [shape for shape in calls if tuple(shape) == (1, 1)]


def test_only_the_mixers_run_per_request_and_the_rest_of_their_layers_on_the_packed_row():
    """A conv layer's norms and MLP see each packed forward once, whatever its requests; Falcon-H1's layers, with a
    Mamba mixer beside their attention, run whole per request."""
    model = hybrid("lfm2")
    prompts = random_prompts((5, 17, 9), seed=2)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4)
    assert {type(module).__name__ for module in generator.per_request.runs} == {"Lfm2ShortConv"}
    layer = generator.per_request.layers[0]
    calls = []
    hook = layer.feed_forward.register_forward_pre_hook(lambda _m, args: calls.append(args[0].shape[:2]))
    try:
        for prompt in prompts:
            generator.add_request(prompt)
        outputs = generator.run()
    finally:
        hook.remove()
    assert [output.generated_tokens for output in outputs] == reference("lfm2", prompts)
    assert len(calls) == len(generator.history) and calls[0] == (1, sum(len(prompt) for prompt in prompts))
    whole = BatchGenerator(hybrid("falcon_h1"), max_new_tokens=2).per_request
    assert whole.runs == whole.layers
