"""Pool compaction: the blocks in use packed to the low end of their pool, so the pool can shrink.

After many requests come and go, the blocks in use are scattered over the whole id range: the storage cannot
shrink (a layer's storage is indexed by id), and a row's blocks rarely form runs a read can view. `compact`
moves every referenced block of a family of caches (a template and its forks, which share pools and storage)
to ids 1..n, in id order, copying the contents in every layer, and rewrites every table of every fork, the
prefix cache's entries and the quantized groups' sealed-copy records. Every id then starts a new lifetime
(`BlockPool.remap` bumps its epoch): blocks no one references are forgotten, including unreferenced
prefix-cached ones. With `keep_free`, each pool of a growable family then shrinks to its blocks in use plus that
many, and the storage with it (it grows again on demand); a fixed pool never shrinks below the `num_blocks` /
`max_memory` it was given, so requests it was sized for keep fitting. Swapped-out caches hold host blocks and
are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blocks.pool import BlockPool
from ..blocks.sealing import QuantizedBlockTables
from ..cache import PagedCache
from ..serving.prefix_cache import PrefixCache
from .swap import KINDS, group_pool, storage_tensors


@dataclass(frozen=True)
class Fragmentation:
    """How scattered a pool's blocks in use are."""

    blocks: int  # ids in the pool
    used: int
    high_water: int  # the highest id in use (0: none); the storage cannot shrink below it
    run_breaks: int  # table entries that do not continue the previous entry's run (a read gathers there)

    @property
    def holes(self) -> int:
        """Free ids below the highest one in use."""
        return self.high_water - self.used

    @property
    def hole_share(self) -> float:
        return self.holes / self.high_water if self.high_water else 0.0


def device_pools(cache: PagedCache) -> list[tuple[BlockPool, str]]:
    """The cache's device pools, each once, with the kind of block it holds ("blocks" or "quantized")."""
    pools = {}
    for group in cache.groups.values():
        for kind in KINDS:
            pool = group_pool(group, kind)
            if pool is not None:
                pools.setdefault(id(pool), (pool, kind))
    return list(pools.values())


def fragmentation(template: PagedCache) -> dict[str, Fragmentation]:
    """Per device pool of the family of `template` (named by its group, "/quantized" for sealed blocks)."""
    caches = list(template._forks.caches)
    result = {}
    for name, group in template.groups.items():
        for kind in KINDS:
            pool = group_pool(group, kind)
            if pool is None:
                continue
            high = max(pool.used_ids(), default=0)
            breaks = sum(1 for ids in _tables(caches, pool) for a, b in zip(ids, ids[1:]) if b != a + 1)
            result[name if kind == "blocks" else f"{name}/quantized"] = Fragmentation(pool.num_blocks, pool.num_used,
                                                                                      high, breaks)  # fmt: skip
    return result


@torch.no_grad()
def compact(template: PagedCache, prefix_cache: PrefixCache | None = None, keep_free: int | None = None) -> None:
    """Pack the blocks in use of every pool of `template`'s family to ids 1..n (see the module docstring); with
    `keep_free`, shrink each pool of a growable family to n + `keep_free` blocks (fixed pools keep their size).
    Call it between steps."""
    if keep_free is not None and (isinstance(keep_free, bool) or not isinstance(keep_free, int) or keep_free < 0):
        raise ValueError(f"`keep_free` must be an int >= 0 (free blocks each pool keeps) or None, got {keep_free!r}")
    caches = list(template._forks.caches)
    for cache in caches:
        cache._check_between_steps("compact the pools of")
    pools = device_pools(template)
    mappings = {id(pool): {block: new for new, block in enumerate(pool.used_ids(), start=1)} for pool, _kind in pools}
    entries = _live_prefix_entries(template, prefix_cache, mappings)
    sealed = _live_sealed_copies(template, mappings)
    for pool, kind in pools:
        mapping = mappings[id(pool)]
        moved = {old: new for old, new in mapping.items() if old != new}
        if moved:
            for tensor in storage_tensors(template, pool, kind):
                src = torch.tensor(list(moved), device=tensor.device)
                dst = torch.tensor(list(moved.values()), device=tensor.device)
                tensor.index_copy_(0, dst, tensor.index_select(0, src))
        pool.remap(mapping)
        for cache in caches:
            for group in cache.groups.values():
                group.plan = None
                for blocks in (blocks for row in group.rows for blocks in row.block_lists() if blocks.pool is pool):
                    blocks.replace([mapping[block] for block in blocks.ids])
    if prefix_cache is not None:
        prefix_cache.entries = {
            key: {name: (block, template.groups[name].pool.epoch(block)) for name, block in entry.items()}
            for key, entry in entries.items()
        }
    for group, records in sealed.items():
        group.sealed_copies.clear()
        group.sealed_copies.update({block: (group.pool.epoch(block), copy, group.qpool.epoch(copy))
                                    for block, copy in records.items()})  # fmt: skip
    if keep_free is not None and template.options.growable:  # a fixed pool keeps the size it was given
        for pool, kind in pools:
            _shrink(template, pool, kind, min(pool.num_used + keep_free, pool.num_blocks))


def _tables(caches: list[PagedCache], pool: BlockPool) -> list[list[int]]:
    return [blocks.ids for cache in caches for group in cache.groups.values() for row in group.rows
            for blocks in row.block_lists() if blocks.pool is pool]  # fmt: skip


def _live_prefix_entries(template: PagedCache, prefix_cache: PrefixCache | None,
                         mappings: dict[int, dict[int, int]]) -> dict[bytes, dict[str, int]]:  # fmt: skip
    """The prefix cache's valid entries on blocks in use, at their new ids."""
    if prefix_cache is None:
        return {}
    entries = {}
    for key, entry in prefix_cache.entries.items():
        kept = {}
        for name, (block, epoch) in entry.items():
            pool = template.groups[name].pool
            if pool.epoch(block) == epoch and block in mappings[id(pool)]:
                kept[name] = mappings[id(pool)][block]
        if kept:
            entries[key] = kept
    return entries


def _live_sealed_copies(template: PagedCache, mappings: dict[int, dict[int, int]]):
    """Per quantized group, its valid sealed-copy records (full-precision block -> its sealed copy) at the new ids."""
    records = {}
    for group in template.groups.values():
        if not isinstance(group, QuantizedBlockTables):
            continue
        fp, quantized = mappings[id(group.pool)], mappings[id(group.qpool)]
        records[group] = {
            fp[block]: quantized[copy] for block, (epoch, copy, copy_epoch) in group.sealed_copies.items()
            if block in fp and copy in quantized and group.pool.epoch(block) == epoch
            and group.qpool.epoch(copy) == copy_epoch
        }  # fmt: skip
    return records


def _shrink(template: PagedCache, pool: BlockPool, kind: str, blocks: int) -> None:
    """Shrink `pool` to `blocks` ids and every layer's storage indexed by it to `blocks + 1` (the null block)."""
    pool.shrink(blocks)
    for name, group in template.groups.items():
        if group_pool(group, kind) is not pool:
            continue
        for layer in template._members[name]:
            if kind == "blocks" and layer.key_blocks is not None:
                layer.key_blocks = layer.key_blocks[: blocks + 1].clone()
                layer.value_blocks = layer.value_blocks[: blocks + 1].clone()
            elif kind == "quantized" and layer.qkey:
                layer.qkey = {field: tensor[: blocks + 1].clone() for field, tensor in layer.qkey.items()}
                layer.qvalue = {field: tensor[: blocks + 1].clone() for field, tensor in layer.qvalue.items()}
