"""`PagedLayer`: a cache layer whose keys and values live in blocks; its `LayerType` says how it is read.

A layer owns its storage (`key_blocks` / `value_blocks`, `[blocks + 1, block_size, kv_heads, head_dim]`,
block 0 being the all-zero null block) and shares block tables with the other layers of its group.
It writes a step's new tokens into their slots and either returns the K/V gathered through the block
tables (any attention implementation) or leaves them in place for the `"paged"` attention to read.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
import torch
from transformers.cache_utils import CacheLayerMixin

from ..blocks.plan import StepPlan
from ..blocks.tables import BlockTables
from ..kernels import cpu_attention, cpu_write
from ..kernels.layout import allocate_kv_blocks, heads_first
from ..attention.contract import PAGED_KV_KWARG
from ..attention.paged_states import paged_only
from .handle import AfterAttention, PagedKV
from .interfaces import ReadRules, StorageOptions
from .storage import LayerStorage, grown_blocks, reserved_blocks, storage_field

MAX_RUNS = 8  # a row's read cut into more runs of blocks than this is gathered slot by slot


class PagedLayer(CacheLayerMixin):
    """An attention layer stored in blocks; its `layer_type` (full, sliding, chunked...) says how it is read."""

    is_croppable = True
    is_compileable = False
    is_quantized = False
    read_by_others = False  # a `share_with` layer reads this layer's step after it (`SharedKVLayer`)
    key_blocks = storage_field("key_blocks")
    value_blocks = storage_field("value_blocks")

    def __init__(self, tables: BlockTables, options: StorageOptions, layer_type: ReadRules):
        self.storage = LayerStorage()
        super().__init__()
        self.tables = tables
        self.options = options
        self.layer_type = layer_type
        self.seq_len = 0  # tokens this layer has written (its group's length once the step reached it)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layer_type.name}, group={self.tables.name!r}, tokens={self.seq_len})"

    @property
    def is_sliding(self) -> bool:
        return self.layer_type.is_sliding

    @property
    def sliding_window(self) -> int | None:
        return self.tables.sliding_window

    def uses_kernels(self, device: torch.device | None = None) -> bool:
        """Whether the Triton kernels write and read this layer's blocks (`device`: where the states of a layer not
        initialized yet are). They take one head dim for keys and values, so values of another width (a model
        caching latents stores its positional key as the values) are written and read by the torch paths."""
        if self.is_initialized:
            return self._kernels
        return self.layer_type.kernels_read and self.options.uses_kernels(self.options.device or device)

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = self.options.device or key_states.device
        self.dtype = self.options.dtype or key_states.dtype
        self.kv_shape = (key_states.shape[1], key_states.shape[-1])
        self.value_dim = value_states.shape[-1]
        # Who writes and reads the blocks, fixed with the storage's device (asked per layer and sequence at every step
        # of a packed forward, where asking a `torch.device` its type each time is slow enough to show).
        self._kernels = (self.layer_type.kernels_read and self.value_dim == self.kv_shape[1]
                         and self.options.uses_kernels(self.device))  # fmt: skip
        self._cpu_kernel = self.options.uses_cpu_kernel(self.device)
        if self.key_blocks is None:  # else a fork of this cache allocated the shared storage already
            self.key_blocks = self._allocate(self.kv_shape[1])
            self.value_blocks = self._allocate(self.value_dim)
        self.is_initialized = True

    def fork(self, tables: BlockTables) -> PagedLayer:
        """This layer for a fork of its cache whose group is `tables`: the same storage when the fork shares
        the group's pool (a pool not created yet is not shared, nor is the storage)."""
        twin = copy.copy(self)
        twin.tables = tables
        if tables.pool is None:
            twin.storage = LayerStorage()
        return twin

    def _allocate(self, head_dim: int) -> torch.Tensor:
        blocks = self.tables.pool.num_blocks + 1
        # Zero-filled: the null block is what unstored positions (padding) read as, and whole-block reads
        # (`read_with_mask`) see the unwritten tail of a row's last block, masked but never NaN.
        shape = (self.tables.block_size, self.kv_shape[0], head_dim)
        return allocate_kv_blocks(blocks, *shape, self.dtype, self.device, fill=0.0,
                                  capacity=self._room(blocks, shape, self.dtype, self.device))

    def _resized(self, storage: torch.Tensor, blocks: int) -> torch.Tensor:
        """Uninitialised storage of `blocks` blocks in `storage`'s layout (room reserved as for a first allocation)."""
        capacity = self._room(blocks, storage.shape[1:], storage.dtype, storage.device)
        return allocate_kv_blocks(blocks, *storage.shape[1:], storage.dtype, storage.device, capacity=capacity)

    def _room(self, blocks: int, block_shape, dtype: torch.dtype, device: torch.device) -> int:
        block_bytes = math.prod(block_shape) * dtype.itemsize
        return reserved_blocks(blocks, block_bytes, device, self.tables.pool.growable)

    def _fit_pool(self) -> None:
        """Size the storage to the pool: grown after the (growable) pool grew, existing blocks keeping their ids;
        cut after the pool was trimmed (the ids above its end are free), so the memory is given back."""
        blocks = self.tables.pool.num_blocks + 1
        if len(self.key_blocks) < blocks:
            self.key_blocks, self.value_blocks = (
                grown_blocks(storage, blocks, lambda storage=storage: self._resized(storage, blocks))
                for storage in (self.key_blocks, self.value_blocks)
            )
        elif len(self.key_blocks) > blocks:
            self.cut_storage()

    def fit_pool(self) -> None:
        """Size the storage to the pool now (a trimmed pool gives its memory back before the next write)."""
        if self.is_initialized:
            self._fit_pool()

    def cut_storage(self) -> None:
        """Cut the storage (whichever of the forks allocated it) to its pool after the pool shrank: a fresh
        allocation of the pool's size, in the storage's layout, so the memory above it is given back."""
        blocks = self.tables.pool.num_blocks + 1
        if self.key_blocks is not None and len(self.key_blocks) > blocks:
            self.key_blocks, self.value_blocks = (
                self._resized(storage, blocks).copy_(storage[:blocks])
                for storage in (self.key_blocks, self.value_blocks)
            )

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        if self.is_initialized:
            self._fit_pool()
            src = torch.tensor(sources, device=self.device)
            dst = torch.tensor(targets, device=self.device)
            self.key_blocks.index_copy_(0, dst, self.key_blocks.index_select(0, src))
            self.value_blocks.index_copy_(0, dst, self.value_blocks.index_select(0, src))

    @property
    def storage_bytes(self) -> int:
        """Bytes of the storage (shared with the forks of the cache; allocated by whichever wrote first)."""
        if self.key_blocks is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.key_blocks, self.value_blocks))

    @property
    def block_bytes(self) -> int:
        """Bytes one full-precision block of this layer holds (keys and values)."""
        if self.key_blocks is None:
            return 0
        return sum(t[0].numel() * t.element_size() for t in (self.key_blocks, self.value_blocks))

    # ------------------------------------------------------------------ the HF layer contract
    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layer_type.mask_sizes(self.tables, self.seq_len, query_length)

    def get_max_length(self) -> int:
        return self.layer_type.max_length(self.tables)

    def check_states(self, key_states: torch.Tensor) -> None:
        """Raise before anything changes if `key_states` do not fit this layer's storage."""
        heads, head_dim = key_states.shape[1], key_states.shape[-1]
        if self.is_initialized and (heads, head_dim) != self.kv_shape:
            raise ValueError(
                f"This PagedCache layer stores {self.kv_shape[0]} KV heads of size {self.kv_shape[1]} but received "
                f"{heads} heads of size {head_dim}: the cache was built for a different model. Build a new "
                "`PagedCache(model.config)` for this model."
            )

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        plan: StepPlan,
        attention_kwargs: dict | None = None,
        after_attention: AfterAttention | None = None,
        undo: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's new K/V into the slots `plan` (made by the cache for the layer's group) gives.

        With an attention-kwargs dict (the `"paged"` attention reads the blocks itself) the return value
        is the new states only and `attention_kwargs["paged_kv"]` tells the attention where the rest is;
        without one, the K/V of the whole read range are returned, gathered through the block tables.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._fit_pool()
        self._write(plan, key_states, value_states)
        self.seq_len = plan.new_len
        return self.hand_over(plan, key_states, value_states, attention_kwargs, after_attention, undo)

    def hand_over(
        self,
        plan: StepPlan,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        attention_kwargs: dict | None = None,
        after_attention: AfterAttention | None = None,
        undo: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `update()` returns once the step is written: a `PagedKV` in the attention kwargs (and the new
        states, usable by nothing else), or the K/V of the whole read range, gathered."""
        if attention_kwargs is not None:
            paged_kv = attention_kwargs[PAGED_KV_KWARG] = PagedKV(self, plan, after_attention, undo)
            # Any other attention fails on these; a later layer that reuses them (KV-shared) reads through paged_kv.
            return paged_only(key_states, paged_kv), paged_only(value_states, paged_kv)
        keys, values = self.gather(plan)
        if keys.dtype != key_states.dtype:  # a storage dtype other than the model's (e.g. fp16 for an fp32 model)
            keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
        return keys, values

    def sync_length(self) -> None:
        """Take the group's length after a whole-cache edit (crop, reset)."""
        self.seq_len = self.tables.length

    def _write(self, plan: StepPlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.uses_kernels():
            from ..kernels import write_kv

            tokens = [states.transpose(1, 2).reshape(-1, *states.shape[1:2], states.shape[-1]).to(self.dtype)
                      for states in (key_states, value_states)]  # fmt: skip
            write_kv(self.key_blocks, self.value_blocks, *tokens, plan.tensor("slot_mapping", self.device))
            return
        slots = plan.tensor("write_slots", self.device)
        if slots.numel() == 0:
            return
        tokens = None if plan.write_tokens is None else plan.tensor("write_tokens", self.device)
        self._store(slots, key_states, value_states, tokens)

    def _store(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               tokens: torch.Tensor | None = None) -> None:  # fmt: skip
        """Copy the new K/V `[batch, kv_heads, q, d]` (only `tokens` of the batch-major tokens, if given) to `slots`: in
        one call of the C++ write where the CPU kernels are loaded (the same bits, `kernels.cpu_write`), else with one
        `index_copy_` per tensor."""
        keys, values = (self._rows(states, tokens) for states in (key_states, value_states))
        if self._cpu_kernel and cpu_attention.loaded():
            cpu_write.write_kv_cpu(self.key_blocks, self.value_blocks, keys, values, slots)
            return
        for rows, blocks in ((keys, self.key_blocks), (values, self.value_blocks)):
            blocks.view(-1, *blocks.shape[2:]).index_copy_(0, slots, rows)

    def _rows(self, states: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """New states `[batch, kv_heads, q, d]` as the rows to store `[tokens, kv_heads, d]`, in the storage's dtype."""
        rows = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[-1])
        if tokens is not None:
            rows = rows.index_select(0, tokens.to(rows.device))
        if rows.dtype != self.dtype or rows.device != self.device:
            rows = rows.to(device=self.device, dtype=self.dtype)
        return rows

    def writes_plain_row(self, plan: StepPlan, q_len: int, device: torch.device) -> bool:
        """Whether this layer's `q_len` new tokens (on `device`) of the step under way can be written by `write_rows`
        together with other caches' (a packed forward's later layers): an earlier layer planned the step, the plan's
        one row stores its new tokens in full precision through the torch path (`stores_every_token`), and it
        mirrors no other row."""
        tables = self.tables
        return (tables.plan is plan and plan is not None and plan.q_len == q_len
                and self.seq_len + q_len == tables.length and len(plan.read_start) == 1 and not plan.mirrors
                and self.stores_every_token(plan) and not self.uses_kernels(device))  # fmt: skip

    def stores_every_token(self, plan: StepPlan) -> bool:
        """Whether the one-row `plan` stores each of its new tokens as it comes (a layer that handles the others
        before `write_rows` says so)."""
        return plan.write_tokens is None

    def take_arrivals(self, plan: StepPlan, key_states: torch.Tensor, value_states: torch.Tensor,
                      tokens: slice = slice(None)) -> None:  # fmt: skip
        """What this layer does with its new K/V of the one-row `plan` (`tokens` of `[1, kv_heads, q, d]` states: a
        packed forward slices only where something is due) before `write_rows` stores them (a quantized layer seals
        the blocks they complete); nothing here."""

    def write_rows(self, plans: list[StepPlan], key_states: torch.Tensor, value_states: torch.Tensor,
                   memo: dict) -> None:  # fmt: skip
        """Write the new tokens of the one-row `plans` (caches sharing this layer's storage, each `writes_plain_row`),
        side by side in `key_states` / `value_states` `[1, kv_heads, tokens, d]` in the plans' order, with one copy
        per storage tensor (of the tokens each plan stores, `StepPlan.write_tokens`). `memo` keeps the joined slots for
        the other layers of the group in the same forward."""
        self._fit_pool()
        key = ("write_rows", tuple(map(id, plans)), self.device)
        if key not in memo:
            slots = torch.cat([plan.tensor("write_slots", self.device) for plan in plans])
            memo[key] = slots, None if all(plan.write_tokens is None for plan in plans) else self._stored_tokens(plans)
        slots, tokens = memo[key]
        self._store(slots, key_states, value_states, tokens)

    def _stored_tokens(self, plans: list[StepPlan]) -> torch.Tensor:
        """Which of the one-row `plans`' new tokens, side by side in their order, are stored: each plan's
        `write_tokens` (all of its tokens without), offset by the tokens of the plans before it."""
        tokens, offset = [], 0
        for plan in plans:
            own = (torch.arange(plan.q_len, device=self.device) if plan.write_tokens is None
                   else plan.tensor("write_tokens", self.device))  # fmt: skip
            tokens.append(own + offset)
            offset += plan.q_len
        return torch.cat(tokens)

    # ------------------------------------------------------------------ reading
    def row_kv(self, plan: StepPlan, row: int, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s stored read range (its first `count` tokens, if given) as K/V `[kv_heads, tokens, head_dim]`:
        views of the storage when its blocks form one run, else one copy (`_row_pieces`)."""
        pieces = [self._row_pieces(blocks, plan, row, count) for blocks in (self.key_blocks, self.value_blocks)]
        keys, values = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for parts in pieces)
        return keys, values

    def _row_pieces(self, blocks: torch.Tensor, plan: StepPlan, row: int,
                    count: int | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Row `row`'s stored read range of `blocks` (its first `count` tokens, if given) as `[kv_heads, n_i, head_dim]`
        pieces in order: views of its runs (`StepPlan.runs`), or one slot-by-slot gather when it is cut into more
        than `MAX_RUNS` runs (one index beats many small copies)."""
        runs = plan.runs()[row]
        start = plan.read_start[row]
        count = plan.read_stop[row] - start if count is None else count
        if len(runs) > MAX_RUNS:
            slots = plan.cached(("row_slots", row, count, self.device),
                                lambda: plan.slots(row, start, count).to(self.device))  # fmt: skip
            return [blocks.view(-1, *blocks.shape[2:]).index_select(0, slots).transpose(0, 1)]
        flat, pieces = heads_first(blocks), []
        for _column, slot, tokens in runs:
            if count <= 0:
                break
            pieces.append(flat[:, slot : slot + min(tokens, count)])
            count -= tokens
        return pieces

    def stored_blocks(self, plan: StepPlan, start: int | None = None, stop: int | None = None) -> list[int]:
        """The ids of the full-precision blocks stored tokens `start` .. `stop` - 1 of the one-row `plan` lie in (its
        read range by default), in order."""
        start = plan.read_start[0] if start is None else start
        stop = plan.read_stop[0] if stop is None else stop
        block_size, ids = self.tables.block_size, plan.tables.rows[0].blocks.ids
        return ids[start // block_size : -(-stop // block_size)]

    def cpu_kernel_reads(self, dtype: torch.dtype) -> bool:
        """Whether the C++ CPU attention kernel can read this layer for queries of `dtype`: the backend allows it and it
        is built (`kernels.cpu_attention`), and the full-precision storage and the queries are float32."""
        return (self._cpu_kernel and self.dtype == torch.float32 and dtype == torch.float32
                and cpu_attention.available())  # fmt: skip

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at the given slots (any shape `S`), as `[*S[:-1], kv_heads, S[-1], head_dim]`."""
        out = []
        for blocks in (self.key_blocks, self.value_blocks):
            gathered = blocks.view(-1, *blocks.shape[2:]).index_select(0, slots.reshape(-1))
            out.append(gathered.view(*slots.shape, *blocks.shape[2:]).transpose(-3, -2))
        return out[0], out[1]

    def gather(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V for logical positions [kv_offset, new_len) of every row, `[batch, kv_heads, n, head_dim]`;
        padding reads as zeros. A single unpadded row whose blocks form one run comes back as a strided view
        of the storage (no copy); otherwise every row's runs are copied once into a contiguous batch-major
        tensor, as `DynamicCache` returns (some models `view()` the K/V they get back)."""
        runs = plan.runs()
        if len(runs) == 1 and len(runs[0]) == 1 and runs[0][0][0] == 0:
            keys, values = self.row_kv(plan, 0)
            return keys.unsqueeze(0), values.unsqueeze(0)
        total, out = plan.new_len - plan.kv_offset, []
        for blocks in (self.key_blocks, self.value_blocks):
            gathered = blocks.new_empty(len(runs), blocks.shape[2], total, blocks.shape[3])
            for row, row_runs in enumerate(runs):
                at = row_runs[0][0] if row_runs else total  # the row's left padding reads as zeros
                gathered[row, :, :at] = 0
                for piece in self._row_pieces(blocks, plan, row) if row_runs else []:
                    gathered[row, :, at : at + piece.shape[1]] = piece
                    at += piece.shape[1]
            out.append(gathered)
        return out[0], out[1]

    # ------------------------------------------------------------------ eviction support
    def stored_key_chunks(self, row: int):
        """The row's stored keys in stored order, as `[kv_heads, n, head_dim]` chunks (views when the
        blocks form one run), for eviction scores and attention statistics."""
        tables = self.tables
        count = tables.stored_tokens(row)
        if not count:
            return
        flat = self.key_blocks.view(-1, *self.key_blocks.shape[2:])
        first_block = tables.first_run_block(row)
        if first_block is not None:
            first = first_block * tables.block_size
            yield flat[first : first + count].transpose(0, 1)
        else:
            yield flat[tables.slots(row, 0, count).to(self.device)].transpose(0, 1)

    def stored_keys(self, row: int) -> torch.Tensor:
        """Every stored key of the row, float32 `[kv_heads, n, head_dim]` (a transient copy)."""
        chunks = [chunk.float() for chunk in self.stored_key_chunks(row)]
        return torch.cat(chunks, dim=1) if chunks else torch.zeros(self.kv_shape[0], 0, self.kv_shape[1])

    def move_tokens(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy K/V from slots `sources` `[1 or kv_heads, k]` (one row per head for per-head eviction) to slots
        `targets` `[k]` (eviction's compaction): all reads first."""
        self._fit_pool()  # compaction may have grown the pool for fresh copy-on-write blocks
        src, dst = sources.to(self.device), targets.to(self.device)
        for blocks in (self.key_blocks, self.value_blocks):
            flat = heads_first(blocks)  # [kv_heads, slots, d], a view of the storage
            index = src.expand(flat.shape[0], -1)[..., None].expand(-1, -1, flat.shape[-1])
            flat[:, dst] = flat.gather(1, index)

    def state_dict(self, blocks: list[int], quantized: list[int]) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a saved file keeps of the layer: its dtype, device and shapes, and the K/V of pool ids `blocks`
        (its block i is `blocks[i]`) heads first, `[kv_heads, blocks, block_size, d]`, the storage's own layout,
        so each head's block is one contiguous copy. `quantized`: the sealed blocks (quantized layers)."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        state = {"dtype": self.dtype, "device": self.device, "kv_heads": self.kv_shape[0], "head_dim": self.kv_shape[1],
                 "value_dim": self.value_dim}  # fmt: skip
        tensors = {name: storage.permute(2, 0, 1, 3).index_select(1, ids)
                   for name, storage in (("keys", self.key_blocks), ("values", self.value_blocks))}  # fmt: skip
        return state, tensors

    def storage_shapes(self, blocks: int, quantized: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype `load_state_dict` takes each tensor of `state_dict` in, for that many blocks."""
        return {name: ((storage.shape[2], blocks, storage.shape[1], storage.shape[3]), storage.dtype)
                for name, storage in (("keys", self.key_blocks), ("values", self.value_blocks))}  # fmt: skip

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor], blocks: list[int],
                        quantized: list[int]) -> None:  # fmt: skip
        """Take a saved layer's K/V into pool ids `blocks` of the storage (allocated by `lazy_initialization`;
        `tensors` have the `storage_shapes`)."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for name, storage in (("keys", self.key_blocks), ("values", self.value_blocks)):
            storage.permute(2, 0, 1, 3).index_copy_(1, ids, tensors[name].to(self.device))
        self.sync_length()

