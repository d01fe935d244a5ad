"""One forward step across a cache's groups: the first layer of a forward plans every group's step (free blocks
checked for all groups before any changes, pools grown, blocks that left a window trimmed), and a refused step
is taken back."""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache

from .blocks.plan import StepPlan
from .blocks.pool import GROWTH, BlockPool, grown_size
from .blocks.sealing import QuantizedBlockTables
from .blocks.tables import BlockTables
from .errors import OutOfBlocksError
from .layers.paged import PagedLayer
from .layers.quantized import QuantizedLayer
from .layers.shared_kv import SharedKVLayer



class CacheStep:
    """The step planning of one `PagedCache` (passed to each method, so no cycle keeps a fork alive), and the
    groups' lengths before the step under way (`start`), which `undo` takes the cache back to."""

    def __init__(self):
        self.start: dict[str, int] = {}

    def undo(self, cache: Cache) -> None:
        """Take back the forward step under way, whose attention refused the model (a keyword only the attention
        function sees, e.g. gpt-oss's `s_aux`): every group that stepped goes back to its length before the step.
        Exact for a step into an empty cache (a fresh generation) and for full-precision tables without eviction
        (blocks that left a sliding window at the step stay freed: no later step reads them); a step's sealing or
        evictions cannot be taken back, and then the caller is told to reset."""
        if len(self.start) == len(cache.groups) and not any(self.start.values()):
            cache.reset()
            return
        try:
            unpaged = [layer for layer in cache.layers if not isinstance(layer, (PagedLayer, SharedKVLayer))]
            if cache.evictor is not None or unpaged:
                raise RuntimeError("eviction, or layers not stored in blocks, changed state the step cannot give back")
            for name, length in self.start.items():
                if isinstance(cache.groups[name], QuantizedBlockTables):
                    raise RuntimeError(f"the {name} layers may have sealed (quantized) blocks in this step")
                cache.groups[name].check_crop(length)
        except RuntimeError as error:
            raise RuntimeError(
                f"The refused forward step could not be taken back ({error}): call `cache.reset()` before using the "
                "cache again"
            ) from error
        for name, length in self.start.items():
            cache.groups[name].crop(length)
        cache.sync_lengths()

    def plan(
        self, cache: Cache, layer: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor,
        attention_kwargs: dict | None,
    ) -> StepPlan:
        """The plan of `layer`'s group for this forward; the first layer of a forward plans every group.

        Planning checks the free blocks of every group before it changes any, so running out of blocks
        leaves the cache exactly as it was.
        """
        batch, q_len = key_states.shape[0], key_states.shape[2]
        tables = layer.tables
        if tables.plan is not None and layer.seq_len + q_len == tables.length and tables.plan.q_len == q_len:
            return tables.plan
        self._check_step(cache, layer, batch, q_len)
        cache.ensure_storage(key_states.dtype)
        cache.claim_step()
        stepping = [group for group in cache.groups.values() if group.length == tables.length]
        pads = [0] * batch
        if tables.length == 0:
            pads, exact = left_padding(attention_kwargs, batch, q_len)
            for group in stepping:
                group.padding_exact = exact
        if cache.evictor is not None:
            cache.evictor.before_step(stepping, q_len)
        self.start = {group.name: group.length for group in stepping}
        mirrors = self._mirrors(cache, stepping, pads, key_states, value_states)
        growth, shortage = self._growth(cache, stepping, q_len, pads, mirrors)
        if shortage is not None and cache.evictor is not None:  # pool pressure: evict to budget, plan again
            cache.evictor.relieve(stepping)
            mirrors = self._mirrors(cache, stepping, pads, key_states, value_states)
            growth, shortage = self._growth(cache, stepping, q_len, pads, mirrors)
        if shortage is not None:
            raise shortage
        for pool, extra in growth:
            pool.grow(extra)
        for group in stepping:
            members = cache.group_layers(group.name)
            group.planner.apply_step(q_len, pads, functools.partial(copy_blocks, members),
                                     functools.partial(seal, members), mirrors[group.name])  # fmt: skip
        if cache.evictor is not None:
            cache.evictor.step_planned(q_len)
        self.trim(cache, stepping)  # blocks that left a window this step, or that a reorder let go since the last
        return tables.plan

    def _check_step(self, cache: Cache, layer: PagedLayer, batch: int, q_len: int) -> None:
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

    def _mirrors(self, cache: Cache, stepping: list[BlockTables], pads: list[int], key_states: torch.Tensor,
                 value_states: torch.Tensor) -> dict[str, dict[int, int]]:  # fmt: skip
        """Per group, the rows that will share their source row's blocks this step instead of storing their own:
        rows whose state is identical to an earlier row's and whose new K/V (in the layer that plans) are too.
        Every other layer checks its own K/V before writing (`check_mirrors`), so sharing stays exact."""
        mirrors = {group.name: {} for group in stepping}
        if not cache.options.sharing or key_states.shape[0] < 2:
            return mirrors
        candidates = {group.name: group.planner.mirror_candidates(pads) for group in stepping}
        if all(row == first for rows in candidates.values() for row, first in enumerate(rows)):
            return mirrors
        same = equal_rows(key_states, value_states)
        for name, rows in candidates.items():
            mirrors[name] = {row: first for row, first in enumerate(rows) if first != row and same[row] == same[first]}
        return mirrors

    def check_mirrors(self, cache: Cache, layer: PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor,
                      plan: StepPlan) -> StepPlan:  # fmt: skip
        """Before a layer writes: a mirror row whose K/V differ from its source's in this layer gets its own blocks
        (the exact check behind identical-row sharing; with identical inputs it does not happen in practice)."""
        for row, source in list(plan.mirrors.items()):
            if torch.equal(key_states[row], key_states[source]) and torch.equal(value_states[row], value_states[source]):
                continue
            tables, bs = layer.tables, layer.tables.block_size
            needed = len(tables.rows[row].blocks) - (tables.stored_tokens(row) - plan.new_tokens[row]) // bs
            tables.pool.reserve(needed, group=tables.name, block_size=bs)
            plan = tables.planner.unmirror(row, functools.partial(copy_blocks, cache.group_layers(tables.name)))
        return plan

    def _growth(self, cache: Cache, stepping: list[BlockTables], q_len: int, pads: list[int],
                mirrors: dict[str, dict[int, int]]):  # fmt: skip
        """([(pool, blocks to add)], None) for the step, or ([], the error to raise) when a fixed pool is short."""
        growth = []
        for group in stepping:
            for pool, needed, freed, name in group.planner.demands(q_len, pads, mirrors[group.name]):
                try:
                    extra = pool.check_reserve(needed, group=name, block_size=group.block_size, freed=freed)
                except OutOfBlocksError as shortage:
                    return [], shortage
                if extra:
                    growth.append((pool, extra))
        return growth, None

    def trim(self, cache: Cache, groups: list[BlockTables]) -> None:
        """Keep a growable pool's storage within `GROWTH` x its blocks in use after blocks were freed (a window moved
        on, an eviction, a crop; the rows a reorder let go at the next step): a pool holding more is packed to its
        low ids and cut to `grown_size` of them, never below `initial_blocks`, and its layers' storage with it.
        Packing keeps every row's read path, so no result changes. Fixed pools keep the size asked for.
        Only full-precision groups of a cache that shares its pools with no fork (forks, and the batch generator's
        requests, hold ids this cache cannot rewrite; `BatchGenerator.compact` packs those)."""
        if not cache.options.growable or len(cache.caches_sharing_pools()) > 1:
            return
        for group in groups:
            pool = group.pool
            if pool is None or isinstance(group, QuantizedBlockTables):
                continue
            target = max(grown_size(pool.num_used), cache.options.initial_blocks or 0)
            if pool.num_blocks + 1 <= GROWTH * pool.num_used or target >= pool.num_blocks:
                continue
            members = cache.group_layers(group.name)
            group.trim_pool(target, functools.partial(copy_blocks, members))
            for layer in members:
                layer.fit_pool()

    def demand(self, cache: Cache, q_len: int) -> dict[BlockPool, int]:
        """`PagedCache.step_demand`: free blocks per pool the next step of `q_len` tokens per row takes."""
        demand: dict[BlockPool, int] = {}
        rows = next((len(group.rows) for group in cache.groups.values() if group.length > 0), 1)
        for group in cache.groups.values():
            for pool, needed, freed, _name in group.planner.demands(q_len, [0] * rows, {}):
                demand[pool] = demand.get(pool, 0) + max(needed - freed, 0)
        return demand


def copy_blocks(layers: list[PagedLayer], sources: list[int], targets: list[int]) -> None:
    """Copy-on-write: block contents from `sources` to `targets` in every layer of a group."""
    for layer in layers:
        layer.storage.copy_blocks(sources, targets)


def copy_quantized(layers: list[QuantizedLayer], sources: list[int], targets: list[int]) -> None:
    for layer in layers:
        layer.sealed.copy_blocks(sources, targets)


def seal(layers: list[PagedLayer], sources: list[int], targets: list[int], keep: list[int]) -> None:
    """Quantize full-precision blocks `sources` into sealed blocks `targets` in every layer of a group, each
    keeping a copy of blocks `keep` for the step (`QuantizedLayer.seal`)."""
    for layer in layers:
        layer.seal(sources, targets, keep)


def left_padding(attention_kwargs: dict | None, batch: int, q_len: int) -> tuple[list[int], bool]:
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


def equal_rows(key_states: torch.Tensor, value_states: torch.Tensor) -> list[int]:
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
