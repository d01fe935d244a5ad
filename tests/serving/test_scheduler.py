"""Schedulers order a step's running requests; `BlockRoom` says whether a step's blocks fit."""

from __future__ import annotations

import pytest
from batch_workloads import PRESSURE, random_prompts, tiny_model, unconstrained
from hypothesis import given
from hypothesis import strategies as st

from hf_paged_cache import PagedCache
from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.serving.requests import GenerationOutput, Request
from hf_paged_cache.serving.scheduler import FIFO, BlockRoom, DecodeFirst, Scheduler

pytestmark = pytest.mark.usefixtures("one_thread")


def _request(request_id: int, prompt: int, fed: int, last_step: int = -1) -> Request:
    return Request(GenerationOutput(request_id, list(range(prompt))), settings=None, fed=fed, last_step=last_step)


requests_lists = st.lists(st.tuples(st.integers(1, 9), st.integers(0, 8), st.integers(-1, 5)), max_size=8).map(
    lambda rows: [_request(i, prompt, min(fed, prompt - 1), step) for i, (prompt, fed, step) in enumerate(rows)]
)


@given(requests_lists)
def test_decode_first_puts_decode_tokens_first_then_higher_priority(running):
    order = DecodeFirst().order(running, lambda r: (r.last_step, -r.request_id))
    assert sorted(r.request_id for r in order) == [r.request_id for r in running]
    decoding = [r.pending == 1 for r in order]
    assert decoding == sorted(decoding, reverse=True)
    for first, second in zip(order, order[1:]):
        if (first.pending == 1) == (second.pending == 1):
            assert (first.last_step, -first.request_id) >= (second.last_step, -second.request_id)


@given(requests_lists)
def test_fifo_serves_the_earliest_request_first(running):
    order = FIFO().order(list(reversed(running)), lambda r: (0, 0))
    assert [r.request_id for r in order] == sorted(r.request_id for r in running)


def test_a_custom_scheduler_decides_the_order_of_every_step():
    """The requests a step schedules are a prefix of the custom scheduler's order (newest first here), and the
    outputs do not depend on the order."""

    class NewestFirst(Scheduler):
        def __init__(self):
            self.orders = []

        def order(self, running, priority):
            self.orders.append([r.request_id for r in sorted(running, key=lambda r: -r.request_id)])
            return sorted(running, key=lambda r: -r.request_id)

    scheduler = NewestFirst()
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=12, block_size=4, max_batch_tokens=16,
                               prefix_caching=False, scheduler=scheduler)  # fmt: skip
    batches = []
    generator.before_forward.append(lambda batch: batches.append([r.request_id for r, _ in batch]))
    for prompt in random_prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    outputs = generator.run()
    assert generator.requests.order is scheduler and len(scheduler.orders) == len(generator.history)
    for ordered, batch in zip(scheduler.orders, batches):
        scheduled = [request_id for request_id in batch if request_id in ordered]
        assert scheduled == ordered[: len(scheduled)] and batch[: len(scheduled)] == scheduled
    assert any(len(ordered) > 1 for ordered in scheduler.orders)
    assert tuple(tuple(o.generated_tokens) for o in outputs) == unconstrained("llama_gqa")


@pytest.mark.parametrize("scheduler", ["fifo", FIFO()], ids=["name", "instance"])
def test_fifo_under_pressure_gives_the_unconstrained_outputs(scheduler):
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=12, block_size=4, max_batch_tokens=16,
                               num_blocks=15, prefix_caching=False, preemption="recompute",
                               scheduler=scheduler)  # fmt: skip
    assert isinstance(generator.requests.order, FIFO)
    for prompt in random_prompts(PRESSURE, seed=9):
        generator.add_request(prompt)
    outputs = generator.run()
    assert tuple(tuple(o.generated_tokens) for o in outputs) == unconstrained("llama_gqa")
    assert generator.metrics().preempted_recompute > 0


def test_block_room_counts_headroom_threshold_and_the_largest_chunk():
    model = tiny_model("llama_gqa")
    template = PagedCache(model.config, block_size=4, num_blocks=10)
    room = BlockRoom(template, threshold=0.5)
    cache = template.sibling()
    pool = next(iter(cache.step_demand(4)))
    assert room.pools() == [pool] and room.total_blocks() == 10
    taken = {}
    assert room.fits({pool: 6}, taken, headroom=4) and taken == {pool: 6}
    assert not room.fits({pool: 1}, taken, headroom=4) and taken == {pool: 6}  # a refusal takes nothing
    assert room.below_threshold({pool: 5}, idle=False) and not room.below_threshold({pool: 6}, idle=False)
    assert room.below_threshold({pool: 10}, idle=True)  # an idle generator takes whatever fits
    assert room.largest_chunk(cache, 40, {pool: 7}) == 12
    assert BlockRoom(template, None).below_threshold({pool: 99}, idle=False)
