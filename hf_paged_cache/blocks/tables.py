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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .packing import BlockCopier, Renumbering, pack
from .pool import NULL_BLOCK, BlockPool
from .rows import BlockList, Row, blocks_freed


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepPlan:
    """What one forward step writes and reads for a group; computed once, used by each of its layers.

    Stored indices count a row's full-precision tokens from slot 0 of its first block.
    """

    q_len: int
    new_len: int  # logical length after the step
    kv_offset: int  # first logical position attention reads
    write_slots: torch.Tensor  # int64 [stored new tokens]: destination slot of each, row-major
    write_tokens: torch.Tensor | None  # int64: which of the B*q new tokens are stored (None: all of them)
    read_start: list[int]  # per row: first stored index to read
    read_stop: list[int]  # per row: stored tokens after the step (exclusive end of the read)
    new_tokens: list[int]  # per row: stored new tokens of this step
    padding_exact: bool  # every stored token is a real one (no padding was stored)
    tables: BlockTables
    # Per row, the logical position of slot 0 of the first full-precision block (virtual after an
    # eviction compacted the row: see `Row.base`).
    base: list[int] = field(default_factory=list)
    # Per row, the sealed (quantized) block ids that precede the full-precision blocks (empty lists
    # in a full-precision group).
    quantized_tables: list[list[int]] = field(default_factory=list)
    # Rows that store nothing of their own this step: row -> the earlier row whose blocks it shares and whose
    # new K/V it repeats exactly (identical rows, e.g. `num_return_sequences`); each layer checks before writing.
    mirrors: dict[int, int] = field(default_factory=dict)
    # Blocks each layer seals from this step's own tokens before it reads (quantized groups, steps longer than
    # the residual window): (row, index of its first new token in the step, the full-precision blocks holding
    # the stored tokens among them, how many those are, the sealed block ids).
    arrivals: list[tuple[int, int, list[int], int, list[int]]] = field(default_factory=list)
    # Per row, the blocks that some of this step's tokens read quantized and the others in full precision (see
    # `QuantizedBlockTables`): the last ones of `quantized_tables` when the step sealed them as they arrived,
    # else the first full-precision ones.
    transition: list[int] = field(default_factory=list)
    _memo: dict = field(default_factory=dict, repr=False)

    def cached(self, key, build: Callable[[], object]):
        """`build()`, computed once per step and shared by the group's layers."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def tensor(self, name: str, device: torch.device) -> torch.Tensor:
        """A plan tensor on `device`, built and moved once per step (each layer may live elsewhere)."""
        return self.cached((name, device), lambda: self._build(name).to(device))

    def slots(self, row: int, first: int, count: int) -> torch.Tensor:
        """Slots of the row's stored tokens [first, first + count)."""
        return self.tables.slots(row, first, count)

    def runs(self) -> list[list[tuple[int, int, int]]]:
        """Per row, its read range cut where the block ids stop being consecutive: (first column of the
        logical read range, first slot, tokens), in order (see `BlockTables.read_runs`)."""
        return self.cached("runs", lambda: self.tables.read_runs(self))

    def _build(self, name: str) -> torch.Tensor:
        if name in ("write_slots", "write_tokens"):
            return getattr(self, name)
        if name == "slot_mapping":  # every new token's slot, -1 for padding that is not stored
            slots = torch.full((self.q_len * len(self.read_start),), -1, dtype=torch.long)
            tokens = slice(None) if self.write_tokens is None else self.write_tokens
            slots[tokens] = self.write_slots
            return slots
        if name == "read_slots":
            return self.tables.gather_slots(self.kv_offset, self.new_len)
        if name == "block_tables":
            return self.tables.table_tensor().to(torch.int32)
        bs = self.tables.block_size
        if name == "seq_lens":  # every stored token the kernels read: a quantized prefix, then full precision
            return torch.tensor([len(q) * bs + stop for q, stop in zip(self.quantized_tables, self.read_stop)],
                                dtype=torch.int32)  # fmt: skip
        if name == "quantized_lens":
            return torch.tensor([len(table) * bs for table in self.quantized_tables], dtype=torch.int32)
        if name == "quantized_block_tables":
            width = max((len(table) for table in self.quantized_tables), default=0)
            rows = [table + [NULL_BLOCK] * (width - len(table)) for table in self.quantized_tables]
            return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
        if name == "query_lens":
            return torch.tensor(self.new_tokens, dtype=torch.int32)
        raise KeyError(name)


class BlockTables:
    """The rows of one layer group, their logical length, and the planning of each step."""

    def __init__(self, name: str, pool: BlockPool | None, block_size: int, sliding_window: int | None = None):
        self.name = name
        self.pool = pool  # None until a `max_memory` cache learns its bytes per block
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.record_past = False
        self.padding_exact = True
        self.plan: StepPlan | None = None
        self.rows: list[Row] = []
        self.length = 0

    # ------------------------------------------------------------------ read-only views of the rows
    @property
    def tables(self) -> list[list[int]]:
        """Full-precision block ids per row."""
        return [row.blocks.ids for row in self.rows]

    @property
    def qtables(self) -> list[list[int]]:
        """Sealed (quantized) block ids per row."""
        return [row.quantized.ids if row.quantized is not None else [] for row in self.rows]

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
        contiguous logical range [base, length), and only readers that go by stored index are exact."""
        return any(row.kept_positions is not None for row in self.rows)

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
        if self.sliding_window is None:
            return 0
        return max(length - self.sliding_window + 1, 0)

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
        (sliding groups only)."""
        keep_past = self.record_past if keep_past is None else keep_past
        if self.sliding_window is None or keep_past or self.length == 0:
            return [(0, 0)] * len(self.rows)
        keep_from, bs = self.read_offset(self.length), self.block_size
        drops = []
        for index, row in enumerate(self.rows):
            quantized = min(max(keep_from - self.first_stored(index), 0) // bs, len(row.quantized or ()))
            drops.append((quantized, max(keep_from - row.base, 0) // bs))
        return drops

    def _seal_counts(self, q_len: int, fp_drops: list[int]) -> list[int]:
        """Full-precision blocks per row (after `fp_drops`) that a step seals: none without quantization."""
        return [0] * len(self.rows)

    def _step_drops(self, q_len: int) -> list[int]:
        """Leading full-precision blocks per row that leave the tables at a step (window, then sealing)."""
        window = [fp for _quantized, fp in self._window_drops()]
        return [drop + seal for drop, seal in zip(window, self._seal_counts(q_len, window))]

    def _row_growth(self, q_len: int, pads: list[int], drops: list[int]):
        """Per row: (stored tokens after drops, blocks held after drops, new stored tokens)."""
        if self.length == 0:
            for pad in pads:
                yield 0, 0, q_len - pad
            return
        for index, row in enumerate(self.rows):
            stored = self.stored_tokens(index) - drops[index] * self.block_size
            yield stored, len(row.blocks) - drops[index], q_len

    def apply_step(self, q_len: int, pads: list[int], copy_blocks: BlockCopier, seal_blocks: BlockCopier,
                   mirrors: dict[int, int] | None = None) -> StepPlan:  # fmt: skip
        """Drop, seal, copy-on-write and allocate for a step of `q_len` tokens (the caller checked the free
        blocks), and return its plan. `copy_blocks(src, dst)` copies block contents in every layer of the
        group (copy-on-write); `seal_blocks(src, dst)` quantizes them (quantized groups). `mirrors` (row ->
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
        write_slots, write_tokens = [], []
        for index, new in enumerate(new_tokens):
            new = min(new, self.stored_tokens(index))  # tokens sealed as they arrived are not stored here
            if new and index not in mirrors:
                first_token = index * q_len + (q_len - new)
                write_slots.append(self.slots(index, self.stored_tokens(index) - new, new))
                write_tokens.append(torch.arange(first_token, first_token + new))
        slots = torch.cat(write_slots) if write_slots else torch.empty(0, dtype=torch.long)
        tokens = torch.cat(write_tokens) if write_tokens else torch.empty(0, dtype=torch.long)
        kv_offset = self.read_offset(self.length - q_len)
        read_start = [max(kv_offset - row.base, 0) for row in self.rows]
        read_stop = [self.stored_tokens(index) for index in range(len(self.rows))]
        return StepPlan(
            q_len=q_len,
            new_len=self.length,
            kv_offset=kv_offset,
            write_slots=slots,
            write_tokens=None if tokens.numel() == q_len * len(self.rows) else tokens,
            read_start=read_start,
            read_stop=read_stop,
            new_tokens=list(new_tokens),
            padding_exact=self.padding_exact,
            tables=self,
            base=self.base,
            quantized_tables=[list(table) for table in self.qtables],
            mirrors=dict(mirrors),
        )

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

    def _new_row(self, pad: int) -> Row:
        return Row(pads=pad, base=pad, blocks=BlockList(self.pool))

    def _take_arrivals(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> None:
        """After a step's drops: take out of the rows the blocks its layers seal as they write (quantized groups)."""

    def _seal(self, q_len: int, seal_blocks: BlockCopier) -> None:
        """Quantize the blocks a step seals (quantized groups)."""

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
        growing together keep out of each other's way and stay readable as views (`read_runs`)."""
        starting = [index for index, (row, extra) in enumerate(zip(self.rows, extras))
                    if extra > 0 and not row.blocks.can_continue()]  # fmt: skip
        for index, extra in enumerate(extras):
            if extra > 0 and index not in starting:
                self.rows[index].blocks.extend(extra)
        for index, run in zip(starting, self.pool.allocate_runs([extras[index] for index in starting])):
            self.rows[index].blocks.append_fresh(run)

    def slots(self, row: int, first: int, count: int) -> torch.Tensor:
        """Slots of the row's full-precision stored tokens [first, first + count)."""
        stored = torch.arange(first, first + count)
        blocks = torch.tensor(self.rows[row].blocks.ids, dtype=torch.long)[stored // self.block_size]
        return blocks * self.block_size + stored % self.block_size

    def first_run_block(self, row: int) -> int | None:
        """The first block id when all of the row's full-precision blocks form one run, else None."""
        blocks = self.rows[row].blocks
        return blocks.ids[0] if blocks.ids and blocks.run_from == 0 else None

    # ------------------------------------------------------------------ reading
    def read_runs(self, plan: StepPlan) -> list[list[tuple[int, int, int]]]:
        """Per row, the stored range [read_start, read_stop) as runs of consecutive slots: (column in the
        logical read range [kv_offset, new_len), first slot, tokens). Each run is one contiguous stretch
        per head of the head-major storage, so a reader takes views of it instead of gathering slots.
        Stored index `s` stands at column `base + s - kv_offset` (virtual after a compaction)."""
        bs, runs = self.block_size, []
        for row, start, stop, base in zip(self.rows, plan.read_start, plan.read_stop, plan.base):
            ids, row_runs, index = row.blocks.ids, [], start
            while index < stop:
                block = end = index // bs
                if block >= row.blocks.run_from:  # consecutive from here to the end
                    end = ceil_div(stop, bs) - 1
                while (end + 1) * bs < stop and ids[end + 1] == ids[end] + 1:
                    end += 1
                count = min((end + 1) * bs, stop) - index
                row_runs.append((base + index - plan.kv_offset, ids[block] * bs + index % bs, count))
                index += count
            runs.append(row_runs)
        return runs

    def block_read(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's read range as whole blocks, in stored order: (block ids `[rows, width]`, null-padded;
        the logical position of every slot of them `[rows, width * block_size]`; whether that slot is in
        the row's read range). Reading whole blocks copies `block_size` tokens per index, and rows need
        not line up by position: the mask goes by each slot's logical position instead."""
        bs = self.block_size
        first = [start // bs for start in plan.read_start]
        counts = [max(ceil_div(stop, bs) - block, 0) for block, stop in zip(first, plan.read_stop)]
        width = max(max(counts, default=0), 1)
        ids = torch.tensor([row.blocks.ids[block : block + count] + [NULL_BLOCK] * (width - count)
                            for row, block, count in zip(self.rows, first, counts)], dtype=torch.long)  # fmt: skip
        stored = torch.tensor(first)[:, None] * bs + torch.arange(width * bs)[None, :]
        valid = (stored >= torch.tensor(plan.read_start)[:, None]) & (stored < torch.tensor(plan.read_stop)[:, None])
        return ids, torch.tensor(plan.base)[:, None] + stored, valid

    def table_tensor(self) -> torch.Tensor:
        """Block tables as one int64 tensor `[rows, max blocks]`, short rows padded with the null block."""
        tables = self.tables
        width = max((len(table) for table in tables), default=0)
        return torch.tensor([table + [NULL_BLOCK] * (width - len(table)) for table in tables], dtype=torch.long)

    def gather_slots(self, kv_offset: int, new_len: int) -> torch.Tensor:
        """Slot of every logical position in [kv_offset, new_len) per row; unstored ones map to the null slot."""
        positions = torch.arange(kv_offset, new_len)
        stored = positions[None, :] - torch.tensor(self.base)[:, None]
        valid = stored >= 0
        stored = stored.clamp(min=0)
        table = self.table_tensor()
        if table.shape[1] == 0:
            return torch.zeros(stored.shape, dtype=torch.long)
        blocks = table.gather(1, (stored // self.block_size).clamp(max=table.shape[1] - 1))
        slots = blocks * self.block_size + stored % self.block_size
        return torch.where(valid, slots, NULL_BLOCK * self.block_size)

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

    def unshare_demand(self, order: list[int]) -> list[tuple[BlockPool, int]]:
        """(pool, fresh blocks) that `unshare` takes after `reorder(order)`: one per reference beyond the first
        (computed before the reorder, so a shortage can be reported with nothing changed)."""
        def holders(rows: list[Row]) -> Counter:
            return Counter((id(blocks.pool), block) for row in rows for blocks in (row.blocks, row.quantized)
                           if blocks is not None for block in blocks.ids)  # fmt: skip

        pools = {id(pool): pool for pool in self.pools() if pool is not None}
        before, after = holders(self.rows), holders([self.rows[source] for source in order])
        demand = Counter()
        for (pool, block), count in after.items():
            demand[pool] += max(pools[pool].ref_count(block) - before[(pool, block)] + count - 1, 0)
        return [(pools[pool], count) for pool, count in demand.items() if count]

    def unshare(self, copy_blocks: BlockCopier, copy_quantized: BlockCopier) -> None:
        """Give every row its own copy of each block another table also holds (`sharing=False`); the caller
        checked `unshare_demand` against the free blocks."""
        for blocks in self._block_lists():
            shared = [index for index, block in enumerate(blocks.ids) if blocks.pool.ref_count(block) > 1]
            if not shared:
                continue
            sources = [blocks.ids[index] for index in shared]
            fresh = blocks.pool.allocate(len(shared))
            (copy_blocks if blocks.pool is self.pool else copy_quantized)(sources, fresh)
            blocks.pool.free(sources)
            ids = list(blocks.ids)
            for index, block in zip(shared, fresh):
                ids[index] = block
            blocks.replace(ids)
        self.plan = None

    def _block_lists(self) -> list[BlockList]:
        return [blocks for row in self.rows for blocks in row.block_lists()]

    def check_crop(self, new_len: int) -> None:
        """Raise (changing nothing) if cropping to `new_len` would need tokens that were already dropped."""
        needed_from = self.read_offset(new_len)
        for index, row in enumerate(self.rows):
            if row.kept_positions is not None:  # evicted (full attention only): its survivors are what it has
                if new_len > 0:
                    self.stored_before(index, new_len)  # per-head rows: raises if the heads would differ
                continue
            first = self.first_stored(index)
            if first > row.pads and needed_from < first:
                raise RuntimeError(
                    f"Cannot crop the {self.name} layers to {new_len} tokens: their sliding window already dropped "
                    f"positions before {first}. Call `cache.activate_past_recording()` before generating "
                    "to keep them until the crop."
                )

    def crop(self, new_len: int) -> None:
        """Forget every token at or after logical position `new_len`."""
        if new_len == 0:
            self.release()
            return
        for index, row in enumerate(self.rows):
            if row.kept_positions is not None:
                self._crop_compacted(index, new_len)
            elif row.quantized is not None and len(row.quantized) and new_len < row.base:  # into the sealed prefix
                first = self.first_stored(index)
                keep = max(new_len - first, 0) // self.block_size
                row.quantized.truncate(keep)
                row.blocks.free_all()
                row.base = first + keep * self.block_size
            row.blocks.truncate(ceil_div(max(new_len - row.base, 0), self.block_size))
        self.length = new_len
        self.plan = None

    def _crop_compacted(self, index: int, new_len: int) -> None:
        """Crop a compacted row: its survivors up to `new_len`, by stored index (`base` is virtual)."""
        row = self.rows[index]
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
        return self.pool, None

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

class QuantizedBlockTables(BlockTables):
    """Block tables whose rows start with sealed quantized blocks (ids of a second pool, `qpool`).

    Sealing follows positions, not step sizes. A token at position p reads quantized every block that ends
    at least `R = max(residual_length, 1)` positions before p + 1, as in token-by-token decoding; a step
    seals what its first new token reads that way (blocks of tokens stored before the step: a quantized
    block is allocated, every layer of the group quantizes the block into it, the full-precision block
    goes back to its pool). A step of at most R tokens seals nothing more, so a crop back to any of its
    tokens (assisted decoding) finds exactly the blocks a cache grown to that length would have sealed.
    A longer step (a prompt chunk) leaves the row as token-by-token growth would: each layer quantizes the
    blocks its new tokens complete up to R positions before the step's end straight from the new K/V
    (`StepPlan.arrivals`), so they never take a full-precision block. History is quantized exactly once;
    quantized blocks are always full, so rows share them without copy-on-write.
    """

    def __init__(self, name: str, pool: BlockPool | None, qpool: BlockPool, block_size: int,
                 sliding_window: int | None, kv_format, residual_length: int):  # fmt: skip
        super().__init__(name, pool, block_size, sliding_window)
        self.qpool = qpool
        self.kv_format = kv_format
        self.residual_length = residual_length
        # Shared full-precision block -> (its epoch, its sealed copy, that copy's epoch), shared by the forks of
        # the cache: the first table to seal a shared block seals it, the others take a reference to the copy.
        self.sealed_copies: dict[int, tuple[int, int, int]] = {}
        self._arrivals: list[tuple[int, int, list[int], int, list[int]]] = []  # this step's (`StepPlan.arrivals`)

    @property
    def window(self) -> int:
        """R: a token reads quantized the blocks that end at least R positions before it + 1."""
        return max(self.residual_length, 1)

    def _new_row(self, pad: int) -> Row:
        return Row(pads=pad, base=pad, blocks=BlockList(self.pool), quantized=BlockList(self.qpool))

    def _seal_counts(self, q_len: int, fp_drops: list[int]) -> list[int]:
        if self.length == 0:
            return [0] * len(self.rows)
        horizon = self.length + 1 - self.window  # what the step's first token reads quantized
        return [
            max(min(max(horizon - row.base, 0) // self.block_size, len(row.blocks)) - drop, 0)
            for row, drop in zip(self.rows, fp_drops)
        ]

    def _transition(self, q_len: int, stored: int, new: int) -> int:
        """Blocks from the start of a row's full-precision tokens (`stored` of them after the step's drops, then
        `new`) that some but not all of the step's tokens read quantized: those ending R positions or more
        before the step's end."""
        return max((stored + new - self.window) // self.block_size, 0) if q_len > 1 else 0

    def _arrival(self, q_len: int, stored: int, new: int) -> tuple[int, int, int]:
        """(blocks, of their tokens the stored ones, full-precision blocks holding those) that a step seals
        as its layers write: the transition blocks of a step longer than R, none otherwise."""
        sealed = self._transition(q_len, stored, new) if q_len > self.window else 0
        older = min(stored, sealed * self.block_size)
        return sealed, older, ceil_div(older, self.block_size)

    def _row_growth(self, q_len: int, pads: list[int], drops: list[int]):
        """As `BlockTables._row_growth`, with the blocks sealed as they arrive taken out."""
        for stored, held, new in super()._row_growth(q_len, pads, drops):
            sealed, older, blocks = self._arrival(q_len, stored, new)
            yield stored - older, held - blocks, new - (sealed * self.block_size - older)

    def _take_arrivals(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> None:
        self._arrivals = []
        for index, row in enumerate(self.rows):
            new = q_len if self.length else q_len - pads[index]
            sealed, older, blocks = self._arrival(q_len, self.stored_tokens(index), new)
            if not sealed or index in mirrors:
                continue
            sources = row.blocks.ids[:blocks]  # every layer kept a copy of their tokens (`_seal`)
            row.blocks.drop_front(blocks)
            last = row.quantized.ids[-1] if len(row.quantized) else None
            fresh = self.qpool.allocate(sealed, after=last)
            row.quantized.append_fresh(fresh)
            row.base += sealed * self.block_size
            self._arrivals.append((index, q_len - new, sources, older, fresh))

    def _make_plan(self, q_len: int, new_tokens: list[int], mirrors: dict[int, int]) -> StepPlan:
        plan = super()._make_plan(q_len, new_tokens, mirrors)
        plan.arrivals = self._arrivals
        if q_len > self.window:
            sealed = {row: len(fresh) for row, _first, _sources, _older, fresh in self._arrivals}
            plan.transition = [sealed.get(mirrors.get(row, row), 0) for row in range(len(self.rows))]
        else:
            plan.transition = [self._transition(q_len, self.stored_tokens(row), 0) for row in range(len(self.rows))]
        plan.transition = [0 if row.kept_positions is not None else count
                           for row, count in zip(self.rows, plan.transition)]  # fmt: skip
        return plan

    def _sealed_blocks(self, q_len: int) -> list[list[int]]:
        """Per row, the full-precision block ids a step of `q_len` tokens seals."""
        window = [fp for _quantized, fp in self._window_drops()]
        seals = self._seal_counts(q_len, window)
        return [row.blocks.ids[drop : drop + seal] for row, drop, seal in zip(self.rows, window, seals)]

    def demands(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> list[tuple[BlockPool, int, int, str]]:
        sealed = {block for blocks in self._sealed_blocks(q_len) for block in blocks}
        quantized_drops = [(row.quantized, drop) for row, (drop, _fp) in zip(self.rows, self._window_drops())]
        freed = blocks_freed(quantized_drops) if self.rows else 0
        drops = self._step_drops(q_len)
        arrivals = [self._arrival(q_len, stored, new)
                    for stored, _held, new in BlockTables._row_growth(self, q_len, pads, drops)]  # fmt: skip
        needed = len(sealed) + sum(sealed for row, (sealed, _, _) in enumerate(arrivals) if row not in mirrors)
        ((pool, fp_needed, _freed, name),) = super().demands(q_len, pads, mirrors)
        # The full-precision blocks sealed with new tokens follow the drops, and go back to the pool with them.
        leading = [(row.blocks, drop + blocks) for row, drop, (_, _, blocks) in zip(self.rows, drops, arrivals)]
        fp_freed = blocks_freed(leading)
        return [(pool, fp_needed, fp_freed if self.rows else 0, name),
                (self.qpool, needed, freed, f"{self.name} (quantized)")]  # fmt: skip

    def _seal(self, q_len: int, seal_blocks: BlockCopier) -> None:
        sealed: dict[int, int] = {}  # fp block -> its quantized block (rows sharing a block share its copy)
        for row, blocks in zip(self.rows, self._sealed_blocks(q_len)):
            for block in blocks:
                copy = self._sealed_copy(block)
                if copy is not None:
                    row.quantized.append_shared(copy, fresh=False)
                    continue
                fresh = block not in sealed
                if fresh:
                    last = row.quantized.ids[-1] if len(row.quantized) else None
                    (sealed[block],) = self.qpool.allocate(1, after=last)
                row.quantized.append_shared(sealed[block], fresh)
        for block, copy in sealed.items():
            if self.pool.ref_count(block) > sum(block in ids for ids in self.tables):  # a fork holds it too
                self.sealed_copies[block] = (self.pool.epoch(block), copy, self.qpool.epoch(copy))
        keep = self._kept_blocks(q_len)
        if sealed or keep:
            seal_blocks(list(sealed), list(sealed.values()), keep)

    def _kept_blocks(self, q_len: int) -> list[int]:
        """The full-precision blocks whose tokens a step seals along with new ones: each layer keeps a copy of
        them when the step is planned, before any block the step frees can be handed out again."""
        drops, keep = self._step_drops(q_len), {}
        for index, (stored, _held, new) in enumerate(BlockTables._row_growth(self, q_len, [], drops)):
            blocks = self._arrival(q_len, stored, new)[2]
            keep.update(dict.fromkeys(self.rows[index].blocks.ids[drops[index] : drops[index] + blocks]))
        return list(keep)

    def _sealed_copy(self, block: int) -> int | None:
        """The sealed copy a fork already made of `block`, if both are still the blocks they were."""
        entry = self.sealed_copies.get(block)
        if entry is None:
            return None
        epoch, copy, copy_epoch = entry
        if self.pool.epoch(block) == epoch and self.qpool.ref_count(copy) and self.qpool.epoch(copy) == copy_epoch:
            return copy
        del self.sealed_copies[block]  # the block or its copy was freed and reused since
        return None

    def check_crop(self, new_len: int) -> None:
        """Cropping inside a row's quantized prefix is exact only at a block boundary (whole quantized
        blocks are dropped; none is re-quantized); anywhere else it raises, changing nothing."""
        for index, row in enumerate(self.rows):
            if row.kept_positions is not None and new_len > 0:
                if self.stored_before(index, new_len) < self.quantized_tokens(index):
                    raise RuntimeError(
                        f"Cannot crop the {self.name} layers to {new_len} tokens: row {index} was compacted by "
                        "eviction and the crop would reach into its quantized blocks; crop fewer tokens."
                    )
                continue
            offset = new_len - self.first_stored(index)
            if new_len > 0 and len(row.quantized) and new_len < row.base and offset > 0 and offset % self.block_size:
                lower = new_len - offset % self.block_size
                raise RuntimeError(
                    f"Cannot crop the {self.name} layers to {new_len} tokens: position {new_len} lies inside a "
                    f"quantized block (row {index}), and a quantized block is never re-quantized or split. Crop to "
                    f"a block boundary ({lower} or {lower + self.block_size}) or into the full-precision tokens "
                    f"(>= {row.base}), or raise `residual_length` (now {self.residual_length}) so that more "
                    "recent tokens stay in full precision."
                )
        super().check_crop(new_len)

    def remap_sealed_copies(self, old_to_new: Renumbering) -> None:
        """Renumber the sealed-copy records, shared by the forks (so once per family), ahead of the pools' remap:
        records of stale or unreferenced blocks are forgotten."""
        fp, quantized = old_to_new[self.pool], old_to_new[self.qpool]
        live = {
            fp[block]: quantized[copy] for block, (epoch, copy, copy_epoch) in self.sealed_copies.items()
            if block in fp and copy in quantized and self.pool.epoch(block) == epoch
            and self.qpool.epoch(copy) == copy_epoch
        }  # fmt: skip
        self.sealed_copies.clear()
        self.sealed_copies.update({block: (self.pool.remapped_epoch(block), copy, self.qpool.remapped_epoch(copy))
                                   for block, copy in live.items()})  # fmt: skip

    def pools(self) -> tuple[BlockPool | None, BlockPool | None]:
        return self.pool, self.qpool
