"""Forks: caches that share one cache's pools and storage — `fork()` (the same rows, blocks shared by reference
count), `sibling()` (empty, for another request) — and copies that share nothing (`copy.deepcopy` with
`sharing=False`, pickling)."""

from __future__ import annotations

import copy
import threading
import weakref
from collections import Counter
from typing import Self

from transformers.cache_utils import Cache

from .cache_step import CacheStep
from .layers.paged import PagedLayer
from .layers.shared_kv import SharedKVLayer


class Forks:
    """What a cache and its forks share besides pools and storage: which of them are alive (metrics), and which
    thread's forward step of which of them is under way (the pools serve one step at a time)."""

    def __init__(self, cache: Cache):
        self.caches: weakref.WeakSet[Cache] = weakref.WeakSet([cache])
        self.step: tuple[int | None, weakref.ref | None] = (None, None)


class ForkingCache:
    """The forking half of `PagedCache`: what makes a cache's pools shareable, and who shares them (`_forks`)."""

    def claim_step(self) -> None:
        """This thread's forward step of this cache is under way: until every layer wrote it, `update()` from
        another thread is refused (the pools a cache shares with its forks serve one step at a time)."""
        self._forks.step = (threading.get_ident(), weakref.ref(self))

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

    def caches_sharing_pools(self) -> list[Self]:
        """This cache and its live forks and siblings: every cache whose tables hold ids of its pools."""
        return list(self._forks.caches)

    def fork(self) -> Self:
        """A second cache with the same contents that shares every block by reference count, in the same pools:
        time and memory grow with the number of blocks, no K/V is copied, and whichever cache first writes into a
        shared partly filled block copies that block only. Quantized codes, eviction survivors and statistics
        are kept. With `sharing=False` the fork is an independent copy instead (blocks copied)."""
        self.check_between_steps("fork")
        if not self.options.sharing:
            return self._independent_copy({})
        return self._share_pools()

    def sibling(self) -> Self:
        """An empty cache with the same options in the same pools and storage (what the batch generator gives
        each request): blocks any of them frees serve the others. Pools are shared even with `sharing=False`,
        which concerns the blocks' contents."""
        self.check_between_steps("fork")
        twin = self._share_pools()
        twin.reset()
        return twin

    def _share_pools(self) -> Self:
        """What `fork()` and `sibling()` start from: a cache with the same rows in the same pools and storage."""
        twin = self.__class__.__new__(self.__class__)  # not copy.copy: that would run __setstate__'s pool rebuild
        twin.__dict__.update(self.__dict__)
        twin.groups = {name: group.fork() for name, group in self.groups.items()}
        twin.planner = CacheStep()
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

    def __deepcopy__(self, memo: dict) -> Self:
        """`copy.deepcopy(cache)` is `fork()`: transformers' "re-use a prompt cache" recipe works unchanged and
        costs no copy of the prompt (an independent copy with `sharing=False`)."""
        if self.options.sharing:
            return self.fork()
        self.check_between_steps("copy")
        return self._independent_copy(memo)

    def _independent_copy(self, memo: dict) -> Self:
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
        self._forks = Forks(self)
        references: dict[int, Counter] = {}
        for group in self.groups.values():
            for row in group.rows:
                for pool, blocks in zip(group.pools(), (row.blocks, row.quantized)):
                    if blocks is not None:
                        references.setdefault(id(pool), Counter()).update(blocks.ids)
        for group in self.groups.values():
            for pool in group.pools():
                if pool is not None:
                    pool.set_references(references.get(id(pool), Counter()))

    def check_between_steps(self, what: str) -> None:
        """Raise unless every paged layer wrote the current step (`what` names the refused operation)."""
        if self.layers_written() < len(self.paged_layers):
            raise RuntimeError(
                f"Cannot {what} a PagedCache in the middle of a forward step ({self.layers_written()} of "
                f"{len(self.paged_layers)} layers written): {what} it between steps, or `reset()` it after a failed "
                "forward"
            )

    def _layer_indices(self, layers: list[PagedLayer]) -> list[int]:
        return [next(i for i, layer in enumerate(self.layers) if layer is member) for member in layers]
