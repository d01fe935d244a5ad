"""What the batch generator counts, and the snapshot of it taken after every step (`BatchGenerator.history`).

Preemptions are counted per mechanism name (`preemption.SWAP`, `RECOMPUTE`), whichever strategy chose it, so a
new strategy needs no field of its own; `preempted_swap` / `preempted_recompute` read the two counts.
"""

from __future__ import annotations

import warnings

from collections import Counter
from dataclasses import dataclass, field

from ..accounting import CacheMetrics
from ..memory.copy_stream import CopyStats
from ..memory.swap import SwapStats
from .prefix_cache import PrefixStats


@dataclass(frozen=True)
class BatchMetrics:
    """A snapshot of the generator after a step; `BatchGenerator.history` keeps one per step (a time series)."""

    step: int
    seconds: float
    running: int
    waiting: int
    finished: int
    tokens_scheduled: int  # tokens this step computed
    token_budget: int
    blocks_used: int  # over every pool of the family
    blocks_total: int
    kv_bytes: int  # bytes of the blocks in use (every pool of the family)
    shared_blocks: int
    prompt_tokens: int  # of the requests admitted so far (cached or computed)
    prefix_hit_tokens: int
    stalled: int  # requests waiting for blocks: swapped out, or running but not scheduled this step
    preempted: dict[str, int] = field(default_factory=dict, hash=False)  # preemptions so far, by mechanism
    swap_out_blocks: int = 0  # swap traffic so far, each way
    swap_out_bytes: int = 0
    swap_in_blocks: int = 0
    swap_in_bytes: int = 0
    swap_stall_seconds: float = 0.0  # time the host or the compute stream waited for swap copies so far
    swap_copy_seconds: float = 0.0  # time the swap copies took so far (overlapped with compute or not)
    swap_prefetched: int = 0  # swap-ins copied while a forward they were not part of ran (a step ahead)
    recomputed_tokens: int = 0  # tokens computed again after recompute preemptions (prefix hits excluded)
    fragmentation: float = 0.0  # the largest share of free ids below a pool's highest block in use
    defragmentations: int = 0  # so far (`BatchGenerator.defragment`)
    state_bytes: int = 0  # running requests' recurrent state outside the blocks (hybrid models: `recurrent.py`)
    state_slots: int = 0  # slots of the state pool (`state_pool.py`): one per request that may run at once
    state_pool_bytes: int = 0  # bytes the state pool allocated up front (0 for a model without recurrent state)
    state_checkpoints: int = 0  # states kept after cached prefixes (hybrid models' prefix caching)
    state_checkpoint_bytes: int = 0
    packed_weight_bytes: int = 0  # the linear weights' packed copies (`BatchConfig(prepack_weights=True)`)

    @property
    def preempted_swap(self) -> int:
        return self.preempted.get("swap", 0)

    @property
    def preempted_recompute(self) -> int:
        return self.preempted.get("recompute", 0)

    @property
    def usage_ratio(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    def as_dict(self) -> dict:
        """One flat record (a row of a table of `BatchGenerator.history`): the fields, each mechanism's preemptions
        as `preempted_<mechanism>` (swap and recompute always), and the derived ratios."""
        record = {name: value for name, value in vars(self).items() if name != "preempted"}
        counts = {"swap": 0, "recompute": 0, **self.preempted}
        record.update({f"preempted_{mechanism}": count for mechanism, count in counts.items()})
        return {**record, "usage_ratio": self.usage_ratio, "batch_efficiency": self.batch_efficiency,
                "prefix_hit_rate": self.prefix_hit_rate}  # fmt: skip

    @property
    def batch_efficiency(self) -> float:
        """Tokens computed per token of budget."""
        return self.tokens_scheduled / self.token_budget

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def compactions(self) -> int:
        """Deprecated: `defragmentations` (in this library, "compact" is what eviction does to a row)."""
        warnings.warn("`BatchMetrics.compactions` is `defragmentations`", FutureWarning, stacklevel=2)
        return self.defragmentations


@dataclass
class ServingCounters:
    """The generator's running totals (the queues' lengths and the pools' use are read when a snapshot is taken)."""

    preempted: Counter = field(default_factory=Counter)  # mechanism name -> preemptions
    prefetched: int = 0  # swap-ins started while a forward they were not part of ran
    recomputed_tokens: int = 0
    defragmentations: int = 0
    finished: int = 0
    admitted_prompt_tokens: int = 0
    forward_seconds: float = 0.0  # time in packed forwards and sampling
    forward_tokens: int = 0

    @property
    def compute_rate(self) -> float:
        """Measured tokens per second of the packed forwards (prefill and decode together)."""
        return self.forward_tokens / max(self.forward_seconds, 1e-9)

    def snapshot(self, step: int, seconds: float, queues: tuple[int, int, int], scheduled: int, budget: int,
                 cache: CacheMetrics, prefix: PrefixStats | None, swap: SwapStats, copies: CopyStats,
                 holes: float, state: tuple[int, int, int] = (0, 0, 0), checkpoints: tuple[int, int] = (0, 0),
                 packed_weight_bytes: int = 0) -> BatchMetrics:  # fmt: skip
        """The metrics after a step that computed `scheduled` tokens; `queues`: running, waiting and stalled
        requests (swapped out, or running but not scheduled); `state`: the running requests' recurrent state bytes,
        the state pool's slots and its bytes; `checkpoints`: states kept for prefix hits and their bytes;
        `packed_weight_bytes`: what packed weights hold."""
        running, waiting, stalled = queues
        state_bytes, state_slots, state_pool_bytes = state
        return BatchMetrics(
            step=step, seconds=seconds, running=running, waiting=waiting, finished=self.finished,
            tokens_scheduled=scheduled, token_budget=budget,
            blocks_used=cache.blocks_used + cache.quantized_blocks_used,
            blocks_total=cache.blocks_total + cache.quantized_blocks_total, kv_bytes=cache.used_bytes,
            shared_blocks=cache.shared_blocks, prompt_tokens=self.admitted_prompt_tokens,
            prefix_hit_tokens=prefix.hit_tokens if prefix is not None else 0, stalled=stalled,
            preempted=dict(self.preempted), swap_out_blocks=swap.out_blocks, swap_out_bytes=swap.out_bytes,
            swap_in_blocks=swap.in_blocks, swap_in_bytes=swap.in_bytes, swap_stall_seconds=copies.stall_seconds,
            swap_copy_seconds=copies.copy_seconds, swap_prefetched=self.prefetched,
            recomputed_tokens=self.recomputed_tokens, fragmentation=holes, defragmentations=self.defragmentations,
            state_bytes=state_bytes, state_slots=state_slots, state_pool_bytes=state_pool_bytes,
            state_checkpoints=checkpoints[0], state_checkpoint_bytes=checkpoints[1],
            packed_weight_bytes=packed_weight_bytes,
        )  # fmt: skip
