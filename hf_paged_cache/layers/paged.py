"""`PagedLayer`: a cache layer whose keys and values live in blocks; its `LayerType` says how it is read.

A layer holds its storage in a `KVBlocks` store (`key_blocks` / `value_blocks`, `[blocks + 1, block_size, kv_heads,
head_dim]`, block 0 being the all-zero null block) and shares block tables with the other layers of its group.
It keeps transformers' layer contract: it writes a step's new tokens into their slots and either returns the K/V
gathered through the block tables (any attention implementation) or leaves them in place for the `"paged"`
attention (`read_paths/`) to read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from ..blocks.plan import StepPlan
from ..blocks.tables import BlockTables
from ..kernels import cpu_attention
from ..attention.contract import PAGED_KV_KWARG
from ..attention.paged_states import paged_only
from .handle import AfterAttention, PagedKV
from .interfaces import ReadRules, StorageOptions
from .storage import BlockStore, KVBlocks, store_view


class PagedLayer(CacheLayerMixin):
    """An attention layer stored in blocks; its `layer_type` (full, sliding, chunked...) says how it is read."""

    is_croppable = True
    is_compileable = False
    is_quantized = False
    read_by_others = False  # a `share_with` layer reads this layer's step after it (`SharedKVLayer`)
    key_blocks = store_view("storage", "keys")
    value_blocks = store_view("storage", "values")

    def __init__(self, tables: BlockTables, options: StorageOptions, layer_type: ReadRules):
        self.storage = KVBlocks()
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
    @property
    def stores(self) -> list[BlockStore]:
        """Every store of the layer (each indexed by one pool's ids)."""
        return [self.storage]

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
        if not self.storage.allocated:  # else a fork of this cache allocated the shared storage already
            self.storage.allocate(self.tables.pool, self.tables.block_size, self.kv_shape[0],
                                  (self.kv_shape[1], self.value_dim), self.dtype, self.device)
        self.is_initialized = True

    def fork(self, tables: BlockTables) -> PagedLayer:
        """This layer for a fork of its cache whose group is `tables`: the same stores when the fork shares the
        group's pools (a pool not created yet is not shared, nor is the storage)."""
        twin = copy.copy(self)
        twin.tables = tables
        if tables.pool is None:
            twin.storage = KVBlocks()
        return twin

    def fit_pool(self) -> None:
        """Size the stores to their pools now (grown before a write, or cut so a trimmed pool gives its memory
        back), whichever of the forks allocated them."""
        for store in self.stores:
            store.fit()

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
        self.fit_pool()
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

    # ------------------------------------------------------------------ writing
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
        """Copy the new K/V `[batch, kv_heads, q, d]` (only `tokens` of the batch-major tokens, if given) to `slots`,
        as rows `[tokens, kv_heads, d]` in the storage's dtype."""
        rows = []
        for states in (key_states, value_states):
            part = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[-1])
            if tokens is not None:
                part = part.index_select(0, tokens.to(part.device))
            rows.append(part if part.dtype == self.dtype and part.device == self.device
                        else part.to(device=self.device, dtype=self.dtype))  # fmt: skip
        self.storage.write(slots, *rows, cpu_kernel=self._cpu_kernel and cpu_attention.loaded())

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
        the other layers of the group in the same forward (kept with the plans they join, which a later layer checks)."""
        self.fit_pool()
        key = ("write_rows", self.tables.name, self.device)
        joined = memo.get(key)
        if joined is None or len(joined[0]) != len(plans) or any(a is not b for a, b in zip(joined[0], plans)):
            slots = torch.cat([plan.tensor("write_slots", self.device) for plan in plans])
            every = all(plan.write_tokens is None for plan in plans)
            joined = memo[key] = list(plans), slots, None if every else _stored_tokens(plans, self.device)
        self._store(joined[1], key_states, value_states, joined[2])

    # ------------------------------------------------------------------ reading
    def cpu_kernel_reads(self, dtype: torch.dtype) -> bool:
        """Whether the C++ CPU attention kernel can read this layer for queries of `dtype`: the backend allows it and it
        is built (`kernels.cpu_attention`), and the full-precision storage and the queries are float32."""
        return (self._cpu_kernel and self.dtype == torch.float32 and dtype == torch.float32
                and cpu_attention.available())  # fmt: skip

    def gather(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V for logical positions [kv_offset, new_len) of every row, `[batch, kv_heads, n, head_dim]`;
        padding reads as zeros. A single unpadded row whose blocks form one run comes back as a strided view
        of the storage (no copy); otherwise every row's runs are copied once into a contiguous batch-major
        tensor, as `DynamicCache` returns (some models `view()` the K/V they get back)."""
        runs = plan.runs()
        if len(runs) == 1 and len(runs[0]) == 1 and runs[0][0][0] == 0:
            keys, values = self.storage.row_kv(plan, 0)
            return keys.unsqueeze(0), values.unsqueeze(0)
        total, out = plan.new_len - plan.kv_offset, []
        for blocks in (self.key_blocks, self.value_blocks):
            gathered = blocks.new_empty(len(runs), blocks.shape[2], total, blocks.shape[3])
            for row, row_runs in enumerate(runs):
                at = row_runs[0][0] if row_runs else total  # the row's left padding reads as zeros
                gathered[row, :, :at] = 0
                for piece in self.storage.row_pieces(blocks, plan, row) if row_runs else []:
                    gathered[row, :, at : at + piece.shape[1]] = piece
                    at += piece.shape[1]
            out.append(gathered)
        return out[0], out[1]

    def stored_key_chunks(self, row: int):
        """The row's stored keys in stored order, as `[kv_heads, n, head_dim]` chunks (views when the
        blocks form one run), for eviction scores and attention statistics."""
        count, blocks, bs = self.tables.stored_tokens(row), self.tables.rows[row].blocks, self.tables.block_size
        if not count:
            return
        flat = self.key_blocks.view(-1, *self.key_blocks.shape[2:])
        first_block = blocks.one_run_start()
        if first_block is not None:
            yield flat[first_block * bs : first_block * bs + count].transpose(0, 1)
        else:
            yield flat[blocks.slots(0, count, bs).to(self.device)].transpose(0, 1)

    # ------------------------------------------------------------------ state
    def state_dict(self, blocks: list[int], quantized: list[int]) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a saved file keeps of the layer: its dtype, device and shapes, and the K/V of pool ids `blocks`
        (its block i is `blocks[i]`) heads first, `[kv_heads, blocks, block_size, d]` (`KVBlocks.saved`).
        `quantized`: the sealed blocks (quantized layers)."""
        state = {"dtype": self.dtype, "device": self.device, "kv_heads": self.kv_shape[0], "head_dim": self.kv_shape[1],
                 "value_dim": self.value_dim}  # fmt: skip
        return state, self.storage.saved(blocks)

    def storage_shapes(self, blocks: int, quantized: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype `load_state_dict` takes each tensor of `state_dict` in, for that many blocks."""
        return self.storage.saved_shapes(blocks)

    def load_state_dict(self, state: dict, tensors: dict[str, torch.Tensor], blocks: list[int],
                        quantized: list[int]) -> None:  # fmt: skip
        """Take a saved layer's K/V into pool ids `blocks` of the storage (allocated by `lazy_initialization`;
        `tensors` have the `storage_shapes`)."""
        self.storage.load(tensors, blocks)
        self.sync_length()


def stored_keys(layer: PagedLayer, row: int) -> torch.Tensor:
    """Every stored key of the row (sealed ones decoded), float32 `[kv_heads, n, head_dim]` (a transient copy), for
    eviction scores and probes."""
    chunks = [chunk.float() for chunk in layer.stored_key_chunks(row)]
    return torch.cat(chunks, dim=1) if chunks else torch.zeros(layer.kv_shape[0], 0, layer.kv_shape[1])


def _stored_tokens(plans: list[StepPlan], device: torch.device) -> torch.Tensor:
    """Which of the one-row `plans`' new tokens, side by side in their order, are stored: each plan's `write_tokens`
    (all of its tokens without), offset by the tokens of the plans before it."""
    tokens, offset = [], 0
    for plan in plans:
        own = (torch.arange(plan.q_len, device=device) if plan.write_tokens is None
               else plan.tensor("write_tokens", device))  # fmt: skip
        tokens.append(own + offset)
        offset += plan.q_len
    return torch.cat(tokens)
