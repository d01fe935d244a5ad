"""Swapping: a cache's blocks moved to a pool of host-memory blocks and back, bit for bit (or compressed, when
asked).

Under memory pressure a scheduler can park a request instead of dropping its work: `SwapSpace.swap_out`
copies every block the cache's rows hold (every layer; full-precision and quantized storage alike) into host
blocks and drops the cache's references to the device blocks. A device block another cache also holds (a fork,
a shared prefix) keeps its other references, and one the prefix cache remembers stays findable in the free
queue until it is reused: only this cache's reference goes. While swapped, the rows' block lists point into
the host pool (so `reset()` or dropping the cache frees host blocks); `swap_in` copies them back into fresh
device blocks and the rows point to the device again. The host pool is one `BlockPool` per device pool, with
its own free queue; its storage is pinned on CUDA (plain CPU tensors otherwise, the same code path).

The copies run on a `CopyStream` (`copy_stream.py`): synchronous by default, so the blocks are usable when a
call returns; with `copies="async"` (CUDA) they run on a side stream and the tables change at once, so the
caller fences (`copies.fence()`) before the compute stream touches blocks again -- the batch generator does,
and swaps a request in a step before it runs again, so the copy overlaps that step's forward. A swap-in waits
for the same cache's swap-out to complete (its host blocks are read). Compressed copies are encoded on the
device before the copy out and decoded on the device after the copy in: fewer bytes cross the link each way,
and the host only moves bytes.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..blocks.pool import BlockPool
from ..cache import PagedCache
from .copy_stream import CopyStream, Transfer
from ..quantization.base import QuantFormat
from ..quantization.registry import format_from_spec


@dataclass
class SwapStats:
    """Traffic since the swap space was made: blocks and bytes each way (the copies' times: `copies.stats`)."""

    out_blocks: int = 0
    out_bytes: int = 0
    in_blocks: int = 0
    in_bytes: int = 0


class _HostPool:
    """Host blocks mirroring one device pool: a free queue and, per device storage tensor, its host fields (the
    tensor itself as field "blocks", or the fields of its compressed format, `formats[i]` not None)."""

    def __init__(self, num_blocks: int, like: list[torch.Tensor], formats: list[QuantFormat | None]):
        self.pool = BlockPool(num_blocks)
        self.formats = formats
        self.pin = any(tensor.is_cuda for tensor in like) and torch.cuda.is_available()
        self.slots: list[dict[str, torch.Tensor]] = []
        for tensor, fmt in zip(like, formats):
            if fmt is None:
                fields = {"blocks": torch.zeros((num_blocks + 1, *tensor.shape[1:]), dtype=tensor.dtype)}
            else:
                fields = fmt.allocate(num_blocks + 1, *tensor.shape[1:])
            self.slots.append({name: field.pin_memory() if self.pin else field for name, field in fields.items()})
        self.block_bytes = _block_bytes(like, formats)

    def store(self, tensors: list[torch.Tensor], device_ids: list[int],
              host_ids: list[int]) -> tuple[Callable[[], None], Callable[[], None]]:  # fmt: skip
        """The copy of device blocks `device_ids` of each storage tensor into host blocks `host_ids`, in two parts:
        `copy` gathers (and compresses) them on the device into host staging; `finish` scatters the staging into
        the host slots, once the copy has completed."""
        staged: list[dict[str, torch.Tensor]] = []

        def copy() -> None:
            for tensor, fmt in zip(tensors, self.formats):
                blocks = tensor.index_select(0, torch.tensor(device_ids, device=tensor.device))
                if fmt is None:
                    fields = {"blocks": blocks}
                else:
                    fields = fmt.allocate(len(device_ids), *tensor.shape[1:], device=tensor.device)
                    fmt.quantize(blocks, fields, range(len(device_ids)))
                staged.append({name: self._to_host(field) for name, field in fields.items()})

        def finish() -> None:
            ids = torch.tensor(host_ids)
            for slot, data in zip(self.slots, staged):
                for name, field in slot.items():
                    field.index_copy_(0, ids, data[name])

        return copy, finish

    def load(self, tensors: list[torch.Tensor], host_ids: list[int], device_ids: list[int]) -> Callable[[], None]:
        """Gather host blocks `host_ids` into staging now (the host blocks may be reused once this returns) and
        return the copy that moves them into device blocks `device_ids` of each storage tensor (decompressing on
        the device)."""
        ids = torch.tensor(host_ids)
        staged = [{name: self._gather(field, ids) for name, field in slot.items()} for slot in self.slots]

        def copy() -> None:
            for tensor, fmt, data in zip(tensors, self.formats, staged):
                fields = {name: field.to(tensor.device, non_blocking=True) for name, field in data.items()}
                if fmt is None:
                    blocks = fields["blocks"]
                else:
                    blocks = fmt.dequantize(fields, slice(0, len(device_ids)), tensor.dtype)
                tensor.index_copy_(0, torch.tensor(device_ids, device=tensor.device), blocks)

        return copy

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor's copy into pinned host memory, asynchronous on CUDA; a host tensor as it is."""
        if not tensor.is_cuda:
            return tensor
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor, non_blocking=True)

    def _gather(self, field: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Host blocks `ids` of one field, copied into (pinned, on CUDA) staging."""
        out = torch.empty((len(ids), *field.shape[1:]), dtype=field.dtype, pin_memory=self.pin)
        return torch.index_select(field, 0, ids, out=out)


class SwapSpace:
    """Host blocks for one family of caches (a template and its forks, which share pools and storage).

    `num_blocks` host blocks are made per device pool when that pool is first swapped from (None: as many as
    the device pool holds). `compression` (a `quant` format: "fp8", "int4", ...) stores full-precision blocks
    compressed on the host, so they return close to, not equal to, what they were; already-quantized blocks
    always move as they are. `copies` is the `CopyStream` mode ("sync": every call returns with its copy done).
    """

    def __init__(self, template: PagedCache, num_blocks: int | None = None, compression: str | None = None,
                 copies: str = "sync"):  # fmt: skip
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                       or num_blocks < 1):  # fmt: skip
            raise ValueError(f"`swap_blocks` must be a positive int (host blocks per device pool), got {num_blocks!r}")
        self.template = template
        self.num_blocks = num_blocks
        try:
            self.compression = format_from_spec(compression) if compression is not None else None
        except ValueError as error:
            raise ValueError(f"`swap_compression`: {error}") from None
        self.copies = CopyStream(copies)
        self.stats = SwapStats()
        self._host: dict[int, _HostPool] = {}  # id(device pool) -> its host pool
        self._swapped: weakref.WeakSet[PagedCache] = weakref.WeakSet()
        # Each cache's latest transfer, and which way it went.
        self._transfers: weakref.WeakKeyDictionary[PagedCache, tuple[str, Transfer]] = weakref.WeakKeyDictionary()

    def is_swapped(self, cache: PagedCache) -> bool:
        return cache in self._swapped

    def in_flight(self, cache: PagedCache) -> str | None:
        """"out" or "in" while the latest copy of `cache`'s blocks has not completed; None otherwise."""
        direction, transfer = self._transfers.get(cache, (None, None))
        return direction if transfer is not None and not transfer.done() else None

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
    def swap_out(self, cache: PagedCache) -> Transfer:
        """Copy every block of `cache` to host blocks and drop its device references at once (the caller checked
        `can_swap_out`; a shortage raises before anything changes). Returns the copy's transfer."""
        if self.is_swapped(cache):
            raise ValueError("this cache is swapped out already")
        cache.check_between_steps("swap out")
        if not self.can_swap_out(cache):
            raise ValueError(f"the host pool cannot take {self.out_demand(cache)} more blocks: raise `swap_blocks`")
        parts = list(self._fields(cache))
        device = self._device(parts)
        copies, finishes = [], []
        for (pool, kind), ids, tensors in parts:
            host = self._host_pool(pool, kind, tensors)
            mapping = dict(zip(ids, host.pool.allocate(len(ids))))
            copy, finish = host.store(tensors, ids, list(mapping.values()))
            copies.append(copy)
            finishes.append(finish)
            self._move(cache, pool, mapping, host.pool)
            self.stats.out_blocks += len(ids)
            self.stats.out_bytes += len(ids) * host.block_bytes
        self._swapped.add(cache)
        return self._submit(cache, "out", device, copies, finishes)

    def swap_in(self, cache: PagedCache) -> Transfer:
        """Copy a swapped cache's blocks back into fresh device blocks (the caller checked `in_demand` against
        the free blocks; a shortage raises before anything changes) and free its host blocks. Waits for the
        cache's swap-out to complete first. Returns the copy's transfer."""
        if not self.is_swapped(cache):
            raise ValueError("this cache is not swapped out")
        for pool, count in self.in_demand(cache).items():
            if count > pool.num_free:
                raise ValueError(f"swapping in needs {count} free device blocks but only {pool.num_free} are free")
        parts = list(self._fields(cache))
        device = self._device(parts)
        self._transfers[cache][1].wait()
        copies = []
        for (pool, kind), host_ids, tensors in parts:
            host = self._host[id(pool)]
            mapping = dict(zip(host_ids, pool.allocate(len(host_ids))))
            copies.append(host.load(tensors, host_ids, list(mapping.values())))
            self._move(cache, host.pool, mapping, pool)
            self.stats.in_blocks += len(host_ids)
            self.stats.in_bytes += len(host_ids) * host.block_bytes
        self._swapped.discard(cache)
        cache.blocks.drop_plans()
        return self._submit(cache, "in", device, copies, [])

    def _device(self, parts: list) -> torch.device | None:
        """The one device of a swap's blocks, checked against the copy mode (None: a family split over devices by
        accelerate's `device_map`, or no blocks: such copies run synchronously)."""
        devices = {tensor.device for _key, _ids, tensors in parts for tensor in tensors}
        device = devices.pop() if len(devices) == 1 else None
        self.copies.check(device)
        return device

    def _submit(self, cache: PagedCache, direction: str, device: torch.device | None,
                copies: list[Callable[[], None]], finishes: list[Callable[[], None]]) -> Transfer:  # fmt: skip
        """One transfer for every pool's part of a swap."""

        def copy() -> None:
            for part in copies:
                part()

        def finish() -> None:
            for part in finishes:
                part()

        transfer = self.copies.submit(device, copy, finish)
        self._transfers[cache] = (direction, transfer)
        return transfer

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _distinct(cache: PagedCache) -> dict[tuple[BlockPool, str], list[int]]:
        """Per (device pool, "blocks" / "quantized"): the distinct block ids the cache's rows hold, in order."""
        return cache.blocks.held()

    def _fields(self, cache: PagedCache):
        """(device pool, kind), its distinct ids in `cache`, and the storage tensors of every layer indexed by them."""
        for (pool, kind), ids in self._distinct(cache).items():
            yield (pool, kind), ids, cache.blocks.storage(pool, kind)

    def _host_size(self, pool: BlockPool) -> int:
        return self.num_blocks if self.num_blocks is not None else pool.num_blocks

    def _host_pool(self, pool: BlockPool, kind: str, tensors: list[torch.Tensor]) -> _HostPool:
        if id(pool) not in self._host:
            self._host[id(pool)] = _HostPool(self._host_size(pool), tensors, self._formats(kind, tensors))
        return self._host[id(pool)]

    def _formats(self, kind: str, tensors: list[torch.Tensor]) -> list[QuantFormat | None]:
        """The host format of each storage tensor: compressed full-precision keys and values (`CacheBlocks.storage`
        lists them key, value per layer), everything else as it is."""
        if self.compression is None or kind != "blocks":
            return [None] * len(tensors)
        return [self.compression.key if index % 2 == 0 else self.compression.value for index in range(len(tensors))]

    @staticmethod
    def _move(cache: PagedCache, source: BlockPool, mapping: dict[int, int], target: BlockPool) -> None:
        """Point every block list of the cache's rows that holds ids of `source` at their `mapping` in `target`:
        each list drops its references to the old blocks and holds one to the new (each new block was allocated
        once, so the lists after the first that hold it take one more reference)."""
        holders = Counter()
        for blocks in cache.blocks.block_lists(source):
            fresh = [mapping[block] for block in blocks.ids]
            target.fork([block for block in fresh if holders[block]])
            holders.update(fresh)
            blocks.repoint(target, fresh)


def _block_bytes(tensors: list[torch.Tensor], formats: list[QuantFormat | None]) -> int:
    """Host bytes of one block of every storage tensor, in its host format."""
    return sum(tensor[0].numel() * tensor.element_size() if fmt is None else fmt.bytes_per_block(*tensor.shape[1:])
               for tensor, fmt in zip(tensors, formats))  # fmt: skip
