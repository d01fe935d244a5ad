"""Swapping: a cache's blocks moved to a pool of host-memory blocks and back, bit for bit (or compressed on the
host, when asked).

Under memory pressure a scheduler can park a request instead of dropping its work: `SwapSpace.swap_out`
copies every block the cache's rows hold (every layer; full-precision and quantized storage alike) into host
blocks and drops the cache's references to the device blocks. A device block another cache also holds (a fork,
a shared prefix) keeps its other references, and one the prefix cache remembers stays findable in the free
queue until it is reused: only this cache's reference goes. While swapped, the rows' block lists point into
the host pool (so `reset()` or dropping the cache frees host blocks); `swap_in` copies them back into fresh
device blocks and the rows point to the device again. The host pool is one `BlockPool` per device pool, with
its own free queue; its storage is pinned on CUDA (plain CPU tensors otherwise, the same code path). Copies are
synchronous, on CUDA too: there is no side stream or prefetch overlapping them with compute yet.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

from .block_pool import BlockPool
from .block_tables import BlockTables
from .cache import PagedCache
from .quantization import QuantFormat, parse_kv_format
from .rows import BlockList


KINDS = ("blocks", "quantized")  # a row's block lists: full precision (`Row.blocks`), sealed (`Row.quantized`)


def group_pool(group: BlockTables, kind: str) -> BlockPool | None:
    """The device pool of a group's `kind` of blocks (None: the group has no such blocks, or no pool yet)."""
    return group.pool if kind == "blocks" else getattr(group, "qpool", None)


@dataclass
class SwapStats:
    """Traffic since the swap space was made: blocks and bytes each way, and the seconds the copies took."""

    out_blocks: int = 0
    out_bytes: int = 0
    in_blocks: int = 0
    in_bytes: int = 0
    seconds: float = 0.0


class _HostPool:
    """Host blocks mirroring one device pool: a free queue and, per device storage tensor, a host tensor (or the
    fields of its compressed format, `formats[i]` not None)."""

    def __init__(self, num_blocks: int, like: list[torch.Tensor], formats: list[QuantFormat | None]):
        self.pool = BlockPool(num_blocks)
        self.formats = formats
        pin = any(tensor.is_cuda for tensor in like) and torch.cuda.is_available()
        self.slots = []
        for tensor, fmt in zip(like, formats):
            if fmt is None:
                slot = torch.zeros((num_blocks + 1, *tensor.shape[1:]), dtype=tensor.dtype)
                self.slots.append(slot.pin_memory() if pin else slot)
            else:
                fields = fmt.allocate(num_blocks + 1, *tensor.shape[1:])
                self.slots.append({name: field.pin_memory() if pin else field for name, field in fields.items()})
        self.block_bytes = _block_bytes(like, formats)

    def store(self, tensors: list[torch.Tensor], device_ids: list[int], host_ids: list[int]) -> None:
        """Device blocks `device_ids` of each storage tensor into host blocks `host_ids` (compressed if asked)."""
        for tensor, slot, fmt in zip(tensors, self.slots, self.formats):
            blocks = tensor.index_select(0, torch.tensor(device_ids, device=tensor.device))
            if fmt is None:
                slot.index_copy_(0, torch.tensor(host_ids), blocks.cpu())
            else:
                fmt.quantize(blocks, slot, host_ids)

    def load(self, tensors: list[torch.Tensor], host_ids: list[int], device_ids: list[int]) -> None:
        """Host blocks `host_ids` back into device blocks `device_ids` of each storage tensor."""
        for tensor, slot, fmt in zip(tensors, self.slots, self.formats):
            ids = torch.tensor(host_ids)
            blocks = slot.index_select(0, ids) if fmt is None else fmt.dequantize(slot, ids, tensor.dtype)
            tensor.index_copy_(0, torch.tensor(device_ids, device=tensor.device), blocks.to(tensor.device))


class SwapSpace:
    """Host blocks for one family of caches (a template and its forks, which share pools and storage).

    `num_blocks` host blocks are made per device pool when that pool is first swapped from (None: as many as
    the device pool holds). `compression` (a `quant` format: "fp8", "int4", ...) stores full-precision blocks
    compressed on the host, so they return close to, not equal to, what they were; already-quantized blocks
    always move as they are.
    """

    def __init__(self, template: PagedCache, num_blocks: int | None = None, compression: str | None = None):
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                       or num_blocks < 1):  # fmt: skip
            raise ValueError(f"`swap_blocks` must be a positive int (host blocks per device pool), got {num_blocks!r}")
        self.template = template
        self.num_blocks = num_blocks
        try:
            self.compression = parse_kv_format(compression) if compression is not None else None
        except ValueError as error:
            raise ValueError(f"`swap_compression`: {error}") from None
        self.stats = SwapStats()
        self._host: dict[int, _HostPool] = {}  # id(device pool) -> its host pool
        self._swapped: weakref.WeakSet[PagedCache] = weakref.WeakSet()

    def is_swapped(self, cache: PagedCache) -> bool:
        return cache in self._swapped

    # ------------------------------------------------------------------ demand
    def out_demand(self, cache: PagedCache) -> int:
        """Host blocks `swap_out(cache)` takes (each distinct device block once), summed over pools."""
        return sum(len(ids) for ids in self._distinct(cache).values())

    def can_swap_out(self, cache: PagedCache) -> bool:
        """Whether the host pools hold every block of `cache` now."""
        for (pool, _kind), ids in self._distinct(cache).items():
            host = self._host.get(id(pool))
            if len(ids) > (host.pool.num_free if host is not None else self._host_size(pool)):
                return False
        return True

    def in_demand(self, cache: PagedCache) -> dict[BlockPool, int]:
        """Device blocks per pool that `swap_in(cache)` takes."""
        demand: dict[BlockPool, int] = {}
        for (pool, _kind), ids in self._distinct(cache).items():
            demand[pool] = demand.get(pool, 0) + len(ids)
        return demand

    def swap_bytes(self, cache: PagedCache) -> int:
        """Host bytes one swap of `cache` copies (either way; compressed blocks count their compressed bytes)."""
        return sum(len(ids) * _block_bytes(tensors, self._formats(kind, tensors))
                   for (_pool, kind), ids, tensors in self._fields(cache))  # fmt: skip

    # ------------------------------------------------------------------ moves
    def swap_out(self, cache: PagedCache) -> None:
        """Copy every block of `cache` to host blocks and drop its device references (the caller checked
        `can_swap_out`; a shortage raises before anything changes)."""
        if self.is_swapped(cache):
            raise ValueError("this cache is swapped out already")
        cache._check_between_steps("swap out")
        if not self.can_swap_out(cache):
            raise ValueError(f"the host pool cannot take {self.out_demand(cache)} more blocks: raise `swap_blocks`")
        started = time.perf_counter()
        for (pool, kind), ids, tensors in self._fields(cache):
            host = self._host_pool(pool, kind, tensors)
            mapping = dict(zip(ids, host.pool.allocate(len(ids))))
            host.store(tensors, ids, list(mapping.values()))
            self._move(cache, kind, pool, mapping, host.pool)
            self.stats.out_blocks += len(ids)
            self.stats.out_bytes += len(ids) * host.block_bytes
        self._swapped.add(cache)
        self.stats.seconds += time.perf_counter() - started

    def swap_in(self, cache: PagedCache) -> None:
        """Copy a swapped cache's blocks back into fresh device blocks (the caller checked `in_demand` against
        the free blocks; a shortage raises before anything changes) and free its host blocks."""
        if not self.is_swapped(cache):
            raise ValueError("this cache is not swapped out")
        for pool, count in self.in_demand(cache).items():
            if count > pool.num_free:
                raise ValueError(f"swapping in needs {count} free device blocks but only {pool.num_free} are free")
        started = time.perf_counter()
        for (pool, kind), host_ids, tensors in self._fields(cache):
            host = self._host[id(pool)]
            mapping = dict(zip(host_ids, pool.allocate(len(host_ids))))
            host.load(tensors, host_ids, list(mapping.values()))
            self._move(cache, kind, host.pool, mapping, pool)
            self.stats.in_blocks += len(host_ids)
            self.stats.in_bytes += len(host_ids) * host.block_bytes
        self._swapped.discard(cache)
        for group in cache.groups.values():
            group.plan = None
        self.stats.seconds += time.perf_counter() - started

    # ------------------------------------------------------------------ helpers
    def _distinct(self, cache: PagedCache) -> dict[tuple[BlockPool, str], list[int]]:
        """Per (device pool, "blocks" / "quantized"): the distinct block ids the cache's rows hold, in order."""
        found: dict[tuple[BlockPool, str], dict[int, None]] = {}
        for group in cache.groups.values():
            for kind in KINDS:
                pool = group_pool(group, kind)
                for row in group.rows:
                    blocks = getattr(row, kind)
                    if blocks is not None and blocks.ids:
                        found.setdefault((pool, kind), {}).update(dict.fromkeys(blocks.ids))
        return {key: list(ids) for key, ids in found.items()}

    def _fields(self, cache: PagedCache):
        """(device pool, kind), its distinct ids in `cache`, and the storage tensors of every layer indexed by them."""
        for (pool, kind), ids in self._distinct(cache).items():
            yield (pool, kind), ids, storage_tensors(cache, pool, kind)

    def _host_size(self, pool: BlockPool) -> int:
        return self.num_blocks if self.num_blocks is not None else pool.num_blocks

    def _host_pool(self, pool: BlockPool, kind: str, tensors: list[torch.Tensor]) -> _HostPool:
        if id(pool) not in self._host:
            self._host[id(pool)] = _HostPool(self._host_size(pool), tensors, self._formats(kind, tensors))
        return self._host[id(pool)]

    def _formats(self, kind: str, tensors: list[torch.Tensor]) -> list[QuantFormat | None]:
        """The host format of each storage tensor: compressed full-precision keys and values (`storage_tensors`
        lists them key, value per layer), everything else as it is."""
        if self.compression is None or kind != "blocks":
            return [None] * len(tensors)
        return [self.compression.key if index % 2 == 0 else self.compression.value for index in range(len(tensors))]

    @staticmethod
    def _move(cache: PagedCache, kind: str, source: BlockPool, mapping: dict[int, int], target: BlockPool) -> None:
        """Point every `kind` list of the cache's rows that holds ids of `source` at their `mapping` in `target`:
        each list drops its references to the old blocks and holds one to the new (each new block was allocated
        once, so the lists after the first that hold it take one more reference)."""
        holders = Counter()
        for group in cache.groups.values():
            for row in group.rows:
                blocks: BlockList | None = getattr(row, kind)
                if blocks is None or blocks.pool is not source:
                    continue
                blocks.pool.free(blocks.ids)
                fresh = [mapping[block] for block in blocks.ids]
                target.fork([block for block in fresh if holders[block]])
                holders.update(fresh)
                blocks.pool = target
                blocks.replace(fresh)


def storage_tensors(cache: PagedCache, pool: BlockPool, kind: str) -> list[torch.Tensor]:
    """Every storage tensor indexed by ids of `pool`: the full-precision K/V of its group's layers (`kind`
    "blocks"; key, value per layer) or their quantized fields ("quantized"). The layers of a cache's forks share
    this storage."""
    tensors = []
    for name, group in cache.groups.items():
        if group_pool(group, kind) is not pool:
            continue
        for layer in cache._members[name]:
            if kind == "blocks":
                tensors += [layer.key_blocks, layer.value_blocks]
            else:
                tensors += [*layer.qkey.values(), *layer.qvalue.values()]
    return tensors


def _block_bytes(tensors: list[torch.Tensor], formats: list[QuantFormat | None]) -> int:
    """Host bytes of one block of every storage tensor, in its host format."""
    return sum(tensor[0].numel() * tensor.element_size() if fmt is None else fmt.bytes_per_block(*tensor.shape[1:])
               for tensor, fmt in zip(tensors, formats))  # fmt: skip
