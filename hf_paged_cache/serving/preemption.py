"""Who is preempted under memory pressure (victim policies) and how (preemption strategies).

A victim policy ranks running requests: the lowest priority is preempted first. A preemption strategy says
which mechanism frees a victim's blocks: `SWAP` (its blocks go to host memory and come back before it runs
again) or `RECOMPUTE` (they are dropped; it is queued again with its generated tokens as part of its prompt).
The generator applies the mechanism and counts preemptions by its name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PagedCache
from ..memory.swap import SwapSpace
from .recurrent import state_bytes
from .requests import Request

SWAP = "swap"
RECOMPUTE = "recompute"
# Host copy speed assumed before the first swap is measured (bytes/s); `Auto` compares it with the measured
# prefill speed.
DEFAULT_COPY_RATE = 4e9


# ---------------------------------------------------------------------- victims
class VictimPolicy:
    """Ranks running requests for preemption; `touch` records that a request was scheduled at `step`."""

    def priority(self, request: Request, step: int, pool_blocks: int) -> tuple[float, int]:
        """Higher is kept longer (the victim is the lowest); `pool_blocks`: blocks of every device pool."""
        raise NotImplementedError

    def touch(self, request: Request, step: int) -> None:
        request.last_step = step

    def victims(self, running: list[Request], step: int, pool_blocks: int) -> list[Request]:
        """`running` in preemption order: the first is preempted first."""
        return sorted(running, key=lambda request: self.priority(request, step, pool_blocks))


@dataclass(frozen=True)
class LRUVictims(VictimPolicy):
    """Least recently scheduled first; ties: the latest admitted."""

    def priority(self, request: Request, step: int, pool_blocks: int) -> tuple[float, int]:
        return request.last_step, -request.request_id


@dataclass(frozen=True)
class WeightedVictims(VictimPolicy):
    """The seeds' score: access frequency x time decay (steps it was scheduled in, each weighted `decay ** steps
    ago`) less `size_weight` x the share of the pool it holds -- cold requests and large ones (which free the
    most blocks per preemption) go first."""

    decay: float = 0.9
    size_weight: float = 1.0

    def __post_init__(self) -> None:
        check_weights(self.decay, self.size_weight)

    def priority(self, request: Request, step: int, pool_blocks: int) -> tuple[float, int]:
        hot = request.hotness * self.decay ** (step - request.last_step)
        share = request.cache.blocks.held_count() / max(pool_blocks, 1)
        return hot - self.size_weight * share, -request.request_id

    def touch(self, request: Request, step: int) -> None:
        request.hotness = request.hotness * self.decay ** (step - request.last_step) + 1.0
        super().touch(request, step)


def check_weights(decay: float, size_weight: float) -> None:
    if not 0.0 < decay <= 1.0 or size_weight < 0:
        raise ValueError(f"`decay` must be in (0, 1] and `size_weight` >= 0, got {decay!r} and {size_weight!r}")


# ---------------------------------------------------------------------- preemption
class Preemption:
    """Chooses the mechanism (`SWAP` or `RECOMPUTE`) that frees a victim's blocks."""

    def choose(self, request: Request, swap: SwapSpace, compute_rate: float) -> str:
        """`compute_rate`: the measured tokens per second of the packed forwards."""
        raise NotImplementedError

    def swap_space(self, template: PagedCache, device: torch.device) -> SwapSpace:
        """The host blocks its swaps go to (host pools are made at the first swap: unused ones cost nothing)."""
        return SwapSpace(template)


@dataclass(frozen=True)
class Recompute(Preemption):
    """Always drop the victim's blocks: it is computed again from its tokens (the prefix cache may recover some)."""

    def choose(self, request: Request, swap: SwapSpace, compute_rate: float) -> str:
        return RECOMPUTE


@dataclass(frozen=True)
class Swap(Preemption):
    """Swap the victim to host blocks (a hybrid model's recurrent state slot goes to host memory with them:
    `state_pool.py`); recompute it when the host pool cannot take them or it holds nothing.

    `blocks`: host blocks per device pool (None: as many as the device pool has); `compression`: a `quant` format
    for host copies of full-precision blocks; `copies`: when the copies run (`copy_stream.COPY_MODES`). These are
    `BatchConfig`'s `swap_blocks`, `swap_compression` and `swap_copies`.
    """

    blocks: int | None = None
    compression: str | None = None
    copies: str = "auto"

    def swap_space(self, template: PagedCache, device: torch.device) -> SwapSpace:
        if self.copies == "async" and device.type != "cuda":
            raise ValueError(f"`swap_copies='async'` needs a model on CUDA, this one is on {device}: use 'auto'")
        return SwapSpace(template, self.blocks, self.compression, self.copies)

    def choose(self, request: Request, swap: SwapSpace, compute_rate: float) -> str:
        return SWAP if self.can_swap(request, swap) else RECOMPUTE

    @staticmethod
    def can_swap(request: Request, swap: SwapSpace) -> bool:
        """The fall-back step: a request with nothing computed, or more blocks than the host pool has free, is
        recomputed instead."""
        return request.fed > 0 and swap.can_swap_out(request.cache)


@dataclass(frozen=True)
class Auto(Swap):
    """Swap or recompute, the cheaper by an estimate: bytes to copy both ways at the measured copy speed
    (`copy_rate` bytes/s before any copy was measured) against tokens to compute again at the measured speed."""

    copy_rate: float = DEFAULT_COPY_RATE

    def __post_init__(self) -> None:
        if not self.copy_rate > 0:
            raise ValueError(f"`copy_rate` must be a positive number of bytes per second, got {self.copy_rate!r}")

    def choose(self, request: Request, swap: SwapSpace, compute_rate: float) -> str:
        if not self.can_swap(request, swap):
            return RECOMPUTE
        stats, seconds = swap.stats, swap.copies.stats.copy_seconds
        copy_rate = (stats.out_bytes + stats.in_bytes) / seconds if seconds else self.copy_rate
        moved = swap.swap_bytes(request.cache) + state_bytes(request.cache)  # blocks, and a hybrid's state
        cheaper = 2 * moved / copy_rate < request.fed / compute_rate
        return SWAP if cheaper else RECOMPUTE
