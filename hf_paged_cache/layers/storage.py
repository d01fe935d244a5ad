"""Block storage of the cache layers: tensors with a pool's blocks along dim 0, shared between forks, grown in
place where memory allows.

On CPU a growable pool's storage is a view of a larger allocation: its untouched pages take no memory (the OS
commits a page when it is first written), so a pool that grows within that room gets a longer view, nothing
copied; only outgrowing the room copies the blocks into a new one. A device allocator commits what it allocates,
so device storage is allocated at its size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..blocks.plan import StepPlan
from ..blocks.pool import BlockPool
from ..kernels import cpu_write
from ..kernels.layout import allocate_kv_blocks, heads_first

CPU_RESERVE = 4  # a growable CPU pool's storage has room for this many times its blocks,
CPU_ROOM_BYTES = 64 << 20  # and for at least this many bytes (address space, not memory, until written)
MAX_RUNS = 8  # a row's read cut into more runs of blocks than this is gathered slot by slot

# `make(blocks, zeroed, growable)`: a store's tensors for that many blocks, zero-filled or uninitialised, with room
# reserved to grow into where `growable`.
Make = Callable[[int, bool, bool], dict[str, torch.Tensor]]


class BlockStore:
    """One layer's tensors of one pool, by name, each `[pool blocks + 1, ...]` (block 0 the null block): allocated
    for the pool, grown and cut with it, copied block by block, saved and loaded. The forks of a cache that share
    a pool share the layer's store, so storage that grows with the pool grows for every fork at once."""

    saved_dim = 0  # where a saved tensor has its blocks (`_saved_layout`)

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.pool: BlockPool | None = None
        self._make: Make | None = None

    def _allocate(self, pool: BlockPool, make: Make) -> None:
        """Allocate the tensors `make` gives for `pool`'s blocks (zero-filled: zeros read as zeros, never NaN)."""
        self.pool, self._make = pool, make
        self.tensors = make(pool.num_blocks + 1, True, pool.growable)

    @property
    def allocated(self) -> bool:
        return bool(self.tensors)

    def fit(self) -> None:
        """Size the tensors to the pool: grown after the (growable) pool grew, existing blocks keeping their ids; cut
        after the pool was trimmed (the ids above its end are free), so the memory is given back."""
        if not self.tensors:
            return
        blocks, held = self.pool.num_blocks + 1, len(next(iter(self.tensors.values())))
        if held < blocks:
            fresh = functools.cache(lambda: self._make(blocks, False, self.pool.growable))
            self.tensors = {name: grown_blocks(tensor, blocks, lambda name=name: fresh()[name])
                            for name, tensor in self.tensors.items()}  # fmt: skip
        elif held > blocks:
            fresh = self._make(blocks, False, self.pool.growable)
            self.tensors = {name: fresh[name].copy_(tensor[:blocks]) for name, tensor in self.tensors.items()}

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy whole blocks `sources` to `targets` (copy-on-write, defragmentation)."""
        if not self.tensors:
            return
        self.fit()
        device = self.device
        src, dst = torch.tensor(sources, device=device), torch.tensor(targets, device=device)
        for tensor in self.tensors.values():
            tensor.index_copy_(0, dst, tensor.index_select(0, src))

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every tensor's."""
        return sum(tensor[0].numel() * tensor.element_size() for tensor in self.tensors.values())

    def _saved_layout(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as a saved file keeps it, its blocks along `saved_dim`."""
        return tensor

    def saved(self, blocks: list[int]) -> dict[str, torch.Tensor]:
        """The tensors' blocks `blocks` (the file's block i is `blocks[i]`), in the saved layout."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return {name: self._saved_layout(tensor).index_select(self.saved_dim, ids)
                for name, tensor in self.tensors.items()}  # fmt: skip

    def saved_shapes(self, blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype `load` takes each saved tensor in, for that many blocks."""
        shapes = {}
        for name, tensor in self.tensors.items():
            shape = list(self._saved_layout(tensor).shape)
            shape[self.saved_dim] = blocks
            shapes[name] = (tuple(shape), tensor.dtype)
        return shapes

    def load(self, tensors: dict[str, torch.Tensor], blocks: list[int]) -> None:
        """Take saved tensors (`saved_shapes`) into blocks `blocks`."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for name, tensor in self.tensors.items():
            self._saved_layout(tensor).index_copy_(self.saved_dim, ids, tensors[name].to(self.device))


class KVBlocks(BlockStore):
    """Full-precision keys and values, `[blocks, block_size, kv_heads, d]` each, stored heads first
    (`kernels.layout`): written and read by slot (`block * block_size + offset`)."""

    saved_dim = 1  # saved heads first, `[kv_heads, blocks, block_size, d]`: each head's block one contiguous copy

    def allocate(self, pool: BlockPool, block_size: int, kv_heads: int, dims: tuple[int, int], dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        """Allocate for `pool`'s blocks of `block_size` tokens, `kv_heads` heads of widths `dims` (key, value)."""
        self._allocate(pool, functools.partial(_kv_tensors, block_size, kv_heads, dims, dtype, device))

    @property
    def keys(self) -> torch.Tensor | None:
        return self.tensors.get("keys")

    @property
    def values(self) -> torch.Tensor | None:
        return self.tensors.get("values")

    def _saved_layout(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.permute(2, 0, 1, 3)

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cpu_kernel: bool) -> None:
        """Store rows `[tokens, kv_heads, d]` at `slots`: in one call of the C++ write where the CPU kernels are
        loaded (`cpu_kernel`; the same bits, `kernels.cpu_write`), else with one `index_copy_` per tensor."""
        if cpu_kernel:
            cpu_write.write_kv_cpu(self.keys, self.values, keys, values, slots)
            return
        for rows, blocks in ((keys, self.keys), (values, self.values)):
            blocks.view(-1, *blocks.shape[2:]).index_copy_(0, slots, rows)

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V at the given slots (any shape `S`), as `[*S[:-1], kv_heads, S[-1], head_dim]`."""
        out = []
        for blocks in (self.keys, self.values):
            gathered = blocks.view(-1, *blocks.shape[2:]).index_select(0, slots.reshape(-1))
            out.append(gathered.view(*slots.shape, *blocks.shape[2:]).transpose(-3, -2))
        return out[0], out[1]

    def move_tokens(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Copy K/V from slots `sources` `[1 or kv_heads, k]` (one row per head for per-head eviction) to slots
        `targets` `[k]` (eviction's compaction): all reads first."""
        self.fit()  # compaction may have grown the pool for fresh copy-on-write blocks
        src, dst = sources.to(self.device), targets.to(self.device)
        for blocks in (self.keys, self.values):
            flat = heads_first(blocks)  # [kv_heads, slots, d], a view of the storage
            index = src.expand(flat.shape[0], -1)[..., None].expand(-1, -1, flat.shape[-1])
            flat[:, dst] = flat.gather(1, index)

    def row_kv(self, plan: StepPlan, row: int, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s stored read range (its first `count` tokens, if given) as K/V `[kv_heads, tokens, head_dim]`:
        views of the storage when its blocks form one run, else one copy (`row_pieces`)."""
        pieces = [self.row_pieces(blocks, plan, row, count) for blocks in (self.keys, self.values)]
        keys, values = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for parts in pieces)
        return keys, values

    def row_pieces(self, blocks: torch.Tensor, plan: StepPlan, row: int,
                   count: int | None = None) -> list[torch.Tensor]:  # fmt: skip
        """Row `row`'s stored read range of `blocks` (keys or values; its first `count` tokens, if given) as
        `[kv_heads, n_i, head_dim]` pieces in order: views of its runs (`StepPlan.runs`), or one slot-by-slot gather
        when it is cut into more than `MAX_RUNS` runs (one index beats many small copies)."""
        runs = plan.runs()[row]
        start = plan.read_start[row]
        count = plan.read_stop[row] - start if count is None else count
        if len(runs) > MAX_RUNS:
            device = self.device
            slots = plan.cached(("row_slots", row, count, device), lambda: plan.slots(row, start, count).to(device))
            return [blocks.view(-1, *blocks.shape[2:]).index_select(0, slots).transpose(0, 1)]
        flat, pieces = heads_first(blocks), []
        for _column, slot, tokens in runs:
            if count <= 0:
                break
            pieces.append(flat[:, slot : slot + min(tokens, count)])
            count -= tokens
        return pieces


def _kv_tensors(block_size: int, kv_heads: int, dims: tuple[int, int], dtype: torch.dtype, device: torch.device,
                blocks: int, zeroed: bool, growable: bool) -> dict[str, torch.Tensor]:  # fmt: skip
    """A `KVBlocks` store's tensors (`Make`), keys and values of widths `dims`, in `kernels.layout`'s layout."""
    tensors = {}
    for name, dim in zip(("keys", "values"), dims):
        room = reserved_blocks(blocks, block_size * kv_heads * dim * dtype.itemsize, device, growable)
        tensors[name] = allocate_kv_blocks(blocks, block_size, kv_heads, dim, dtype, device,
                                           fill=0.0 if zeroed else None, capacity=room)  # fmt: skip
    return tensors


def store_view(store: str, name: str) -> property:
    """A layer attribute that is one tensor (or field dict) of one of its stores, read-only."""
    return property(lambda layer: getattr(getattr(layer, store), name))


def reserved_blocks(blocks: int, block_bytes: int, device: torch.device, growable: bool) -> int:
    """The blocks (of `block_bytes` each) an allocation for `blocks` has room for: more than asked only for a
    growable pool on CPU."""
    if not growable or torch.device(device).type != "cpu":
        return blocks
    return max(blocks * CPU_RESERVE, CPU_ROOM_BYTES // max(block_bytes, 1))


def block_capacity(storage: torch.Tensor) -> int:
    """The blocks (dim 0) the allocation under `storage` has room for: dim 0 grows until it would reach the next
    outer dim (a head-major layout's head stride) or the allocation's end."""
    step = storage.stride(0)
    dims = zip(storage.shape[1:], storage.stride()[1:])
    outer = [(size, stride) for size, stride in dims if stride >= step and size > 1]
    elements = storage.untyped_storage().nbytes() // storage.element_size() - storage.storage_offset()
    last = elements - sum((size - 1) * stride for size, stride in outer)  # room of the last outer slice
    return min([stride // step for _, stride in outer] + [last // step])


def grown_blocks(storage: torch.Tensor, blocks: int, fresh: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Storage of `blocks` blocks holding `storage`'s first and zeros after them: a longer view of the same
    allocation when it has room, else `fresh()` (uninitialised, `blocks` long) with the old blocks copied in. Only
    the new blocks are zeroed, so a growth writes (and commits) no more memory than it adds."""
    if blocks <= block_capacity(storage):
        grown = storage.as_strided((blocks, *storage.shape[1:]), storage.stride(), storage.storage_offset())
    else:
        grown = fresh()
        grown[: len(storage)] = storage
    grown[len(storage) :] = 0
    return grown
