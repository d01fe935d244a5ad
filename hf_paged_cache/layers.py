"""Cache layers whose keys and values live in blocks: one class per layer behaviour, as in transformers.

A layer owns its storage (`key_blocks` / `value_blocks`, `[blocks + 1, block_size, kv_heads, head_dim]`,
block 0 being the all-zero null block) and shares block tables with the other layers of its group.
It writes a step's new tokens into their slots and either returns the K/V gathered through the block
tables (any attention implementation) or leaves them in place for the `"paged"` attention to read.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from .block_tables import BlockTables, StepPlan
from .kernels.layout import allocate_kv_blocks
from .paged_states import paged_only

if TYPE_CHECKING:
    from .cache import PagedCache
    from .config import PagedCacheConfig

PAGED_KV_KWARG = "paged_kv"
QUERY_CHUNK = 256  # queries per pass when the torch path computes attention statistics


class PagedKV:
    """The handle `update()` passes to the `"paged"` attention function in place of gathered K/V."""

    def __init__(self, layer: PagedLayer, plan: StepPlan):
        self.layer = layer
        self.plan = plan

    @property
    def sliding_window(self) -> int | None:
        return self.layer.tables.sliding_window

    @property
    def uses_kernels(self) -> bool:
        return self.layer.uses_kernels()

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of logical positions [kv_offset, new_len) of every row, `[batch, kv_heads, n, head_dim]`."""
        return self.layer.gather(self.plan)

    def read(self, mask: torch.Tensor | None, q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K/V and the matching mask for the torch attention (see `PagedLayer.read_with_mask`)."""
        return self.layer.read_with_mask(self.plan, mask, q_len)


class PagedLayer(CacheLayerMixin):
    """A full-attention layer stored in blocks."""

    is_sliding = False
    is_croppable = True
    is_compileable = False
    is_quantized = False
    chunked = False

    def __init__(self, tables: BlockTables, options: PagedCacheConfig, owner: PagedCache):
        super().__init__()
        self.tables = tables
        self.options = options
        self._owner = owner
        self.seq_len = 0
        self.key_blocks: torch.Tensor | None = None
        self.value_blocks: torch.Tensor | None = None
        self.attention_stats: torch.Tensor | None = None  # eviction statistics, see `record_attention`

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.tables.name!r}, tokens={self.seq_len})"

    @property
    def eviction_policy(self):
        """The cache's eviction policy where this layer evicts (full attention), else None."""
        return None if self.is_sliding else self.options.eviction

    def uses_kernels(self) -> bool:
        """Whether the Triton kernels write and read this layer's blocks."""
        return not self.chunked and self.options.uses_kernels(self.device)

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = self.options.device or key_states.device
        self.dtype = self.options.dtype or key_states.dtype
        self.kv_shape = (key_states.shape[1], key_states.shape[-1])
        self.value_dim = value_states.shape[-1]
        self.key_blocks = self._allocate(self.kv_shape[1])
        self.value_blocks = self._allocate(self.value_dim)
        self.is_initialized = True

    def _allocate(self, head_dim: int, blocks: int | None = None) -> torch.Tensor:
        blocks = self.tables.pool.num_blocks + 1 if blocks is None else blocks
        storage = allocate_kv_blocks(blocks, self.options.block_size, self.kv_shape[0], head_dim, self.dtype, self.device)
        storage[0].zero_()  # the null block: what unstored positions (padding) read as
        return storage

    def _fit_pool(self) -> None:
        """Grow the storage after the (growable) pool grew; existing blocks keep their ids."""
        blocks = self.tables.pool.num_blocks + 1
        if len(self.key_blocks) < blocks:
            grown_keys, grown_values = self._allocate(self.kv_shape[1], blocks), self._allocate(self.value_dim, blocks)
            grown_keys[: self.key_blocks.shape[0]] = self.key_blocks
            grown_values[: self.value_blocks.shape[0]] = self.value_blocks
            self.key_blocks, self.value_blocks = grown_keys, grown_values

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        if self.is_initialized:
            self._fit_pool()
            src = torch.tensor(sources, device=self.device)
            dst = torch.tensor(targets, device=self.device)
            self.key_blocks.index_copy_(0, dst, self.key_blocks.index_select(0, src))
            self.value_blocks.index_copy_(0, dst, self.value_blocks.index_select(0, src))

    @property
    def storage_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.key_blocks, self.value_blocks))

    @property
    def block_bytes(self) -> int:
        """Bytes one full-precision block of this layer holds (keys and values)."""
        if not self.is_initialized:
            return 0
        return sum(t[0].numel() * t.element_size() for t in (self.key_blocks, self.value_blocks))

    # ------------------------------------------------------------------ the HF layer contract
    def get_seq_length(self) -> int:
        return self.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, attention_kwargs: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's new K/V into blocks; return K/V for the attention function.

        With the `"paged"` attention implementation and an attention-kwargs dict, the return value is
        the new states only and `attention_kwargs["paged_kv"]` tells the attention where the rest is.
        """
        heads, head_dim = key_states.shape[1], key_states.shape[-1]
        if self.is_initialized and (heads, head_dim) != self.kv_shape:
            raise ValueError(
                f"This PagedCache layer stores {self.kv_shape[0]} KV heads of size {self.kv_shape[1]} but received "
                f"{heads} heads of size {head_dim}: the cache was built for a different model. Build a new "
                "`PagedCache(model.config)` for this model."
            )
        plan = self._owner.begin_step(self, key_states, value_states, attention_kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._fit_pool()
        self._write(plan, key_states, value_states)
        self.seq_len = plan.new_len
        if attention_kwargs is not None and self._owner.reads_in_place:
            attention_kwargs[PAGED_KV_KWARG] = PagedKV(self, plan)
            return paged_only(key_states), paged_only(value_states)  # any other attention fails clearly
        keys, values = self.gather(plan)
        if keys.dtype != key_states.dtype:  # a storage dtype other than the model's (e.g. fp16 for an fp32 model)
            keys, values = keys.to(key_states.dtype), values.to(value_states.dtype)
        return keys, values

    def _write(self, plan: StepPlan, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.uses_kernels():
            from .kernels import write_kv

            tokens = [states.transpose(1, 2).reshape(-1, *states.shape[1:2], states.shape[-1]).to(self.dtype)
                      for states in (key_states, value_states)]  # fmt: skip
            write_kv(self.key_blocks, self.value_blocks, *tokens, plan.tensor("slot_mapping", self.device))
            return
        slots = plan.tensor("write_slots", self.device)
        if slots.numel() == 0:
            return
        tokens = None if plan.write_tokens is None else plan.tensor("write_tokens", self.device)
        for states, blocks in ((key_states, self.key_blocks), (value_states, self.value_blocks)):
            rows = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[-1])
            if tokens is not None:
                rows = rows.index_select(0, tokens.to(rows.device))
            if rows.dtype != self.dtype or rows.device != self.device:
                rows = rows.to(device=self.device, dtype=self.dtype)
            blocks.view(-1, *blocks.shape[2:]).index_copy_(0, slots, rows)

    # ------------------------------------------------------------------ reading
    def row_view(self, plan: StepPlan, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Row `row`'s readable K/V as views `[kv_heads, tokens, head_dim]` when its blocks are one run."""
        start_block = plan.run_start[row]
        if start_block is None:
            return None
        bs = self.options.block_size
        start, stop = plan.read_start[row], plan.read_stop[row]
        first = start // bs
        count = -(-stop // bs) - first
        offset = start - first * bs
        views = []
        for blocks in (self.key_blocks, self.value_blocks):
            flat = blocks[start_block : start_block + count].view(-1, *blocks.shape[2:])
            views.append(flat[offset : offset + stop - start].transpose(0, 1))
        return views[0], views[1]

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at the given slots (any shape `S`), as `[*S[:-1], kv_heads, S[-1], head_dim]`."""
        out = []
        for blocks in (self.key_blocks, self.value_blocks):
            gathered = blocks.view(-1, *blocks.shape[2:]).index_select(0, slots.reshape(-1))
            out.append(gathered.view(*slots.shape, *blocks.shape[2:]).transpose(-3, -2))
        return out[0], out[1]

    def gather(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V for logical positions [kv_offset, new_len) of every row; padding reads as zeros.

        A single row whose blocks form one run comes back as a strided view of the storage: no copy.
        """
        if len(plan.read_start) == 1 and plan.new_len - plan.kv_offset == plan.read_stop[0] - plan.read_start[0]:
            view = self.row_view(plan, 0)
            if view is not None:
                return view[0].unsqueeze(0), view[1].unsqueeze(0)
        return self.read_slots(plan.tensor("read_slots", self.device))


    def read_with_mask(
        self, plan: StepPlan, mask: torch.Tensor | None, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K/V of the step's read range and the boolean mask `[b, 1, q, n]` (or None) that goes with them.

        Unless eviction compacted a row this is `gather` with the model's mask. A compacted row stores
        its survivors in front of its virtual `base` (`BlockTables.compact`): the read then starts at the
        smallest base of the batch and hides, per row, the columns before that row's own base (positions
        whose tokens were evicted), which the model's mask still shows.
        """
        if not plan.tables.compacted:
            return (*self.gather(plan), mask)
        first = max(min(plan.base), plan.kv_offset)
        width = plan.new_len - first
        if len(plan.read_start) == 1 and plan.read_stop[0] - plan.read_start[0] == width:
            view = self.row_view(plan, 0) or self.read_slots(plan.tables._slots(plan.tables.tables[0], 0, width).to(self.device))
            keys, values = view[0].unsqueeze(0), view[1].unsqueeze(0)
        else:
            keys, values = self.read_slots(plan.tables.gather_slots(first, plan.new_len).to(self.device))
        if mask is None:
            total = plan.new_len - plan.kv_offset
            mask = torch.ones(q_len, total, dtype=torch.bool, device=keys.device).tril(total - q_len)[None, None]
        columns = torch.arange(first, plan.new_len, device=mask.device)
        bases = torch.tensor(plan.base, device=mask.device)
        own = (columns[None, :] >= bases[:, None])[:, None, None, :]
        return keys, values, mask[..., first - plan.kv_offset :] & own

    # ------------------------------------------------------------------ eviction support
    def stored_key_chunks(self, row: int):
        """The row's stored keys in stored order, as `[kv_heads, n, head_dim]` chunks (views when the
        blocks form one run), for eviction scores and attention statistics."""
        tables = self.tables
        count, table = tables.stored_tokens(row), tables.tables[row]
        if not count:
            return
        flat = self.key_blocks.view(-1, *self.key_blocks.shape[2:])
        if tables.run_from[row] == 0:
            first = table[0] * self.options.block_size
            yield flat[first : first + count].transpose(0, 1)
        else:
            yield flat[tables._slots(table, 0, count).to(self.device)].transpose(0, 1)

    def stored_keys(self, row: int) -> torch.Tensor:
        """Every stored key of the row, float32 `[kv_heads, n, head_dim]` (a transient copy)."""
        chunks = [chunk.float() for chunk in self.stored_key_chunks(row)]
        return torch.cat(chunks, dim=1) if chunks else torch.zeros(self.kv_shape[0], 0, self.kv_shape[1])

    @torch.no_grad()
    def record_attention(
        self, query: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None, policy
    ) -> None:
        """Fold this step's attention into `attention_stats` `[rows, kv_heads, capacity]` (stored order),
        the statistic `policy` needs: per stored key, the probability it received summed over its query
        group and the selected queries. The Triton path runs `paged_attention_mass`; the torch path visits
        the keys in the chunks the read uses, twice (log-sum-exp, then probabilities), `QUERY_CHUNK`
        queries at a time, so no `[queries, keys]` matrix of a whole row is ever built."""
        batch, _heads, q_len, _ = query.shape
        statistic = policy.statistic
        if statistic == "window" and q_len == 1:
            return  # SnapKV observes the prompt's last queries: decode steps leave its scores alone
        selected = {"accumulate": q_len, "last": 1}.get(statistic) or min(policy.observation_window, q_len)
        counts = [self.tables.stored_count(row) for row in range(batch)]
        self._fit_stats(batch, max(counts))
        kernel = self.uses_kernels() and not self.is_quantized  # the mass kernel reads full precision only
        mass = self._kernel_mass(query, scale, softcap, selected) if kernel else None
        for row in range(batch):
            n = counts[row]
            row_mass = mass[row, :, :n] if mass is not None else self._torch_mass(query, mask, scale, softcap, row, n, selected)
            stats = self.attention_stats[row, :, :n]
            if statistic == "accumulate" and getattr(policy, "decay", None) is not None:
                stats.mul_(policy.decay)
            stats.copy_(stats + row_mass if statistic == "accumulate" else row_mass)

    def _kernel_mass(self, query: torch.Tensor, scale: float, softcap: float | None, selected: int) -> torch.Tensor:
        from .kernels import paged_attention_mass

        plan, device = self.tables.plan, query.device
        return paged_attention_mass(
            query.transpose(1, 2), self.key_blocks, plan.tensor("block_tables", device), plan.tensor("seq_lens", device),
            plan.tensor("query_lens", device), scale, 0, softcap or 0.0, selected,
        )  # fmt: skip

    def _torch_mass(self, query, mask, scale: float, softcap, row: int, n: int, selected: int) -> torch.Tensor:
        kv_heads, (_, heads, q_len, head_dim) = self.kv_shape[0], query.shape
        length = self.tables.length
        columns = length - n + torch.arange(n, device=query.device)  # virtual position of each stored token
        chunks = functools.partial(self.stored_key_chunks, row)
        total = torch.zeros(kv_heads, n, device=query.device)
        for lo in range(q_len - selected, q_len, QUERY_CHUNK):
            hi = min(lo + QUERY_CHUNK, q_len)
            queries = query[row, :, lo:hi].float().reshape(kv_heads, -1, head_dim)  # [kv_heads, group * s, d]
            if mask is not None:
                visible = mask[row if mask.shape[0] > 1 else 0, 0, lo:hi].to(query.device)[:, columns]
            else:  # plain causality: query i sits at position length - q_len + i
                visible = columns[None, :] <= (length - q_len + torch.arange(lo, hi, device=query.device))[:, None]
            total += _attention_mass(queries, chunks, visible, heads // kv_heads, scale, softcap)
        return total

    def _fit_stats(self, rows: int, count: int) -> None:
        stats = self.attention_stats
        if stats is None or stats.shape[0] != rows or stats.shape[2] < count:
            capacity = max(count, 2 * (stats.shape[2] if stats is not None else 0), 64)
            grown = torch.zeros(rows, self.kv_shape[0], capacity, device=self.device)
            if stats is not None and stats.shape[0] == rows:
                grown[..., : stats.shape[2]] = stats
            self.attention_stats = grown

    def compact_stats(self, row: int, keep: torch.Tensor) -> None:
        """Reorder the row's statistics like its tokens after a compaction (`BlockTables.compact`)."""
        if self.attention_stats is None:
            return
        stats = self.attention_stats[row]
        kept = stats[:, : keep.shape[0]][:, keep.to(stats.device)].clone()
        stats.zero_()
        stats[:, : kept.shape[1]] = kept

    def forget_stats_after(self, stored_count) -> None:
        """Zero the statistics past each row's `stored_count(row)` tokens (after a crop), so tokens stored
        next start from nothing."""
        if self.attention_stats is not None:
            for row in range(self.attention_stats.shape[0]):
                self.attention_stats[row, :, stored_count(row) :] = 0

    def move_tokens(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy K/V from slots `sources` to slots `targets` (eviction's compaction): all reads first."""
        src, dst = sources.to(self.device), targets.to(self.device)
        for blocks in (self.key_blocks, self.value_blocks):
            flat = blocks.view(-1, *blocks.shape[2:])
            flat.index_copy_(0, dst, flat.index_select(0, src))


class PagedSlidingLayer(PagedLayer):
    """A sliding-window layer stored in blocks: blocks that leave the window go back to the pool.

    Lengths and returned K/V match transformers' `DynamicSlidingWindowLayer` (the previous
    `window - 1` tokens plus the new ones), so masks built for it apply unchanged.
    """

    is_sliding = True

    @property
    def sliding_window(self) -> int:
        return self.tables.sliding_window

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = self.tables.read_offset(self.seq_len)
        return self.seq_len - kv_offset + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window


def _attention_mass(queries: torch.Tensor, chunks, visible: torch.Tensor, group: int, scale: float, softcap) -> torch.Tensor:
    """Per key, the softmax probability summed over `queries` `[kv_heads, group * s, d]` (float32) over
    the key chunks `[kv_heads, n_i, d]` that `chunks()` yields in order (called twice: once for the
    log-sum-exp, once for the probabilities; a single chunk takes one softmax); `visible` `[s, sum n_i]`.
    Returns `[kv_heads, sum n_i]`."""
    visible = visible[None].expand(group, -1, -1).reshape(1, group * visible.shape[0], visible.shape[1])  # [1, g*s, n]

    def logits(chunk: torch.Tensor, start: int) -> torch.Tensor:
        out = torch.matmul(queries, chunk.float().transpose(-1, -2)).mul_(scale)
        if softcap is not None:
            out = out.div_(softcap).tanh_().mul_(softcap)
        return out.masked_fill_(~visible[..., start : start + chunk.shape[1]], float("-inf"))

    stream = chunks()
    head = list(itertools.islice(stream, 2))
    if not head:
        return queries.new_zeros(queries.shape[0], 0)
    if len(head) == 1:  # the row is one chunk (full precision): one fused softmax, a query seeing no key adds 0
        return torch.softmax(logits(head[0], 0), dim=-1).nan_to_num_(0.0).sum(dim=1)
    lse, start = None, 0
    for chunk in itertools.chain(head, stream):
        part = torch.logsumexp(logits(chunk, start), dim=-1)
        lse = part if lse is None else torch.logaddexp(lse, part)
        start += chunk.shape[1]
    masses, start = [], 0
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    for chunk in chunks():
        masses.append(torch.exp(logits(chunk, start) - safe[..., None]).sum(dim=1))
        start += chunk.shape[1]
    return torch.cat(masses, dim=-1)
