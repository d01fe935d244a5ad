"""Preemption under memory pressure: swap, recompute and auto give the unconstrained outputs; the strategies."""

from __future__ import annotations

import pytest
import torch
from batch_workloads import PRESSURE, pressure_run, random_prompts, tiny_model, unconstrained
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import MODELS_BY_NAME

from hf_paged_cache import PagedCache, SwapSpace
from hf_paged_cache.memory.copy_stream import CopyStream
from hf_paged_cache.sequence_state import SequenceState
from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.serving.preemption import (
    DEFAULT_COPY_RATE,
    RECOMPUTE,
    SWAP,
    Auto,
    LRUVictims,
    Preemption,
    Recompute,
    Swap,
    WeightedVictims,
)
from hf_paged_cache.serving.request_memory import RequestMemory
from hf_paged_cache.serving.requests import GenerationOutput, Request
from hf_paged_cache.serving.state_pool import StatePool

pytestmark = pytest.mark.usefixtures("one_thread")


def _memory(cache):
    """A request's memory outside a generator: its cache, with a state pool of no tensors."""
    return RequestMemory(cache, StatePool(SequenceState(), 1, {}))


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
    generator = BatchGenerator(tiny_model(name), max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=15,
                               **options)  # fmt: skip
    for prompt in random_prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    outputs = generator.run()
    assert tuple(tuple(o.generated_tokens) for o in outputs) == unconstrained(name, **cache_options)
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
    assert generator.template.metrics().blocks_used == 0 and not generator.requests.swapped


@pytest.mark.parametrize("options", [{}, {"quant": "int8", "residual_length": 4}, {"swap_threshold": 0.8}],
                         ids=["full", "int8", "threshold"])  # fmt: skip
def test_deferred_copies_keep_the_ordering_rules_and_the_outputs(options):
    """Each copy runs only when a fence or a wait needs it. At every forward no copy out is pending (the victims'
    freed blocks may be written by it) and no request in the batch has a copy in pending; requests swapped in at
    this step (a step ahead of running) may."""
    prefetched_during = []

    def check(generator, batch):
        flights = [generator.swap.in_flight(r.cache) for r in [*generator.requests.running, *generator.requests.swapped]]
        assert "out" not in flights and all(generator.swap.in_flight(r.cache) is None for r, _ in batch)
        prefetched_during.append(flights.count("in"))

    generator, outputs = pressure_run(check=check, swap_copies="deferred", **options)
    cache_options = {key: options[key] for key in ("quant", "residual_length") if key in options}
    assert outputs == unconstrained("llama_gqa", **cache_options)
    last = generator.metrics()
    assert last.swap_in_blocks == last.swap_out_blocks > 0 and last.swap_stall_seconds == last.swap_copy_seconds > 0
    if "swap_threshold" not in options:  # at 80% of this pool, swapped requests come back only into an idle one
        assert sum(prefetched_during) > 0 and 0 < last.swap_prefetched <= last.preempted_swap


def test_deferred_compressed_copies_match_synchronous_ones():
    """fp8 host copies are lossy, so the reference is the same run with synchronous copies: encoding before the
    copy out and decoding after the copy in do not depend on when the copies land."""
    (_, deferred), (generator, sync) = (pressure_run(swap_copies=copies, swap_compression="fp8")
                                        for copies in ("deferred", "sync"))  # fmt: skip
    assert deferred == sync and generator.metrics().preempted_swap > 0


def test_without_the_fence_deferred_copies_change_the_outputs(monkeypatch):
    """The test above can fail: without the fence, forwards write freed blocks before their copy out read them and
    read swapped-in blocks before their copy in landed."""
    monkeypatch.setattr(CopyStream, "fence", lambda self: None)
    generator, outputs = pressure_run(swap_copies="deferred")
    assert generator.metrics().preempted_swap > 0 and outputs != unconstrained("llama_gqa")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="asynchronous copies need CUDA")
def test_cuda_side_stream_copies_give_the_synchronous_outputs():
    model, _config = MODELS_BY_NAME["llama_gqa"].build()  # not the cached CPU model: it moves to the GPU
    model.to("cuda")
    runs = {}
    for copies in ("sync", "async"):
        generator = BatchGenerator(model, max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=15,
                                   prefix_caching=False, preemption="swap", swap_copies=copies)  # fmt: skip
        for prompt in random_prompts(PRESSURE, seed=9):
            generator.add_request(prompt)
        runs[copies] = ([o.generated_tokens for o in generator.run()], generator.metrics())
    (sync, _), (overlapped, last) = runs["sync"], runs["async"]
    assert overlapped == sync and last.preempted_swap > 0 and last.swap_prefetched > 0 and last.swap_copy_seconds > 0
    assert generator.swap.copies.mode == "async"


def test_shared_prefix_blocks_survive_swapping():
    model = tiny_model("llama_gqa")
    generator = BatchGenerator(model, max_new_tokens=12, block_size=4, max_batch_tokens=16, num_blocks=18,
                               preemption="swap")  # fmt: skip
    for prompt in random_prompts(PRESSURE, seed=9, prefix=8):
        generator.add_request(prompt)
    outputs = generator.run()
    assert tuple(tuple(o.generated_tokens) for o in outputs) == unconstrained("llama_gqa", prefix=8)
    last = generator.metrics()
    assert last.preempted_swap > 0 and last.prefix_hit_tokens > 0
    assert last.prompt_tokens == sum(len(o.prompt_ids) for o in outputs)


def _victim_pair(seed: int = 0):
    """A template and a request whose cache holds 10 tokens (3 blocks of 4)."""
    model = tiny_model("llama_gqa")
    template = PagedCache(model.config, block_size=4, num_blocks=32)
    cache = template.sibling()
    with torch.no_grad():
        model(input_ids=torch.tensor([random_prompts((10,), seed=seed)[0]]), cache=cache)
    return template, Request(GenerationOutput(0, list(range(10))), settings=None, memory=_memory(cache), fed=10)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_short_or_nothing_is_computed():
    template, request = _victim_pair()
    assert Swap().choose(request, SwapSpace(template), compute_rate=1.0) == SWAP
    assert Swap().choose(request, SwapSpace(template, num_blocks=2), compute_rate=1.0) == RECOMPUTE
    fresh = Request(GenerationOutput(1, [5]), settings=None, memory=_memory(template.sibling()))
    assert Swap().choose(fresh, SwapSpace(template), compute_rate=1.0) == RECOMPUTE
    assert Recompute().choose(request, SwapSpace(template), compute_rate=1.0) == RECOMPUTE


def test_auto_picks_the_cheaper_by_its_copy_rate_before_any_copy_was_measured():
    template, request = _victim_pair()
    swap = SwapSpace(template)
    assert Auto().copy_rate == DEFAULT_COPY_RATE
    assert Auto(copy_rate=1e15).choose(request, swap, compute_rate=1.0) == SWAP
    assert Auto(copy_rate=1.0).choose(request, swap, compute_rate=1e15) == RECOMPUTE
    assert Auto().choose(request, SwapSpace(template, num_blocks=1), compute_rate=1e-9) == RECOMPUTE  # short
    with pytest.raises(ValueError, match="copy_rate"):
        Auto(copy_rate=0)


@given(st.lists(st.tuples(st.integers(-1, 20), st.floats(0, 50)), max_size=10), st.integers(20, 40),
       st.sampled_from([LRUVictims(), WeightedVictims(), WeightedVictims(decay=0.5, size_weight=3.0)]))  # fmt: skip
def test_the_victim_order_is_a_permutation_of_the_running_requests_lowest_priority_first(rows, step, policy):
    template = PagedCache(tiny_model("llama_gqa").config, block_size=4, num_blocks=8)
    running = [Request(GenerationOutput(i, [1]), settings=None, memory=_memory(template.sibling()), last_step=last, hotness=hot)
               for i, (last, hot) in enumerate(rows)]  # fmt: skip
    victims = policy.victims(running, step, pool_blocks=8)
    assert sorted(map(id, victims)) == sorted(map(id, running))
    priorities = [policy.priority(r, step, 8) for r in victims]
    assert priorities == sorted(priorities)


def test_lru_victims_are_the_least_recently_scheduled_and_weighted_ones_the_coldest_and_largest():
    template, big = _victim_pair()
    small = Request(GenerationOutput(1, [1]), settings=None, memory=_memory(template.sibling()))
    lru, weighted = LRUVictims(), WeightedVictims(decay=0.5, size_weight=100.0)
    for policy in (lru, weighted):
        policy.touch(small, 3)
        policy.touch(big, 4)
    assert lru.victims([big, small], 5, 32)[0] is small  # scheduled longer ago
    assert weighted.victims([big, small], 5, 32)[0] is big  # holds 3 of 32 blocks, weighted 100x
    assert small.hotness == 1.0 and big.last_step == 4
    weighted.touch(small, 5)
    assert small.hotness == 1.0 * 0.5**2 + 1.0
    with pytest.raises(ValueError, match="decay"):
        WeightedVictims(decay=0.0)


@pytest.mark.parametrize("preemption", [Swap(), Auto(copy_rate=1e15)], ids=["swap", "auto-fast-copies"])
def test_preemption_strategies_given_as_instances_are_used(preemption):
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=12, block_size=4, max_batch_tokens=16,
                               num_blocks=15, prefix_caching=False, preemption=preemption,
                               victim_policy=WeightedVictims(decay=0.8))  # fmt: skip
    assert generator.requests.preemption is preemption and generator.requests.victims == WeightedVictims(decay=0.8)
    for prompt in random_prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    outputs = generator.run()
    assert tuple(tuple(o.generated_tokens) for o in outputs) == unconstrained("llama_gqa")
    assert generator.metrics().preempted_swap > 0


def test_a_preemption_that_names_no_mechanism_is_refused_and_leaves_the_request_running():
    class Drop(Preemption):
        def choose(self, request, swap, compute_rate):
            return "drop"

    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=12, block_size=4, max_batch_tokens=16,
                               num_blocks=15, prefix_caching=False, preemption=Drop())  # fmt: skip
    for prompt in random_prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    with pytest.raises(ValueError, match="Drop.choose returned 'drop'"):
        generator.run()
    assert generator.requests.running and generator.metrics().preempted == {}
