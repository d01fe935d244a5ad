"""`PagedCache`: a `transformers.Cache` whose attention layers keep K/V in blocks of a preallocated pool."""

from __future__ import annotations

import functools
import numbers
import os
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .accounting import CacheMetrics, blocks_in_budget, collect_metrics
from .attention.contract import (
    PAGED_KV_KWARG, attention_is_paged, caches_latents, check_attention_kwargs, check_paged_reader, model_name,
)  # fmt: skip
from .blocks.plan import StepPlan
from .blocks.pool import BlockPool
from .blocks.reach import Reach
from .blocks.sealing import QuantizedBlockTables
from .blocks.tables import BlockTables
from .blocks.unsharing import unshare, unshare_demand
from .cache_blocks import CacheBlocks
from .cache_step import CacheStep, copy_blocks, copy_quantized
from .config import PagedCacheConfig
from .distributed import tensor_parallel_size
from .errors import UnsupportedAttentionError
from .eviction import Evictor
from .forks import ForkingCache, Forks
from .layer_types.builder import build_layers
from .layers.handle import PagedKV
from .layers.paged import PagedLayer
from .layers.quantized import QuantizedLayer
from .layers.shared_kv import SharedKVLayer
from .paged_attention import check_model_features
from .persistence.load import load_cache
from .persistence.save import save_cache


class PagedCache(ForkingCache, Cache):
    """A drop-in replacement for `DynamicCache` that stores K/V in fixed-size blocks.

    ```python
    cache = PagedCache(model.config, block_size=16, max_memory="2GiB")
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)
    ```

    Full-attention layers share one set of block tables, sliding-window layers of each window size
    another; KV-sharing consumers (Gemma-3n) store nothing and read their producer layer's blocks; layers
    the paged store does not own (linear attention) use transformers' own layer classes. Options are those
    of `PagedCacheConfig`, given either as keyword arguments or as one `PagedCacheConfig`.

    `fork()` (and `copy.deepcopy`) gives a second cache that shares every block by reference count, in the
    same pools: "one context, many questions" costs the questions only. A cache and its forks belong to one
    generation at a time and one thread: a thread that calls `update()` while another thread's forward step
    of the same family is under way gets a `RuntimeError`. Give each thread an independent cache (a pickle
    round trip, or `save` / `load`).
    """

    def __init__(self, config: PretrainedConfig, options: PagedCacheConfig | None = None, **kwargs: Any):
        if options is not None and kwargs:
            raise ValueError("Pass either a `PagedCacheConfig` or keyword options to PagedCache, not both")
        if options is not None and not isinstance(options, PagedCacheConfig):
            raise TypeError(f"`options` must be a PagedCacheConfig, got {type(options).__name__}")
        if options is None:
            try:
                options = PagedCacheConfig(**kwargs)
            except TypeError as error:
                known = ", ".join(PagedCacheConfig.__dataclass_fields__)
                raise TypeError(f"{error}; PagedCache options are: {known}") from None
        if not isinstance(config, PretrainedConfig):
            raise TypeError(f"PagedCache needs the model's config (`model.config`), got {type(config).__name__}")
        self.options = options
        self.model_config = config.get_text_config(decoder=True)
        self.tp_size = tensor_parallel_size(config)  # ranks sharing the KV heads (tensor parallelism)
        self._latents = caches_latents(self.model_config)  # fixed by the config, as the layers built from it
        self.groups: dict[str, BlockTables] = {}
        self.planner = CacheStep()
        self._forks = Forks(self)
        layers, self.layer_types = build_layers(self.model_config, options, self._group)
        super().__init__(layers=layers)
        # Each group's layers, found once: every step hands them its copy-on-write and sealing work.
        self._members = {name: [layer for layer in self.paged_layers if layer.tables is group]
                         for name, group in self.groups.items()}  # fmt: skip
        self.evictor = None
        if options.eviction is not None:
            evicting = {i: layer for i, (layer, layer_type) in enumerate(zip(layers, self.layer_types))
                        if isinstance(layer, PagedLayer) and layer_type.evictable}  # fmt: skip
            self.evictor = Evictor(options.eviction, evicting, options.block_size, options.evict_every,
                                   options.evict_between_chunks, self.tp_size)  # fmt: skip

    def _group(self, name: str, reach: Reach | None, quant: str | None = None) -> BlockTables:
        """The tables of layers of one kind (full, or sliding or chunked of one size) and one storage format."""
        if quant is not None:
            name = f"{name}/{quant.strip()}"
        if name not in self.groups:
            self.groups[name] = _new_group(self.options, name, reach, quant)
        return self.groups[name]

    @property
    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    @property
    def blocks(self) -> CacheBlocks:
        """What the rows hold of the pools, for swap, defragmentation, a prefix cache and a scheduler."""
        return CacheBlocks(self)

    # ------------------------------------------------------------------ the write path
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"This PagedCache was built for a model with {len(self.layers)} layers but layer {layer_idx} wrote to "
                "it: build the cache from the config of the model that uses it (`PagedCache(model.config)`)."
            )
        layer = self.layers[layer_idx]
        attention_kwargs = kwargs.get("kwargs")
        # Whether this forward runs the "paged" attention, which reads K/V from the blocks itself unless the model
        # caches latents (its attention reads K/V expanded from the gathered history).
        paged = attention_kwargs is not None and attention_is_paged(self.model_config)
        in_place = paged and not self._latents
        if paged:  # what the config and this layer's kwargs show is refused before this layer writes
            try:
                if not isinstance(layer, PagedLayer) or layer.seq_len == layer.tables.length:  # its group's first
                    check_model_features(self.model_config)  # layer in this step: once per step, as it plans
                check_attention_kwargs(model_name(self.model_config), attention_kwargs)
            except UnsupportedAttentionError:
                if self.layers_written() < len(self.paged_layers):  # earlier layers of this forward wrote
                    self._undo_step()
                raise
        if isinstance(layer, SharedKVLayer):
            states = layer.update(key_states, value_states, attention_kwargs if in_place else None, self._undo_step)
            if paged and not in_place:
                self._leave_gathered_handle(attention_kwargs, layer.source, layer.source.tables.plan)
            return states
        if not isinstance(layer, PagedLayer):
            return layer.update(key_states, value_states, *args, **kwargs)
        self._check_thread()
        if self.options.eviction is not None or layer.tables.compacted:
            evicted = any(group.compacted for group in self.groups.values())
            check_paged_reader(self.model_config, attention_kwargs, evicted)
        if not layer.is_initialized:
            self.options.check_backend(self.options.device or key_states.device)
        layer.check_states(key_states)
        plan = self.planner.plan(self, layer, key_states, value_states, attention_kwargs)
        if plan.mirrors:
            plan = self.planner.check_mirrors(self, layer, key_states, value_states, plan)
        if not in_place:
            states = layer.update(key_states, value_states, plan)
            if paged:
                self._leave_gathered_handle(attention_kwargs, layer, plan)
            return states
        after = None
        if self.evictor is not None and layer_idx in self.evictor.layers:
            after = functools.partial(self._after_attention, layer_idx)
        return layer.update(key_states, value_states, plan, attention_kwargs, after, self._undo_step)

    def planned_row(self, layer_idx: int, q_len: int, device: torch.device) -> StepPlan | None:
        """The plan of the step under way for layer `layer_idx` when a packed forward may write its `q_len` tokens (on
        `device`) together with other caches' (`take_step`, then `PagedLayer.write_rows`): an earlier layer of its
        group planned the step, and nothing but the write is due (and the seal of the blocks its tokens complete: no
        eviction, one plain row); else None (`update`)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, PagedLayer) or layer.tables.compacted or self._latents:
            return None
        if self.evictor is not None and layer_idx in self.evictor.layers:
            return None
        plan = layer.tables.plan
        return plan if layer.writes_plain_row(plan, q_len, device) else None

    def take_step(self, layer_idx: int, plan: StepPlan, key_states: torch.Tensor, value_states: torch.Tensor,
                  tokens: slice) -> PagedKV:  # fmt: skip
        """Layer `layer_idx` takes its tokens of the step planned as `plan` (`tokens` of the packed forward's
        `key_states` / `value_states` `[1, kv_heads, tokens, d]`, which `PagedLayer.write_rows` then stores for every
        cache at once): its storage's shapes at a first step, what it does before the write
        (`PagedLayer.take_arrivals`), its new length, and the handle its attention reads the blocks through."""
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)  # shapes and dtype: the same for every cache's tokens
        layer.take_arrivals(plan, key_states, value_states, tokens=tokens)
        layer.seq_len = plan.new_len
        return PagedKV(layer, plan, None, self._undo_step)

    def _leave_gathered_handle(self, attention_kwargs: dict, layer: PagedLayer, plan: StepPlan) -> None:
        """For the "paged" attention of a model that caches latents (handed the gathered history, not blocks): a
        handle that lets it take the step back on a refusal, and a packed forward mask each sequence's rows."""
        attention_kwargs[PAGED_KV_KWARG] = PagedKV(layer, plan, None, self._undo_step, gathered=True)

    def _undo_step(self) -> None:
        """Take back the forward step under way (`CacheStep.undo`): its attention refused the model."""
        self.planner.undo(self)

    def layers_written(self) -> int:
        """Paged layers that have written the latest step (all of them between steps)."""
        return sum(layer.seq_len == layer.tables.length for layer in self.paged_layers)

    def ensure_storage(self, dtype: torch.dtype) -> None:
        """Create the pools of a `max_memory` cache at its first write (or load), which tells the storage dtype."""
        if self.options.max_memory is None or all(group.pool is not None for group in self.groups.values()):
            return
        num_blocks = blocks_in_budget(self.model_config, self.options.max_memory, self.options.block_size,
                                      self.options.dtype or dtype, self.tp_size)  # fmt: skip
        for group in self.groups.values():
            group.pool = BlockPool(num_blocks, growable=self.options.growable)

    def step_demand(self, q_len: int) -> dict[BlockPool, int]:
        """Free blocks per pool that this cache's next step of `q_len` tokens per row takes (what it allocates
        less what it returns): a scheduler admits a step only when the pools hold them."""
        return self.planner.demand(self, q_len)

    def group_layers(self, name: str) -> list[PagedLayer]:
        """The paged layers that store their K/V through group `name`'s tables."""
        return self._members[name]

    def _after_attention(self, layer_idx: int, *attention) -> None:
        """After a layer's `"paged"` attention: the evictor records its statistics and may evict, and the storage
        of the blocks an eviction freed is given back at once (a prompt compressed to 25% holds 25%)."""
        self.evictor.after_attention(layer_idx, *attention)
        self.planner.trim(self, [self.layers[layer_idx].tables])

    # ------------------------------------------------------------------ eviction
    def evict_now(self) -> int:
        """Apply the eviction policy now: every row above its budget is compacted to it. Returns the
        tokens evicted (summed over layers and rows)."""
        if self.evictor is None:
            raise ValueError("This PagedCache has no eviction policy: build it with `eviction=...` (e.g. SnapKV(budget=1024))")
        groups = [group for group in self.groups.values() if group.length > 0]
        evicted = self.evictor.evict(groups, slack=0)
        self.planner.trim(self, groups)
        return evicted

    # ------------------------------------------------------------------ whole-cache edits used by generate()
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam `beam_idx[i]`. Rows share blocks by reference; no K/V is copied."""
        beam_idx = _row_indices(beam_idx, "beam_idx")
        self._reorder(beam_idx.tolist())
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):
                layer.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = len(next(iter(self.groups.values())).rows) if self.groups else 0
        self._reorder([row for row in range(rows) for _ in range(repeats)])
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):
                layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        indices = _row_indices(indices, "indices")
        self._reorder(indices.tolist())
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):
                layer.batch_select_indices(indices)

    def _reorder(self, order: list[int]) -> None:
        rows = next((len(group.rows) for group in self.groups.values() if group.length > 0), None)
        if rows is not None and (not order or not all(0 <= row < rows for row in order)):
            raise ValueError(
                f"PagedCache holds {rows} rows: a reorder takes one or more row indices, each in [0, {rows}); "
                f"got {order}"
            )
        stepped = [group for group in self.groups.values() if group.length > 0]
        demand = [] if self.options.sharing else [
            (group, *need) for group in stepped for need in unshare_demand(group, order)
        ]
        for group, pool, count in demand:  # sharing=False: the copies must fit before anything changes
            pool.check_reserve(count, group=group.name, block_size=group.block_size)
        for group in stepped:
            group.reorder(order)
        for group, pool, count in demand:
            pool.reserve(count, group=group.name, block_size=group.block_size)
        if demand:
            self._unshare(stepped)
        if self.evictor is not None:
            self.evictor.reorder(order)

    def _unshare(self, groups: list[BlockTables]) -> None:
        """`sharing=False`: rows that a reorder left sharing blocks get their own copies, as `DynamicCache`'s
        reorder copies its tensors."""
        for group in groups:
            members = self._members[group.name]
            quantized = [layer for layer in members if isinstance(layer, QuantizedLayer)]
            unshare(group, functools.partial(copy_blocks, members), functools.partial(copy_quantized, quantized))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (assisted and prompt-lookup decoding roll back this way)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral):
            raise ValueError(
                f"`tokens_to_remove` must be an int <= 0 (the negative count of tokens to remove from the end), got "
                f"{tokens_to_remove!r}"
            )
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        targets = {}
        for name, group in self.groups.items():
            if group.length == 0:
                continue
            targets[name] = group.length + tokens_to_remove
            if targets[name] < 0:
                raise ValueError(f"Cannot crop {-tokens_to_remove} tokens: the cache holds only {group.length}")
            group.check_crop(targets[name])
        for name, target in targets.items():
            self.groups[name].crop(target)
            self.groups[name].trim_to_window()
        if self.evictor is not None:
            self.evictor.cropped()
        self.planner.trim(self, [self.groups[name] for name in targets])
        for layer in self.layers:
            if isinstance(layer, PagedLayer):
                layer.sync_length()
            else:
                layer.crop(tokens_to_remove)

    def reset(self) -> None:
        """Return every block to the pool; storage stays allocated for the next generation."""
        for group in self.groups.values():
            group.release()
        if self.evictor is not None:
            self.evictor.reset()
        self.sync_lengths()
        for layer in self.layers:
            if not isinstance(layer, PagedLayer):
                layer.reset()

    def sync_lengths(self) -> None:
        """Layers take their group's length after the groups' rows were set from outside (a prefix cache hit)."""
        for layer in self.paged_layers:
            layer.sync_length()

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep what a later `crop` rolls back into (assisted and prompt-lookup decoding): blocks that leave a window,
        and, through transformers' own layers, the recurrent states `kwargs` ask for (`recurrent_states_to_keep`)."""
        for group in self.groups.values():
            group.record_past = True
        super().activate_past_recording(**kwargs)

    # ------------------------------------------------------------------ accounting
    def metrics(self) -> CacheMetrics:
        """Blocks, tokens and bytes held right now, per group and in total."""
        counts = self.evictor.counts if self.evictor is not None else {}
        groups = {name: (group, self._members[name], counts.get(name, (0, 0))) for name, group in self.groups.items()}
        quantized = {index: layer for index, layer in enumerate(self.layers) if isinstance(layer, QuantizedLayer)}
        return collect_metrics(self.options.block_size, groups, quantized, self.tp_size, len(self._forks.caches))

    def __repr__(self) -> str:
        return f"PagedCache(groups={list(self.groups)}, block_size={self.options.block_size}, layers={len(self.layers)})"

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write the cache to one safetensors file: the blocks in use (quantized ones as codes), the tables,
        per-row and eviction state; `PagedCache.load` continues from it exactly. Save between forward steps.
        An existing writable file is replaced; a write-protected one only with `overwrite=True`."""
        save_cache(self, path, overwrite)

    @classmethod
    def load(
        cls, path: str | os.PathLike, config: PretrainedConfig, options: PagedCacheConfig | None = None, **kwargs: Any
    ) -> PagedCache:
        """The cache `save` wrote to `path`, for the model of `config`, with its own pool (sized to the blocks
        it holds, or by `num_blocks` / `max_memory`). Without options it takes the file's; a `PagedCacheConfig`,
        or keywords replacing single saved options, may change where and how large its storage is (`device`,
        `backend`, `num_blocks`, `max_memory`, `initial_blocks`), and every other option must equal the
        file's. A corrupted file, another model's config or mismatched options raise `CacheFileError` (a
        `ValueError`) naming the mismatch. Loading runs no code from the file (safetensors and JSON, no pickle)."""
        return load_cache(cls, path, config, options, **kwargs)


def _new_group(options: PagedCacheConfig, name: str, reach: Reach | None, quant: str | None) -> BlockTables:
    """A group's tables and pools: no pool yet for a `max_memory` cache (`PagedCache.ensure_storage`), else one of
    the blocks a pool starts with (0 when a growable pool is sized by the first step's demand)."""
    start = options.num_blocks or options.initial_blocks or 0
    pool = None if options.max_memory is not None else BlockPool(start, growable=options.growable)
    if quant is None:
        return BlockTables(name, pool, options.block_size, reach)
    qpool = BlockPool(start, growable=options.growable)
    return QuantizedBlockTables(name, pool, qpool, options.block_size, reach, options.kv_format(quant),
                                options.residual_length)  # fmt: skip


def _row_indices(indices, name: str) -> torch.Tensor:
    """Row indices (a 1-D integer tensor or a sequence) as an int64 tensor, for the reorder methods."""
    indices = torch.as_tensor(indices)
    integer = not (indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool)
    if indices.dim() != 1 or (indices.numel() and not integer):
        raise ValueError(f"`{name}` must be a 1-D tensor of row indices, got {indices.dtype} {tuple(indices.shape)}")
    return indices.long()
