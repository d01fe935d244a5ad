"""Cache layers whose history is stored quantized: sealed quantized blocks, then full-precision ones.

Which blocks are sealed when is the tables' business (`block_tables.QuantizedBlockTables`); a layer
quantizes the blocks it is told to (`seal`, one vectorized `quantize` per layer for all blocks sealed
at a step; `_seal_arrivals`, the blocks a long step's own tokens complete, from their K/V) and reads them
back. A token reads a block quantized or not by positions alone, so the blocks at the residual window's
edge during a multi-token step (`StepPlan.transition`) are read both ways, each query its own way.

Reads: the `"paged"` attention (`QuantizedLayer.attend`) dequantizes runs of at most `CHUNK_TOKENS`
quantized tokens at a time and merges the chunks with an online softmax, so no full-precision copy of
the quantized history ever exists (only a bounded transient one per chunk). A packed forward's decode tokens
whose histories fit in a chunk are read together (`gather_rows`): their blocks decoded in one call per K / V.
Other attention implementations need K/V tensors from `update()`: they get a transient dequantized copy.
Under the Triton backend the kernels read the quantized prefix themselves (dequantizing in registers,
`kernels.QuantizedKV`) and `kernels.quantize_blocks` seals blocks in one launch.
"""

from __future__ import annotations

import copy
import functools

import torch

from ..blocks.plan import StepPlan
from ..blocks.sealing import QuantizedBlockTables
from .handle import PagedKV
from .paged import PagedLayer
from .storage import grown_blocks, reserved_blocks, storage_field
from ..quantization.base import KVFormat
from ..quantization.registry import kv_format_fields
from ..attention.torch_path import OnlineSoftmax, visible_columns
from ..kernels import cpu_attention, cpu_quantize

CHUNK_TOKENS = 2048  # quantized tokens dequantized at a time by the paged read (a bounded transient)
QUERY_TILE = 512  # queries of a long step attended at a time by that read (its logits: a tile x a chunk)
# Queries of a step with a transition attended at a time: each tile reads only the span of columns it sees each way,
# so smaller tiles skip most of what a long step's early queries cannot see.
TRANSITION_TILE = 128


class QuantizedLayer(PagedLayer):
    """An attention layer whose history is stored quantized (the most recent tokens in full precision).

    Storage: the full-precision `key_blocks` / `value_blocks` of `PagedLayer`, plus `qkey` / `qvalue`, the
    quantized fields (codes, scale, zero) of the group's quantized pool, `[qblocks + 1, ...]` each.
    """

    is_quantized = True
    tables: QuantizedBlockTables
    qkey: dict[str, torch.Tensor] = storage_field("qkey", {})
    qvalue: dict[str, torch.Tensor] = storage_field("qvalue", {})

    def __init__(self, tables: QuantizedBlockTables, options, layer_type):
        super().__init__(tables, options, layer_type)
        self.kv_format: KVFormat = tables.kv_format
        # Sampled reconstruction error: per "key" / "value", [sum of sample means, samples, max].
        self.error_stats = {"key": [0.0, 0, 0.0], "value": [0.0, 0, 0.0]}
        self._arrived: dict = {}  # this step's blocks sealed as they arrived, full precision, until the paged read
        self._kept = None  # (ids, keys, values): full-precision blocks `seal` kept for this step's arrivals

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # Whether the C++ kernel decodes (and seals) this layer's formats: fixed with its shapes, asked at every read.
        bs, fmt = self.tables.block_size, self.kv_format
        self._kernel_decodes = (cpu_attention.reads_format(fmt.key, bs, self.kv_shape[1])
                                and cpu_attention.reads_format(fmt.value, bs, self.value_dim))  # fmt: skip
        if not self.qkey:
            self.qkey, self.qvalue = self._allocate_quantized(self.tables.qpool.num_blocks + 1)

    def fork(self, tables: QuantizedBlockTables) -> QuantizedLayer:
        twin = super().fork(tables)
        twin.error_stats = copy.deepcopy(self.error_stats)
        twin.forget_step_copies()
        return twin

    def forget_step_copies(self) -> None:
        """Drop the full-precision copies of this step's sealed blocks (a fork starts with none of its own)."""
        self._arrived, self._kept = {}, None

    def _allocate_quantized(self, blocks: int, zeroed: bool = True) -> tuple[dict, dict]:
        bs, heads = self.tables.block_size, self.kv_shape[0]
        block_bytes = self.kv_format.key.bytes_per_block(bs, heads, self.kv_shape[1])
        capacity = reserved_blocks(blocks, block_bytes, self.device, self.tables.qpool.growable)
        return (
            self.kv_format.key.allocate(blocks, bs, heads, self.kv_shape[1], self.device, zeroed, capacity),
            self.kv_format.value.allocate(blocks, bs, heads, self.value_dim, self.device, zeroed, capacity),
        )

    def _fit_pool(self) -> None:
        super()._fit_pool()
        blocks = self.tables.qpool.num_blocks + 1
        if self.qkey["codes"].shape[0] < blocks:
            fresh = functools.cache(lambda: self._allocate_quantized(blocks, zeroed=False))
            self.qkey, self.qvalue = (
                {name: grown_blocks(tensor, blocks, lambda name=name: fresh()[side][name])
                 for name, tensor in old.items()}
                for side, old in enumerate((self.qkey, self.qvalue))
            )
        elif self.qkey["codes"].shape[0] > blocks:
            self.cut_storage()

    def cut_storage(self) -> None:
        super().cut_storage()
        blocks = self.tables.qpool.num_blocks + 1
        if self.qkey and self.qkey["codes"].shape[0] > blocks:
            fresh = self._allocate_quantized(blocks, zeroed=False)
            self.qkey, self.qvalue = (
                {name: new[name].copy_(tensor[:blocks]) for name, tensor in old.items()}
                for old, new in zip((self.qkey, self.qvalue), fresh)
            )

    @property
    def storage_bytes(self) -> int:
        quantized = sum(t.numel() * t.element_size() for fields in (self.qkey, self.qvalue) for t in fields.values())
        return super().storage_bytes + quantized

    @property
    def quantized_block_bytes(self) -> int:
        """Bytes of one quantized block (key + value codes, scales and zero points)."""
        if not self.qkey:
            return 0
        return sum(t[0].numel() * t.element_size() for fields in (self.qkey, self.qvalue) for t in fields.values())

    def copy_quantized_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy sealed blocks (codes, scales, zero points) from `sources` to `targets`."""
        if self.is_initialized:
            self._fit_pool()
            src, dst = torch.tensor(sources, device=self.device), torch.tensor(targets, device=self.device)
            for fields in (self.qkey, self.qvalue):
                for tensor in fields.values():
                    tensor.index_copy_(0, dst, tensor.index_select(0, src))

    # ------------------------------------------------------------------ sealing
    def update(self, key_states, value_states, plan: StepPlan, attention_kwargs=None, *hooks):
        """`PagedLayer.update` (`hooks`: its arguments after `attention_kwargs`), after quantizing the blocks
        this step's own tokens complete (`plan.arrivals`)."""
        if not self.is_initialized and plan.arrivals:
            self.lazy_initialization(key_states, value_states)
        self.take_arrivals(plan, key_states, value_states, attention_kwargs is not None)
        return super().update(key_states, value_states, plan, attention_kwargs, *hooks)

    def take_arrivals(self, plan: StepPlan, key_states: torch.Tensor, value_states: torch.Tensor,
                      paged_read: bool = True, tokens: slice = slice(None)) -> None:  # fmt: skip
        """Quantize the blocks this step's own tokens (`tokens` of the states) complete (`plan.arrivals`), before the
        rest of its tokens are written; for the paged read (`paged_read`), keep their full-precision copy where its
        queries read them both ways (`arrival_kv`)."""
        self._arrived = {}
        if plan.arrivals:
            self._fit_pool()
            arrived = self._seal_arrivals(plan, key_states[:, :, tokens], value_states[:, :, tokens])
            if paged_read:  # the paged read gives the step's earlier tokens their full precision
                arrived.update({row: arrived[source] for row, source in plan.mirrors.items() if source in arrived})
                self._arrived = {row: pair for row, pair in arrived.items() if plan.transition[row]}

    def stores_every_token(self, plan: StepPlan) -> bool:
        """`PagedLayer.stores_every_token`, or a step that seals the rest of its tokens as they arrive (`take_arrivals`
        runs before `write_rows`)."""
        return super().stores_every_token(plan) or bool(plan.arrivals)

    @torch.no_grad()
    def _seal_arrivals(self, plan: StepPlan, key_states: torch.Tensor, value_states: torch.Tensor) -> dict:
        """Quantize each arriving block from the step's K/V (and the stored tokens among them, from the copies
        `seal` kept of their full-precision blocks) and return those full-precision blocks per row,
        `[blocks, block_size, kv_heads, head_dim]` K and V: a transient copy, never blocks of the pool."""
        bs, arrived, targets = self.tables.block_size, {}, []
        kept, self._kept = self._kept, None
        for row, first, sources, older, sealed in plan.arrivals:
            count = len(sealed) * bs - older
            pair = []
            for states, copies in ((key_states, kept and kept[1]), (value_states, kept and kept[2])):
                tokens = states[row, :, first : first + count].transpose(0, 1).to(device=self.device, dtype=self.dtype)
                if older:
                    stored = copies[[kept[0].index(block) for block in sources]].flatten(0, 1)[:older]
                    tokens = torch.cat([stored, tokens])
                pair.append(tokens.reshape(len(sealed), bs, *tokens.shape[1:]))
            arrived[row] = tuple(pair)
            targets.extend(sealed)
        keys, values = (torch.cat([pair[side] for pair in arrived.values()]) for side in (0, 1))
        self._quantize(keys, values, torch.arange(keys.shape[0], device=self.device), targets)
        return arrived

    def seal(self, sources: list[int], targets: list[int], keep: list[int] = ()) -> None:
        """Quantize full-precision blocks `sources` into quantized blocks `targets` (one call per K / V), and keep
        a copy of blocks `keep`, whose tokens this step seals with new ones (`_seal_arrivals`)."""
        if not self.is_initialized:
            return
        self._fit_pool()
        if keep:
            ids = torch.tensor(keep, device=self.device)
            self._kept = (list(keep), self.key_blocks.index_select(0, ids), self.value_blocks.index_select(0, ids))
        if sources:
            self._quantize(self.key_blocks, self.value_blocks, torch.tensor(sources, device=self.device), targets)

    @torch.no_grad()
    def _quantize(self, key_blocks: torch.Tensor, value_blocks: torch.Tensor, src: torch.Tensor,
                  targets: list[int]) -> None:  # fmt: skip
        """Blocks `src` of `key_blocks` / `value_blocks` (the storage, or a transient copy) into quantized blocks
        `targets`; the first of them is decoded again to sample the reconstruction error."""
        dst = torch.tensor(targets, device=self.device)
        kernels = self.uses_kernels()
        if kernels:  # one launch quantizes every block of K and V
            from ..kernels import quantize_blocks

            fmt = self.kv_format
            quantize_blocks(key_blocks, value_blocks, src, self.qkey, self.qvalue, dst, fmt.key, fmt.value)
        cpu = not kernels and key_blocks.dtype == torch.float32 and self.cpu_kernel_reads(torch.float32)
        for name, blocks, fmt, fields in (
            ("key", key_blocks, self.kv_format.key, self.qkey),
            ("value", value_blocks, self.kv_format.value, self.qvalue),
        ):
            if cpu:  # the C++ encode, bit for bit the format's: one call instead of a dozen small ops
                error = cpu_quantize.quantize_blocks_cpu(fmt, blocks, src, fields, dst)
            else:
                if not kernels:
                    fmt.quantize(blocks.index_select(0, src), fields, dst)
                sample = blocks[src[:1]].float()
                decoded = fmt.dequantize(fields, dst[:1])
                # Per token and head, relative to the head's mean token norm in the block (a near-zero token
                # would make its own norm a meaningless denominator).
                scale = sample.norm(dim=-1).mean(dim=1, keepdim=True).clamp(min=1e-12)
                error = (decoded - sample).norm(dim=-1) / scale
            errors = error.flatten().tolist()  # a few dozen numbers: reduced here, not by a tensor op each
            stats = self.error_stats[name]
            stats[0] += sum(errors) / len(errors)
            stats[1] += 1
            stats[2] = max(stats[2], *errors)

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
    def _quantized_chunks(self, plan: StepPlan, row: int, drop: int = 0) -> list[tuple[slice | list[int], int]]:
        """(blocks, logical position of their first token) covering the row's readable quantized prefix, but its last
        `drop` blocks (read apart: a transition, `_transition_pieces`).

        Runs of consecutive ids (the pool continues a row's run when it can) become slices, so decoding
        them reads views of the pool; each chunk holds at most `CHUNK_TOKENS` tokens. Computed once per
        step and row, shared by the group's layers.
        """
        def build() -> list[tuple[slice, int]]:
            bs, table = self.tables.block_size, plan.quantized_tables[row]
            first, start = self._first_readable(plan, row)
            return [(ids, start + index * bs) for ids, index in _id_runs(table[: len(table) - drop], first, bs)]

        return plan.cached(("quantized_chunks", row, drop), build)

    def _first_readable(self, plan: StepPlan, row: int) -> tuple[int, int]:
        """(the index in the row's quantized table of its first block the step reads (one ending after the row's
        `read_from`), the logical position of the table's first token)."""
        start = plan.base[row] - len(plan.quantized_tables[row]) * self.tables.block_size
        return max(plan.read_from[row] - start, 0) // self.tables.block_size, start

    def _dequantized(
        self, blocks: slice, dtype: torch.dtype, rotated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks decoded as `[kv_heads, tokens, head_dim]` keys and values (a rotated side as stored, if
        `rotated`: see `QuantFormat.dequantize`)."""
        keys = self.kv_format.key.dequantize(self.qkey, blocks, dtype, rotated)
        values = self.kv_format.value.dequantize(self.qvalue, blocks, dtype, rotated)
        return keys.flatten(0, 1).transpose(0, 1), values.flatten(0, 1).transpose(0, 1)

    def stored_key_chunks(self, row: int):
        """Quantized keys decoded a run (at most `CHUNK_TOKENS`) at a time, then the full-precision ones."""
        for ids, _index in _id_runs(self.tables.rows[row].quantized.ids, 0, self.tables.block_size):
            yield self.kv_format.key.dequantize(self.qkey, ids).flatten(0, 1).transpose(0, 1)
        yield from super().stored_key_chunks(row)

    def quantized_kv(self, plan: StepPlan, device: torch.device):
        """The quantized prefix as the Triton kernels read it (`kernels.QuantizedKV`)."""
        from ..kernels.quantized import QuantizedKV

        return QuantizedKV(
            self.kv_format.key, self.kv_format.value, self.qkey, self.qvalue,
            plan.tensor("quantized_block_tables", device), plan.tensor("quantized_lens", device),
        )  # fmt: skip

    def reads_quantized(self, plan: StepPlan) -> bool:
        """Whether the step reads any sealed block."""
        return any(self._quantized_chunks(plan, row) for row in range(len(plan.quantized_tables)))

    def gather(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of logical positions [kv_offset, new_len), the quantized ones decoded into a transient copy
        (attention implementations other than `"paged"` need whole K/V tensors)."""
        if not self.reads_quantized(plan):
            return super().gather(plan)
        keys, values = self.read_slots(plan.tensor("read_slots", self.device))  # quantized positions read zeros
        for row in range(keys.shape[0]):
            for blocks, first in self._quantized_chunks(plan, row):
                chunk_keys, chunk_values = self._dequantized(blocks, self.dtype)
                skip = max(plan.read_from[row] - first, 0)
                columns = slice(first + skip - plan.kv_offset, first + chunk_keys.shape[1] - plan.kv_offset)
                keys[row][:, columns] = chunk_keys[:, skip:]
                values[row][:, columns] = chunk_values[:, skip:]
        return keys, values

    def gather_rows(self, plans: list[StepPlan], memo: dict,
                    skip: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """`PagedLayer.gather_rows` over quantized histories, in float32 (the precision `attend` reads them in): each
        row's readable quantized blocks (null-padded to the longest such table), decoded straight into the batch in
        one call per K / V for every row, then its full-precision range. Columns before a row's `read_from` are
        masked."""
        if skip:
            raise ValueError("gather_rows(skip=...) reads past a shared prefix, which a quantized layer has none of "
                             "(`read_blocks` is empty): read the whole ranges (skip=0)")  # fmt: skip

        def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            bs, reads = self.tables.block_size, []
            for plan in plans:
                first, start = self._first_readable(plan, 0)
                hidden = max(plan.read_from[0] - start - first * bs, 0)  # positions of the first block not read
                reads.append((plan.quantized_tables[0][first:], hidden, plan.read_stop[0] - plan.read_start[0]))
            width = max(len(ids) for ids, _hidden, _stored in reads)
            stored_width = max(stored for _ids, _hidden, stored in reads)
            blocks = torch.zeros(len(plans), width, dtype=torch.long)  # block 0: the null block, decoded as zeros
            slots = torch.zeros(len(plans), stored_width, dtype=torch.long)  # slot 0: the null block's first
            mask = torch.zeros(len(plans), width * bs + stored_width, dtype=torch.bool)
            for index, (plan, (ids, hidden, stored)) in enumerate(zip(plans, reads)):
                blocks[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                slots[index, :stored] = plan.slots(0, plan.read_start[0], stored)
                mask[index, hidden : len(ids) * bs] = True
                mask[index, width * bs : width * bs + stored] = True
            return blocks.to(self.device), slots.flatten().to(self.device), mask[:, None, None, :].to(self.device)

        key = ("gather_quantized_rows", tuple(map(id, plans)), self.device)
        if key not in memo:
            memo[key] = build()
        blocks, slots, mask = memo[key]
        rows, quantized = blocks.shape[0], blocks.shape[1] * self.tables.block_size
        out = []
        for fmt, fields, storage in ((self.kv_format.key, self.qkey, self.key_blocks),
                                     (self.kv_format.value, self.qvalue, self.value_blocks)):  # fmt: skip
            batch = torch.empty(rows, mask.shape[-1], *storage.shape[2:], device=self.device)  # [rows, n, kv_heads, d]
            if quantized:
                target = batch[:, :quantized].unflatten(1, blocks.shape[1:] + (-1,))
                if fmt.rotate:  # rotated back, then copied
                    target.copy_(fmt.dequantize(fields, blocks, torch.float32))
                else:
                    fmt.dequantize(fields, blocks, torch.float32, out=target)
            flat = storage.view(-1, *storage.shape[2:])
            batch[:, quantized:] = flat.index_select(0, slots).view(rows, -1, *flat.shape[1:])
            out.append(batch.transpose(1, 2))
        return out[0], out[1], mask

    def attend_quantized(
        self, query: torch.Tensor, plan: StepPlan, mask: torch.Tensor | None, scale: float, softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The `"paged"` attention over this layer's quantized history: `[batch, heads, q, head_dim]`, like
        `attention.attend`.

        Row by row: the quantized prefix is decoded at most `CHUNK_TOKENS` tokens at a time, each chunk attended by
        every tile of `QUERY_TILE` queries (so a long prompt chunk's transients stay bounded), and the chunks merged
        with an online softmax in float32. A row's transition blocks (`StepPlan.transition`) and its full-precision
        suffix are attended last, in one call per tile of `TRANSITION_TILE` queries over the columns it sees.
        A rotated side is read as stored: the queries (rotated keys) and the short full-precision suffix are
        mapped into its code space instead (`QuantFormat.code_space`), and the output (rotated values) back
        once at the end, as the Triton kernels do -- not every decoded token of a long history.
        """
        batch, _heads, q_len, _ = query.shape
        width = plan.new_len - plan.kv_offset
        if mask is None and (q_len > 1 or plan.kv_offset or any(plan.transition)):
            # (one query with nothing cut and no transition sees every key, and needs no mask)
            mask = self.causal_mask(plan, q_len, query.device)
        key_format, value_format = self.kv_format.key, self.kv_format.value
        out = []
        for row in range(batch):
            row_query = key_format.code_space(query[row])
            transition = self.transition_kv(plan, row) if plan.transition[row] else None
            tile = QUERY_TILE if transition is None else TRANSITION_TILE
            tiles = [(q0, None if mask is None else mask[row if mask.shape[0] > 1 else 0, 0, q0 : q0 + tile],
                      OnlineSoftmax(row_query[:, q0 : q0 + tile], scale, softcap, sinks))
                     for q0 in range(0, q_len, tile)]  # fmt: skip
            span = None if transition is None else (transition[0], transition[0] + transition[1][0].shape[1])
            suffix = None
            for keys, values, first in self._read_parts(plan, row, span):
                if span is not None and first >= span[1]:  # the suffix after a transition: attended with it
                    suffix = keys, values, first
                    continue
                for _q0, row_mask, softmax in tiles:
                    visible = None if row_mask is None else visible_columns(row_mask, first - plan.kv_offset, keys.shape[1])
                    softmax.update(keys, values, visible)
            if transition is not None:
                for q0, row_mask, softmax in tiles:
                    for keys, values, visible in self._transition_pieces(plan, transition, suffix, row_mask,
                                                                         q_len - q0):  # fmt: skip
                        softmax.update(keys, values, visible)
            result = torch.cat([softmax.result() for _q0, _mask, softmax in tiles], dim=1)
            out.append(value_format.code_space(result))
        self.attended()
        return (out[0][None] if batch == 1 else torch.stack(out)).to(query.dtype)

    def attended(self) -> None:
        """Called once this step's attention read this layer: the full-precision copy of the blocks it sealed as they
        arrived is not needed again, unless another layer reads this one's step (`read_by_others`)."""
        if not self.read_by_others:
            self._arrived = {}

    def cpu_kernel_reads(self, dtype: torch.dtype) -> bool:
        """`PagedLayer.cpu_kernel_reads`, for formats the kernel decodes (`cpu_attention.reads_format`)."""
        return super().cpu_kernel_reads(dtype) and self._kernel_decodes

    def attend_rows_in_place(self, queries: torch.Tensor, parts: list[PagedKV], counts: list[int], memo: dict,
                             scale: float) -> torch.Tensor:  # fmt: skip
        """`PagedLayer.attend_rows_in_place` over quantized histories: each row reads its sealed blocks (decoded in
        the kernel), then its transition blocks both ways (each query choosing as it would one token at a time), then
        its full-precision blocks. Blocks sealed as they arrived are decoded in the kernel too, next to their
        full-precision copy (`arrival_kv`); a transition not sealed yet is decoded here (`transition_kv`)."""
        plans, bs = [part.plan for part in parts], self.tables.block_size
        arrivals = [part.layer.arrival_kv(0) if part.plan.transition[0] else None for part in parts]
        unsealed = any(plan.transition[0] and arrival is None for plan, arrival in zip(plans, arrivals))
        transitions = [part.layer.transition_kv(part.plan, 0) if part.plan.transition[0] else None
                       for part in parts] if unsealed else [None] * len(parts)  # fmt: skip

        def build() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
            # The quantized read ends with the blocks sealed as they arrived, unless they are decoded here.
            quantized = [plan.quantized_tables[0][: len(plan.quantized_tables[0]) - (plan.transition[0] if unsealed
                                                                                     and arrival is not None else 0)]
                         for plan, arrival in zip(plans, arrivals)]  # fmt: skip
            table = torch.zeros(len(plans), max(max(map(len, quantized)), 1), dtype=torch.long)
            reads = torch.zeros(len(plans), 2, dtype=torch.long)
            for row, (plan, ids) in enumerate(zip(plans, quantized)):
                first, start = self._first_readable(plan, 0)
                table[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                reads[row] = torch.tensor([min(max(plan.read_from[0] - start, first * bs), len(ids) * bs),
                                           len(ids) * bs])  # fmt: skip
            # A transition not sealed yet is the first of the stored blocks.
            skips = [plan.transition[0] if plan.transition[0] and arrival is None else 0
                     for plan, arrival in zip(plans, arrivals)]  # fmt: skip
            return table, reads, skips

        key = ("quantized_row_tables", tuple(map(id, plans)))
        if key not in memo:
            memo[key] = build()
        table, reads, skips = memo[key]
        fmt = self.kv_format
        quantized = cpu_attention.QuantizedRows(fmt.key, fmt.value, self.qkey, self.qvalue, table, reads)
        transition, window = None, self.tables.window
        if unsealed:  # every transition decoded here
            (exact, starts), (decoded, _starts) = (_joined([t and t[pair] for t in transitions]) for pair in (1, 2))
            transition = cpu_attention.TransitionRows(exact, decoded, starts, window)
        elif any(arrival is not None for arrival in arrivals):  # decoded in the kernel from the quantized read's end
            exact, starts = _joined(arrivals)
            transition = cpu_attention.TransitionRows(exact, None, starts, window)
        tables = self._kernel_tables(plans, counts, memo, skips)
        out = cpu_attention.paged_attention_cpu(queries, self.key_blocks, self.value_blocks, *tables, scale, quantized,
                                                transition)  # fmt: skip
        for part in parts:
            part.layer.attended()
        return out

    def arrival_kv(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The full-precision K/V `[kv_heads, n, d]` (views, in the layer's dtype) of the blocks row `row` sealed as
        they arrived this step, if it did."""
        if row not in self._arrived:
            return None
        return tuple(part.flatten(0, 1).transpose(0, 1) for part in self._arrived[row])  # type: ignore[return-value]

    def _read_parts(self, plan: StepPlan, row: int, span: tuple[int, int] | None = None):
        """The row's read as float32 `(keys, values, first position)` parts in the code space, `[kv_heads, n, d]`:
        its quantized chunks decoded (at most `CHUNK_TOKENS` tokens each) from its `read_from` on and its
        full-precision suffix, but the positions `span` (a transition's blocks, read apart). A suffix that continues the last chunk is copied into
        the end of that chunk's buffer, so the two are attended in one call (the suffix is at most the residual
        window and a block)."""
        base, start, stop = plan.base[row], plan.read_start[row], plan.read_stop[row]
        span = span or (base, base)
        chunks = self._quantized_chunks(plan, row, max(base - span[0], 0) // self.tables.block_size)
        skip = max(min(span[1] - base, stop) - start, 0)  # suffix tokens within the span
        start += skip
        suffix_first = base + start
        for index, (blocks, first) in enumerate(chunks):
            tokens = (blocks.stop - blocks.start) * self.tables.block_size
            joined = index == len(chunks) - 1 and stop > start and first + tokens == suffix_first
            extra = stop - start if joined else 0
            keys, values = self._decoded_buffer(blocks, tokens, extra)
            if joined:
                suffix_keys, suffix_values = self._suffix(plan, row, skip)
                keys[:, tokens:], values[:, tokens:] = suffix_keys, suffix_values
                stop = start  # the suffix is read
            lead = max(plan.read_from[row] - first, 0)  # the first block's positions before the row's read
            yield keys[:, lead:], values[:, lead:], first + lead
        if stop > start:
            keys, values = self._suffix(plan, row, skip)
            yield keys, values, suffix_first

    def _decoded_buffer(self, blocks: slice, tokens: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized blocks decoded (rotated sides as stored) into float32 `[kv_heads, tokens + extra, d]` K and V
        buffers, whose last `extra` columns are left for the caller."""
        bs, heads = self.tables.block_size, self.kv_shape[0]
        out = []
        for fmt, fields, dim in ((self.kv_format.key, self.qkey, self.kv_shape[1]),
                                 (self.kv_format.value, self.qvalue, self.value_dim)):  # fmt: skip
            buffer = torch.empty(heads, tokens + extra, dim, device=self.device)
            target = buffer[:, :tokens].unflatten(1, (tokens // bs, bs)).permute(1, 2, 0, 3)
            fmt.dequantize(fields, blocks, torch.float32, rotated=True, out=target)
            out.append(buffer)
        return out[0], out[1]

    def _suffix(self, plan: StepPlan, row: int, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's full-precision read range but its first `skip` tokens, float32 in the code space,
        `[kv_heads, n, d]`."""
        keys, values = (part[:, skip:].float() for part in self.row_kv(plan, row))
        return self.kv_format.key.code_space(keys), self.kv_format.value.code_space(values)

    def transition_kv(self, plan: StepPlan, row: int) -> tuple[int, tuple, tuple]:
        """The row's transition blocks both ways, once per step: their first position, their full-precision K/V
        and their quantized (decoded) K/V, each `[kv_heads, n, d]` in float32 (rotated sides as stored)."""
        tables, count = self.tables, plan.transition[row]
        bs, heads = tables.block_size, self.kv_shape[0]
        if row in self._arrived:  # sealed as they arrived: the last of the row's quantized blocks
            first = plan.base[row] - count * bs
            keys, values = self._arrived[row]
            quantized = self._dequantized(plan.quantized_tables[row][-count:], torch.float32, rotated=True)
        else:  # still full precision: decoded as they will be sealed
            first = plan.base[row]
            ids = torch.tensor(tables.rows[row].blocks.ids[:count], device=self.device)
            keys, values = self.key_blocks[ids], self.value_blocks[ids]
            fields = []
            for fmt, blocks, dim in ((self.kv_format.key, keys, self.kv_shape[1]),
                                     (self.kv_format.value, values, self.value_dim)):  # fmt: skip
                scratch = fmt.allocate(count, bs, heads, dim, device=self.device)
                fmt.quantize(blocks, scratch, range(count))
                fields.append(fmt.dequantize(scratch, slice(0, count), torch.float32, rotated=True))
            quantized = tuple(field.flatten(0, 1).transpose(0, 1) for field in fields)
        keys, values = (part.flatten(0, 1).transpose(0, 1).float() for part in (keys, values))
        keys, values = self.kv_format.key.code_space(keys), self.kv_format.value.code_space(values)
        return first, (keys, values), quantized

    def _transition_pieces(self, plan: StepPlan, transition: tuple, suffix: tuple | None, row_mask: torch.Tensor,
                           back: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
        """A row's transition blocks (`transition_kv`) as each query of the tile `back` tokens before the step's end
        (the queries are the step's last tokens: all of its tokens, or its last alone in a narrowed forward) would
        read them one token at a time: quantized when they end `window` positions or more before the query's own
        position + 1, else in full precision; then the row's `suffix` (keys, values, first position), if any.
        Returns `(keys, values, visible)` pieces of at most `CHUNK_TOKENS` columns each way (a bounded transient,
        as for the quantized prefix), of only the columns some query of the tile sees that way, the suffix joined
        to the last piece: one call each."""
        first, full, quantized = transition
        n = full[0].shape[1]
        start_position = plan.new_len - back
        positions = torch.arange(start_position, start_position + row_mask.shape[0], device=row_mask.device)
        ends = first + (torch.arange(n, device=row_mask.device) // self.tables.block_size + 1) * self.tables.block_size
        reads_quantized = ends[None, :] <= positions[:, None] + 1 - self.tables.window
        visible = visible_columns(row_mask, first - plan.kv_offset, n)
        pieces = []
        for start in range(0, n, CHUNK_TOKENS):
            columns = slice(start, start + CHUNK_TOKENS)
            parts = [(*side, visible[:, columns] & reads) for side, reads in (
                ((quantized[0][:, columns], quantized[1][:, columns]), reads_quantized[:, columns]),
                ((full[0][:, columns], full[1][:, columns]), ~reads_quantized[:, columns]))]  # fmt: skip
            if suffix is not None and start + CHUNK_TOKENS >= n:
                keys, values, suffix_first = suffix
                parts.append((keys, values, visible_columns(row_mask, suffix_first - plan.kv_offset, keys.shape[1])))
            parts = [_seen_columns(*part) for part in parts]
            pieces.append(tuple(torch.cat(side, 1) for side in zip(*parts)))
        return pieces

    # ------------------------------------------------------------------ state
    def state_dict(self, blocks: list[int], quantized: list[int]) -> tuple[dict, dict[str, torch.Tensor]]:
        """`PagedLayer.state_dict`, plus the sealed blocks `quantized` (codes, scales, zero points), the sampled
        error and the resolved format (what a spec like "int2" meant when the file was written)."""
        state, tensors = super().state_dict(blocks, quantized)
        ids = torch.tensor(quantized, dtype=torch.long, device=self.device)
        for side, fields in (("qkey", self.qkey), ("qvalue", self.qvalue)):
            for name, field in fields.items():
                tensors[f"{side}.{name}"] = field.index_select(0, ids)
        state["error_stats"] = self.error_stats
        state["kv_format"] = kv_format_fields(self.kv_format)
        return state, tensors

    def storage_shapes(self, blocks: int, quantized: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = super().storage_shapes(blocks, quantized)
        for side, fields in (("qkey", self.qkey), ("qvalue", self.qvalue)):
            for name, field in fields.items():
                shapes[f"{side}.{name}"] = ((quantized, *field.shape[1:]), field.dtype)
        return shapes

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor], blocks: list[int],
                        quantized: list[int]) -> None:  # fmt: skip
        ids = torch.tensor(quantized, dtype=torch.long, device=self.device)
        for side, fields in (("qkey", self.qkey), ("qvalue", self.qvalue)):
            for name, field in fields.items():
                field.index_copy_(0, ids, tensors[f"{side}.{name}"].to(self.device))
        self.error_stats = state["error_stats"]
        super().load_state_dict(state, tensors, blocks, quantized)

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


def _joined(pairs: list[tuple[torch.Tensor, torch.Tensor] | None],
            ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:  # fmt: skip
    """Rows' (keys, values) `[kv_heads, n_i, d]` (None: a row without) joined along the tokens (a lone pair as it is),
    and where each row's begin, `[rows + 1]`."""
    present = [pair for pair in pairs if pair is not None]
    keys, values = (present[0][side] if len(present) == 1 else torch.cat([pair[side] for pair in present], 1)
                    for side in (0, 1))  # fmt: skip
    starts = torch.tensor([0, *(0 if pair is None else pair[0].shape[1] for pair in pairs)]).cumsum(0)
    return (keys, values), starts


def _seen_columns(keys: torch.Tensor, values: torch.Tensor,
                  visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`keys` / values `[kv_heads, n, d]` and `visible` `[q, n]` cut to the span of columns some query sees (one
    column, unseen, if none is: a query that sees nothing anywhere still gets its log-sum-exp of -inf)."""
    seen = visible.any(0).nonzero()
    columns = slice(int(seen[0]), int(seen[-1]) + 1) if seen.numel() else slice(0, min(keys.shape[1], 1))
    return keys[:, columns], values[:, columns], visible[:, columns]
