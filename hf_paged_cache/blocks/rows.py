"""One sequence's state in a layer group: `Row`, and the `BlockList` both of its block tables use.

A row owns its tables, as a nano-vLLM sequence does: the full-precision blocks, the sealed quantized blocks
that precede them (quantized groups only), its left padding, the logical position its blocks start at, and
what eviction left of it. Everything that edits a list of block ids against a `BlockPool` -- drop from the
front, truncate, free all, fork, continue a contiguous run -- is `BlockList`, so the full-precision and the
quantized tables share one implementation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .pool import BlockPool


@dataclass
class BlockList:
    """Block ids of one table, in order, in `pool`; `run_from` is the index from which the ids are
    consecutive, so a read that starts there is a view of the storage rather than a copy."""

    pool: BlockPool
    ids: list[int] = field(default_factory=list)
    run_from: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def one_run_start(self) -> int | None:
        """The first id when all the ids form one run of consecutive ids, else None."""
        return self.ids[0] if self.ids and self.run_from == 0 else None

    def slots(self, first: int, count: int, block_size: int) -> torch.Tensor:
        """Slots of tokens [first, first + count) of the list's blocks (`block_size` each): one range per run of
        consecutive ids they lie in (a step's few new tokens: one range, built at the cost of a single op)."""
        ids, ranges, position, stop = self.ids, [], first, first + count
        while position < stop:
            block = end = position // block_size
            while (end + 1) * block_size < stop and ids[end + 1] == ids[end] + 1:  # the run goes on
                end += 1
            last = min(stop, (end + 1) * block_size)
            begin = ids[block] * block_size + position % block_size
            ranges.append(torch.arange(begin, begin + last - position))
            position = last
        if len(ranges) == 1:
            return ranges[0]
        return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.long)

    def extend(self, count: int) -> list[int]:
        """Allocate `count` blocks at the end, continuing the run where the pool allows."""
        fresh = self.pool.allocate(count, after=self.ids[-1] if self.ids else None)
        self.append_fresh(fresh)
        return fresh

    def can_continue(self) -> bool:
        """Whether the block after the last one is free (an empty list starts anywhere: no)."""
        return bool(self.ids) and self.pool.is_free(self.ids[-1] + 1)

    def append_fresh(self, fresh: list[int]) -> None:
        """Append blocks allocated for this table (reference already taken), marking where the run breaks."""
        first = len(self.ids)
        self.ids.extend(fresh)
        for index in range(max(first, 1), len(self.ids)):  # the run may break inside `fresh` too
            if self.ids[index] != self.ids[index - 1] + 1:
                self.run_from = index

    def replace_last(self) -> tuple[int, int]:
        """Copy-on-write of the last block: a fresh block takes its place (the caller copies the contents);
        returns (old id, new id)."""
        old = self.ids[-1]
        (new,) = self.pool.allocate(1, after=self.ids[-2] if len(self.ids) > 1 else None)
        self.pool.free([old])
        self.ids[-1] = new
        if len(self.ids) > 1 and new != self.ids[-2] + 1:
            self.run_from = len(self.ids) - 1
        return old, new

    def drop_front(self, count: int) -> None:
        self.pool.free(self.ids[:count])
        del self.ids[:count]
        self.run_from = max(self.run_from - count, 0)

    def truncate(self, keep: int) -> None:
        """Free every block after the first `keep`."""
        self.pool.free(self.ids[keep:])
        del self.ids[keep:]
        self.run_from = min(self.run_from, max(len(self.ids) - 1, 0))

    def free_all(self) -> None:
        self.truncate(0)

    def fork(self) -> BlockList:
        """A second table holding the same blocks (one more reference each)."""
        self.pool.fork(self.ids)
        return BlockList(self.pool, list(self.ids), self.run_from)

    def replace(self, ids: list[int]) -> None:
        """Take `ids` (already referenced for this table) as the table; the run is recomputed."""
        self.ids = ids
        self.run_from = max((i for i in range(1, len(ids)) if ids[i] != ids[i - 1] + 1), default=0)

    def append_shared(self, block: int, fresh: bool) -> None:
        """Append `block`: a fresh allocation (already referenced) or one more reference to a shared one."""
        if not fresh:
            self.pool.fork([block])
        self.ids.append(block)

    def remap(self, old_to_new: Mapping[int, int], keep_runs: bool = True) -> None:
        """The same blocks under the ids a packed pool gives them (consecutive ids stay consecutive). `keep_runs`
        keeps `run_from`, so reads take the path they took before (a view or a gather, which round differently) and
        the packing changes no result; otherwise the runs the new ids form are taken."""
        ids = [old_to_new[block] for block in self.ids]
        if keep_runs:
            self.ids = ids
        else:
            self.replace(ids)

    def repoint(self, target: BlockPool, ids: list[int]) -> None:
        """The same contents as blocks `ids` of `target` (already referenced for this table: a swap copied them
        there); the references in the current pool go."""
        self.pool.free(self.ids)
        self.pool = target
        self.replace(ids)

    def state_dict(self) -> dict:
        return {"ids": list(self.ids), "run_from": self.run_from}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved table whose ids are already referenced for it; reads take the saved paths (views from
        `run_from` on) where the ids allow."""
        self.replace(list(state["ids"]))
        self.run_from = max(self.run_from, state["run_from"])


def blocks_freed(lists: Iterable[tuple[BlockList, int]]) -> int:
    """Blocks that return to the free queue when each list drops its first `count` ids (a block shared by
    several lists returns only when all of its references go)."""
    dropped: dict[int, int] = {}
    pool = None
    for blocks, count in lists:
        pool = blocks.pool
        for block in blocks.ids[:count]:
            dropped[block] = dropped.get(block, 0) + 1
    return sum(1 for block, refs in dropped.items() if pool.ref_count(block) == refs)


@dataclass
class Row:
    """One sequence of a layer group.

    - `pads`: left-padding tokens, which occupy no blocks;
    - `base`: logical position of slot 0 of the first full-precision block (tokens are stored
      contiguously from there on; sliding groups advance it when whole blocks leave the window; after an
      eviction it is virtual: `length - stored tokens`, so new tokens keep their positions);
    - `blocks`: the full-precision blocks; `quantized`: the sealed blocks before them (or None);
    - `kept_positions`: logical positions of the tokens that survived the last compaction (None: never
      compacted), `[n]`, or `[kv_heads, n]` after a per-head eviction (each head keeps as many tokens);
      tokens stored since then follow contiguously.
    """

    pads: int
    base: int
    blocks: BlockList
    quantized: BlockList | None = None
    kept_positions: torch.Tensor | None = None

    def block_lists(self) -> list[BlockList]:
        """The row's tables: its full-precision blocks, then its sealed ones if it has a table of them."""
        return [self.blocks] if self.quantized is None else [self.blocks, self.quantized]

    def fork(self) -> Row:
        """A row with the same contents, sharing every block by reference (copy-on-write on first write)."""
        quantized = self.quantized.fork() if self.quantized is not None else None
        return Row(self.pads, self.base, self.blocks.fork(), quantized, self.kept_positions)

    def release(self) -> None:
        for blocks in self.block_lists():
            blocks.free_all()

    def remap(self, old_to_new: Mapping[BlockPool, Mapping[int, int]], keep_runs: bool = True) -> None:
        """Renumber the tables in the packed pools (`BlockList.remap`); tables in other pools stay."""
        for blocks in self.block_lists():
            if blocks.pool in old_to_new:
                blocks.remap(old_to_new[blocks.pool], keep_runs)

    def state_dict(self) -> dict:
        """Padding, base, both tables (pool ids) and the eviction survivors (a tensor, or None)."""
        quantized = self.quantized.state_dict() if self.quantized is not None else None
        return {"pads": self.pads, "base": self.base, "blocks": self.blocks.state_dict(), "quantized": quantized,
                "kept_positions": self.kept_positions}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Take a saved row into this fresh one (its tables' ids already referenced for it)."""
        self.pads, self.base, self.kept_positions = state["pads"], state["base"], state["kept_positions"]
        self.blocks.load_state_dict(state["blocks"])
        if self.quantized is not None:
            self.quantized.load_state_dict(state["quantized"])
