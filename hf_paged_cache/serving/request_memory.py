"""A running request's memory as one object: its cache (blocks of the template's pools) and, for a hybrid model, its
slot of recurrent state (`state_pool.py`). Whatever moves one moves the other -- the slot is taken when the request is
admitted, both are swapped out and in together, and both are given back when it finishes, is cancelled, dropped for
recompute or rolled back -- so the two never disagree."""

from __future__ import annotations

from ..blocks.pool import BlockPool
from ..cache import PagedCache
from ..memory.swap import SwapSpace
from .state_checkpoints import Saved
from .state_pool import StatePool


class RequestMemory:
    """`cache` (a sibling of the generator's template) and its slot in `states`, if it holds one."""

    def __init__(self, cache: PagedCache, states: StatePool):
        self.cache = cache
        self.states = states
        self.start: Saved | None = None  # the state after the cache's prefix hit, until the slot is taken

    def take_slot(self) -> None:
        """A state slot for a request that starts running (a fresh sequence, a recomputed one, or one continuing
        from the state saved after its prefix hit)."""
        self.states.attach(self.cache, self.start)
        self.start = None

    def step_demand(self, q: int) -> dict[BlockPool, int]:
        """Free blocks per pool a step of `q` tokens takes."""
        return self.cache.step_demand(q)

    def swap_demand(self, swap: SwapSpace) -> dict[BlockPool, int]:
        """Device blocks per pool a swap-in of this request takes."""
        return swap.in_demand(self.cache)

    def swap_out(self, swap: SwapSpace) -> None:
        """Blocks and state to host memory; the device blocks and the slot go back."""
        swap.swap_out(self.cache)
        self.states.swap_out(self.cache)

    def swap_in(self, swap: SwapSpace) -> None:
        """Blocks and state back to the device, into fresh blocks and a fresh slot."""
        swap.swap_in(self.cache)
        self.states.swap_in(self.cache)

    def release(self) -> None:
        """Every block (device or host) and the slot go back; also after a forward interrupted halfway, where some
        layers wrote and others not. Prefix-cached blocks stay findable until they are reused."""
        self.states.detach(self.cache)
        self.cache.reset()
