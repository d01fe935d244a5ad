"""Defragmenting: the blocks in use packed to the low end of their pool, so the pool can shrink.

After many requests come and go, the blocks in use are scattered over the whole id range: the storage cannot
shrink (a layer's storage is indexed by id), and a row's blocks rarely form runs a read can view. `defragment`
moves every referenced block of a family of caches (a template and its forks, which share pools and storage)
to ids 1..n, in id order, copying the contents in every layer (`blocks/packing.py`); every table of every fork,
the quantized groups' sealed-copy records and what the caller holds besides (the batch generator's prefix cache,
passed as `holders` so this module needs nothing of serving's) renumber themselves (`remap`). Every
id then starts a new lifetime (`BlockPool.remap` bumps its epoch): blocks no one references are forgotten,
including unreferenced prefix-cached ones. With `keep_free`, each pool of a growable family then shrinks to its
blocks in use plus that many, and the storage with it (it grows again on demand); a fixed pool never shrinks
below the `num_blocks` / `max_memory` it was given, so requests it was sized for keep fitting. Swapped-out caches
hold host blocks and are left as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..blocks.renumbering import Holder, renumber_to_front
from ..cache import PagedCache


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


def fragmentation(template: PagedCache) -> dict[str, Fragmentation]:
    """Per device pool of the family of `template` (named by its group, "/quantized" for sealed blocks)."""
    caches = template.caches_sharing_pools()
    result = {}
    for name, (pool, _kind) in template.blocks.named_pools().items():
        high = max(pool.used_ids(), default=0)
        breaks = sum(1 for cache in caches for blocks in cache.blocks.block_lists(pool)
                     for a, b in zip(blocks.ids, blocks.ids[1:]) if b != a + 1)  # fmt: skip
        result[name] = Fragmentation(pool.num_blocks, pool.num_used, high, breaks)
    return result


def largest_hole_share(template: PagedCache) -> float:
    """The largest `Fragmentation.hole_share` among the pools of the family of `template` (0 without pools)."""
    return max((f.hole_share for f in fragmentation(template).values()), default=0.0)


@torch.no_grad()
def defragment(template: PagedCache, holders: Sequence[Holder] = (), keep_free: int | None = None) -> None:
    """Pack the blocks in use of every pool of `template`'s family to ids 1..n (see the module docstring), also
    renumbering what `holders` (`remap`s beyond the family's own tables) hold; with `keep_free`, shrink each pool
    of a growable family to n + `keep_free` blocks (fixed pools keep their size). Call it between steps."""
    if keep_free is not None and (isinstance(keep_free, bool) or not isinstance(keep_free, int) or keep_free < 0):
        raise ValueError(f"`keep_free` must be an int >= 0 (free blocks each pool keeps) or None, got {keep_free!r}")
    caches = template.caches_sharing_pools()
    for cache in caches:
        cache.check_between_steps("compact the pools of")
    pools = template.blocks.pools()
    own = [holder for cache in caches for holder in cache.blocks.remaps(sealed_copies=cache is template)]
    copies = [(pool, functools.partial(_copy, template.blocks.storage(pool, kind))) for pool, kind in pools]
    renumber_to_front(copies, [*own, *holders])
    if keep_free is not None and template.options.growable:  # a fixed pool keeps the size it was given
        for pool, _kind in pools:
            pool.shrink(min(pool.num_used + keep_free, pool.num_blocks))
        template.blocks.fit_storage()


def _copy(tensors: list[torch.Tensor], sources: list[int], targets: list[int]) -> None:
    """Move block contents in every storage tensor a pool indexes."""
    for tensor in tensors:
        src, dst = torch.tensor(sources, device=tensor.device), torch.tensor(targets, device=tensor.device)
        tensor.index_copy_(0, dst, tensor.index_select(0, src))
