"""What one forward step writes and reads for a group of layers: `StepPlan`, made once by the group's
`BlockTables` and used by each of its layers, with the layouts readers take of the step's read range."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .pool import NULL_BLOCK
from .rows import Row


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PlannedTables(Protocol):
    """What a plan reads of the `BlockTables` that made it (this module cannot import them: they import it)."""

    block_size: int
    rows: list[Row]

    @property
    def tables(self) -> list[list[int]]: ...

    @property
    def base(self) -> list[int]: ...

    @property
    def compacted(self) -> bool: ...

    def slots(self, row: int, first: int, count: int) -> torch.Tensor: ...


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
    # Per row: the first logical position read, `kv_offset` or later where the row's first query reads less than the
    # step's window (chunked attention: the chunk it falls in began after the window's start).
    read_from: list[int]
    read_start: list[int]  # per row: first stored index to read (of `read_from`, or 0 where it is not stored)
    read_stop: list[int]  # per row: stored tokens after the step (exclusive end of the read)
    new_tokens: list[int]  # per row: stored new tokens of this step
    padding_exact: bool  # every stored token is a real one (no padding was stored)
    tables: PlannedTables
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
        """Slots of the row's full-precision stored tokens [first, first + count)."""
        return self.tables.rows[row].blocks.slots(first, count, self.tables.block_size)

    def stored_blocks(self, start: int | None = None, stop: int | None = None) -> list[int]:
        """The ids of the full-precision blocks stored tokens `start` .. `stop` - 1 of this one-row plan lie in (its
        read range by default), in order."""
        start = self.read_start[0] if start is None else start
        stop = self.read_stop[0] if stop is None else stop
        block_size = self.tables.block_size
        return self.tables.rows[0].blocks.ids[start // block_size : -(-stop // block_size)]

    def runs(self) -> list[list[tuple[int, int, int]]]:
        """Per row, the stored range [read_start, read_stop) as runs of consecutive slots: (column in the
        logical read range [kv_offset, new_len), first slot, tokens), in order. Each run is one contiguous
        stretch per head of the head-major storage, so a reader takes views of it instead of gathering slots.
        Stored index `s` stands at column `base + s - kv_offset` (virtual after a compaction)."""
        return self.cached("runs", self._read_runs)

    def _read_runs(self) -> list[list[tuple[int, int, int]]]:
        bs, runs = self.tables.block_size, []
        for row, start, stop, base in zip(self.tables.rows, self.read_start, self.read_stop, self.base):
            ids, row_runs, index = row.blocks.ids, [], start
            while index < stop:
                block = end = index // bs
                if block >= row.blocks.run_from:  # consecutive from here to the end
                    end = ceil_div(stop, bs) - 1
                while (end + 1) * bs < stop and ids[end + 1] == ids[end] + 1:
                    end += 1
                count = min((end + 1) * bs, stop) - index
                row_runs.append((base + index - self.kv_offset, ids[block] * bs + index % bs, count))
                index += count
            runs.append(row_runs)
        return runs

    def block_read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's read range as whole blocks, in stored order: (block ids `[rows, width]`, null-padded;
        the logical position of every slot of them `[rows, width * block_size]`; whether that slot is in
        the row's read range). Reading whole blocks copies `block_size` tokens per index, and rows need
        not line up by position: the mask goes by each slot's logical position instead."""
        bs, rows = self.tables.block_size, self.tables.rows
        first = [start // bs for start in self.read_start]
        counts = [max(ceil_div(stop, bs) - block, 0) for block, stop in zip(first, self.read_stop)]
        width = max(max(counts, default=0), 1)
        ids = torch.tensor([row.blocks.ids[block : block + count] + [NULL_BLOCK] * (width - count)
                            for row, block, count in zip(rows, first, counts)], dtype=torch.long)  # fmt: skip
        stored = torch.tensor(first)[:, None] * bs + torch.arange(width * bs)[None, :]
        valid = (stored >= torch.tensor(self.read_start)[:, None]) & (stored < torch.tensor(self.read_stop)[:, None])
        return ids, torch.tensor(self.base)[:, None] + stored, valid

    def gather_slots(self) -> torch.Tensor:
        """Slot of every logical position in [kv_offset, new_len) per row; unstored ones map to the null slot."""
        bs = self.tables.block_size
        positions = torch.arange(self.kv_offset, self.new_len)
        stored = positions[None, :] - torch.tensor(self.tables.base)[:, None]
        valid = stored >= 0
        stored = stored.clamp(min=0)
        table = _table_tensor(self.tables.tables)
        if table.shape[1] == 0:
            return torch.zeros(stored.shape, dtype=torch.long)
        blocks = table.gather(1, (stored // bs).clamp(max=table.shape[1] - 1))
        slots = blocks * bs + stored % bs
        return torch.where(valid, slots, NULL_BLOCK * bs)

    def _build(self, name: str) -> torch.Tensor:
        if name in ("write_slots", "write_tokens"):
            return getattr(self, name)
        if name == "slot_mapping":  # every new token's slot, -1 for padding that is not stored
            slots = torch.full((self.q_len * len(self.read_start),), -1, dtype=torch.long)
            tokens = slice(None) if self.write_tokens is None else self.write_tokens
            slots[tokens] = self.write_slots
            return slots
        if name == "read_slots":
            return self.gather_slots()
        if name == "block_tables":
            return _table_tensor(self.tables.tables).to(torch.int32)
        bs = self.tables.block_size
        if name == "seq_lens":  # every stored token the kernels read: a quantized prefix, then full precision
            return torch.tensor([len(q) * bs + stop for q, stop in zip(self.quantized_tables, self.read_stop)],
                                dtype=torch.int32)  # fmt: skip
        if name == "quantized_lens":
            return torch.tensor([len(table) * bs for table in self.quantized_tables], dtype=torch.int32)
        if name == "quantized_block_tables":
            return _table_tensor(self.quantized_tables).to(torch.int32)
        if name == "stored_origins":  # logical position of stored index 0, from the row's first real token
            origins = zip(self.base, self.quantized_tables, self.tables.rows)
            return torch.tensor([base - len(q) * bs - row.pads for base, q, row in origins], dtype=torch.int32)
        if name == "query_lens":
            return torch.tensor(self.new_tokens, dtype=torch.int32)
        raise KeyError(name)


def _table_tensor(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int64 tensor `[rows, max blocks]`, short rows padded with the null block."""
    width = max((len(table) for table in tables), default=0)
    rows = [table + [NULL_BLOCK] * (width - len(table)) for table in tables]
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), width)
