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

import torch

from .renumbering import BlockCopier, Renumbering, renumber_to_front
from .plan import StepPlan, ceil_div
from .planner import StepPlanner
from .pool import BlockPool
from .reach import Reach, SlidingWindow
from .rows import BlockList, Row


class BlockTables:
    """The rows of one layer group and their logical length; `planner` plans each step (`planner.py`: what it
    demands of the pools, then the rows' new blocks and the step's plan). Quantized groups
    (`QuantizedBlockTables`, sealing.py) plan with a `SealingPlanner`."""

    PLANNER = StepPlanner

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
        self.planner = self.PLANNER(self)

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
    def pads(self) -> list[int]:
        return [row.pads for row in self.rows]

    @property
    def base(self) -> list[int]:
        return [row.base for row in self.rows]

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

    def new_row(self, pad: int) -> Row:
        """An empty row (a quantized group's also has a table of sealed blocks)."""
        return Row(pads=pad, base=pad, blocks=BlockList(self.pool))

    def adopt(self, base: int, blocks: list[int], length: int) -> None:
        """Become one row of `length` tokens whose blocks (already referenced for it) hold positions from `base`
        on: a prefix found in the prefix cache."""
        row = self.new_row(0)
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
        twin.planner = self.PLANNER(twin)
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
            needed_from = self.planner.first_read(new_len, row)
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
        renumber_to_front([(self.pool, copy_blocks)], [functools.partial(self.remap, keep_runs=True)])
        self.pool.shrink(num_blocks)
        if plan is not None:
            self.plan = self.planner.make_plan(plan.q_len, plan.new_tokens, plan.mirrors)

    def trim_to_window(self) -> None:
        """Free the blocks a recorded past kept beyond the window (after `crop` in assisted decoding)."""
        for row, (quantized, fp) in zip(self.rows, self.planner.window_drops(keep_past=False)):
            if quantized:
                row.quantized.drop_front(quantized)
            if fp:
                row.blocks.drop_front(fp)
                row.base += fp * self.block_size
        self.plan = None

    # ------------------------------------------------------------------ state
    def pools(self) -> tuple[BlockPool | None, BlockPool | None]:
        """(full-precision pool, quantized pool): None where the group has none (yet), or seals nothing."""
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
            row = self.new_row(saved["pads"])
            row.load_state_dict(saved)
            self.rows.append(row)
        self.length, self.record_past = state["length"], state["record_past"]
        self.padding_exact = state["padding_exact"]
        self.plan = None
