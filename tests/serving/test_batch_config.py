"""`BatchConfig`: strategies by name or as instances, every field checked with a clear error."""

from __future__ import annotations

import pytest
from batch_workloads import tiny_model

from hf_paged_cache.serving.batch_config import PREEMPTIONS, SCHEDULERS, VICTIM_POLICIES, BatchConfig
from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.serving.preemption import Auto, LRUVictims, Recompute, Swap, WeightedVictims
from hf_paged_cache.serving.scheduler import FIFO, DecodeFirst, Scheduler


def test_names_map_to_strategy_classes_with_the_defaults_of_today():
    config = BatchConfig()
    assert (config.preemption, config.victim_policy, config.scheduler) == ("auto", "lru", "decode_first")
    assert config.make_preemption() == Auto() and config.make_victims() == LRUVictims()
    assert isinstance(config.make_scheduler(), DecodeFirst)
    assert BatchConfig(preemption="swap").make_preemption() == Swap()
    assert BatchConfig(preemption="recompute").make_preemption() == Recompute()
    assert isinstance(BatchConfig(scheduler="fifo").make_scheduler(), FIFO)
    assert set(PREEMPTIONS) == {"auto", "swap", "recompute"} and set(VICTIM_POLICIES) == {"lru", "weighted"}
    assert set(SCHEDULERS) == {"decode_first", "fifo"}


def test_the_weighted_name_takes_the_decay_and_size_weight_fields():
    config = BatchConfig(victim_policy="weighted", decay=0.7, size_weight=2.0)
    assert config.make_victims() == WeightedVictims(decay=0.7, size_weight=2.0)


def test_instances_are_used_as_given():
    swap, victims, scheduler = Swap(), WeightedVictims(decay=0.8), FIFO()
    config = BatchConfig(preemption=swap, victim_policy=victims, scheduler=scheduler)
    assert config.make_preemption() is swap and config.make_victims() is victims
    assert config.make_scheduler() is scheduler


@pytest.mark.parametrize("field,value,match", [
    ("preemption", "drop", r"`preemption` must be one of \('auto', 'swap', 'recompute'\) or a `Preemption`"),
    ("victim_policy", "fifo", r"`victim_policy` must be one of \('lru', 'weighted'\) or a `VictimPolicy`"),
    ("scheduler", "sjf", r"`scheduler` must be one of \('decode_first', 'fifo'\) or a `Scheduler`"),
    ("scheduler", Scheduler, "got <class"),  # the class, not an instance
    ("preemption", ["swap"], "got \\['swap'\\]"),
    ("decay", 0.0, "decay"),
    ("size_weight", -1.0, "size_weight"),
    ("checkpoint_memory", -1, "`checkpoint_memory` must be positive"),
    ("checkpoint_memory", "lots", "`checkpoint_memory`='lots' is not a size"),
    ("checkpoint_memory", True, "`checkpoint_memory` must be a number of bytes"),
])  # fmt: skip
def test_bad_strategies_and_knobs_are_refused_clearly(field, value, match):
    with pytest.raises(ValueError, match=match):
        BatchConfig(**{field: value})


def test_the_swap_fields_go_to_the_swap_the_name_makes():
    config = BatchConfig(preemption="auto", swap_blocks=8, swap_compression="fp8", swap_copies="deferred")
    assert config.make_preemption() == Auto(blocks=8, compression="fp8", copies="deferred")
    assert BatchConfig(preemption="swap", swap_blocks=3).make_preemption() == Swap(blocks=3)


@pytest.mark.parametrize("options", [
    {"preemption": Swap(), "swap_compression": "fp8"},
    {"preemption": Recompute(), "swap_blocks": 4},
    {"victim_policy": WeightedVictims(), "decay": 0.5},
], ids=["swap", "recompute", "weighted"])  # fmt: skip
def test_knob_fields_with_a_strategy_instance_are_refused_not_ignored(options):
    with pytest.raises(ValueError, match="give them to it"):
        BatchConfig(**options)


def test_a_swap_instance_sizes_the_generators_host_space():
    generator = BatchGenerator(tiny_model("llama_gqa"), preemption=Swap(blocks=5, copies="deferred"))
    assert generator.swap.num_blocks == 5 and generator.swap.copies.mode == "deferred"
    with pytest.raises(ValueError, match="needs a model on CUDA"):
        BatchGenerator(tiny_model("llama_gqa"), preemption=Auto(copies="async"))


def test_checkpoint_memory_defaults_to_the_state_pools_bytes_and_zero_means_none():
    assert BatchConfig().checkpoint_bytes(4096) == 4096
    assert BatchConfig(checkpoint_memory="1KiB").checkpoint_bytes(4096) == 1024
    assert BatchConfig(checkpoint_memory=0).checkpoint_bytes(4096) == 0
