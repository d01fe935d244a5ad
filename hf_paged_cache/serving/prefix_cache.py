"""Prefix caching: full blocks found again by the tokens they hold, so a request computes only its uncached tail.

Each full block is keyed by a chained hash of every token up to its end (the block's own tokens and,
through its parent's key, all before them), so a key names both the contents and the position. An entry
remembers the block id and the pool's allocation epoch of that block (`BlockPool.epoch`): blocks stay in
the pool's free queue when no request holds them, and an entry is valid exactly as long as its block was
not handed out again. The free queue hands out the blocks freed longest ago first, so unreferenced cached
blocks are dropped least-recently-used, and only when the pool needs them — nothing is evicted eagerly.

Groups: full-attention groups need every block of the prefix; a sliding-window group needs only the blocks
its window still reads at the hit length. Quantized and evicting groups are not cached (their blocks'
contents depend on when they were sealed or compacted), so `PrefixCache.supports` says no for them.

Hybrid models: a hit also needs the recurrent / conv state after the prefix, which no block holds, so it is found
only where a state checkpoint was kept (`state_checkpoints.py`). A request keeps one at its marks
(`checkpoint_marks`): where its prompt's shared part ends -- the blocks already cached of it, or its common prefix
with the requests queued beside it; its per-request layers copy their state there inside the chunk
(`recurrent.StateCuts`). The attention block size stays as it is, so prompts of a few blocks get hits too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from ..blocks.pool import BlockPool
from ..blocks.renumbering import Renumbering
from ..cache import PagedCache
from ..sequence_state import SequenceState
from .recurrent import holds_state
from .state_checkpoints import Saved, StateCheckpoints


def block_keys(tokens: list[int], block_size: int, count: int, known: list[bytes] | None = None) -> list[bytes]:
    """Chained keys of the first `count` full blocks of `tokens`, continuing the `known` keys of its first blocks."""
    keys = list(known or [])
    for index in range(len(keys), count):
        chunk = array("q", tokens[index * block_size : (index + 1) * block_size]).tobytes()
        keys.append(hashlib.blake2b((keys[-1] if keys else b"") + chunk, digest_size=16).digest())
    return keys[:count]


@dataclass
class PrefixStats:
    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        """One admitted request's lookup (a scheduler records each request once, however often it attached)."""
        self.lookups += 1
        self.prompt_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PrefixCache:
    """Maps chained block keys to the blocks that hold them, per layer group of one family of caches."""

    def __init__(self, template: PagedCache, checkpoints: StateCheckpoints | None = None):
        """`checkpoints`: where a hybrid model's states after cached prefixes are kept (None for a model without
        recurrent state)."""
        self.block_size = template.options.block_size
        self.entries: dict[bytes, dict[str, tuple[int, int]]] = {}  # key -> {group: (block, epoch)}
        self.checkpoints = checkpoints
        self.stats = PrefixStats()

    @staticmethod
    def supports(cache: PagedCache, state: SequenceState) -> bool:
        """Whether every group of `cache` can be cached (full precision, no eviction), and a hit can restore whatever
        else a sequence holds: a hybrid model's `state` is its slot's tensors alone (not a layer's own K/V, as
        Falcon-H1's), and its prompts may be cut where a checkpoint is kept (not Mamba-1's, computed whole)."""
        if cache.evictor is not None or cache.blocks.stores_sealed():
            return False
        return not holds_state(cache) or state.checkpointable(cache.model_config.model_type)

    # ------------------------------------------------------------------ lookup
    def attach(self, cache: PagedCache, prompt: list[int]) -> tuple[int, Saved | None]:
        """Give the fresh `cache` the longest cached prefix of `prompt` (whole blocks, at least one prompt token
        left to compute; for a hybrid model, one after which a state was kept). Returns its length in tokens (0:
        nothing cached) and the state to start the rest from (None for a model without one, or no hit)."""
        keys = block_keys(prompt, self.block_size, (len(prompt) - 1) // self.block_size)
        for count in range(len(keys), 0, -1):
            if self.checkpoints is not None and keys[count - 1] not in self.checkpoints:
                continue
            found = self._found(cache, keys, count)
            if found is not None:
                cache.blocks.attach_prefix(found, count * self.block_size)
                state = self.checkpoints.restore(keys[count - 1]) if self.checkpoints is not None else None
                return count * self.block_size, state
        return 0, None

    def checkpoint_marks(self, cache: PagedCache, prompt: list[int], hit: int,
                         neighbours: Iterable[list[int]]) -> list[int]:  # fmt: skip
        """Where a hybrid model's request of `prompt` (a fresh `cache` given a `hit`) keeps its state, in ascending
        order: where its shared part ends, as the end of its blocks already cached and of its common prefix with each
        of `neighbours` (the prompts queued or running beside it), in whole blocks before its last token; empty
        without checkpoints. Not at every prompt's end: that would cut every prompt, and each cut piece costs a
        mixer call of its own (docs/BENCHMARKS.md)."""
        if self.checkpoints is None:
            return []
        bs, last = self.block_size, (len(prompt) - 1) // self.block_size
        keys = block_keys(prompt, bs, last)
        cached = next((count for count in range(last, hit // bs, -1) if self._found(cache, keys, count)), 0)
        shared = [_common_blocks(prompt, other, bs, last) for other in neighbours]
        return sorted({count * bs for count in (cached, *shared) if count * bs > hit})

    def computed_by_others(self, prompt: list[int], hit: int, others: list[tuple[list[int], int, list[int]]]) -> bool:
        """Whether another running sequence (its tokens, how many of them its cache holds, its checkpoint marks) has
        yet to compute what the `hit` tokens a fresh cache found of `prompt` would continue with: the block after
        them, or for a hybrid model a checkpoint beyond them. Waiting until it has, the prompt finds that too,
        instead of computing it a second time (a prompt's first chunk and its siblings' admitted in the same step
        would all compute their shared prefix)."""
        if self.checkpoints is not None:
            return any(hit < mark < len(prompt) and fed < mark and tokens[:mark] == prompt[:mark]
                       for tokens, fed, marks in others for mark in marks)  # fmt: skip
        end = hit + self.block_size
        if end >= len(prompt):  # a hit leaves at least one token to compute: no further block to find
            return False
        return any(fed < end <= len(tokens) and tokens[:end] == prompt[:end] for tokens, fed, _marks in others)

    def _found(self, cache: PagedCache, keys: list[bytes], count: int) -> dict[str, tuple[int, list[int]]] | None:
        """Per group of `cache`, what a row needs to hold the first `count` blocks of `keys`; None if one is missing."""
        firsts = cache.blocks.prefix_reads_from(count * self.block_size)
        found = {}
        for name, pool in cache.blocks.group_pools().items():
            found[name] = self._blocks(name, pool, firsts[name], keys[:count])
            if found[name] is None:
                return None
        return found

    def _blocks(self, name: str, pool: BlockPool, first: int, keys: list[bytes]) -> tuple[int, list[int]] | None:
        """(base position, block ids) a row of group `name` (whose blocks are of `pool`) needs to hold the blocks of
        `keys` from its block `first` on (0 without a window), or None."""
        blocks = []
        for key in keys[first:]:
            block, epoch = self.entries.get(key, {}).get(name, (None, None))
            if block is None or pool.epoch(block) != epoch:
                return None
            blocks.append(block)
        return first * self.block_size, blocks

    # ------------------------------------------------------------------ registration
    def register(self, cache: PagedCache, tokens: list[int], keys: list[bytes]) -> list[bytes]:
        """Record the full blocks `cache` (one row) holds of `tokens` (the tokens fed to it so far); `keys` are
        the keys computed at the previous call. Returns the keys of every full block, for the next call."""
        bs = self.block_size
        full = len(tokens) // bs
        if len(keys) == full:
            return keys
        done, keys = len(keys), block_keys(tokens, bs, full, keys)
        pools = cache.blocks.group_pools()
        if len(self.entries) > 4 * sum(pool.num_blocks for pool in pools.values()):
            self._prune(pools)
        for name, (first, ids) in cache.blocks.full_blocks().items():
            pool = pools[name]  # a sliding group's row starts at its first block still in the window (`first`)
            for index in range(max(done, first), full):
                block = ids[index - first]
                entry = self.entries.setdefault(keys[index], {})
                known = entry.get(name)
                if known is None or pool.epoch(known[0]) != known[1]:
                    entry[name] = (block, pool.epoch(block))
        return keys

    def _prune(self, pools: dict[str, BlockPool]) -> None:
        """Forget entries whose blocks were handed out again (kept bounded by the pools' size); `pools`: each group's,
        by name."""
        for key in list(self.entries):
            entry = {name: (block, epoch) for name, (block, epoch) in self.entries[key].items()
                     if pools[name].epoch(block) == epoch}  # fmt: skip
            if entry:
                self.entries[key] = entry
            else:
                del self.entries[key]

    def keep_state(self, keys: list[bytes], fed: int, saved: Saved) -> None:
        """Keep a hybrid model's state `saved` after the first `fed` tokens (a whole number of the blocks `keys`)."""
        self.checkpoints.keep(keys[fed // self.block_size - 1], saved)

    def clear(self) -> None:
        """Forget every cached prefix: later prompts compute theirs again. Blocks stay with whoever holds them, and
        a running sequence registers only the blocks it completes from now on."""
        self.entries.clear()
        if self.checkpoints is not None:
            self.checkpoints.clear()

    # ------------------------------------------------------------------ state
    def remap(self, old_to_new: Renumbering, pools: dict[str, BlockPool]) -> None:
        """Renumber the entries after the groups' `pools` (the template's, by group name) were packed, ahead of the
        pools' remap: entries on blocks handed out again, or on blocks no table holds, are forgotten."""
        entries = {}
        for key, entry in self.entries.items():
            kept = {}
            for name, (block, epoch) in entry.items():
                pool = pools[name]
                if pool.epoch(block) == epoch and block in old_to_new[pool]:
                    new = old_to_new[pool][block]
                    kept[name] = (new, pool.remapped_epoch(new))
            if kept:
                entries[key] = kept
        self.entries = entries


def _common_blocks(prompt: list[int], other: list[int], block_size: int, most: int) -> int:
    """Full blocks `prompt` and `other` begin with alike, at most `most` (a binary search on slices: C-speed)."""
    low, high = 0, min(most, len(other) // block_size)
    while low < high:
        middle = (low + high + 1) // 2
        if prompt[: middle * block_size] == other[: middle * block_size]:
            low = middle
        else:
            high = middle - 1
    return low
