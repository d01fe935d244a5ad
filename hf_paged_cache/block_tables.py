"""Per-row block tables of one group of layers that always hold the same tokens.

All full-attention layers of a model see the same tokens, so they share one set of tables (and one
`BlockPool` of ids); sliding-window layers of one window size share another. A layer's storage is
indexed by these ids, so a step is planned once per group and every layer of the group reuses the plan.

Per row the state is explicit:
- `pads[b]`: left-padding tokens, which occupy no blocks;
- `base[b]`: logical position held by slot 0 of the row's first block (tokens are stored contiguously
  from there on; sliding groups advance it when whole blocks leave the window);
- `tables[b]`: block ids, in order;
- `run_from[b]`: index in `tables[b]` from which the ids are consecutive, so a read that starts there
  is a view of the storage rather than a copy.
The logical length (`length`) counts pads and is shared by every row, as in `DynamicCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_pool import NULL_BLOCK, BlockPool


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepPlan:
    """What one forward step writes and reads for a group; computed once, used by each of its layers.

    Stored indices count a row's stored tokens from slot 0 of its first block.
    """

    q_len: int
    new_len: int  # logical length after the step
    kv_offset: int  # first logical position attention reads
    write_slots: torch.Tensor  # int64 [stored new tokens]: destination slot of each, row-major
    write_tokens: torch.Tensor | None  # int64: which of the B*q new tokens are stored (None: all of them)
    read_start: list[int]  # per row: first stored index to read
    read_stop: list[int]  # per row: stored tokens after the step (exclusive end of the read)
    new_tokens: list[int]  # per row: stored new tokens of this step
    run_start: list[int | None]  # per row: first block id when the read is one contiguous run, else None
    padding_exact: bool  # every stored token is a real one (no padding was stored)
    tables: BlockTables
    # Per row, the logical position of slot 0 of the first full-precision block (virtual after an
    # eviction compacted the row: see `BlockTables.compact`).
    base: list[int] = field(default_factory=list)
    # Quantized groups only: per row, the sealed (quantized) block ids that precede the full-precision blocks.
    quantized_tables: list[list[int]] = field(default_factory=list)
    _memo: dict = field(default_factory=dict, repr=False)

    def tensor(self, name: str, device: torch.device) -> torch.Tensor:
        """A plan tensor on `device`, built and moved once per step (each layer may live elsewhere)."""
        key = (name, device)
        if key not in self._memo:
            self._memo[key] = self._build(name).to(device)
        return self._memo[key]

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
        if name == "seq_lens":  # every stored token the kernels read: a quantized prefix, then full precision
            prefix = [len(table) * self.tables.block_size for table in self.quantized_tables] or [0] * len(self.read_stop)
            return torch.tensor([q + stop for q, stop in zip(prefix, self.read_stop)], dtype=torch.int32)
        if name == "quantized_lens":
            return torch.tensor([len(table) * self.tables.block_size for table in self.quantized_tables], dtype=torch.int32)
        if name == "quantized_block_tables":
            width = max((len(table) for table in self.quantized_tables), default=0)
            rows = [table + [NULL_BLOCK] * (width - len(table)) for table in self.quantized_tables]
            return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), width)
        if name == "query_lens":
            return torch.tensor(self.new_tokens, dtype=torch.int32)
        raise KeyError(name)


class BlockTables:
    """Block tables, pads and lengths for the rows of one layer group, plus the step planning."""

    def __init__(self, name: str, pool: BlockPool | None, block_size: int, sliding_window: int | None = None):
        self.name = name
        self.pool = pool  # None until a `max_memory` cache learns its bytes per block
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.record_past = False
        self.padding_exact = True
        self.plan: StepPlan | None = None
        self._clear()

    def _clear(self) -> None:
        self.length = 0
        self.tables: list[list[int]] = []
        self.pads: list[int] = []
        self.base: list[int] = []
        self.run_from: list[int] = []
        # Eviction: per row, the logical positions of the tokens that survived the last compaction (None:
        # never compacted); tokens stored since then follow contiguously. See `compact`.
        self.kept_positions: list[torch.Tensor | None] = []
        self.plan = None

    @property
    def batch_size(self) -> int | None:
        return len(self.tables) if self.length > 0 else None

    def stored_tokens(self, row: int) -> int:
        """Full-precision tokens the row stores."""
        return max(self.length - self.base[row], 0) if self.length > 0 else 0

    def stored_count(self, row: int) -> int:
        """Every token the row stores (quantized groups add their quantized prefix)."""
        return self.stored_tokens(row)

    @property
    def compacted(self) -> bool:
        """Whether some row lost tokens from the middle (eviction): stored tokens are then no longer the
        contiguous logical range [base, length), and only readers that go by stored index are exact."""
        return any(kept is not None for kept in self.kept_positions)

    def stored_positions(self, row: int) -> torch.Tensor:
        """Logical position of each stored token of the row, in stored order (int64 `[stored_count]`).

        After a compaction `base` is virtual (`length - stored_count`), so that new tokens keep their
        slots and positions; the true positions of the survivors are remembered in `kept_positions`.
        """
        count, kept = self.stored_count(row), self.kept_positions[row] if self.kept_positions else None
        if kept is None:
            return torch.arange(self.length - count, self.length)
        return torch.cat([kept, torch.arange(self.length - (count - len(kept)), self.length)])

    # ------------------------------------------------------------------ planning a step
    def read_offset(self, length: int) -> int:
        """First logical position attention reads at a step that starts at `length` (HF's `kv_offset`)."""
        if self.sliding_window is None:
            return 0
        return max(length - self.sliding_window + 1, 0)

    def demands(self, q_len: int, pads: list[int]) -> list[tuple[BlockPool, int, int, str]]:
        """Per pool of the group: (pool, blocks the step allocates, blocks it returns, name for errors)."""
        return [(self.pool, *self.blocks_needed(q_len, pads), self.name)]

    def blocks_needed(self, q_len: int, pads: list[int]) -> tuple[int, int]:
        """(blocks the step must allocate, blocks its drops would return to the free queue)."""
        drops = self._step_drops(q_len)
        returned = {}
        for row, count in enumerate(drops):
            for block in self.tables[row][:count] if self.tables else ():
                returned[block] = returned.get(block, 0) + 1
        freed = sum(1 for block, refs in returned.items() if self.pool.ref_count(block) == refs)
        needed = 0
        for row, (stored, held, new) in enumerate(self._row_growth(q_len, pads, drops)):
            needed += max(_ceil_div(stored + new, self.block_size) - held, 0)
            if new and stored % self.block_size and self.pool.ref_count(self.tables[row][-1]) > 1:
                needed += 1  # copy-on-write of a shared, partly filled last block
        return needed, freed

    def _step_drops(self, q_len: int) -> list[int]:
        """Leading blocks per row that leave the (full-precision) tables at a step of `q_len` tokens."""
        return self._drops()

    def _drops(self, keep_past: bool | None = None) -> list[int]:
        """Leading blocks per row that lie wholly before the next step's window (sliding groups only)."""
        keep_past = self.record_past if keep_past is None else keep_past
        if self.sliding_window is None or keep_past or self.length == 0:
            return [0] * len(self.tables)
        keep_from = self.read_offset(self.length)
        return [max(keep_from - base, 0) // self.block_size for base in self.base]

    def _drop_front(self, row: int, count: int) -> None:
        table = self.tables[row]
        self.pool.free(table[:count])
        del table[:count]
        self.base[row] += count * self.block_size
        self.run_from[row] = max(self.run_from[row] - count, 0)

    def _row_growth(self, q_len: int, pads: list[int], drops: list[int]):
        """Per row: (stored tokens after drops, blocks held after drops, new stored tokens)."""
        rows = len(pads) if self.length == 0 else len(self.tables)
        for row in range(rows):
            if self.length == 0:
                yield 0, 0, q_len - pads[row]
            else:
                stored = self.stored_tokens(row) - drops[row] * self.block_size
                yield stored, len(self.tables[row]) - drops[row], q_len

    def apply_step(self, q_len: int, pads: list[int], copy_blocks, seal_blocks=None) -> StepPlan:
        """Drop, copy-on-write and allocate for a step of `q_len` tokens; the caller checked the free blocks.

        `copy_blocks(src, dst)` copies block contents in every layer of the group (for copy-on-write);
        `seal_blocks` is used by quantized groups only. Both are passed per step rather than stored, so the
        tables hold no reference to the layers (copies and pickles of a cache stay independent).
        """
        bs = self.block_size
        start = self.length
        if start == 0:
            self.tables = [[] for _ in pads]
            self.pads = list(pads)
            self.base = list(pads)
            self.run_from = [0] * len(pads)
            self.kept_positions = [None] * len(pads)
        drops = self._step_drops(q_len)
        cow_src, cow_dst = [], []
        write_slots, write_tokens = [], []
        for row, ((stored, _held, new), drop) in enumerate(zip(self._row_growth(q_len, pads, drops), drops)):
            table = self.tables[row]
            if drop:
                self._drop_front(row, drop)
            if new and stored % bs and self.pool.ref_count(table[-1]) > 1:
                previous = table[-1]
                (copy,) = self.pool.allocate(1, after=table[-2] if len(table) > 1 else None)
                self.pool.free([previous])
                cow_src.append(previous)
                cow_dst.append(copy)
                self._set_last(row, copy)
            extra = _ceil_div(stored + new, bs) - len(table)
            if extra > 0:
                fresh = self.pool.allocate(extra, after=table[-1] if table else None)
                table.extend(fresh)
                for index in range(max(len(table) - extra, 1), len(table)):  # the run may break inside `fresh` too
                    if table[index] != table[index - 1] + 1:
                        self.run_from[row] = index
            if new:
                first_token = row * q_len + (q_len - new)
                write_slots.append(self._slots(table, stored, new))
                write_tokens.append(torch.arange(first_token, first_token + new))
        if cow_src:
            copy_blocks(cow_src, cow_dst)
        self.length = start + q_len
        slots = torch.cat(write_slots) if write_slots else torch.empty(0, dtype=torch.long)
        tokens = torch.cat(write_tokens) if write_tokens else torch.empty(0, dtype=torch.long)
        all_written = tokens.numel() == q_len * len(self.tables)
        kv_offset = self.read_offset(start)
        read_start = [max(kv_offset - base, 0) for base in self.base]
        read_stop = [self.stored_tokens(row) for row in range(len(self.tables))]
        self.plan = StepPlan(
            q_len=q_len,
            new_len=self.length,
            kv_offset=kv_offset,
            write_slots=slots,
            write_tokens=None if all_written else tokens,
            read_start=read_start,
            read_stop=read_stop,
            new_tokens=[q_len - pads[row] if start == 0 else q_len for row in range(len(self.tables))],
            run_start=[self._run_start(row, a, b) for row, (a, b) in enumerate(zip(read_start, read_stop))],
            padding_exact=self.padding_exact,
            tables=self,
            base=list(self.base),
        )
        return self.plan

    def _set_last(self, row: int, block: int) -> None:
        table = self.tables[row]
        table[-1] = block
        if len(table) > 1 and block != table[-2] + 1:
            self.run_from[row] = len(table) - 1

    def _slots(self, table: list[int], first: int, count: int) -> torch.Tensor:
        stored = torch.arange(first, first + count)
        blocks = torch.tensor(table, dtype=torch.long)[stored // self.block_size]
        return blocks * self.block_size + stored % self.block_size

    def _run_start(self, row: int, start: int, stop: int) -> int | None:
        if stop <= start:
            return None
        first = start // self.block_size
        return self.tables[row][first] if first >= self.run_from[row] else None

    # ------------------------------------------------------------------ reading
    def table_tensor(self) -> torch.Tensor:
        """Block tables as one int64 tensor `[rows, max blocks]`, short rows padded with the null block."""
        width = max((len(table) for table in self.tables), default=0)
        return torch.tensor([table + [NULL_BLOCK] * (width - len(table)) for table in self.tables], dtype=torch.long)

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

    # ------------------------------------------------------------------ whole-batch edits
    def reorder(self, order: list[int]) -> None:
        """Row i becomes a copy of row order[i] (beam search): shares blocks by reference count."""
        tables = [list(self.tables[source]) for source in order]
        self.pool.fork(block for table in tables for block in table)
        self.pool.free(block for table in self.tables for block in table)
        self.tables = tables
        self.pads = [self.pads[source] for source in order]
        self.base = [self.base[source] for source in order]
        self.run_from = [self.run_from[source] for source in order]
        self.kept_positions = [self.kept_positions[source] for source in order]
        self.plan = None

    def first_stored(self, row: int) -> int:
        """Logical position of the first token the row still stores."""
        return self.base[row]

    def check_crop(self, new_len: int) -> None:
        """Raise (changing nothing) if cropping to `new_len` would need tokens that were already dropped."""
        needed_from = self.read_offset(new_len)
        for row in range(len(self.tables)):
            first = self.first_stored(row)
            if first > self.pads[row] and needed_from < first:
                raise RuntimeError(
                    f"Cannot crop the {self.name} layers to {new_len} tokens: their sliding window already dropped "
                    f"positions before {first}. Call `cache.activate_past_recording()` before generating "
                    "to keep them until the crop."
                )

    def crop(self, new_len: int) -> None:
        """Forget every token at or after logical position `new_len`."""
        for row, kept in enumerate(self.kept_positions):
            if kept is not None and new_len > 0:
                self._crop_compacted(row, new_len)
        for row, table in enumerate(self.tables):
            keep = _ceil_div(max(new_len - self.base[row], 0), self.block_size)
            self.pool.free(table[keep:])
            del table[keep:]
            self.run_from[row] = min(self.run_from[row], max(len(table) - 1, 0))
        self.length = new_len
        self.plan = None
        if new_len == 0:
            self._clear()

    def _crop_compacted(self, row: int, new_len: int) -> None:
        """Crop a compacted row: its survivors up to `new_len`, by stored index (`base` is virtual)."""
        positions = self.stored_positions(row)
        keep = int((positions < new_len).sum())
        self.kept_positions[row] = positions[: min(keep, len(self.kept_positions[row]))]
        self.base[row] = new_len - (keep - self.stored_count(row) + self.stored_tokens(row))

    # ------------------------------------------------------------------ eviction
    def unit_sizes(self, row: int) -> list[int]:
        """Sizes of the units a row's stored tokens are evicted in, in stored order: single tokens here."""
        return [1] * self.stored_count(row)

    def check_compact(self, keeps: dict[int, torch.Tensor]) -> None:
        """Raise (changing nothing) if compacting rows `keeps` needs more fresh blocks than are free:
        a row's shared (copy-on-write) blocks cannot be written, so its survivors go to fresh ones."""
        fresh = sum(self._fresh_needed(row, keep) for row, keep in keeps.items())
        if fresh > self.pool.num_free:
            from .errors import OutOfBlocksError

            raise OutOfBlocksError(self.name, fresh, self.pool.num_free, self.pool.num_blocks, self.block_size)

    def _fresh_needed(self, row: int, keep_fp: torch.Tensor) -> int:
        needed = _ceil_div(int(keep_fp.sum()), self.block_size)
        return sum(1 for block in self.tables[row][:needed] if self.pool.ref_count(block) > 1)

    def compact(self, row: int, keep: torch.Tensor, move_tokens) -> int:
        """Keep the row's stored tokens where `keep` (bool, stored order) is True; returns tokens evicted.

        Survivors move, in order, to the front of the row's blocks; blocks no longer needed go back to
        the pool; blocks shared with other rows are not written (fresh ones take their survivors).
        `move_tokens(src_slots, dst_slots)` moves K/V in every layer of the group (reading all sources
        before writing any). The logical length is unchanged: `base` becomes virtual.
        """
        positions = self.stored_positions(row)
        self._compact_storage(row, keep, move_tokens)
        self.kept_positions[row] = positions[keep]
        self.plan = None
        return int((~keep).sum())

    def _compact_storage(self, row: int, keep: torch.Tensor, move_tokens) -> None:
        bs, table = self.block_size, self.tables[row]
        sources = keep.nonzero().flatten()
        needed = _ceil_div(len(sources), bs)
        reusable = [block if self.pool.ref_count(block) == 1 else None for block in table[:needed]]
        self.pool.free([block for block in table if block not in reusable])
        targets = [block if block is not None else self.pool.allocate(1)[0] for block in reusable]
        src = torch.tensor(table, dtype=torch.long)[sources // bs] * bs + sources % bs if len(sources) else sources
        dst = torch.tensor(targets, dtype=torch.long).repeat_interleave(bs)[: len(sources)] * bs
        dst = dst + torch.arange(len(sources)) % bs
        moved = src != dst
        if bool(moved.any()):
            move_tokens(src[moved], dst[moved])
        self.tables[row] = targets
        self.base[row] = self.length - len(sources)
        self.run_from[row] = max((i for i in range(1, len(targets)) if targets[i] != targets[i - 1] + 1), default=0)

    def release(self) -> None:
        """Return every block to the pool and forget all rows (a pool not created yet holds none)."""
        if self.pool is not None:
            self.pool.free(block for table in self.tables for block in table)
        self._clear()

    def trim_to_window(self) -> None:
        """Free the blocks a recorded past kept beyond the window (after `crop` in assisted decoding)."""
        for row, drop in enumerate(self._drops(keep_past=False)):
            if drop:
                self._drop_front(row, drop)
        self.plan = None
