"""`CacheBlocks`: the narrow face of a cache's blocks for what manages memory around it.

Swap, defragmentation, the prefix cache and the batch generator's scheduler ask a cache which pools it draws on,
which ids its rows hold, which storage those ids index, and they renumber, attach or drop blocks through it, as
vLLM's schedulers go through its `KVCacheManager`: none of them reaches into the cache's groups, rows or layers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from .blocks.pool import BlockPool
from .blocks.renumbering import Holder
from .blocks.rows import BlockList
from .blocks.sealing import QuantizedBlockTables

KINDS = ("blocks", "quantized")  # a row's block lists: full precision (`Row.blocks`), sealed (`Row.quantized`)


class CacheBlocks:
    """What a cache's rows hold of its pools, and the few edits other modules make to them."""

    def __init__(self, cache: Cache):
        self.cache = cache  # a `PagedCache` (made by its `blocks` property)

    # ------------------------------------------------------------------ pools and the ids held in them
    def named_pools(self) -> dict[str, tuple[BlockPool, str]]:
        """Every group's device pools by name ("<group>" for full-precision blocks, "<group>/quantized" for sealed
        ones), each with its kind ("blocks" or "quantized"); a pool not created yet is left out."""
        named = {}
        for name, group in self.cache.groups.items():
            for kind, pool in zip(KINDS, group.pools()):
                if pool is not None:
                    named[name if kind == "blocks" else f"{name}/quantized"] = (pool, kind)
        return named

    def pools(self) -> list[tuple[BlockPool, str]]:
        """The device pools, each once, with their kind."""
        return list({id(pool): (pool, kind) for pool, kind in self.named_pools().values()}.values())

    def group_pools(self) -> dict[str, BlockPool]:
        """Each group's full-precision pool, by group name (a prefix cache keys its entries so)."""
        return {name: group.pool for name, group in self.cache.groups.items()}

    def block_lists(self, pool: BlockPool) -> list[BlockList]:
        """Every block list of the cache's rows that holds ids of `pool` (device or host, after a swap)."""
        return [blocks for group in self.cache.groups.values() for row in group.rows
                for blocks in row.block_lists() if blocks.pool is pool]  # fmt: skip

    def held(self) -> dict[tuple[BlockPool, str], list[int]]:
        """Per (device pool, kind): the distinct ids the rows hold, in order (ids of the host pool standing in for
        it while the cache is swapped out)."""
        found: dict[tuple[BlockPool, str], dict[int, None]] = {}
        for group in self.cache.groups.values():
            for row in group.rows:
                for kind, pool, blocks in zip(KINDS, group.pools(), row.block_lists()):
                    if blocks.ids:
                        found.setdefault((pool, kind), {}).update(dict.fromkeys(blocks.ids))
        return {key: list(ids) for key, ids in found.items()}

    def held_count(self) -> int:
        """Blocks the rows hold (full-precision and sealed; a shared one counted once per holder)."""
        return sum(len(blocks) for group in self.cache.groups.values() for row in group.rows
                   for blocks in row.block_lists())  # fmt: skip

    def storage(self, pool: BlockPool, kind: str) -> list[torch.Tensor]:
        """Every storage tensor indexed by ids of the device pool `pool`: per layer of the groups drawing on it, its
        full-precision keys and values (`kind` "blocks") or its sealed fields ("quantized"). A cache's forks share
        this storage."""
        tensors = []
        for name, group in self.cache.groups.items():
            if group.pools()[KINDS.index(kind)] is pool:
                for layer in self.cache.group_layers(name):
                    tensors += (layer.storage if kind == "blocks" else layer.sealed).tensors.values()
        return tensors

    # ------------------------------------------------------------------ edits
    def remaps(self, sealed_copies: bool = False) -> list[Holder]:
        """What renumbers the ids this cache holds after its pools were packed (`blocks.renumbering`); with
        `sealed_copies`, also the quantized groups' records of sealed copies (once per family: its template's)."""
        groups = list(self.cache.groups.values())
        holders: list[Holder] = [group.remap for group in groups]
        if sealed_copies:
            holders += [group.remap_sealed_copies for group in groups if isinstance(group, QuantizedBlockTables)]
        return holders

    def fit_storage(self) -> None:
        """Size every layer's storage to its pools after they shrank, so the memory is given back."""
        for layer in self.cache.paged_layers:
            layer.fit_pool()

    def drop_plans(self) -> None:
        """Forget the last step's plans (they name ids the rows no longer hold: a swap moved them)."""
        for group in self.cache.groups.values():
            group.drop_plan()

    # ------------------------------------------------------------------ prefixes
    def stores_sealed(self) -> bool:
        """Whether some group seals blocks (quantized; such blocks are not shared as prefixes)."""
        return any(isinstance(group, QuantizedBlockTables) for group in self.cache.groups.values())

    def prefix_reads_from(self, length: int) -> dict[str, int]:
        """Per group, the first block a row of `length` tokens still reads (0 without a window)."""
        return {name: group.read_offset(length) // group.block_size for name, group in self.cache.groups.items()}

    def full_blocks(self) -> dict[str, tuple[int, list[int]]]:
        """Per group, the one row's blocks: (the index of its first block in the sequence, the ids)."""
        return {name: (group.rows[0].base // group.block_size, group.rows[0].blocks.ids)
                for name, group in self.cache.groups.items()}  # fmt: skip

    def attach_prefix(self, found: dict[str, tuple[int, list[int]]], length: int) -> None:
        """Give the fresh cache a cached prefix of `length` tokens: per group, (the position its blocks start at, the
        block ids), each taken with one more reference."""
        for name, (base, blocks) in found.items():
            group = self.cache.groups[name]
            for block in blocks:
                group.pool.take(block)
            group.adopt(base, blocks, length)
        self.cache.sync_lengths()
