"""`RequestScheduler`: the queues of a generator, admission within `max_num_seqs`, cancelling from any queue, and a
rolled-back batch queued again with nothing held. (Preemption, swap-in and admission under pressure:
`test_preemption.py`, `test_generator.py`.)"""

from __future__ import annotations

import pytest
from batch_workloads import random_prompts, tiny_model

from hf_paged_cache.serving.generator import BatchGenerator

pytestmark = pytest.mark.usefixtures("one_thread")


def _generator(**options) -> tuple[BatchGenerator, list[int]]:
    generator = BatchGenerator(tiny_model("llama_gqa"), max_new_tokens=50, block_size=4, num_blocks=80,
                               prefix_caching=False, **options)  # fmt: skip
    return generator, [generator.add_request(prompt) for prompt in random_prompts((9, 7, 5), seed=3)]


def test_admission_stops_at_max_num_seqs_and_the_next_batch_holds_the_running():
    generator, ids = _generator(max_num_seqs=2)
    requests = generator.requests
    batch = requests.next_batch(0)
    assert [request.request_id for request, _q in batch] == ids[:2] and [q for _r, q in batch] == [9, 7]
    assert [request.request_id for request in requests.running] == ids[:2]
    assert [request.request_id for request in requests.waiting] == ids[2:] and requests.waiting[0].memory is None


def test_cancel_takes_a_request_out_of_any_queue_and_releases_its_memory():
    generator, ids = _generator(max_num_seqs=1)
    generator.step()
    requests, template = generator.requests, generator.template
    assert template.metrics().blocks_used > 0
    cancelled = requests.cancel(ids[0])
    assert cancelled.request_id == ids[0] and cancelled.memory is None and template.metrics().blocks_used == 0
    assert requests.cancel(ids[2]).request_id == ids[2] and requests.cancel(ids[2]) is None
    assert [request.request_id for request in requests.waiting] == [ids[1]] and requests.has_work()


def test_a_rolled_back_batch_is_queued_first_in_its_order_holding_nothing():
    generator, ids = _generator()
    requests = generator.requests
    batch = requests.next_batch(0)
    generator.step()  # the prompts are in the caches
    requests.roll_back(batch)
    assert not requests.running and [request.request_id for request in requests.waiting] == ids
    assert all(request.memory is None and request.fed == 0 for request in requests.waiting)
    assert generator.template.metrics().blocks_used == 0
