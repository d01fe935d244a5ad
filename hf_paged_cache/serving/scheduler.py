"""What runs at a step: the order running requests get the token budget in (`Scheduler`), and whether a step's
blocks fit the pools (`BlockRoom`).

A scheduler's order is also the preemption order within a step: when a request's step does not fit, the
requests at the end of the order that are not scheduled yet are preempted first.
"""

from __future__ import annotations

from collections.abc import Callable

from ..blocks.pool import BlockPool
from ..cache import PagedCache
from .requests import Request

Priority = Callable[[Request], tuple]


class Scheduler:
    """The hook that orders the running requests of a step (new requests are admitted after them, in arrival
    order)."""

    def order(self, running: list[Request], priority: Priority) -> list[Request]:
        """`running` in the order they get this step's tokens; `priority` is the victim policy's (higher: kept
        longer)."""
        raise NotImplementedError


class DecodeFirst(Scheduler):
    """Decode tokens before prompt chunks, each by the victim policy's priority (the default)."""

    def order(self, running: list[Request], priority: Priority) -> list[Request]:
        return sorted(running, key=lambda request: (request.pending == 1, priority(request)), reverse=True)


class FIFO(Scheduler):
    """First come, first served: the earliest request first, so the latest arrived is preempted first."""

    def order(self, running: list[Request], priority: Priority) -> list[Request]:
        return sorted(running, key=lambda request: request.request_id)


class BlockRoom:
    """Whether a step's blocks fit the pools of one family of caches, with a block of headroom per running
    request (so admitting one cannot starve those already running) and under `threshold` (a share of a pool:
    `BatchConfig.swap_threshold`)."""

    def __init__(self, template: PagedCache, threshold: float | None):
        self.template = template
        self.growable = template.options.growable
        self.threshold = threshold

    def pools(self) -> list[BlockPool]:
        return [pool for pool, _kind in self.template.blocks.pools()]

    def total_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools())

    def below_threshold(self, demand: dict[BlockPool, int], idle: bool) -> bool:
        """Whether every pool stays at or below the threshold after taking `demand` (always without one, and
        when nothing runs, `idle`: an idle generator takes whatever fits)."""
        if self.threshold is None or idle:
            return True
        return all(pool.num_used + demand.get(pool, 0) <= self.threshold * pool.num_blocks for pool in self.pools())

    def fits(self, demand: dict[BlockPool, int], taken: dict[BlockPool, int], headroom: int) -> bool:
        """Whether the pools hold `demand` besides what this step already took (and `headroom` blocks more);
        if so, `demand` is added to `taken`."""
        if self.growable:
            return True
        if any(pool.num_free - taken.get(pool, 0) - headroom < need for pool, need in demand.items() if need):
            return False
        for pool, need in demand.items():
            taken[pool] = taken.get(pool, 0) + need
        return True

    def largest_chunk(self, cache: PagedCache, most: int, taken: dict[BlockPool, int]) -> int:
        """The most tokens (at most `most`, 0 if not even one) whose step of `cache` fits, recorded in `taken`."""
        low, high = 0, most
        while low < high:
            middle = (low + high + 1) // 2
            if self.fits(cache.step_demand(middle), dict(taken), headroom=0):
                low = middle
            else:
                high = middle - 1
        if low:
            self.fits(cache.step_demand(low), taken, headroom=0)
        return low
