"""`PagedCache`: a `transformers.Cache` whose attention layers keep K/V in blocks of a preallocated pool."""

from __future__ import annotations

import copy
import functools
import numbers
import os
import threading
import weakref
from collections import Counter
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from .attention.dispatch import ATTENTION_NAME
from .attention.contract import (
    caches_latents,
    check_attention_kwargs,
    check_model_features,
    kv_sharing_sources,
    model_name,
)
from .blocks.plan import StepPlan
from .blocks.pool import GROWTH, BlockPool, grown_size
from .blocks.sealing import QuantizedBlockTables
from .blocks.tables import BlockTables
from .config import PagedCacheConfig
from .distributed import tensor_parallel_size
from .errors import OutOfBlocksError, UnsupportedAttentionError
from .eviction import Evictor
from .layers.paged import PAGED_KV_KWARG, PagedKV, PagedLayer, PagedSlidingLayer, SharedKVLayer
from .memory.accounting import SLIDING_TYPES, CacheMetrics, blocks_in_budget, collect_metrics
from .persistence.files import load_cache, save_cache
from .quantization.formats import parse_kv_format
from .layers.quantized import QuantizedLayer, QuantizedSlidingLayer


class PagedCache(Cache):
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
        self.groups: dict[str, BlockTables] = {}
        self._step_start: dict[str, int] = {}  # each group's length before the step under way (to take it back)
        self._forks = _Forks(self)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(self.model_config)
        _check_layer_counts(options, len(layer_types))
        _check_quant_layers(options, layer_types)
        # Layers the model itself makes reuse an earlier layer's K/V (transformers types them "dummy"): they call
        # no `update()`, so they read the producer's blocks whatever `sharing` says.
        reused = kv_sharing_sources(self.model_config)
        if reused and options.eviction is not None:
            raise ValueError(
                f"`eviction` cannot serve {model_name(self.model_config)}: its layers {sorted(reused)} reuse the K/V "
                "of earlier layers within the same forward, after those layers' eviction may already have moved "
                "their tokens. Build the cache without `eviction` for this model."
            )
        if caches_latents(self.model_config) and options.eviction is not None:
            raise ValueError(
                f"`eviction` cannot serve {model_name(self.model_config)}: it caches compressed latents and expands "
                "them into K/V after `update()`, so its attention reads the gathered history, not the blocks eviction "
                "scores and leaves gaps in. Build the cache without `eviction` for this model."
            )
        layers = []
        for index, (layer_type, kwargs_of_layer) in enumerate(zip(layer_types, layer_kwargs)):
            quant = options.layer_quant(index)
            source = options.shares_from(index)
            producer = _stored_layer(layers[reused[index]]) if index in reused else None
            if source is not None:
                _check_share_with(index, source, layer_types, layer_kwargs, layers)
                layers.append(SharedKVLayer(layers[source]))
            elif producer is not None:
                layers.append(SharedKVLayer(producer))
            elif layer_type == "full_attention":
                # With eviction each full-attention layer keeps its own tables: layers keep different tokens.
                tables = self._group(f"full_attention@{index}" if options.eviction else "full_attention", None, quant)
                layers.append((QuantizedLayer if quant else PagedLayer)(tables, options))
            elif layer_type in SLIDING_TYPES:
                tables = self._group(f"sliding_attention[{kwargs_of_layer['sliding_window']}]",
                                     kwargs_of_layer["sliding_window"], quant)  # fmt: skip
                layer_class = QuantizedSlidingLayer if quant else PagedSlidingLayer
                layers.append(layer_class(tables, options, chunked=layer_type == "chunked_attention"))
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs_of_layer))
        super().__init__(layers=layers)
        # Each group's layers, found once: every step hands them its copy-on-write and sealing work.
        self._members = {name: [layer for layer in self.paged_layers if layer.tables is group]
                         for name, group in self.groups.items()}  # fmt: skip
        self.evictor = None
        if options.eviction is not None:
            evicting = {i: layer for i, layer in enumerate(layers) if isinstance(layer, PagedLayer) and not layer.is_sliding}
            self.evictor = Evictor(options.eviction, evicting, options.block_size, options.evict_every,
                                   options.evict_between_chunks, self.tp_size)  # fmt: skip

    def _group(self, name: str, window: int | None, quant: str | None = None) -> BlockTables:
        """The tables of layers of one kind (full, or sliding with one window) and one storage format."""
        if quant is not None:
            name = f"{name}/{quant.strip()}"
        if name not in self.groups:
            pool = None if self.options.max_memory is not None else self._new_pool(self._fixed_pool_size())
            if quant is None:
                self.groups[name] = BlockTables(name, pool, self.options.block_size, window)
            else:
                self.groups[name] = QuantizedBlockTables(
                    name, pool, self._new_pool(self._fixed_pool_size()), self.options.block_size, window,
                    parse_kv_format(quant), self.options.residual_length,
                )  # fmt: skip
        return self.groups[name]

    def _new_pool(self, num_blocks: int) -> BlockPool:
        return BlockPool(num_blocks, growable=self.options.growable)

    def _fixed_pool_size(self) -> int:
        """Blocks a pool starts with; 0 when a growable pool is sized by the first step's demand."""
        return self.options.num_blocks or self.options.initial_blocks or 0

    @property
    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

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
        paged = attention_kwargs is not None and self._attention_is_paged()
        in_place = paged and not caches_latents(self.model_config)
        if paged:  # what the config and this layer's kwargs show is refused before this layer writes
            try:
                check_model_features(self.model_config)
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
            self._check_paged_reader(attention_kwargs)
        if not layer.is_initialized:
            self.options.check_backend(self.options.device or key_states.device)
        layer.check_states(key_states)
        plan = self._plan(layer, key_states, value_states, attention_kwargs)
        if plan.mirrors:
            plan = self._check_mirrors(layer, key_states, value_states, plan)
        if not in_place:
            states = layer.update(key_states, value_states, plan)
            if paged:
                self._leave_gathered_handle(attention_kwargs, layer, plan)
            return states
        after = None
        if self.evictor is not None and layer_idx in self.evictor.layers:
            after = functools.partial(self._after_attention, layer_idx)
        return layer.update(key_states, value_states, plan, attention_kwargs, after, self._undo_step)

    def _leave_gathered_handle(self, attention_kwargs: dict, layer: PagedLayer, plan: StepPlan) -> None:
        """For the "paged" attention of a model that caches latents (handed the gathered history, not blocks): a
        handle that lets it take the step back on a refusal, and a packed forward mask each sequence's rows."""
        attention_kwargs[PAGED_KV_KWARG] = PagedKV(layer, plan, None, self._undo_step, gathered=True)

    def _undo_step(self) -> None:
        """Take back the forward step under way, whose attention refused the model (a keyword only the attention
        function sees, e.g. gpt-oss's `s_aux`): every group that stepped goes back to its length before the step.
        Exact for a step into an empty cache (a fresh generation) and for full-precision tables without eviction
        (blocks that left a sliding window at the step stay freed: no later step reads them); a step's sealing or
        evictions cannot be taken back, and then the caller is told to reset."""
        if len(self._step_start) == len(self.groups) and not any(self._step_start.values()):
            self.reset()
            return
        try:
            unpaged = [layer for layer in self.layers if not isinstance(layer, (PagedLayer, SharedKVLayer))]
            if self.evictor is not None or unpaged:
                raise RuntimeError("eviction, or layers not stored in blocks, changed state the step cannot give back")
            for name, length in self._step_start.items():
                if isinstance(self.groups[name], QuantizedBlockTables):
                    raise RuntimeError(f"the {name} layers may have sealed (quantized) blocks in this step")
                self.groups[name].check_crop(length)
        except RuntimeError as error:
            raise RuntimeError(
                f"The refused forward step could not be taken back ({error}): call `cache.reset()` before using the "
                "cache again"
            ) from error
        for name, length in self._step_start.items():
            self.groups[name].crop(length)
        self.sync_lengths()

    def _check_thread(self) -> None:
        """Refuse (changing nothing) an update from a thread other than the one whose forward step is under
        way: some layers have written that step and others not yet. Between steps another thread may take
        the cache over (e.g. a worker thread that runs the next generation)."""
        thread, (owner, stepping) = threading.get_ident(), self._forks.step
        stepping = stepping() if stepping is not None else None
        if owner in (None, thread) or stepping is None:
            return
        written, layers = stepping.layers_written(), len(stepping.paged_layers)
        if written < layers:
            raise RuntimeError(
                f"A PagedCache of this family (it and its forks share pools) is in the middle of a forward step of "
                f"another thread ({written} of {layers} layers written) and thread {thread} called update(): a cache "
                "and its forks belong to one generation at a time, in one thread. Give each thread an independent "
                "cache (a pickle round trip, or `save` / `load`); if the other thread's forward failed, call `reset()` "
                "on its cache first."
            )

    def layers_written(self) -> int:
        """Paged layers that have written the latest step (all of them between steps)."""
        return sum(layer.seq_len == layer.tables.length for layer in self.paged_layers)

    def _check_paged_reader(self, attention_kwargs: dict | None) -> None:
        """Eviction needs the `"paged"` attention: it reads the blocks by stored index (other implementations
        read every logical position, so they would not see the gaps eviction leaves) and computes the
        statistics policies score by. Raised at the first forward, before anything changes."""
        if attention_kwargs is None:
            cause = "this model's attention calls `cache.update()` without attention kwargs, so nothing reads blocks"
            remedy = "build the cache without `eviction` for this model."
        elif not self._attention_is_paged():
            implementation = getattr(self.model_config, "_attn_implementation", None)
            cause = f"the config this cache was built from selects the {implementation!r} attention"
            remedy = (
                'call `model.set_attn_implementation("paged")` or load with `attn_implementation="paged"` (registered '
                "by `import hf_paged_cache`, and again by `register_paged_attention()`), and build the cache from that "
                "model's config."
            )
        else:
            return
        reason = "evicted tokens" if any(group.compacted for group in self.groups.values()) else "an eviction policy"
        raise RuntimeError(f'PagedCache has {reason}, which only the "paged" attention reads, but {cause}: {remedy}')

    def _attention_is_paged(self) -> bool:
        return getattr(self.model_config, "_attn_implementation", None) == ATTENTION_NAME

    def _plan(
        self, layer: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor, attention_kwargs: dict | None
    ) -> StepPlan:
        """The plan of `layer`'s group for this forward; the first layer of a forward plans every group.

        Planning checks the free blocks of every group before it changes any, so running out of blocks
        leaves the cache exactly as it was.
        """
        batch, q_len = key_states.shape[0], key_states.shape[2]
        tables = layer.tables
        if tables.plan is not None and layer.seq_len + q_len == tables.length and tables.plan.q_len == q_len:
            return tables.plan
        self._check_step(layer, batch, q_len)
        self._ensure_pools(key_states.dtype)
        self._forks.step = (threading.get_ident(), weakref.ref(self))
        stepping = [group for group in self.groups.values() if group.length == tables.length]
        pads = [0] * batch
        if tables.length == 0:
            pads, exact = _left_padding(attention_kwargs, batch, q_len)
            for group in stepping:
                group.padding_exact = exact
        if self.evictor is not None:
            self.evictor.before_step(stepping, q_len)
        self._step_start = {group.name: group.length for group in stepping}
        mirrors = self._mirrors(stepping, pads, key_states, value_states)
        growth, shortage = self._growth(stepping, q_len, pads, mirrors)
        if shortage is not None and self.evictor is not None:  # pool pressure: evict to budget, plan again
            self.evictor.relieve(stepping)
            mirrors = self._mirrors(stepping, pads, key_states, value_states)
            growth, shortage = self._growth(stepping, q_len, pads, mirrors)
        if shortage is not None:
            raise shortage
        for pool, extra in growth:
            pool.grow(extra)
        for group in stepping:
            members = self._members[group.name]
            group.apply_step(q_len, pads, functools.partial(_copy_blocks, members), functools.partial(_seal, members),
                             mirrors[group.name])  # fmt: skip
        if self.evictor is not None:
            self.evictor.step_planned(q_len)
        self._trim(stepping)  # blocks that left a window this step, or that a reorder let go since the last
        return tables.plan

    def _check_step(self, layer: PagedLayer, batch: int, q_len: int) -> None:
        tables = layer.tables
        if layer.seq_len != tables.length:
            raise RuntimeError(
                f"PagedCache layer holds {layer.seq_len} tokens but its group holds {tables.length}: a forward pass "
                "was interrupted. Call `cache.reset()` (or `cache.crop(...)`) before using it again."
            )
        rows = len(tables.rows)
        if tables.length > 0 and batch != rows:
            raise ValueError(
                f"PagedCache holds {rows} sequences from an earlier generation but received a batch of {batch}: "
                "call `cache.reset()` before reusing it for a different batch, or build a new PagedCache."
            )
        if q_len == 0:
            raise ValueError("PagedCache.update received no new tokens (query length 0)")

    def _mirrors(self, stepping: list[BlockTables], pads: list[int], key_states: torch.Tensor,
                 value_states: torch.Tensor) -> dict[str, dict[int, int]]:  # fmt: skip
        """Per group, the rows that will share their source row's blocks this step instead of storing their own:
        rows whose state is identical to an earlier row's and whose new K/V (in the layer that plans) are too.
        Every other layer checks its own K/V before writing (`_check_mirrors`), so sharing stays exact."""
        mirrors = {group.name: {} for group in stepping}
        if not self.options.sharing or key_states.shape[0] < 2:
            return mirrors
        candidates = {group.name: group.mirror_candidates(pads) for group in stepping}
        if all(row == first for rows in candidates.values() for row, first in enumerate(rows)):
            return mirrors
        same = _equal_rows(key_states, value_states)
        for name, rows in candidates.items():
            mirrors[name] = {row: first for row, first in enumerate(rows) if first != row and same[row] == same[first]}
        return mirrors

    def _check_mirrors(self, layer: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor,
                       plan: StepPlan) -> StepPlan:  # fmt: skip
        """Before a layer writes: a mirror row whose K/V differ from its source's in this layer gets its own blocks
        (the exact check behind identical-row sharing; with identical inputs it does not happen in practice)."""
        for row, source in list(plan.mirrors.items()):
            if torch.equal(key_states[row], key_states[source]) and torch.equal(value_states[row], value_states[source]):
                continue
            tables, bs = layer.tables, layer.tables.block_size
            needed = len(tables.rows[row].blocks) - (tables.stored_tokens(row) - plan.new_tokens[row]) // bs
            tables.pool.reserve(needed, group=tables.name, block_size=bs)
            plan = tables.unmirror(row, functools.partial(_copy_blocks, self._members[tables.name]))
        return plan

    def _growth(self, stepping: list[BlockTables], q_len: int, pads: list[int], mirrors: dict[str, dict[int, int]]):
        """([(pool, blocks to add)], None) for the step, or ([], the error to raise) when a fixed pool is short."""
        growth = []
        for group in stepping:
            for pool, needed, freed, name in group.demands(q_len, pads, mirrors[group.name]):
                try:
                    extra = pool.check_reserve(needed, group=name, block_size=group.block_size, freed=freed)
                except OutOfBlocksError as shortage:
                    return [], shortage
                if extra:
                    growth.append((pool, extra))
        return growth, None

    def _ensure_pools(self, dtype: torch.dtype) -> None:
        """Create the pools of a `max_memory` cache at its first write, which tells the storage dtype."""
        if self.options.max_memory is None or all(group.pool is not None for group in self.groups.values()):
            return
        num_blocks = blocks_in_budget(self.model_config, self.options.max_memory, self.options.block_size,
                                      self.options.dtype or dtype, self.tp_size)  # fmt: skip
        for group in self.groups.values():
            group.pool = self._new_pool(num_blocks)

    def _after_attention(self, layer_idx: int, *attention) -> None:
        """After a layer's `"paged"` attention: the evictor records its statistics and may evict, and the storage
        of the blocks an eviction freed is given back at once (a prompt compressed to 25% holds 25%)."""
        self.evictor.after_attention(layer_idx, *attention)
        self._trim([self.layers[layer_idx].tables])

    def _trim(self, groups: list[BlockTables]) -> None:
        """Keep a growable pool's storage within `GROWTH` x its blocks in use after blocks were freed (a window moved
        on, an eviction, a crop; the rows a reorder let go at the next step): a pool holding more is packed to its
        low ids and cut to `grown_size` of them, never below `initial_blocks`, and its layers' storage with it.
        Packing keeps every row's read path, so no result changes. Fixed pools keep the size asked for.
        Only full-precision groups of a cache that shares its pools with no fork (forks, and the batch generator's
        requests, hold ids this cache cannot rewrite; `BatchGenerator.compact` packs those)."""
        if not self.options.growable or len(self._forks.caches) > 1:
            return
        for group in groups:
            pool = group.pool
            if pool is None or isinstance(group, QuantizedBlockTables):
                continue
            target = max(grown_size(pool.num_used), self.options.initial_blocks or 0)
            if pool.num_blocks + 1 <= GROWTH * pool.num_used or target >= pool.num_blocks:
                continue
            members = self._members[group.name]
            group.trim_pool(target, functools.partial(_copy_blocks, members))
            for layer in members:
                layer.fit_pool()

    def step_demand(self, q_len: int) -> dict[BlockPool, int]:
        """Free blocks per pool that this cache's next step of `q_len` tokens per row takes (what it allocates
        less what it returns): a scheduler admits a step only when the pools hold them."""
        demand: dict[BlockPool, int] = {}
        rows = next((len(group.rows) for group in self.groups.values() if group.length > 0), 1)
        for group in self.groups.values():
            for pool, needed, freed, _name in group.demands(q_len, [0] * rows, {}):
                demand[pool] = demand.get(pool, 0) + max(needed - freed, 0)
        return demand

    # ------------------------------------------------------------------ forks and copies
    def fork(self) -> PagedCache:
        """A second cache with the same contents that shares every block by reference count, in the same pools:
        time and memory grow with the number of blocks, no K/V is copied, and whichever cache first writes into a
        shared partly filled block copies that block only. Quantized codes, eviction survivors and statistics
        are kept. With `sharing=False` the fork is an independent copy instead (blocks copied)."""
        self._check_between_steps("fork")
        if not self.options.sharing:
            return self._independent_copy({})
        return self._twin()

    def sibling(self) -> PagedCache:
        """An empty cache with the same options in the same pools and storage (what the batch generator gives
        each request): blocks any of them frees serve the others. Pools are shared even with `sharing=False`,
        which concerns the blocks' contents."""
        self._check_between_steps("fork")
        twin = self._twin()
        twin.reset()
        return twin

    def _twin(self) -> PagedCache:
        twin = self.__class__.__new__(self.__class__)  # not copy.copy: that would run __setstate__'s pool rebuild
        twin.__dict__.update(self.__dict__)
        twin.groups = {name: group.fork() for name, group in self.groups.items()}
        twin.layers = []
        for layer in self.layers:
            if isinstance(layer, PagedLayer):
                twin.layers.append(layer.fork(twin.groups[layer.tables.name]))
            elif isinstance(layer, SharedKVLayer):
                twin.layers.append(SharedKVLayer(twin.layers[self.layers.index(layer.source)]))
            else:
                twin.layers.append(copy.deepcopy(layer))
        twin._members = {name: [twin.layers[i] for i in self._layer_indices(members)]
                         for name, members in self._members.items()}  # fmt: skip
        if self.evictor is not None:
            twin.evictor = self.evictor.fork({index: twin.layers[index] for index in self.evictor.layers})
        self._forks.caches.add(twin)
        return twin

    def __del__(self) -> None:
        """A fork that goes away returns its references, so the blocks only it held are free for the others."""
        try:
            for group in self.groups.values():
                group.release()
        except Exception:  # interpreter shutdown may have torn down what release needs; nothing is left to free
            pass

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """`copy.deepcopy(cache)` is `fork()`: transformers' "re-use a prompt cache" recipe works unchanged and
        costs no copy of the prompt (an independent copy with `sharing=False`)."""
        if self.options.sharing:
            return self.fork()
        self._check_between_steps("copy")
        return self._independent_copy(memo)

    def _independent_copy(self, memo: dict) -> PagedCache:
        twin = self.__class__.__new__(self.__class__)
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return twin

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_forks"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        """An unpickled (or independently copied) cache has its own pools: blocks that only its former forks
        referenced are free in them."""
        self.__dict__.update(state)
        self._forks = _Forks(self)
        references: dict[int, Counter] = {}
        for group in self.groups.values():
            for row in group.rows:
                for pool, blocks in ((group.pool, row.blocks), (group.quantized_pool, row.quantized)):
                    if blocks is not None:
                        references.setdefault(id(pool), Counter()).update(blocks.ids)
        for group in self.groups.values():
            for pool in (group.pool, group.quantized_pool):
                if pool is not None:
                    pool.set_references(references.get(id(pool), Counter()))

    def _check_between_steps(self, what: str) -> None:
        if self.layers_written() < len(self.paged_layers):
            raise RuntimeError(
                f"Cannot {what} a PagedCache in the middle of a forward step ({self.layers_written()} of "
                f"{len(self.paged_layers)} layers written): {what} it between steps, or `reset()` it after a failed "
                "forward"
            )

    def _layer_indices(self, layers: list[PagedLayer]) -> list[int]:
        return [next(i for i, layer in enumerate(self.layers) if layer is member) for member in layers]

    # ------------------------------------------------------------------ eviction
    def evict_now(self) -> int:
        """Apply the eviction policy now: every row above its budget is compacted to it. Returns the
        tokens evicted (summed over layers and rows)."""
        if self.evictor is None:
            raise ValueError("This PagedCache has no eviction policy: build it with `eviction=...` (e.g. SnapKV(budget=1024))")
        groups = [group for group in self.groups.values() if group.length > 0]
        evicted = self.evictor.evict(groups, slack=0)
        self._trim(groups)
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
            (group, *need) for group in stepped for need in group.unshare_demand(order)
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
            group.unshare(functools.partial(_copy_blocks, members), functools.partial(_copy_quantized, quantized))

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
        self._trim([self.groups[name] for name in targets])
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

    def activate_past_recording(self) -> None:
        for group in self.groups.values():
            group.record_past = True
        super().activate_past_recording()

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


class _Forks:
    """What a cache and its forks share besides pools and storage: which of them are alive (metrics), and which
    thread's forward step of which of them is under way (the pools serve one step at a time)."""

    def __init__(self, cache: PagedCache):
        self.caches: weakref.WeakSet[PagedCache] = weakref.WeakSet([cache])
        self.step: tuple[int | None, weakref.ref | None] = (None, None)


def _check_share_with(index: int, source: int, layer_types: list[str], layer_kwargs: list[dict], built: list) -> None:
    """`share_with` needs an earlier attention layer of the same kind (and window) that stores its own K/V."""
    if layer_types[index] != layer_types[source] or layer_kwargs[index] != layer_kwargs[source] or not isinstance(
        built[source], PagedLayer
    ):
        raise ValueError(
            f"`share_with` maps layer {index} ({layer_types[index]!r}) to layer {source} ({layer_types[source]!r}): "
            "the source must be an attention layer of the same kind and window that the cache stores in blocks"
        )


def _stored_layer(layer) -> PagedLayer | None:
    """The paged layer whose blocks hold `layer`'s K/V (itself, or a `share_with` layer's source); None if not paged."""
    layer = layer.source if isinstance(layer, SharedKVLayer) else layer
    return layer if isinstance(layer, PagedLayer) else None


def _copy_blocks(layers: list[PagedLayer], sources: list[int], targets: list[int]) -> None:
    """Copy-on-write: block contents from `sources` to `targets` in every layer of a group."""
    for layer in layers:
        layer.copy_blocks(sources, targets)


def _copy_quantized(layers: list[QuantizedLayer], sources: list[int], targets: list[int]) -> None:
    for layer in layers:
        layer.copy_quantized_blocks(sources, targets)


def _seal(layers: list[PagedLayer], sources: list[int], targets: list[int], keep: list[int]) -> None:
    """Quantize full-precision blocks `sources` into sealed blocks `targets` in every layer of a group, each
    keeping a copy of blocks `keep` for the step (`QuantizedLayer.seal`)."""
    for layer in layers:
        layer.seal(sources, targets, keep)


def _check_quant_layers(options: PagedCacheConfig, layer_types: list[str]) -> None:
    for index, spec in (options.quant_layers or {}).items():
        if index >= len(layer_types) or (
            spec is not None and layer_types[index] != "full_attention" and layer_types[index] not in SLIDING_TYPES
        ):
            kind = "does not exist" if index >= len(layer_types) else f"is a {layer_types[index]!r} layer"
            raise ValueError(
                f"`quant_layers` names layer {index}, which {kind}: only the attention layers of this model's "
                f"{len(layer_types)} layers are stored in blocks and can be quantized"
            )


def _left_padding(attention_kwargs: dict | None, batch: int, q_len: int) -> tuple[list[int], bool]:
    """Left-padding tokens per row of a first chunk, and whether that count is exact.

    They are read from the `position_ids` that generate() derives from the attention mask (padding and
    the first real token all sit at position 0). A chunk whose positions are all 0 keeps its last token
    (it may be the first real one); models that pass no `position_ids` store their padding like any
    token. Both stay correct because masks hide stored padding; only the Triton path, which reads no
    mask, needs the count to be exact.
    """
    positions = attention_kwargs.get("position_ids") if attention_kwargs else None
    if not isinstance(positions, torch.Tensor) or positions.shape[-1] != q_len:
        return [0] * batch, False
    if positions.dim() == 3:  # multimodal rope: [sections, batch, q]
        positions = positions[0]
    positions = positions.expand(batch, q_len)
    leading_zeros = (positions == 0).int().cumprod(-1).sum(-1)
    exact = q_len == 1 or bool((leading_zeros < q_len).all())
    return (leading_zeros - 1).clamp(min=0).tolist(), exact


def _equal_rows(key_states: torch.Tensor, value_states: torch.Tensor) -> list[int]:
    """Per row of a step's K/V, the first row whose K and V are exactly equal to it (itself when none). Rows are
    bucketed by a checksum first, so distinct rows cost one reduction, not pairwise comparisons."""
    sums = (key_states.flatten(1).double().sum(-1) + value_states.flatten(1).double().sum(-1)).tolist()
    firsts: dict[float, list[int]] = {}
    same = []
    for row, checksum in enumerate(sums):
        bucket = firsts.setdefault(checksum, [])
        match = next((first for first in bucket if torch.equal(key_states[row], key_states[first])
                      and torch.equal(value_states[row], value_states[first])), None)  # fmt: skip
        if match is None:
            bucket.append(row)
        same.append(row if match is None else match)
    return same


def _check_layer_counts(options: PagedCacheConfig, num_layers: int) -> None:
    """Options that count layers must fit the model: checked when the cache learns its layer count."""
    if options.full_precision_layers > num_layers:
        raise ValueError(
            f"`full_precision_layers`={options.full_precision_layers} but this model has {num_layers} layers: "
            f"at most {num_layers} (which quantizes nothing), or use `quant_layers` to choose layers one by one"
        )
    outside = [layer for pair in (options.share_with or {}).items() for layer in pair if layer >= num_layers]
    if outside:
        raise ValueError(
            f"`share_with` names layer {outside[0]}, but this model has {num_layers} layers (0 to {num_layers - 1})"
        )
    budgets = options.eviction.layer_budgets if options.eviction is not None else None
    if budgets is not None and len(budgets) != num_layers:
        raise ValueError(
            f"`layer_budgets` of the eviction policy has {len(budgets)} multipliers but this model has {num_layers} "
            f"layers: give one per layer (e.g. `pyramid_budgets({num_layers})`)"
        )


def _row_indices(indices, name: str) -> torch.Tensor:
    """Row indices (a 1-D integer tensor or a sequence) as an int64 tensor, for the reorder methods."""
    indices = torch.as_tensor(indices)
    integer = not (indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool)
    if indices.dim() != 1 or (indices.numel() and not integer):
        raise ValueError(f"`{name}` must be a 1-D tensor of row indices, got {indices.dtype} {tuple(indices.shape)}")
    return indices.long()
