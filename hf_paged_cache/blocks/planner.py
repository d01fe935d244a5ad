"""Planning one step of a group's rows: `StepPlanner`.

Planning is check-before-act: `demands` says what a step takes from each pool without changing anything, and
`apply_step` (called once the caller reserved the blocks) drops what left a window, seals (quantized groups),
copies shared last blocks on write, allocates, and returns the step's `StepPlan`, which every layer of the group
reads. A planner works on its group's `BlockTables` (`tables`): their rows, pool, length and window. Quantized
groups plan with `SealingPlanner` (sealing.py), which changes the plan only through the sealing hooks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .renumbering import BlockCopier
from .plan import StepPlan, ceil_div
from .pool import BlockPool
from .rows import Row, blocks_freed

# (full-precision ids, sealed ids, full-precision ids to keep a copy of for the step): quantize in every layer
BlockSealer = Callable[[list[int], list[int], list[int]], None]


class StepPlanner:
    """The planning of a step for one group's tables (`tables`, a `BlockTables`, which hold the rows it edits)."""

    def __init__(self, tables):
        self.tables = tables

    def first_read(self, length: int, row: Row) -> int:
        """First logical position the row needs at a step that starts at `length` (`Reach.first_read`)."""
        tables = self.tables
        if tables.reach is None:
            return 0
        return tables.reach.first_read(length, row.pads if tables.padding_exact else None)

    def demands(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> list[tuple[BlockPool, int, int, str]]:
        """Per pool of the group: (pool, blocks the step allocates, blocks it returns, name for errors).
        Mirror rows allocate nothing: they take their source's blocks."""
        tables = self.tables
        drops = self._step_drops(q_len)
        freed = blocks_freed((row.blocks, drop) for row, drop in zip(tables.rows, drops)) if tables.rows else 0
        needed = 0
        for row, (stored, held, new) in enumerate(self._row_growth(q_len, pads, drops)):
            if row in mirrors:
                continue
            needed += max(ceil_div(stored + new, tables.block_size) - held, 0)
            if new and stored % tables.block_size and self._shared_beyond_mirrors(row, mirrors):
                needed += 1  # copy-on-write of a shared, partly filled last block
        return [(tables.pool, needed, freed, tables.name)]

    def _shared_beyond_mirrors(self, row: int, mirrors: dict[int, int]) -> bool:
        """Whether the row's last block is held by more tables than the row and its mirrors (which follow it)."""
        tables = self.tables
        holders = 1 + sum(1 for source in mirrors.values() if source == row)
        return tables.pool.ref_count(tables.rows[row].blocks.ids[-1]) > holders

    def mirror_candidates(self, pads: list[int]) -> list[int]:
        """Per row, the first row whose state is identical (itself when none): same padding, same blocks. Only
        such rows can share this step's new blocks, when their new K/V are identical too."""
        tables = self.tables
        first: dict[tuple, int] = {}
        candidates = []
        for index, row in enumerate(tables.rows or [None] * len(pads)):
            if row is None:
                key = (pads[index],)
            elif row.kept_positions is None and row.blocks.ids and tables.pool.ref_count(row.blocks.ids[-1]) > 1:
                key = (row.pads, row.base, tuple(row.blocks.ids), tuple(row.quantized.ids) if row.quantized else ())
            else:
                key = ("own", index)
            candidates.append(first.setdefault(key, index))
        return candidates

    def window_drops(self, keep_past: bool | None = None) -> list[tuple[int, int]]:
        """Per row, (quantized, full-precision) leading blocks wholly before the next step's window
        (groups with a reach only)."""
        tables = self.tables
        keep_past = tables.record_past if keep_past is None else keep_past
        if tables.reach is None or keep_past or tables.length == 0:
            return [(0, 0)] * len(tables.rows)
        bs, drops = tables.block_size, []
        for index, row in enumerate(tables.rows):
            keep_from = self.first_read(tables.length, row)
            quantized = min(max(keep_from - tables.first_stored(index), 0) // bs, len(row.quantized or ()))
            drops.append((quantized, max(keep_from - row.base, 0) // bs))
        return drops

    def _step_drops(self, q_len: int) -> list[int]:
        """Leading full-precision blocks per row that leave the tables at a step (window, then sealing)."""
        window = [fp for _quantized, fp in self.window_drops()]
        return [drop + seal for drop, seal in zip(window, self._seal_counts(q_len, window))]

    def _row_growth(self, q_len: int, pads: list[int], drops: list[int]):
        """Per row: (stored tokens after drops, blocks held after drops, new stored tokens), the blocks that the
        step seals as they arrive (`_arrival`) taken out."""
        for stored, held, new in self._stored_growth(q_len, pads, drops):
            sealed, older, blocks = self._arrival(q_len, stored, new)
            yield stored - older, held - blocks, new - (sealed * self.tables.block_size - older)

    def _stored_growth(self, q_len: int, pads: list[int], drops: list[int]):
        """As `_row_growth`, counting every new token as stored in full precision."""
        tables = self.tables
        if tables.length == 0:
            for pad in pads:
                yield 0, 0, q_len - pad
            return
        for index, row in enumerate(tables.rows):
            stored = tables.stored_tokens(index) - drops[index] * tables.block_size
            yield stored, len(row.blocks) - drops[index], q_len

    def apply_step(self, q_len: int, pads: list[int], copy_blocks: BlockCopier, seal_blocks: BlockSealer,
                   mirrors: dict[int, int] | None = None) -> StepPlan:  # fmt: skip
        """Drop, seal, copy-on-write and allocate for a step of `q_len` tokens (the caller checked the free
        blocks), and return its plan. `copy_blocks(src, dst)` copies block contents in every layer of the
        group (copy-on-write); `seal_blocks(src, dst, keep)` quantizes them (quantized groups). `mirrors` (row ->
        earlier row with the same state and, as far as the caller saw, the same new K/V) take their source's
        blocks instead of their own."""
        tables = self.tables
        mirrors = mirrors or {}
        start = tables.length
        if start == 0:
            tables.rows = [tables.new_row(pad) for pad in pads]
        else:
            for row, (quantized, _fp) in zip(tables.rows, self.window_drops()):
                if quantized:
                    row.quantized.drop_front(quantized)
            self._seal(q_len, seal_blocks)
        for row in mirrors:  # let go first, so the source sees who else holds its last block
            tables.rows[row].release()
        self._allocate(q_len, pads, copy_blocks, mirrors)
        for row, source in mirrors.items():
            tables.rows[row] = tables.rows[source].fork()
        tables.length = start + q_len
        tables.plan = self.make_plan(q_len, [q_len - pad if start == 0 else q_len for pad in pads], mirrors)
        return tables.plan

    def make_plan(self, q_len: int, new_tokens: list[int], mirrors: dict[int, int]) -> StepPlan:
        """The plan of the step just applied (tables already hold its tokens): each row's new tokens are its
        last `new_tokens[row]` stored ones; mirror rows write nothing."""
        tables = self.tables
        write_slots, write_ranges = [], []  # the rows' slots, and the ranges of the batch-major tokens they store
        for index, new in enumerate(new_tokens):
            stored = tables.stored_tokens(index)
            new = min(new, stored)  # tokens sealed as they arrived are not stored here
            if new and index not in mirrors:
                write_slots.append(tables.rows[index].blocks.slots(stored - new, new, tables.block_size))
                write_ranges.append((index * q_len + q_len - new, (index + 1) * q_len))
        slots = (write_slots[0] if len(write_slots) == 1 else
                 torch.cat(write_slots) if write_slots else torch.empty(0, dtype=torch.long))  # fmt: skip
        every = sum(stop - start for start, stop in write_ranges) == q_len * len(tables.rows)
        tokens = None if every else torch.cat([torch.arange(start, stop) for start, stop in write_ranges] or
                                              [torch.empty(0, dtype=torch.long)])  # fmt: skip
        kv_offset = tables.read_offset(tables.length - q_len)
        # A row whose first query reads less than the step's window (the chunk it falls in began later) starts there.
        read_from = [max(kv_offset, self.first_read(tables.length - q_len, row)) for row in tables.rows]
        read_start = [max(first - row.base, 0) for first, row in zip(read_from, tables.rows)]
        read_stop = [tables.stored_tokens(index) for index in range(len(tables.rows))]
        return StepPlan(q_len=q_len, new_len=tables.length, kv_offset=kv_offset, write_slots=slots, write_tokens=tokens,
                        read_from=read_from, read_start=read_start, read_stop=read_stop, new_tokens=list(new_tokens),
                        padding_exact=tables.padding_exact, tables=self.tables, base=tables.base,
                        quantized_tables=[list(table) for table in tables.qtables], mirrors=dict(mirrors))  # fmt: skip

    def unmirror(self, row: int, copy_blocks: BlockCopier) -> StepPlan:
        """Row `row` turned out to differ from its mirror source in some layer: it gets its own copies of the
        blocks this step writes (contents copied in every layer of the group: older tokens, and the new ones
        the layers that already wrote found identical) and the plan is made again with the row writing."""
        tables = self.tables
        plan = tables.plan
        blocks, first = tables.rows[row].blocks, (tables.stored_tokens(row) - plan.new_tokens[row]) // tables.block_size
        sources = blocks.ids[first:]
        fresh = tables.pool.allocate(len(sources), after=blocks.ids[first - 1] if first else None)
        tables.pool.free(sources)
        blocks.replace(blocks.ids[:first] + fresh)
        copy_blocks(sources, fresh)
        mirrors = {index: source for index, source in plan.mirrors.items() if index != row}
        tables.plan = self.make_plan(plan.q_len, plan.new_tokens, mirrors)
        return tables.plan

    # ------------------------------------------------------------------ sealing hooks
    # A full-precision group seals nothing; `SealingPlanner` (sealing.py) overrides these four, which are all the
    # ways sealing enters the planning above (it also extends `demands` and `make_plan`).
    def _seal_counts(self, q_len: int, fp_drops: list[int]) -> list[int]:
        """Full-precision blocks per row (after `fp_drops`) that a step seals from tokens stored before it."""
        return [0] * len(self.tables.rows)

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
        tables = self.tables
        bs = tables.block_size
        drops = self._step_drops(q_len)
        growth = list(self._row_growth(q_len, pads, drops))
        for index, drop in enumerate(drops):  # every row drops first: blocks rows share are freed by the last one
            if drop and index not in mirrors:
                tables.rows[index].blocks.drop_front(drop)
                tables.rows[index].base += drop * bs
        self._take_arrivals(q_len, pads, mirrors)
        cow_src, cow_dst = [], []
        for index, (stored, _held, new) in enumerate(growth):
            if index not in mirrors and new and stored % bs and self._shared_beyond_mirrors(index, mirrors):
                old, fresh = tables.rows[index].blocks.replace_last()
                cow_src.append(old)
                cow_dst.append(fresh)
        self._extend_rows([0 if index in mirrors else ceil_div(stored + new, bs) - len(tables.rows[index].blocks)
                           for index, (stored, _held, new) in enumerate(growth)])  # fmt: skip
        if cow_src:
            copy_blocks(cow_src, cow_dst)

    def _extend_rows(self, extras: list[int]) -> None:
        """Give each row its `extras` new blocks. A row whose next block is free continues its run; the rows
        that cannot (every row of a new batch) start runs spread over the longest free stretch, so that rows
        growing together keep out of each other's way and stay readable as views (`StepPlan.runs`)."""
        tables = self.tables
        starting = [index for index, (row, extra) in enumerate(zip(tables.rows, extras))
                    if extra > 0 and not row.blocks.can_continue()]  # fmt: skip
        for index, extra in enumerate(extras):
            if extra > 0 and index not in starting:
                tables.rows[index].blocks.extend(extra)
        for index, run in zip(starting, tables.pool.allocate_runs([extras[index] for index in starting])):
            tables.rows[index].blocks.append_fresh(run)
