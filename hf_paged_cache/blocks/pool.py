"""The block allocator: block ids, a free-block queue and reference counts — nothing else.

Storage tensors live in the cache layers; this class only decides which block ids are in use.

Invariants (checked by the hypothesis state machine in `tests/blocks/test_pool.py`):
- ids run from 1 to `num_blocks`; id 0 is the null block (always zeros, never handed out) and doubles
  as the sentinel node of the free queue;
- a block is in the free queue exactly when its reference count is 0;
- `num_used + num_free == num_blocks` after every call;
- every call either succeeds completely or raises before changing anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import OutOfBlocksError

NULL_BLOCK = 0
GROWTH = 1.25  # a growable pool grows to this many times the blocks in use (storage included)


def grown_size(in_use: int) -> int:
    """Blocks a growable pool holds after growing to fit `in_use` blocks: room for 1.25x them, counting the
    null block every layer's storage adds, so storage is at most 1.25x the blocks in use right after a
    growth (doubling, as vectors do, held up to 2x). Geometric, so a long generation grows O(log n) times."""
    return max(in_use, int(GROWTH * in_use) - 1)


class BlockPool:
    """Free-block queue (a doubly linked list over block ids, O(1) pop / remove / append) plus ref counts.

    Freed blocks go to the tail, so the head holds the blocks freed longest ago. `allocate` prefers
    the block right after a given one when it is free, so a row's blocks form contiguous runs that
    readers can view without copying. A `growable` pool grows when a reservation does not fit (to
    `grown_size` of the blocks then in use); a fixed one raises `OutOfBlocksError` (`reserve`).
    """

    def __init__(self, num_blocks: int, growable: bool = False):
        _check_count(num_blocks, "num_blocks")
        self.growable = growable
        self.num_blocks = 0
        self.num_free = 0
        # Node 0 is the sentinel: _next[0] is the queue's head, _prev[0] its tail.
        self._next = [NULL_BLOCK]
        self._prev = [NULL_BLOCK]
        self._ref = [1]  # the null block is permanently "in use"
        self._epoch = [0]  # per block, how many times it was allocated: tells a reused id from the block it was
        self.grow(num_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def ref_counts(self) -> tuple[int, ...]:
        """Every block's reference count, index = block id (the null block's is always 1)."""
        return tuple(self._ref)

    def used_ids(self) -> list[int]:
        """The blocks some table references, in id order."""
        return [block for block in range(1, self.num_blocks + 1) if self._ref[block]]

    def free_ids(self) -> list[int]:
        """The free queue, head (freed longest ago) first (a broken queue shows as more ids than the pool has)."""
        ids, block = [], self._next[NULL_BLOCK]
        while block != NULL_BLOCK and len(ids) <= self.num_blocks:
            ids.append(block)
            block = self._next[block]
        return ids

    def epoch(self, block: int) -> int:
        """How many times `block` was allocated: a block id with the same epoch still holds the same contents'
        lifetime (it was not freed and handed out again in between)."""
        return self._epoch[block]

    def is_free(self, block: int) -> bool:
        return 0 < block <= self.num_blocks and self._ref[block] == 0

    def sharing(self) -> tuple[int, int]:
        """(blocks held by more than one table, references beyond the first summed over them): the second figure
        is the blocks that sharing saves."""
        shared = [count for count in self._ref[1:] if count > 1]
        return len(shared), sum(shared) - len(shared)

    def shortfall(self, count: int, freed: int = 0) -> int:
        """Blocks missing for `count` allocations once `freed` blocks came back (0: they fit as the pool is)."""
        return max(count - self.num_free - freed, 0)

    def check_reserve(self, count: int, *, group: str, block_size: int, freed: int = 0) -> int:
        """The blocks `reserve` would add, changing nothing: 0 when the blocks fit, else the growth of a growable
        pool; a fixed pool that is short raises `OutOfBlocksError` naming `group`."""
        if not self.shortfall(count, freed):
            return 0
        if not self.growable:
            raise OutOfBlocksError(group, count, self.num_free + freed, self.num_blocks, block_size)
        return grown_size(self.num_used - freed + count) - self.num_blocks

    def reserve(self, count: int, *, group: str, block_size: int, freed: int = 0) -> None:
        """Make room for `count` allocations (after `freed` blocks come back): the one grow-or-raise rule."""
        self.grow(self.check_reserve(count, group=group, block_size=block_size, freed=freed))

    def grow(self, extra_blocks: int) -> None:
        """Append `extra_blocks` (>= 0) new free ids at the end of the id range (and of the free queue)."""
        _check_count(extra_blocks, "extra_blocks")
        first = self.num_blocks + 1
        self._next.extend([NULL_BLOCK] * extra_blocks)
        self._prev.extend([NULL_BLOCK] * extra_blocks)
        self._ref.extend([0] * extra_blocks)
        self._epoch.extend([0] * extra_blocks)
        self.num_blocks += extra_blocks
        for block in range(first, self.num_blocks + 1):
            self._append(block)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """Take `count` free blocks (ref count 1), continuing the run that ends at `after` where possible."""
        if count > self.num_free:
            raise ValueError(f"asked for {count} blocks but only {self.num_free} are free")
        blocks = []
        previous = after
        for _ in range(count):
            candidate = previous + 1 if previous is not None else NULL_BLOCK
            block = candidate if self.is_free(candidate) else self._next[NULL_BLOCK]
            self._remove(block)
            self._ref[block] = 1
            self._epoch[block] += 1
            blocks.append(block)
            previous = block
        return blocks

    def allocate_runs(self, counts: list[int]) -> list[list[int]]:
        """Take one run of consecutive blocks per count, spread with equal gaps over the longest free stretch.

        Rows of a batch grow together, one block each every `block_size` steps; packed end to end, each
        row's next block would be the next row's first and their runs would interleave. The gaps let every
        run grow in place; a stretch that follows a block in use (maybe the end of another run) keeps a gap
        before the first run too. Counts that do not fit the stretch together come from `allocate`.
        """
        if sum(counts) > self.num_free:
            raise ValueError(f"asked for {sum(counts)} blocks but only {self.num_free} are free")
        if not counts:
            return []
        start, length = self._longest_free_stretch()  # O(num_blocks): only when some run starts
        if length < sum(counts):
            return [self.allocate(count) for count in counts]
        gap = (length - sum(counts)) // (len(counts) + (start > 1))
        start += gap if start > 1 else 0
        runs = []
        for count in counts:
            runs.append(list(range(start, start + count)))
            start += count + gap
        for block in (block for run in runs for block in run):
            self._remove(block)
            self._ref[block] = 1
            self._epoch[block] += 1
        return runs

    def _longest_free_stretch(self) -> tuple[int, int]:
        """(first id, length) of the longest stretch of consecutive free ids (the first such one)."""
        best, run_start = (1, 0), None
        for block in range(1, self.num_blocks + 2):
            if block <= self.num_blocks and self._ref[block] == 0:
                run_start = block if run_start is None else run_start
            elif run_start is not None:
                best = max(best, (run_start, block - run_start), key=lambda stretch: stretch[1])
                run_start = None
        return best

    def fork(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block (a second table now points at it)."""
        blocks = list(blocks)
        for block in blocks:
            if not 0 < block <= self.num_blocks or self._ref[block] == 0:
                raise ValueError(f"cannot fork block {block}: it is not allocated")
        for block in blocks:
            self._ref[block] += 1

    def take(self, block: int) -> None:
        """One more reference to `block`, which may be free: a prefix-cached block that no table holds any more
        leaves the free queue with its contents (and epoch) intact."""
        if not 0 < block <= self.num_blocks:
            raise ValueError(f"cannot take block {block}: the pool has blocks 1 to {self.num_blocks}")
        if self._ref[block] == 0:
            self._remove(block)
        self._ref[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block; blocks whose count reaches 0 return to the queue's tail."""
        blocks = list(blocks)
        drops: dict[int, int] = {}
        for block in blocks:
            drops[block] = drops.get(block, 0) + 1
        for block, count in drops.items():
            if not 0 < block <= self.num_blocks or self._ref[block] < count:
                raise ValueError(f"cannot free block {block}: it holds fewer than {count} references")
        for block in blocks:
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._append(block)

    def set_references(self, references: Mapping[int, int]) -> None:
        """Make every block's reference count `references.get(block, 0)` (a copy of one cache of a family keeps
        only that cache's references; the blocks of the others become free)."""
        for block in range(1, self.num_blocks + 1):
            count = references.get(block, 0)
            if count and not self._ref[block]:
                self._remove(block)
            elif not count and self._ref[block]:
                self._append(block)
            self._ref[block] = count

    def remap(self, mapping: Mapping[int, int]) -> None:
        """Move every referenced block to `mapping[block]` (a one-to-one map of all of them; pool compaction, which
        moves the contents). Every id starts a new lifetime (its epoch is bumped), so records of the old ids stop
        matching; the free queue is rebuilt in id order, low ids first."""
        used = self.used_ids()
        targets = [mapping[block] for block in used if block in mapping]
        distinct = len(set(targets)) == len(used) and all(0 < target <= self.num_blocks for target in targets)
        if sorted(mapping) != used or not distinct:
            raise ValueError("a remap must move every referenced block, and only those, to distinct ids of the pool")
        references = {target: self._ref[block] for block, target in zip(used, targets)}
        self._next[NULL_BLOCK] = self._prev[NULL_BLOCK] = NULL_BLOCK
        self.num_free = 0
        for block in range(1, self.num_blocks + 1):
            self._ref[block] = references.get(block, 0)
            self._epoch[block] += 1
            if not self._ref[block]:
                self._append(block)

    def front_renumbering(self) -> dict[int, int]:
        """The `remap` that moves the blocks in use to ids 1..n, in id order (consecutive ids stay consecutive)."""
        return {block: new for new, block in enumerate(self.used_ids(), start=1)}

    def remapped_epoch(self, block: int) -> int:
        """The epoch `block` has once the next `remap` started its new lifetime: what a record renumbered ahead
        of that remap stores."""
        return self._epoch[block] + 1

    def shrink(self, num_blocks: int) -> None:
        """Drop the ids above `num_blocks`, which must all be free (compact the pool first)."""
        valid = not isinstance(num_blocks, bool) and isinstance(num_blocks, int) and 0 <= num_blocks <= self.num_blocks
        if not valid or any(self._ref[block] for block in range(num_blocks + 1, self.num_blocks + 1)):
            raise ValueError(
                f"cannot shrink the pool to {num_blocks} blocks: it has {self.num_blocks}, and blocks above "
                f"{num_blocks} must be free (compact it first; {self.num_used} blocks are in use)"
            )
        for block in range(num_blocks + 1, self.num_blocks + 1):
            self._remove(block)
        del self._next[num_blocks + 1 :], self._prev[num_blocks + 1 :], self._ref[num_blocks + 1 :]
        del self._epoch[num_blocks + 1 :]
        self.num_blocks = num_blocks

    def _append(self, block: int) -> None:
        tail = self._prev[NULL_BLOCK]
        self._next[tail] = block
        self._prev[block] = tail
        self._next[block] = NULL_BLOCK
        self._prev[NULL_BLOCK] = block
        self.num_free += 1

    def _remove(self, block: int) -> None:
        previous, following = self._prev[block], self._next[block]
        self._next[previous] = following
        self._prev[following] = previous
        self.num_free -= 1


def _check_count(value: int, name: str) -> None:
    """Block counts are ints >= 0 (an empty pool is grown before use); `grow` never shrinks a pool (`shrink` does)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be an int >= 0 (a pool never shrinks), got {value!r}")
