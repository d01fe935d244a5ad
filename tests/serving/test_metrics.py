"""The generator's counters and the snapshot each step records."""

from __future__ import annotations

import dataclasses

from hf_paged_cache import CacheMetrics, SwapStats
from hf_paged_cache.memory.copy_stream import CopyStats
from hf_paged_cache.serving.metrics import BatchMetrics, ServingCounters
from hf_paged_cache.serving.prefix_cache import PrefixStats


def _cache_metrics(**values) -> CacheMetrics:
    fields = {field.name: 0 for field in dataclasses.fields(CacheMetrics)}
    return CacheMetrics(**{**fields, **values})


def test_preemptions_are_counted_per_mechanism_and_read_through_the_old_fields():
    counters = ServingCounters()
    counters.preempted["swap"] += 2
    counters.preempted["recompute"] += 1
    counters.finished, counters.admitted_prompt_tokens, counters.prefetched = 3, 40, 1
    prefix = PrefixStats()
    prefix.record(40, 16)
    metrics = counters.snapshot(4, 1.5, (2, 1, 1), 12, 16, _cache_metrics(blocks_used=3, blocks_total=10,
                                quantized_blocks_used=1, quantized_blocks_total=6), prefix,
                                SwapStats(out_blocks=5, out_bytes=50), CopyStats(), 0.25)  # fmt: skip
    assert metrics.preempted == {"swap": 2, "recompute": 1}
    assert (metrics.preempted_swap, metrics.preempted_recompute) == (2, 1)
    assert (metrics.running, metrics.waiting, metrics.stalled, metrics.finished) == (2, 1, 1, 3)
    assert (metrics.blocks_used, metrics.blocks_total, metrics.usage_ratio) == (4, 16, 0.25)
    assert metrics.batch_efficiency == 0.75 and metrics.prefix_hit_rate == 0.4 and metrics.swap_out_blocks == 5
    counters.preempted["swap"] += 1
    assert metrics.preempted_swap == 2  # a snapshot, not a view of the counters
    hash(metrics)


def test_a_snapshot_without_preemptions_or_a_prefix_cache_reads_zero():
    metrics = ServingCounters().snapshot(0, 0.0, (0, 0, 0), 0, 8, _cache_metrics(), None, SwapStats(), CopyStats(), 0.0)
    assert metrics == BatchMetrics(step=0, seconds=0.0, running=0, waiting=0, finished=0, tokens_scheduled=0,
                                   token_budget=8, blocks_used=0, blocks_total=0, kv_bytes=0, shared_blocks=0,
                                   prompt_tokens=0, prefix_hit_tokens=0, stalled=0)  # fmt: skip
    assert metrics.preempted_swap == metrics.preempted_recompute == 0 and metrics.usage_ratio == 0.0


def test_the_compute_rate_is_measured_tokens_per_second():
    counters = ServingCounters(forward_seconds=2.0, forward_tokens=100)
    assert counters.compute_rate == 50.0 and ServingCounters().compute_rate == 0.0


def test_a_flat_record_names_every_mechanism_and_the_ratios():
    metrics = ServingCounters().snapshot(0, 0.0, (1, 0, 0), 6, 8, _cache_metrics(blocks_used=1, blocks_total=4), None,
                                         SwapStats(), CopyStats(), 0.0)  # fmt: skip
    record = dataclasses.replace(metrics, preempted={"swap": 1, "spill": 2}).as_dict()
    assert (record["preempted_swap"], record["preempted_recompute"], record["preempted_spill"]) == (1, 0, 2)
    assert "preempted" not in record and record["running"] == 1
    assert (record["usage_ratio"], record["batch_efficiency"], record["prefix_hit_rate"]) == (0.25, 0.75, 0.0)
