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

import torch

from ..blocks.plan import StepPlan
from ..blocks.sealing import QuantizedBlockTables
from .paged import PagedLayer
from .sealed_blocks import SealedBlocks
from .storage import BlockStore
from ..quantization.base import KVFormat
from ..quantization.registry import kv_format_fields
from ..kernels import cpu_attention

CHUNK_TOKENS = 2048  # quantized tokens dequantized at a time by the paged read (a bounded transient)


class QuantizedLayer(PagedLayer):
    """An attention layer whose history is stored quantized (the most recent tokens in full precision).

    Storage: the full-precision `KVBlocks` of `PagedLayer` (the group's pool), plus `sealed`, a `SealedBlocks` of
    the group's quantized pool in its format (`qkey` / `qvalue`: each side's fields, `[qblocks + 1, ...]`).
    """

    is_quantized = True
    tables: QuantizedBlockTables
    qkey = property(lambda layer: layer.sealed.fields("qkey"))
    qvalue = property(lambda layer: layer.sealed.fields("qvalue"))

    def __init__(self, tables: QuantizedBlockTables, options, layer_type):
        super().__init__(tables, options, layer_type)
        self.kv_format: KVFormat = tables.kv_format
        self.sealed = SealedBlocks(self.kv_format)
        # Sampled reconstruction error: per "key" / "value", [sum of sample means, samples, max].
        self.error_stats = {"key": [0.0, 0, 0.0], "value": [0.0, 0, 0.0]}
        self._arrived: dict = {}  # this step's blocks sealed as they arrived, full precision, until the paged read
        self._kept = None  # (ids, keys, values): full-precision blocks `seal` kept for this step's arrivals

    @property
    def stores(self) -> list[BlockStore]:
        return [self.storage, self.sealed]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # Whether the C++ kernel decodes (and seals) this layer's formats: fixed with its shapes, asked at every read.
        bs, fmt = self.tables.block_size, self.kv_format
        self._kernel_decodes = (cpu_attention.reads_format(fmt.key, bs, self.kv_shape[1])
                                and cpu_attention.reads_format(fmt.value, bs, self.value_dim))  # fmt: skip
        if not self.sealed.allocated:
            self.sealed.allocate(self.tables.qpool, bs, self.kv_shape[0], (self.kv_shape[1], self.value_dim),
                                 self.device)  # fmt: skip

    def fork(self, tables: QuantizedBlockTables) -> QuantizedLayer:
        twin = super().fork(tables)
        if tables.pool is None:
            twin.sealed = SealedBlocks(self.kv_format)
        twin.error_stats = copy.deepcopy(self.error_stats)
        twin.forget_step_copies()
        return twin

    def forget_step_copies(self) -> None:
        """Drop the full-precision copies of this step's sealed blocks (a fork starts with none of its own)."""
        self._arrived, self._kept = {}, None

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
            self.fit_pool()
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
        self.fit_pool()
        if keep:
            ids = torch.tensor(keep, device=self.device)
            self._kept = (list(keep), self.key_blocks.index_select(0, ids), self.value_blocks.index_select(0, ids))
        if sources:
            self._quantize(self.key_blocks, self.value_blocks, torch.tensor(sources, device=self.device), targets)

    def _quantize(self, key_blocks: torch.Tensor, value_blocks: torch.Tensor, src: torch.Tensor,
                  targets: list[int]) -> None:  # fmt: skip
        """Blocks `src` of `key_blocks` / `value_blocks` (the storage, or a transient copy) into sealed blocks
        `targets`, counting the decoded sample's error (`quant_error`)."""
        kernels = self.uses_kernels()
        cpu = not kernels and key_blocks.dtype == torch.float32 and self.cpu_kernel_reads(torch.float32)
        errors = self.sealed.seal(key_blocks, value_blocks, src, targets, kernels, cpu)
        for name, side in (("key", "qkey"), ("value", "qvalue")):
            stats = self.error_stats[name]
            stats[0] += sum(errors[side]) / len(errors[side])
            stats[1] += 1
            stats[2] = max(stats[2], *errors[side])

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
    def quantized_chunks(self, plan: StepPlan, row: int, drop: int = 0) -> list[tuple[slice | list[int], int]]:
        """(blocks, logical position of their first token) covering the row's readable quantized prefix, but its last
        `drop` blocks (read apart: a transition, `_transition_pieces`).

        Runs of consecutive ids (the pool continues a row's run when it can) become slices, so decoding
        them reads views of the pool; each chunk holds at most `CHUNK_TOKENS` tokens. Computed once per
        step and row, shared by the group's layers.
        """
        def build() -> list[tuple[slice, int]]:
            bs, table = self.tables.block_size, plan.quantized_tables[row]
            first, start = self.first_readable(plan, row)
            return [(ids, start + index * bs) for ids, index in _id_runs(table[: len(table) - drop], first, bs)]

        return plan.cached(("quantized_chunks", row, drop), build)

    def first_readable(self, plan: StepPlan, row: int) -> tuple[int, int]:
        """(the index in the row's quantized table of its first block the step reads (one ending after the row's
        `read_from`), the logical position of the table's first token)."""
        start = plan.base[row] - len(plan.quantized_tables[row]) * self.tables.block_size
        return max(plan.read_from[row] - start, 0) // self.tables.block_size, start

    def stored_key_chunks(self, row: int):
        """Quantized keys decoded a run (at most `CHUNK_TOKENS`) at a time, then the full-precision ones."""
        for ids, _index in _id_runs(self.tables.rows[row].quantized.ids, 0, self.tables.block_size):
            yield self.sealed.decoded_keys(ids)
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
        return any(self.quantized_chunks(plan, row) for row in range(len(plan.quantized_tables)))

    def gather(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of logical positions [kv_offset, new_len), the quantized ones decoded into a transient copy
        (attention implementations other than `"paged"` need whole K/V tensors)."""
        if not self.reads_quantized(plan):
            return super().gather(plan)
        keys, values = self.storage.read_slots(plan.tensor("read_slots", self.device))  # quantized positions read zeros
        for row in range(keys.shape[0]):
            for blocks, first in self.quantized_chunks(plan, row):
                chunk_keys, chunk_values = self.sealed.decoded(blocks, self.dtype)
                skip = max(plan.read_from[row] - first, 0)
                columns = slice(first + skip - plan.kv_offset, first + chunk_keys.shape[1] - plan.kv_offset)
                keys[row][:, columns] = chunk_keys[:, skip:]
                values[row][:, columns] = chunk_values[:, skip:]
        return keys, values

    def attended(self) -> None:
        """Called once this step's attention read this layer: the full-precision copy of the blocks it sealed as they
        arrived is not needed again, unless another layer reads this one's step (`read_by_others`)."""
        if not self.read_by_others:
            self._arrived = {}

    def cpu_kernel_reads(self, dtype: torch.dtype) -> bool:
        """`PagedLayer.cpu_kernel_reads`, for formats the kernel decodes (`cpu_attention.reads_format`)."""
        return super().cpu_kernel_reads(dtype) and self._kernel_decodes

    def arrival_kv(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The full-precision K/V `[kv_heads, n, d]` (views, in the layer's dtype) of the blocks row `row` sealed as
        they arrived this step, if it did."""
        if row not in self._arrived:
            return None
        return tuple(part.flatten(0, 1).transpose(0, 1) for part in self._arrived[row])  # type: ignore[return-value]

    def transition_kv(self, plan: StepPlan, row: int) -> tuple[int, tuple, tuple]:
        """The row's transition blocks both ways, once per step: their first position, their full-precision K/V
        and their quantized (decoded) K/V, each `[kv_heads, n, d]` in float32 (rotated sides as stored)."""
        tables, count = self.tables, plan.transition[row]
        bs = tables.block_size
        if row in self._arrived:  # sealed as they arrived: the last of the row's quantized blocks
            first = plan.base[row] - count * bs
            keys, values = self._arrived[row]
            quantized = self.sealed.decoded(plan.quantized_tables[row][-count:], torch.float32, rotated=True)
        else:  # still full precision: decoded as they will be sealed
            first = plan.base[row]
            ids = torch.tensor(tables.rows[row].blocks.ids[:count], device=self.device)
            keys, values = self.key_blocks[ids], self.value_blocks[ids]
            quantized = self.sealed.round_trip(keys, values)
        keys, values = (part.flatten(0, 1).transpose(0, 1).float() for part in (keys, values))
        keys, values = self.kv_format.key.code_space(keys), self.kv_format.value.code_space(values)
        return first, (keys, values), quantized

    # ------------------------------------------------------------------ state
    def state_dict(self, blocks: list[int], quantized: list[int]) -> tuple[dict, dict[str, torch.Tensor]]:
        """`PagedLayer.state_dict`, plus the sealed blocks `quantized` (codes, scales, zero points), the sampled
        error and the resolved format (what a spec like "int2" meant when the file was written)."""
        state, tensors = super().state_dict(blocks, quantized)
        tensors.update(self.sealed.saved(quantized))
        state["error_stats"] = self.error_stats
        state["kv_format"] = kv_format_fields(self.kv_format)
        return state, tensors

    def storage_shapes(self, blocks: int, quantized: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {**super().storage_shapes(blocks, quantized), **self.sealed.saved_shapes(quantized)}

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor], blocks: list[int],
                        quantized: list[int]) -> None:  # fmt: skip
        self.sealed.load(tensors, quantized)
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

