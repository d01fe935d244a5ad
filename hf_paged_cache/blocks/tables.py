"""The rows of one group of layers that always hold the same tokens, and the planning of a step for them.

All full-attention layers of a model see the same tokens, so they share one `BlockTables` (and one
`BlockPool` of ids); sliding-window layers of one window size share another. A layer's storage is
indexed by these ids, so a step is planned once per group and every layer of the group reuses the plan.
Each row's state is one `Row` record (`rows.py`); the logical length (`length`) counts pads and is shared
by every row, as in `DynamicCache`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch

from .packing import BlockCopier, Renumbering, pack
from .plan import StepPlan, ceil_div
from .pool import BlockPool
from .reach import Reach, SlidingWindow
from .rows import BlockList, Row, blocks_freed

# (full-precision ids, sealed ids, full-precision ids to keep a copy of for the step): quantize in every layer
BlockSealer = Callable[[list[int], list[int], list[int]], None]


class BlockTables:
    """The rows of one layer group, their logical length, and the planning of each step.

    Planning is check-before-act: `demands` says what a step takes from each pool without changing anything,
    and `apply_step` (called once the caller reserved the blocks) changes the rows and returns the plan.
    Quantized groups (`QuantizedBlockTables`, sealing.py) change the plan only through the sealing hooks below.
    """

    def __init__(self, name: str, pool: BlockPool | None, block_size: int, reach: Reach | int | None = None):
        self.name = name
        self.pool = pool  # None until a `max_memory` cache learns its bytes per block
        self.block_size = block_size
        # How far back reads go (an int: a sliding window of that size); None: every token is kept.
        self.reach = SlidingWindow(reach) if isinstance(reach, int) else reach
        self.record_past = False
        self.padding_exact = True
        self.plan: StepPlan | None = None
        self.rows: list[Row] = []
        self.length = 0

    # ------------------------------------------------------------------ read-only views of the rows
    @property
    def sliding_window(self) -> int | None:
        """The window (a chunked group's chunk size) that bounds what rows keep; None when they keep every token."""
        return None if self.reach is None else self.reach.size

    @property
    def tables(self) -> list[list[int]]:
        """Full-precision block ids per row."""
        return [row.blocks.ids for row in self.rows]

    @property
    def qtables(self) -> list[list[int]]:
        """Sealed (quantized) block ids per row."""
        return [row.quantized.ids if row.quantized is not None else [] for row in self.rows]

    @property
    def quantized_pool(self) -> BlockPool | None:
        """The pool of the sealed blocks (None: this group seals nothing)."""
        return None

    @property
    def pads(self) -> list[int]:
        return [row.pads for row in self.rows]

    @property
    def base(self) -> list[int]:
        return [row.base for row in self.rows]

    @property
    def batch_size(self) -> int | None:
        return len(self.rows) if self.length > 0 else None

    def stored_tokens(self, row: int) -> int:
        """Full-precision tokens the row stores."""
        return max(self.length - self.rows[row].base, 0) if self.length > 0 else 0

    def quantized_tokens(self, row: int) -> int:
        quantized = self.rows[row].quantized
        return len(quantized) * self.block_size if quantized is not None and self.length > 0 else 0

    def stored_count(self, row: int) -> int:
        """Every token the row stores: its quantized prefix, then its full-precision tokens."""
        return self.quantized_tokens(row) + self.stored_tokens(row)

    def first_stored(self, row: int) -> int:
        """Logical position of the first token the row still stores (virtual after a compaction)."""
        quantized = self.rows[row].quantized
        return self.rows[row].base - (len(quantized) * self.block_size if quantized is not None else 0)

    @property
    def compacted(self) -> bool:
        """Whether some row lost tokens from the middle (eviction): stored tokens are then no longer the
        contiguous logical range [base, length), and only readers that go by stored index are exact. (A loop, not
        `any()` over a generator: a packed forward asks every sequence's tables at every layer.)"""
        for row in self.rows:
            if row.kept_positions is not None:
                return True
        return False

    def stored_positions(self, row: int) -> torch.Tensor:
        """Logical position of each stored token of the row, in stored order: int64 `[stored_count]`, or
        `[kv_heads, stored_count]` when a per-head eviction left each head its own survivors."""
        count, kept = self.stored_count(row), self.rows[row].kept_positions
        if kept is None:
            return torch.arange(self.length - count, self.length)
        since = torch.arange(self.length - (count - kept.shape[-1]), self.length)  # stored since the compaction
        return torch.cat([kept, since.expand(*kept.shape[:-1], -1)], dim=-1)

    def stored_before(self, row: int, position: int) -> int:
        """Stored tokens of the row at logical positions before `position`: the same in every KV head, or a
        crop there would leave heads of different lengths, and this raises."""
        counts = (self.stored_positions(row) < position).sum(dim=-1).flatten().unique()
        if len(counts) > 1:
            safe = int(self.rows[row].kept_positions.max()) + 1
            raise RuntimeError(
                f"Cannot crop the {self.name} layers to {position} tokens: row {row} was evicted per head and its KV "
                f"heads keep different numbers of tokens before position {position}. Crop to {safe} or more, or "
                "evict with `per_head=False`."
            )
        return int(counts[0]) if len(counts) else 0

    # ------------------------------------------------------------------ planning a step
    def read_offset(self, length: int) -> int:
        """First logical position attention reads at a step that starts at `length` (HF's `kv_offset`)."""
        return 0 if self.reach is None else self.reach.read_offset(length)

    def _first_read(self, length: int, row: Row) -> int:
        """First logical position the row needs at a step that starts at `length` (`Reach.first_read`)."""
        if self.reach is None:
            return 0
        return self.reach.first_read(length, row.pads if self.padding_exact else None)

    def demands(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> list[tuple[BlockPool, int, int, str]]:
        """Per pool of the group: (pool, blocks the step allocates, blocks it returns, name for errors).
        Mirror rows allocate nothing: they take their source's blocks."""
        drops = self._step_drops(q_len)
        freed = blocks_freed((row.blocks, drop) for row, drop in zip(self.rows, drops)) if self.rows else 0
        needed = 0
        for row, (stored, held, new) in enumerate(self._row_growth(q_len, pads, drops)):
            if row in mirrors:
                continue
            needed += max(ceil_div(stored + new, self.block_size) - held, 0)
            if new and stored % self.block_size and self._shared_beyond_mirrors(row, mirrors):
                needed += 1  # copy-on-write of a shared, partly filled last block
        return [(self.pool, needed, freed, self.name)]

    def _shared_beyond_mirrors(self, row: int, mirrors: dict[int, int]) -> bool:
        """Whether the row's last block is held by more tables than the row and its mirrors (which follow it)."""
        holders = 1 + sum(1 for source in mirrors.values() if source == row)
        return self.pool.ref_count(self.rows[row].blocks.ids[-1]) > holders

    def mirror_candidates(self, pads: list[int]) -> list[int]:
        """Per row, the first row whose state is identical (itself when none): same padding, same blocks. Only
        such rows can share this step's new blocks, when their new K/V are identical too."""
        first: dict[tuple, int] = {}
        candidates = []
        for index, row in enumerate(self.rows or [None] * len(pads)):
            if row is None:
                key = (pads[index],)
            elif row.kept_positions is None and row.blocks.ids and self.pool.ref_count(row.blocks.ids[-1]) > 1:
                key = (row.pads, row.base, tuple(row.blocks.ids), tuple(row.quantized.ids) if row.quantized else ())
            else:
                key = ("own", index)
            candidates.append(first.setdefault(key, index))
        return candidates

    def _window_drops(self, keep_past: bool | None = None) -> list[tuple[int, int]]:
        """Per row, (quantized, full-precision) leading blocks wholly before the next step's window
        (groups with a reach only)."""
        keep_past = self.record_past if keep_past is None else keep_past
        if self.reach is None or keep_past or self.length == 0:
            return [(0, 0)] * len(self.rows)
        bs, drops = self.block_size, []
        for index, row in enumerate(self.rows):
            keep_from = self._first_read(self.length, row)
            quantized = min(max(keep_from - self.first_stored(index), 0) // bs, len(row.quantized or ()))
            drops.append((quantized, max(keep_from - row.base, 0) // bs))
        return drops

    def _step_drops(self, q_len: int) -> list[int]:
        """Leading full-precision blocks per row that leave the tables at a step (window, then sealing)."""
        window = [fp for _quantized, fp in self._window_drops()]
        return [drop + seal for drop, seal in zip(window, self._seal_counts(q_len, window))]

    def _row_growth(self, q_len: int, pads: list[int], drops: list[int]):
        """Per row: (stored tokens after drops, blocks held after drops, new stored tokens), the blocks that the
        step seals as they arrive (`_arrival`) taken out."""
        for stored, held, new in self._stored_growth(q_len, pads, drops):
            sealed, older, blocks = self._arrival(q_len, stored, new)
            yield stored - older, held - blocks, new - (sealed * self.block_size - older)

    def _stored_growth(self, q_len: int, pads: list[int], drops: list[int]):
        """As `_row_growth`, counting every new token as stored in full precision."""
        if self.length == 0:
            for pad in pads:
                yield 0, 0, q_len - pad
            return
        for index, row in enumerate(self.rows):
            stored = self.stored_tokens(index) - drops[index] * self.block_size
            yield stored, len(row.blocks) - drops[index], q_len

    def apply_step(self, q_len: int, pads: list[int], copy_blocks: BlockCopier, seal_blocks: BlockSealer,
                   mirrors: dict[int, int] | None = None) -> StepPlan:  # fmt: skip
        """Drop, seal, copy-on-write and allocate for a step of `q_len` tokens (the caller checked the free
        blocks), and return its plan. `copy_blocks(src, dst)` copies block contents in every layer of the
        group (copy-on-write); `seal_blocks(src, dst, keep)` quantizes them (quantized groups). `mirrors` (row ->
        earlier row with the same state and, as far as the caller saw, the same new K/V) take their source's
        blocks instead of their own."""
        mirrors = mirrors or {}
        start = self.length
        if start == 0:
            self.rows = [self._new_row(pad) for pad in pads]
        else:
            for row, (quantized, _fp) in zip(self.rows, self._window_drops()):
                if quantized:
                    row.quantized.drop_front(quantized)
            self._seal(q_len, seal_blocks)
        for row in mirrors:  # let go first, so the source sees who else holds its last block
            self.rows[row].release()
        self._allocate(q_len, pads, copy_blocks, mirrors)
        for row, source in mirrors.items():
            self.rows[row] = self.rows[source].fork()
        self.length = start + q_len
        self.plan = self._make_plan(q_len, [q_len - pad if start == 0 else q_len for pad in pads], mirrors)
        return self.plan

    def _make_plan(self, q_len: int, new_tokens: list[int], mirrors: dict[int, int]) -> StepPlan:
        """The plan of the step just applied (tables already hold its tokens): each row's new tokens are its
        last `new_tokens[row]` stored ones; mirror rows write nothing."""
        write_slots, write_ranges = [], []  # the rows' slots, and the ranges of the batch-major tokens they store
        for index, new in enumerate(new_tokens):
            stored = self.stored_tokens(index)
            new = min(new, stored)  # tokens sealed as they arrived are not stored here
            if new and index not in mirrors:
                write_slots.append(self.slots(index, stored - new, new))
                write_ranges.append((index * q_len + q_len - new, (index + 1) * q_len))
        slots = (write_slots[0] if len(write_slots) == 1 else
                 torch.cat(write_slots) if write_slots else torch.empty(0, dtype=torch.long))  # fmt: skip
        every = sum(stop - start for start, stop in write_ranges) == q_len * len(self.rows)
        tokens = None if every else torch.cat([torch.arange(start, stop) for start, stop in write_ranges] or
                                              [torch.empty(0, dtype=torch.long)])  # fmt: skip
        kv_offset = self.read_offset(self.length - q_len)
        # A row whose first query reads less than the step's window (the chunk it falls in began later) starts there.
        read_from = [max(kv_offset, self._first_read(self.length - q_len, row)) for row in self.rows]
        read_start = [max(first - row.base, 0) for first, row in zip(read_from, self.rows)]
        read_stop = [self.stored_tokens(index) for index in range(len(self.rows))]
        return StepPlan(q_len=q_len, new_len=self.length, kv_offset=kv_offset, write_slots=slots, write_tokens=tokens,
                        read_from=read_from, read_start=read_start, read_stop=read_stop, new_tokens=list(new_tokens),
                        padding_exact=self.padding_exact, tables=self, base=self.base,
                        quantized_tables=[list(table) for table in self.qtables], mirrors=dict(mirrors))  # fmt: skip

    def unmirror(self, row: int, copy_blocks: BlockCopier) -> StepPlan:
        """Row `row` turned out to differ from its mirror source in some layer: it gets its own copies of the
        blocks this step writes (contents copied in every layer of the group: older tokens, and the new ones
        the layers that already wrote found identical) and the plan is made again with the row writing."""
        plan = self.plan
        blocks, first = self.rows[row].blocks, (self.stored_tokens(row) - plan.new_tokens[row]) // self.block_size
        sources = blocks.ids[first:]
        fresh = self.pool.allocate(len(sources), after=blocks.ids[first - 1] if first else None)
        self.pool.free(sources)
        blocks.replace(blocks.ids[:first] + fresh)
        copy_blocks(sources, fresh)
        mirrors = {index: source for index, source in plan.mirrors.items() if index != row}
        self.plan = self._make_plan(plan.q_len, plan.new_tokens, mirrors)
        return self.plan

    # ------------------------------------------------------------------ sealing hooks
    # A full-precision group seals nothing; `QuantizedBlockTables` overrides these five, which are all the ways
    # sealing enters the planning above (it also extends `demands`, `_make_plan`, `check_crop` and `_crop_row`).
    def _new_row(self, pad: int) -> Row:
        """An empty row (a quantized group's also has a table of sealed blocks)."""
        return Row(pads=pad, base=pad, blocks=BlockList(self.pool))

    def _seal_counts(self, q_len: int, fp_drops: list[int]) -> list[int]:
        """Full-precision blocks per row (after `fp_drops`) that a step seals from tokens stored before it."""
        return [0] * len(self.rows)

    def _arrival(self, q_len: int, stored: int, new: int) -> tuple[int, int, int]:
        """(blocks, of their tokens the stored ones, full-precision blocks holding those) that a step seals from
        its own tokens as its layers write, for a row of `stored` tokens (after the drops) and `new` ones."""
        return 0, 0, 0

    def _seal(self, q_len: int, seal_blocks: BlockSealer) -> None:
        """Before the step's drops: quantize the blocks `_seal_counts` names."""

    def _take_arrivals(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> None:
        """After the step's drops: take out of the rows the blocks `_arrival` names."""

    def _allocate(self, q_len: int, pads: list[int], copy_blocks: BlockCopier, mirrors: dict[int, int]) -> None:
        """Drop leading blocks, copy-on-write shared last blocks and allocate new ones (mirror rows, released
        by the caller, are skipped: they take their source's blocks afterwards)."""
        bs = self.block_size
        drops = self._step_drops(q_len)
        growth = list(self._row_growth(q_len, pads, drops))
        for index, drop in enumerate(drops):  # every row drops first: blocks rows share are freed by the last one
            if drop and index not in mirrors:
                self.rows[index].blocks.drop_front(drop)
                self.rows[index].base += drop * bs
        self._take_arrivals(q_len, pads, mirrors)
        cow_src, cow_dst = [], []
        for index, (stored, _held, new) in enumerate(growth):
            if index not in mirrors and new and stored % bs and self._shared_beyond_mirrors(index, mirrors):
                old, fresh = self.rows[index].blocks.replace_last()
                cow_src.append(old)
                cow_dst.append(fresh)
        self._extend_rows([0 if index in mirrors else ceil_div(stored + new, bs) - len(self.rows[index].blocks)
                           for index, (stored, _held, new) in enumerate(growth)])  # fmt: skip
        if cow_src:
            copy_blocks(cow_src, cow_dst)

    def _extend_rows(self, extras: list[int]) -> None:
        """Give each row its `extras` new blocks. A row whose next block is free continues its run; the rows
        that cannot (every row of a new batch) start runs spread over the longest free stretch, so that rows
        growing together keep out of each other's way and stay readable as views (`StepPlan.runs`)."""
        starting = [index for index, (row, extra) in enumerate(zip(self.rows, extras))
                    if extra > 0 and not row.blocks.can_continue()]  # fmt: skip
        for index, extra in enumerate(extras):
            if extra > 0 and index not in starting:
                self.rows[index].blocks.extend(extra)
        for index, run in zip(starting, self.pool.allocate_runs([extras[index] for index in starting])):
            self.rows[index].blocks.append_fresh(run)

    def slots(self, row: int, first: int, count: int) -> torch.Tensor:
        """Slots of the row's full-precision stored tokens [first, first + count): one range per run of consecutive
        block ids they lie in (a step's few new tokens: one range, built at the cost of a single op)."""
        ids, bs = self.rows[row].blocks.ids, self.block_size
        ranges, position, stop = [], first, first + count
        while position < stop:
            block = end = position // bs
            while (end + 1) * bs < stop and ids[end + 1] == ids[end] + 1:  # the run goes on
                end += 1
            last = min(stop, (end + 1) * bs)
            begin = ids[block] * bs + position % bs
            ranges.append(torch.arange(begin, begin + last - position))
            position = last
        if len(ranges) == 1:
            return ranges[0]
        return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.long)

    def first_run_block(self, row: int) -> int | None:
        """The first block id when all of the row's full-precision blocks form one run, else None."""
        blocks = self.rows[row].blocks
        return blocks.ids[0] if blocks.ids and blocks.run_from == 0 else None

    def adopt(self, base: int, blocks: list[int], length: int) -> None:
        """Become one row of `length` tokens whose blocks (already referenced for it) hold positions from `base`
        on: a prefix found in the prefix cache."""
        row = self._new_row(0)
        row.base = base
        row.blocks.replace(list(blocks))
        self.rows, self.length, self.plan = [row], length, None

    # ------------------------------------------------------------------ whole-batch edits
    def fork(self) -> BlockTables:
        """The same rows for a fork of the cache, in the same pool(s): every block gains a reference and
        no K/V is copied; whichever side writes into a shared partial block first copies that block."""
        twin = copy.copy(self)
        twin.rows = [row.fork() for row in self.rows]
        twin.plan = None
        return twin

    def reorder(self, order: list[int]) -> None:
        """Row i becomes a copy of row order[i] (beam search): shares blocks by reference count."""
        rows = [self.rows[source].fork() for source in order]
        for row in self.rows:
            row.release()
        self.rows = rows
        self.plan = None

    def check_crop(self, new_len: int) -> None:
        """Raise (changing nothing) if cropping to `new_len` would need tokens that were already dropped."""
        for index, row in enumerate(self.rows):
            needed_from = self._first_read(new_len, row)
            if row.kept_positions is not None:  # evicted (full attention only): its survivors are what it has
                if new_len > 0:
                    self.stored_before(index, new_len)  # per-head rows: raises if the heads would differ
                continue
            first = self.first_stored(index)
            if first > row.pads and needed_from < first:
                raise RuntimeError(
                    f"Cannot crop the {self.name} layers to {new_len} tokens: their window already dropped "
                    f"positions before {first}. Call `cache.activate_past_recording()` before generating "
                    "to keep them until the crop."
                )

    def crop(self, new_len: int) -> None:
        """Forget every token at or after logical position `new_len`."""
        if new_len == 0:
            self.release()
            return
        for index, row in enumerate(self.rows):
            self._crop_row(index, new_len)
            row.blocks.truncate(ceil_div(max(new_len - row.base, 0), self.block_size))
        self.length = new_len
        self.plan = None

    def _crop_row(self, index: int, new_len: int) -> None:
        """Before the row's full-precision blocks are cut at `new_len`: a compacted row keeps its survivors up to
        `new_len`, by stored index (`base` is virtual)."""
        row = self.rows[index]
        if row.kept_positions is not None:
            positions, keep = self.stored_positions(index), self.stored_before(index, new_len)
            row.kept_positions = positions[..., : min(keep, row.kept_positions.shape[-1])]
            row.base = new_len - (keep - self.stored_count(index) + self.stored_tokens(index))

    def release(self) -> None:
        """Return every block to the pool and forget all rows."""
        for row in self.rows:
            row.release()
        self.rows = []
        self.length = 0
        self.plan = None

    def trim_pool(self, num_blocks: int, copy_blocks: BlockCopier) -> None:
        """Move the blocks in use to ids 1..n in id order (`copy_blocks` copies their contents in every layer of
        the group) and shrink the pool to `num_blocks` (>= n) ids, so the layers' storage can shrink with it.
        Only for a pool whose every reference is a row of this group (a cache without forks, full precision):
        nothing else learns the new ids. The plan of the step just applied is made again on them."""
        plan = self.plan
        pack([(self.pool, copy_blocks)], [functools.partial(self.remap, keep_runs=True)])
        self.pool.shrink(num_blocks)
        if plan is not None:
            self.plan = self._make_plan(plan.q_len, plan.new_tokens, plan.mirrors)

    def trim_to_window(self) -> None:
        """Free the blocks a recorded past kept beyond the window (after `crop` in assisted decoding)."""
        for row, (quantized, fp) in zip(self.rows, self._window_drops(keep_past=False)):
            if quantized:
                row.quantized.drop_front(quantized)
            if fp:
                row.blocks.drop_front(fp)
                row.base += fp * self.block_size
        self.plan = None

    # ------------------------------------------------------------------ state
    def pools(self) -> tuple[BlockPool | None, BlockPool | None]:
        """(full-precision pool, quantized pool): None where the group has none (yet)."""
        return self.pool, self.quantized_pool

    def drop_plan(self) -> None:
        """Forget the step plan after the rows' tables moved (a swap, a packing): the next step makes its own."""
        self.plan = None

    def remap(self, old_to_new: Renumbering, keep_runs: bool = False) -> None:
        """Renumber the rows' tables in the packed pools (`Row.remap`); the plan is made again at the next step."""
        for row in self.rows:
            row.remap(old_to_new, keep_runs)
        self.drop_plan()

    def used_blocks(self) -> tuple[list[int], list[int]]:
        """The pool ids the rows reference, ascending: (full-precision, quantized)."""
        fp = {block for row in self.rows for block in row.blocks.ids}
        quantized = {block for row in self.rows if row.quantized is not None for block in row.quantized.ids}
        return sorted(fp), sorted(quantized)

    def state_dict(self) -> dict:
        """Name, length, recording flags and every row's state (`Row.state_dict`, pool ids)."""
        return {"name": self.name, "length": self.length, "record_past": self.record_past,
                "padding_exact": self.padding_exact, "rows": [row.state_dict() for row in self.rows]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Take saved rows (their ids already referenced in this group's pools) in place of the current ones."""
        self.rows = []
        for saved in state["rows"]:
            row = self._new_row(saved["pads"])
            row.load_state_dict(saved)
            self.rows.append(row)
        self.length, self.record_past = state["length"], state["record_past"]
        self.padding_exact = state["padding_exact"]
        self.plan = None
