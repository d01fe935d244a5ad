"""Quantized KV storage: block tables with a sealed quantized prefix, and the layers that store it.

A quantized group's row is a prefix of *sealed* quantized blocks (ids of the group's second pool,
`qpool`) followed by full-precision blocks (the ordinary tables). At each step's planning, every
full-precision block that holds only tokens stored before the step and lies wholly before the most
recent `residual_length` tokens (counted after the step) is sealed: a quantized block is allocated,
every layer of the group quantizes the block into it (one vectorized `quantize` per layer for all
blocks sealed at the step), and the full-precision block goes back to its pool. Only tokens stored
before the step are sealed, so no layer has written the step's new tokens yet and a freed block may be
reused (or be a copy-on-write target) in the same step. History is quantized exactly once, never again.
Quantized blocks are always full, so beam search shares them without copy-on-write.

Reads: the `"paged"` attention (`QuantizedLayer.attend`) dequantizes runs of at most `CHUNK_TOKENS`
quantized tokens at a time and merges the chunks with an online softmax, so no full-precision copy of
the quantized history ever exists (only a bounded transient one per chunk).
Other attention implementations need K/V tensors from `update()`: they get a transient dequantized copy.
Under the Triton backend the kernels read the quantized prefix themselves (dequantizing in registers,
`kernels.QuantizedKV`) and `kernels.quantize_blocks` seals blocks in one launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .attention import attend
from .block_pool import BlockPool
from .block_tables import BlockTables, StepPlan
from .layers import PagedLayer, PagedSlidingLayer
from .quantization import KVFormat

CHUNK_TOKENS = 2048  # quantized tokens dequantized at a time by the paged read (a bounded transient)


class QuantizedBlockTables(BlockTables):
    """`BlockTables` whose rows start with sealed quantized blocks (`qtables`, ids of `qpool`).

    `base[row]` is the logical position of the first *full-precision* block; the quantized prefix covers
    `[base - len(qtables[row]) * block_size, base)`.
    """

    def __init__(
        self,
        name: str,
        pool: BlockPool | None,
        qpool: BlockPool | None,
        block_size: int,
        sliding_window: int | None,
        kv_format: KVFormat,
        residual_length: int,
    ):
        self.qpool = qpool
        self.kv_format = kv_format
        self.residual_length = residual_length
        super().__init__(name, pool, block_size, sliding_window)

    def _clear(self) -> None:
        super()._clear()
        self.qtables: list[list[int]] = []

    def quantized_base(self, row: int) -> int:
        return self.base[row] - len(self.qtables[row]) * self.block_size

    def quantized_tokens(self, row: int) -> int:
        return len(self.qtables[row]) * self.block_size if self.length > 0 else 0

    def stored_count(self, row: int) -> int:
        return self.quantized_tokens(row) + self.stored_tokens(row)

    # ------------------------------------------------------------------ eviction
    def unit_sizes(self, row: int) -> list[int]:
        """Quantized blocks are evicted whole (their tokens share scales and are never re-quantized)."""
        return [self.block_size] * len(self.qtables[row]) + [1] * self.stored_tokens(row)

    def check_compact(self, keeps: dict[int, torch.Tensor]) -> None:
        super().check_compact({row: keep[self.quantized_tokens(row) :] for row, keep in keeps.items()})

    def _compact_storage(self, row: int, keep: torch.Tensor, move_tokens) -> None:
        """Drop the quantized blocks `keep` leaves out (no data moves), compact the full-precision rest."""
        split = self.quantized_tokens(row)
        kept_blocks = keep[:split].view(-1, self.block_size).all(dim=1).tolist() if split else []
        table = self.qtables[row]
        self.qpool.free([block for block, kept in zip(table, kept_blocks) if not kept])
        self.qtables[row] = [block for block, kept in zip(table, kept_blocks) if kept]
        super()._compact_storage(row, keep[split:], move_tokens)

    # ------------------------------------------------------------------ planning
    def _quantized_drops(self, keep_past: bool | None = None) -> list[int]:
        """Leading quantized blocks per row wholly before the next step's window (sliding groups only)."""
        keep_past = self.record_past if keep_past is None else keep_past
        if self.sliding_window is None or keep_past or self.length == 0:
            return [0] * len(self.qtables)
        keep_from = self.read_offset(self.length)
        return [
            min(max(keep_from - self.quantized_base(row), 0) // self.block_size, len(table))
            for row, table in enumerate(self.qtables)
        ]

    def _seals(self, q_len: int, window_drops: list[int]) -> list[int]:
        """Full-precision blocks per row (after the window drops) that a step of `q_len` tokens seals."""
        if self.length == 0:
            return [0] * len(self.tables)
        horizon = min(self.length, self.length + q_len - self.residual_length)
        return [
            max(min(max(horizon - base, 0) // self.block_size, len(table)) - drop, 0)
            for base, table, drop in zip(self.base, self.tables, window_drops)
        ]

    def _step_drops(self, q_len: int) -> list[int]:
        window = self._drops()
        return [drop + seal for drop, seal in zip(window, self._seals(q_len, window))]

    def demands(self, q_len: int, pads: list[int]) -> list[tuple[BlockPool, int, int, str]]:
        window = self._drops()
        sealed = {
            block
            for table, drop, seal in zip(self.tables, window, self._seals(q_len, window))
            for block in table[drop : drop + seal]
        }
        returned: dict[int, int] = {}
        for table, count in zip(self.qtables, self._quantized_drops()):
            for block in table[:count]:
                returned[block] = returned.get(block, 0) + 1
        freed = sum(1 for block, refs in returned.items() if self.qpool.ref_count(block) == refs)
        return [*super().demands(q_len, pads), (self.qpool, len(sealed), freed, f"{self.name} (quantized)")]

    def apply_step(
        self, q_len: int, pads: list[int], copy_blocks, seal_blocks: Callable[[list[int], list[int]], None] | None
    ) -> StepPlan:
        """Drop quantized blocks that left the window, seal blocks (`seal_blocks(fp block ids, quantized block ids)`
        quantizes them in every layer of the group), then plan the full-precision part as usual (which
        frees the sealed blocks)."""
        if self.length > 0:
            for row, count in enumerate(self._quantized_drops()):
                if count:
                    self.qpool.free(self.qtables[row][:count])
                    del self.qtables[row][:count]
            window = self._drops()
            sealed: dict[int, int] = {}  # fp block -> its quantized block (rows sharing a block share its copy)
            for row, (drop, seal) in enumerate(zip(window, self._seals(q_len, window))):
                for block in self.tables[row][drop : drop + seal]:
                    if block in sealed:
                        self.qpool.fork([sealed[block]])
                    else:
                        qtable = self.qtables[row]
                        (sealed[block],) = self.qpool.allocate(1, after=qtable[-1] if qtable else None)
                    self.qtables[row].append(sealed[block])
            if sealed:
                seal_blocks(list(sealed), list(sealed.values()))
        else:
            self.qtables = [[] for _ in pads]
        plan = super().apply_step(q_len, pads, copy_blocks)
        plan.quantized_tables = [list(table) for table in self.qtables]
        return plan

    # ------------------------------------------------------------------ whole-batch edits
    def reorder(self, order: list[int]) -> None:
        qtables = [list(self.qtables[source]) for source in order]
        self.qpool.fork(block for table in qtables for block in table)
        self.qpool.free(block for table in self.qtables for block in table)
        super().reorder(order)
        self.qtables = qtables

    def first_stored(self, row: int) -> int:
        return self.quantized_base(row)

    def check_crop(self, new_len: int) -> None:
        """Cropping inside a row's quantized prefix is exact only at a block boundary (whole quantized
        blocks are dropped; none is re-quantized); anywhere else it raises, changing nothing."""
        for row, table in enumerate(self.qtables):
            if self.kept_positions[row] is not None and new_len > 0:
                if int((self.stored_positions(row) < new_len).sum()) < self.quantized_tokens(row):
                    raise RuntimeError(
                        f"Cannot crop the {self.name} layers to {new_len} tokens: row {row} was compacted by "
                        "eviction and the crop would reach into its quantized blocks; crop fewer tokens."
                    )
                continue
            offset = new_len - self.quantized_base(row)
            if new_len > 0 and table and new_len < self.base[row] and offset > 0 and offset % self.block_size:
                lower = new_len - offset % self.block_size
                raise RuntimeError(
                    f"Cannot crop the {self.name} layers to {new_len} tokens: position {new_len} lies inside a "
                    f"quantized block (row {row}), and a quantized block is never re-quantized or split. Crop to "
                    f"a block boundary ({lower} or {lower + self.block_size}) or into the full-precision tokens "
                    f"(>= {self.base[row]}), or raise `residual_length` (now {self.residual_length}) so that more "
                    "recent tokens stay in full precision."
                )
        super().check_crop(new_len)

    def crop(self, new_len: int) -> None:
        if new_len == 0:
            self.qpool.free(block for table in self.qtables for block in table)
        else:
            for row, table in enumerate(self.qtables):
                if table and self.kept_positions[row] is None and new_len < self.base[row]:  # into the quantized prefix
                    first = self.quantized_base(row)
                    keep = max(new_len - first, 0) // self.block_size
                    self.qpool.free(table[keep:])
                    del table[keep:]
                    self.pool.free(self.tables[row])
                    self.tables[row].clear()
                    self.base[row], self.run_from[row] = first + keep * self.block_size, 0
        super().crop(new_len)

    def release(self) -> None:
        if self.qpool is not None:
            self.qpool.free(block for table in self.qtables for block in table)
        super().release()

    def trim_to_window(self) -> None:
        for row, count in enumerate(self._quantized_drops(keep_past=False)):
            if count:
                self.qpool.free(self.qtables[row][:count])
                del self.qtables[row][:count]
        super().trim_to_window()


class QuantizedLayer(PagedLayer):
    """A full-attention layer whose history is stored quantized (the most recent tokens in full precision).

    Storage: the full-precision `key_blocks` / `value_blocks` of `PagedLayer`, plus `qkey` / `qvalue`, the
    quantized fields (codes, scale, zero) of the group's quantized pool, `[qblocks + 1, ...]` each.
    """

    is_quantized = True
    tables: QuantizedBlockTables

    def __init__(self, tables: QuantizedBlockTables, options, owner):
        super().__init__(tables, options, owner)
        self.kv_format: KVFormat = tables.kv_format
        self.qkey: dict[str, torch.Tensor] = {}
        self.qvalue: dict[str, torch.Tensor] = {}
        # Sampled reconstruction error: per "key" / "value", [sum of sample means, samples, max].
        self.error_stats = {"key": [0.0, 0, 0.0], "value": [0.0, 0, 0.0]}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.qkey, self.qvalue = self._allocate_quantized(self.tables.qpool.num_blocks + 1)

    def _allocate_quantized(self, blocks: int) -> tuple[dict, dict]:
        bs, heads = self.options.block_size, self.kv_shape[0]
        return (
            self.kv_format.key.allocate(blocks, bs, heads, self.kv_shape[1], device=self.device),
            self.kv_format.value.allocate(blocks, bs, heads, self.value_dim, device=self.device),
        )

    def _fit_pool(self) -> None:
        super()._fit_pool()
        blocks = self.tables.qpool.num_blocks + 1
        if self.qkey["codes"].shape[0] < blocks:
            grown = self._allocate_quantized(blocks)
            for old, new in zip((self.qkey, self.qvalue), grown):
                for name, tensor in old.items():
                    new[name][: tensor.shape[0]] = tensor
            self.qkey, self.qvalue = grown

    @property
    def storage_bytes(self) -> int:
        quantized = sum(t.numel() * t.element_size() for fields in (self.qkey, self.qvalue) for t in fields.values())
        return super().storage_bytes + quantized

    @property
    def quantized_block_bytes(self) -> int:
        """Bytes of one quantized block (key + value codes, scales and zero points)."""
        if not self.is_initialized:
            return 0
        bs, heads = self.options.block_size, self.kv_shape[0]
        return self.kv_format.key.bytes_per_block(bs, heads, self.kv_shape[1]) + self.kv_format.value.bytes_per_block(
            bs, heads, self.value_dim
        )

    # ------------------------------------------------------------------ sealing
    @torch.no_grad()
    def seal(self, sources: list[int], targets: list[int]) -> None:
        """Quantize full-precision blocks `sources` into quantized blocks `targets` (one call per K / V);
        the first of them is decoded again to sample the reconstruction error."""
        if not self.is_initialized:
            return
        self._fit_pool()
        src = torch.tensor(sources, device=self.device)
        dst = torch.tensor(targets, device=self.device)
        kernels = self.uses_kernels()
        if kernels:  # one launch quantizes every block of K and V
            from .kernels import quantize_blocks

            fmt = self.kv_format
            quantize_blocks(self.key_blocks, self.value_blocks, src, self.qkey, self.qvalue, dst, fmt.key, fmt.value)
        for name, blocks, fmt, fields in (
            ("key", self.key_blocks, self.kv_format.key, self.qkey),
            ("value", self.value_blocks, self.kv_format.value, self.qvalue),
        ):
            if not kernels:
                fmt.quantize(blocks.index_select(0, src), fields, dst)
            sample = blocks[src[:1]].float()
            decoded = fmt.dequantize(fields, dst[:1])
            # Per token and head, relative to the head's mean token norm in the block (a near-zero token
            # would make its own norm a meaningless denominator).
            scale = sample.norm(dim=-1).mean(dim=1, keepdim=True).clamp(min=1e-12)
            error = (decoded - sample).norm(dim=-1) / scale
            stats = self.error_stats[name]
            stats[0] += error.mean().item()
            stats[1] += 1
            stats[2] = max(stats[2], error.max().item())

    def quant_error(self) -> dict[str, float]:
        """Mean and max relative L2 error of K and V over the sampled sealed blocks: per token and head,
        |decoded - exact| / (the head's mean |exact| over the block's tokens)."""
        result = {}
        for name, (total, count, worst) in self.error_stats.items():
            result[f"{name}_mean"] = total / count if count else 0.0
            result[f"{name}_max"] = worst
        result["samples"] = self.error_stats["key"][1]
        return result

    # ------------------------------------------------------------------ reading
    def _quantized_chunks(self, plan: StepPlan, row: int) -> list[tuple[slice | list[int], int]]:
        """(blocks, logical position of their first token) covering the row's readable quantized prefix.

        Runs of consecutive ids (the pool continues a row's run when it can) become slices, so decoding
        them reads views of the pool; each chunk holds at most `CHUNK_TOKENS` tokens. Computed once per
        step and row, shared by the group's layers.
        """
        key = ("quantized_chunks", row)
        if key not in plan._memo:
            bs, table = self.options.block_size, plan.quantized_tables[row]
            start = plan.base[row] - len(table) * bs
            first = max(plan.kv_offset - start, 0) // bs
            plan._memo[key] = [(ids, start + index * bs) for ids, index in _id_runs(table, first, bs)]
        return plan._memo[key]

    def _dequantized(self, blocks: slice, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks decoded as `[kv_heads, tokens, head_dim]` keys and values."""
        keys = self.kv_format.key.dequantize(self.qkey, blocks, dtype)
        values = self.kv_format.value.dequantize(self.qvalue, blocks, dtype)
        return keys.flatten(0, 1).transpose(0, 1), values.flatten(0, 1).transpose(0, 1)

    def stored_key_chunks(self, row: int):
        """Quantized keys decoded a run (at most `CHUNK_TOKENS`) at a time, then the full-precision ones."""
        for ids, _index in _id_runs(self.tables.qtables[row], 0, self.options.block_size):
            yield self.kv_format.key.dequantize(self.qkey, ids).flatten(0, 1).transpose(0, 1)
        yield from super().stored_key_chunks(row)

    def quantized_kv(self, plan: StepPlan, device: torch.device):
        """The quantized prefix as the Triton kernels read it (`kernels.QuantizedKV`)."""
        from .kernels.quantized import QuantizedKV

        return QuantizedKV(
            self.kv_format.key, self.kv_format.value, self.qkey, self.qvalue,
            plan.tensor("quantized_block_tables", device), plan.tensor("quantized_lens", device),
        )  # fmt: skip

    def _reads_quantized(self, plan: StepPlan) -> bool:
        return any(self._quantized_chunks(plan, row) for row in range(len(plan.quantized_tables)))

    def gather(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of logical positions [kv_offset, new_len), the quantized ones decoded into a transient copy
        (attention implementations other than `"paged"` need whole K/V tensors)."""
        if not self._reads_quantized(plan):
            return super().gather(plan)
        keys, values = self.read_slots(plan.tensor("read_slots", self.device))  # quantized positions read zeros
        for row in range(keys.shape[0]):
            for blocks, first in self._quantized_chunks(plan, row):
                chunk_keys, chunk_values = self._dequantized(blocks, self.dtype)
                skip = max(plan.kv_offset - first, 0)
                columns = slice(first + skip - plan.kv_offset, first + chunk_keys.shape[1] - plan.kv_offset)
                keys[row][:, columns] = chunk_keys[:, skip:]
                values[row][:, columns] = chunk_values[:, skip:]
        return keys, values

    def attend(
        self, query: torch.Tensor, plan: StepPlan, mask: torch.Tensor | None, scale: float, softcap: float | None
    ) -> torch.Tensor:
        """The `"paged"` attention over this layer: `[batch, heads, q, head_dim]`, like `attention.attend`.

        Row by row, the quantized prefix is decoded at most `CHUNK_TOKENS` tokens at a time and the
        full-precision suffix is read as a view (or gathered); the chunks are merged with an online
        softmax in float32. Steps that read nothing quantized take the unquantized path unchanged.
        """
        batch, _heads, q_len, _ = query.shape
        if not self._reads_quantized(plan):
            return attend(query, *self.read_with_mask(plan, mask, q_len), scale, softcap)
        width = plan.new_len - plan.kv_offset
        if mask is None:
            mask = torch.ones(q_len, width, dtype=torch.bool, device=query.device).tril(width - q_len)[None, None]
        out = []
        for row in range(batch):
            row_mask = mask[row if mask.shape[0] > 1 else 0, 0]
            softmax = _OnlineSoftmax(query[row], scale, softcap)
            for blocks, first in self._quantized_chunks(plan, row):
                keys, values = self._dequantized(blocks, torch.float32)
                softmax.update(keys, values, _visible(row_mask, first - plan.kv_offset, keys.shape[1]))
            start, stop = plan.read_start[row], plan.read_stop[row]
            if stop > start:
                view = self.row_view(plan, row)
                if view is None:
                    slots = plan.tables._slots(plan.tables.tables[row], start, stop - start)
                    view = self.read_slots(slots.to(self.device))
                first = plan.base[row] + start - plan.kv_offset
                softmax.update(view[0].float(), view[1].float(), row_mask[:, first : first + stop - start])
            out.append(softmax.result())
        return torch.stack(out).to(query.dtype)


def _id_runs(table: list[int], first: int, block_size: int) -> list[tuple[slice, int]]:
    """`table[first:]` cut into runs of consecutive ids of at most `CHUNK_TOKENS` tokens:
    (the run as a slice of ids, the table index of its first block)."""
    runs, index, most = [], first, max(CHUNK_TOKENS // block_size, 1)
    while index < len(table):
        run = 1
        while run < most and index + run < len(table) and table[index + run] == table[index] + run:
            run += 1
        runs.append((slice(table[index], table[index] + run), index))
        index += run
    return runs


def _visible(row_mask: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Columns [first, first + count) of a `[q, width]` mask; columns before 0 (left of the read) are hidden."""
    if first >= 0:
        return row_mask[:, first : first + count]
    hidden = torch.zeros(row_mask.shape[0], -first, dtype=torch.bool, device=row_mask.device)
    return torch.cat([hidden, row_mask[:, : first + count]], dim=1)


class _OnlineSoftmax:
    """Attention of one row's queries `[heads, q, d]` over K/V chunks `[kv_heads, n, d]` (grouped heads),
    merged with a running max, sum and accumulator (float32). Fully masked queries give 0."""

    def __init__(self, query: torch.Tensor, scale: float, softcap: float | None):
        self.heads, self.q_len, _ = query.shape
        self.query, self.scale, self.softcap = query.float(), scale, softcap
        self.max = self.total = self.acc = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> None:
        kv_heads = keys.shape[0]
        groups = self.heads // kv_heads
        query = self.query.reshape(kv_heads, groups * self.q_len, -1)
        logits = torch.matmul(query, keys.to(query.device).transpose(-1, -2)) * self.scale  # [kv_heads, g*q, n]
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        visible = visible.to(logits.device)[None].expand(groups, -1, -1).reshape(1, groups * self.q_len, -1)
        logits = logits.masked_fill(~visible, float("-inf"))
        chunk_max = logits.amax(-1, keepdim=True)
        new_max = chunk_max if self.max is None else torch.maximum(self.max, chunk_max)
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        weights = torch.exp(logits - safe)
        chunk = torch.matmul(weights, values.to(query.device))
        if self.max is None:
            self.total, self.acc = weights.sum(-1, keepdim=True), chunk
        else:
            decay = torch.exp(self.max - safe)
            self.total = self.total * decay + weights.sum(-1, keepdim=True)
            self.acc = self.acc * decay + chunk
        self.max = new_max

    def result(self) -> torch.Tensor:
        out = torch.where(self.total > 0, self.acc / self.total.clamp(min=1e-30), torch.zeros_like(self.acc))
        return out.reshape(self.heads, self.q_len, -1)


class QuantizedSlidingLayer(QuantizedLayer, PagedSlidingLayer):
    """A sliding-window layer with quantized history: blocks of either kind that leave the window are freed."""
