"""Quantized groups: `QuantizedBlockTables`, the block tables whose rows start with sealed quantized blocks.

They are `BlockTables` whose planner (`SealingPlanner`) also decides which full-precision blocks each step seals
(quantizes into blocks of a second pool) and when; it changes the base planning only through its sealing hooks.
"""

from __future__ import annotations

from .renumbering import Renumbering
from .plan import StepPlan, ceil_div
from .pool import BlockPool
from .reach import Reach
from .rows import BlockList, Row, blocks_freed
from .planner import BlockSealer, StepPlanner
from .tables import BlockTables


class SealingPlanner(StepPlanner):
    """The planning of a quantized group's step: which full-precision blocks it seals, and when (see
    `QuantizedBlockTables`); its tables are a `QuantizedBlockTables`."""

    def __init__(self, tables):
        super().__init__(tables)
        self._arrivals: list[tuple[int, int, list[int], int, list[int]]] = []  # this step's (`StepPlan.arrivals`)

    def _seal_counts(self, q_len: int, fp_drops: list[int]) -> list[int]:
        tables = self.tables
        if tables.length == 0:
            return [0] * len(tables.rows)
        horizon = tables.length + 1 - tables.window  # what the step's first token reads quantized
        return [
            max(min(max(horizon - row.base, 0) // tables.block_size, len(row.blocks)) - drop, 0)
            for row, drop in zip(tables.rows, fp_drops)
        ]

    def _transition(self, q_len: int, stored: int, new: int) -> int:
        """Blocks from the start of a row's full-precision tokens (`stored` of them after the step's drops, then
        `new`) that some but not all of the step's tokens read quantized: those ending R positions or more
        before the step's end."""
        tables = self.tables
        return max((stored + new - tables.window) // tables.block_size, 0) if q_len > 1 else 0

    def _arrival(self, q_len: int, stored: int, new: int) -> tuple[int, int, int]:
        """The transition blocks of a step longer than R, none otherwise."""
        tables = self.tables
        sealed = self._transition(q_len, stored, new) if q_len > tables.window else 0
        older = min(stored, sealed * tables.block_size)
        return sealed, older, ceil_div(older, tables.block_size)

    def _take_arrivals(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> None:
        tables = self.tables
        self._arrivals = []
        for index, row in enumerate(tables.rows):
            new = q_len if tables.length else q_len - pads[index]
            sealed, older, blocks = self._arrival(q_len, tables.stored_tokens(index), new)
            if not sealed or index in mirrors:
                continue
            sources = row.blocks.ids[:blocks]  # every layer kept a copy of their tokens (`_seal`)
            row.blocks.drop_front(blocks)
            last = row.quantized.ids[-1] if len(row.quantized) else None
            fresh = tables.qpool.allocate(sealed, after=last)
            row.quantized.append_fresh(fresh)
            row.base += sealed * tables.block_size
            self._arrivals.append((index, q_len - new, sources, older, fresh))

    def make_plan(self, q_len: int, new_tokens: list[int], mirrors: dict[int, int]) -> StepPlan:
        tables, plan = self.tables, super().make_plan(q_len, new_tokens, mirrors)
        plan.arrivals = self._arrivals
        if q_len > tables.window:
            sealed = {row: len(fresh) for row, _first, _sources, _older, fresh in self._arrivals}
            plan.transition = [sealed.get(mirrors.get(row, row), 0) for row in range(len(tables.rows))]
        else:
            plan.transition = [self._transition(q_len, tables.stored_tokens(row), 0) for row in range(len(tables.rows))]
        plan.transition = [0 if row.kept_positions is not None else count
                           for row, count in zip(tables.rows, plan.transition)]  # fmt: skip
        return plan

    def _sealed_blocks(self, q_len: int) -> list[list[int]]:
        """Per row, the full-precision block ids a step of `q_len` tokens seals."""
        window = [fp for _quantized, fp in self.window_drops()]
        seals = self._seal_counts(q_len, window)
        return [row.blocks.ids[drop : drop + seal] for row, drop, seal in zip(self.tables.rows, window, seals)]

    def demands(self, q_len: int, pads: list[int], mirrors: dict[int, int]) -> list[tuple[BlockPool, int, int, str]]:
        tables = self.tables
        sealed = {block for blocks in self._sealed_blocks(q_len) for block in blocks}
        quantized_drops = [(row.quantized, drop) for row, (drop, _fp) in zip(tables.rows, self.window_drops())]
        freed = blocks_freed(quantized_drops) if tables.rows else 0
        drops = self._step_drops(q_len)
        arrivals = [self._arrival(q_len, stored, new)
                    for stored, _held, new in self._stored_growth(q_len, pads, drops)]  # fmt: skip
        needed = len(sealed) + sum(sealed for row, (sealed, _, _) in enumerate(arrivals) if row not in mirrors)
        ((pool, fp_needed, _freed, name),) = super().demands(q_len, pads, mirrors)
        # The full-precision blocks sealed with new tokens follow the drops, and go back to the pool with them.
        leading = [(row.blocks, drop + blocks) for row, drop, (_, _, blocks) in zip(tables.rows, drops, arrivals)]
        fp_freed = blocks_freed(leading)
        return [(pool, fp_needed, fp_freed if tables.rows else 0, name),
                (tables.qpool, needed, freed, f"{tables.name} (quantized)")]  # fmt: skip

    def _seal(self, q_len: int, seal_blocks: BlockSealer) -> None:
        sealed: dict[int, int] = {}  # fp block -> its quantized block (rows sharing a block share its copy)
        for row, blocks in zip(self.tables.rows, self._sealed_blocks(q_len)):
            for block in blocks:
                copy = self._sealed_copy(block)
                if copy is not None:
                    row.quantized.append_shared(copy, fresh=False)
                    continue
                fresh = block not in sealed
                if fresh:
                    last = row.quantized.ids[-1] if len(row.quantized) else None
                    (sealed[block],) = self.tables.qpool.allocate(1, after=last)
                row.quantized.append_shared(sealed[block], fresh)
        tables = self.tables
        for block, copy in sealed.items():
            if tables.pool.ref_count(block) > sum(block in ids for ids in tables.tables):  # a fork holds it too
                tables.sealed_copies[block] = (tables.pool.epoch(block), copy, tables.qpool.epoch(copy))
        keep = self._kept_blocks(q_len)
        if sealed or keep:
            seal_blocks(list(sealed), list(sealed.values()), keep)

    def _kept_blocks(self, q_len: int) -> list[int]:
        """The full-precision blocks whose tokens a step seals along with new ones: each layer keeps a copy of
        them when the step is planned, before any block the step frees can be handed out again."""
        drops, keep = self._step_drops(q_len), {}
        for index, (stored, _held, new) in enumerate(self._stored_growth(q_len, [], drops)):
            blocks = self._arrival(q_len, stored, new)[2]
            keep.update(dict.fromkeys(self.tables.rows[index].blocks.ids[drops[index] : drops[index] + blocks]))
        return list(keep)

    def _sealed_copy(self, block: int) -> int | None:
        """The sealed copy a fork already made of `block`, if both are still the blocks they were."""
        tables = self.tables
        entry = tables.sealed_copies.get(block)
        if entry is None:
            return None
        epoch, copy, copy_epoch = entry
        if (tables.pool.epoch(block) == epoch and tables.qpool.ref_count(copy)
                and tables.qpool.epoch(copy) == copy_epoch):  # fmt: skip
            return copy
        del tables.sealed_copies[block]  # the block or its copy was freed and reused since
        return None


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

    PLANNER = SealingPlanner

    def __init__(self, name: str, pool: BlockPool | None, qpool: BlockPool, block_size: int,
                 reach: Reach | int | None, kv_format, residual_length: int):  # fmt: skip
        super().__init__(name, pool, block_size, reach)
        self.qpool = qpool
        self.kv_format = kv_format
        self.residual_length = residual_length
        # Shared full-precision block -> (its epoch, its sealed copy, that copy's epoch), shared by the forks of
        # the cache: the first table to seal a shared block seals it, the others take a reference to the copy.
        self.sealed_copies: dict[int, tuple[int, int, int]] = {}

    @property
    def window(self) -> int:
        """R: a token reads quantized the blocks that end at least R positions before it + 1."""
        return max(self.residual_length, 1)

    def pools(self) -> tuple[BlockPool | None, BlockPool]:
        return self.pool, self.qpool

    def new_row(self, pad: int) -> Row:
        return Row(pads=pad, base=pad, blocks=BlockList(self.pool), quantized=BlockList(self.qpool))

    def _crop_row(self, index: int, new_len: int) -> None:
        """A crop into the sealed prefix keeps the whole sealed blocks before `new_len` and no full-precision one."""
        row = self.rows[index]
        if row.kept_positions is None and len(row.quantized) and new_len < row.base:
            first = self.first_stored(index)
            keep = max(new_len - first, 0) // self.block_size
            row.quantized.truncate(keep)
            row.blocks.free_all()
            row.base = first + keep * self.block_size
        super()._crop_row(index, new_len)

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

