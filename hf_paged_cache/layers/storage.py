"""Block storage of the cache layers: shared between forks, and grown in place where memory allows.

Every storage tensor has the pool's blocks along dim 0. On CPU a growable pool's storage is a view of a larger
allocation: its untouched pages take no memory (the OS commits a page when it is first written), so a pool that
grows within that room gets a longer view, nothing copied; only outgrowing the room copies the blocks into a new
one. A device allocator commits what it allocates, so device storage is allocated at its size, as before.
"""

from __future__ import annotations

from collections.abc import Callable
import torch

CPU_RESERVE = 4  # a growable CPU pool's storage has room for this many times its blocks,
CPU_ROOM_BYTES = 64 << 20  # and for at least this many bytes (address space, not memory, until written)


class LayerStorage:
    """A layer's storage tensors, by name. The forks of a cache share its pools, so their layers share one
    `LayerStorage`: storage that grows with a pool grows for every fork at once."""

    def __init__(self):
        self.tensors: dict[str, object] = {}


def storage_field(name: str, default=None) -> property:
    """A layer attribute that lives in its (possibly shared) `LayerStorage`."""
    return property(lambda layer: layer.storage.tensors.get(name, default),
                    lambda layer, value: layer.storage.tensors.__setitem__(name, value))  # fmt: skip


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
