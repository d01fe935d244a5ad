"""Copies of hybrid models' recurrent / conv state at block boundaries of prompts, so a prefix hit can restore it.

A prefix hit gives a request the cached blocks of its prompt's first tokens; for an attention-only model that is all
it needs. A recurrent or conv layer instead carries one state along the whole sequence, which no block holds: to skip
a prefix, the request also needs the state as it was after that prefix. `StateCheckpoints` keeps such states, one
copy of a state-pool slot each, keyed by the prefix cache's chained key of the prefix they follow (so a key names
both the tokens and the position), within a byte budget: the least recently used is dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..sequence_state import StateTensor

Saved = dict[StateTensor, torch.Tensor]  # one sequence's state tensors, as `StatePool.saved` copies them


@dataclass
class CheckpointStats:
    taken: int = 0
    found: int = 0  # prefix lookups that found a state to start from
    dropped: int = 0  # to keep within the budget


class StateCheckpoints:
    """At most `max_bytes` of saved states, each `slot_bytes` (one slot of the state pool), LRU."""

    def __init__(self, max_bytes: int, slot_bytes: int):
        if slot_bytes < 1:
            raise ValueError("state checkpoints need a model with recurrent / conv state (`slot_bytes` > 0)")
        self.capacity = max_bytes // slot_bytes
        self.slot_bytes = slot_bytes
        self._saved: OrderedDict[bytes, Saved] = OrderedDict()
        self.stats = CheckpointStats()

    def __len__(self) -> int:
        return len(self._saved)

    def __contains__(self, key: bytes) -> bool:
        return key in self._saved

    @property
    def nbytes(self) -> int:
        """Bytes the saved states hold."""
        return len(self._saved) * self.slot_bytes

    def keep(self, key: bytes, saved: Saved) -> None:
        """Keep `saved`, the state after the prefix `key` names (a key kept already is only marked as used)."""
        if self.capacity == 0:
            return
        if key in self._saved:
            self._saved.move_to_end(key)
            return
        while len(self._saved) >= self.capacity:
            self._saved.popitem(last=False)
            self.stats.dropped += 1
        self._saved[key] = saved
        self.stats.taken += 1

    def restore(self, key: bytes) -> Saved | None:
        """The state saved after the prefix `key` names (marked as used), or None. Its tensors are shared: the
        caller copies them into a slot and never writes them."""
        saved = self._saved.get(key)
        if saved is not None:
            self._saved.move_to_end(key)
            self.stats.found += 1
        return saved

    def clear(self) -> None:
        self._saved.clear()
