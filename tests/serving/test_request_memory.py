"""`RequestMemory`: a request's blocks and state slot are taken, swapped and given back together."""

from __future__ import annotations

import torch
from test_state_pool import SLOTS, STATE, template

from hf_paged_cache import SwapSpace
from hf_paged_cache.serving.request_memory import RequestMemory
from hf_paged_cache.serving.state_pool import StatePool


def _filled(base):
    """A sibling of `base` whose attention layer holds 6 tokens (two blocks of 4)."""
    cache = base.sibling()
    keys = torch.randn(1, 2, 6, 8)
    cache.update(keys, keys.clone(), 1)
    return cache


def test_the_slot_and_the_blocks_move_together():
    base = template()
    pool, swap = StatePool(STATE, SLOTS, {0: torch.device("cpu")}), SwapSpace(base)
    memory = RequestMemory(_filled(base), pool)
    used = base.metrics().blocks_used
    memory.take_slot()
    assert pool.slot_of(memory.cache) is not None and pool.num_free == SLOTS - 1 and used == 2
    assert sum(memory.step_demand(3).values()) == 1  # the 9th token needs a third block
    memory.swap_out(swap)
    assert pool.num_free == SLOTS and base.metrics().blocks_used == 0
    assert sum(memory.swap_demand(swap).values()) == used  # what coming back takes
    memory.swap_in(swap)
    assert pool.slot_of(memory.cache) is not None and base.metrics().blocks_used == used
    memory.release()
    assert pool.num_free == SLOTS and base.metrics().blocks_used == 0 and memory.cache.get_seq_length() == 0


def test_a_request_without_a_slot_releases_its_blocks_alone():
    """A queued request's prefix hit holds blocks but no slot yet."""
    base = template()
    pool = StatePool(STATE, SLOTS, {0: torch.device("cpu")})
    memory = RequestMemory(_filled(base), pool)
    memory.release()
    assert pool.num_free == SLOTS and base.metrics().blocks_used == 0
