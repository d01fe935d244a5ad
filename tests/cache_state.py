"""`cache_state(cache)`: everything a `PagedCache` holds, as plain comparable values.

A failed call must leave the cache exactly as it was, and a copy must leave its original untouched:
tests compare `cache_state` before and after. Tensors become (shape, dtype, raw bytes), so uninitialised
storage (which may hold NaN) still compares equal to itself.
"""

from __future__ import annotations

import torch

from hf_paged_cache import PagedCache
from hf_paged_cache.layers import PagedLayer


def cache_state(cache: PagedCache) -> dict:
    groups = {}
    for name, group in cache.groups.items():
        groups[name] = {
            "length": group.length,
            "tables": [list(table) for table in group.tables],
            "qtables": [list(table) for table in getattr(group, "qtables", [])],
            "pads": list(group.pads),
            "base": list(group.base),
            "run_from": list(group.run_from),
            "kept": [None if kept is None else kept.tolist() for kept in group.kept_positions],
            "pools": [_pool(group.pool), _pool(getattr(group, "qpool", None))],
        }
    layers = []
    for layer in cache.layers:
        if isinstance(layer, PagedLayer):
            fields = [*getattr(layer, "qkey", {}).values(), *getattr(layer, "qvalue", {}).values()]
            tensors = [layer.key_blocks, layer.value_blocks, layer.attention_stats, *fields]
            layers.append((layer.seq_len, [_tensor(tensor) for tensor in tensors]))
        else:
            layers.append(layer.get_seq_length())
    return {
        "metrics": cache.metrics().as_dict(),
        "groups": groups,
        "layers": layers,
        "evictions": {name: list(counts) for name, counts in cache.evictions.items()},
    }


def _pool(pool) -> tuple | None:
    return None if pool is None else (pool.num_blocks, pool.num_free, list(pool._ref), list(pool._next))


def _tensor(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    return tuple(tensor.shape), str(tensor.dtype), tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
