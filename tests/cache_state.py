"""`cache_state(cache)`: everything a `PagedCache` holds, as plain comparable values.

A failed call must leave the cache exactly as it was, and a copy must leave its original untouched:
tests compare `cache_state` before and after. Tensors become (shape, dtype, raw bytes), so uninitialised
storage (which may hold NaN) still compares equal to itself.
"""

from __future__ import annotations

import torch

from hf_paged_cache import PagedCache
from hf_paged_cache.layers.paged import PagedLayer
from hf_paged_cache.layers.quantized import QuantizedLayer


def quantized_fields(layer: PagedLayer) -> list[torch.Tensor]:
    """The storage of a quantized layer's sealed blocks (its key fields, then its value fields); none otherwise."""
    return [*layer.qkey.values(), *layer.qvalue.values()] if isinstance(layer, QuantizedLayer) else []


def cache_state(cache: PagedCache) -> dict:
    groups = {}
    for name, group in cache.groups.items():
        groups[name] = {
            "length": group.length,
            "rows": [
                (row.pads, row.base, list(row.blocks.ids), row.blocks.run_from,
                 None if row.quantized is None else list(row.quantized.ids),
                 None if row.kept_positions is None else row.kept_positions.tolist())
                for row in group.rows
            ],  # fmt: skip
            "pools": [_pool(group.pool), _pool(group.pools()[1])],
        }
    layers = []
    for layer in cache.layers:
        if isinstance(layer, PagedLayer):
            fields = quantized_fields(layer)
            tensors = [layer.key_blocks, layer.value_blocks, *fields]
            layers.append((layer.seq_len, [_tensor(tensor) for tensor in tensors]))
        else:
            layers.append(layer.get_seq_length())
    evictor = cache.evictor
    return {
        "metrics": cache.metrics().as_dict(),
        "groups": groups,
        "layers": layers,
        "eviction": None if evictor is None else (
            {name: list(counts) for name, counts in evictor.counts.items()},
            {index: _tensor(stats.scores) for index, stats in evictor.stats.items()},
            evictor.decode_steps, evictor.last_q_len,
        ),  # fmt: skip
    }


def row_state(cache: PagedCache) -> dict:
    """What a cache holds as seen through its own tables: rows, and the contents of the blocks they reference
    in every paged layer. A fork shares pools with its original, so the pools themselves differ after either
    writes; this must not."""
    groups = cache_state(cache)["groups"]
    state = {name: (group["length"], group["rows"]) for name, group in groups.items()}
    contents = []
    for layer in cache.layers:
        if not isinstance(layer, PagedLayer) or not layer.is_initialized:
            continue
        rows = layer.tables.rows
        ids = torch.tensor(sorted({block for row in rows for block in row.blocks.ids}), dtype=torch.long)
        qids = torch.tensor(sorted({block for row in rows for block in (row.quantized.ids if row.quantized else [])}),
                            dtype=torch.long)  # fmt: skip
        fields = quantized_fields(layer)
        tensors = [layer.key_blocks[ids], layer.value_blocks[ids], *(field[qids] for field in fields)]
        contents.append((layer.seq_len, [_tensor(tensor) for tensor in tensors]))
    return {"groups": state, "layers": contents, "eviction": cache_state(cache)["eviction"]}


def stored_blocks(cache: PagedCache) -> list[torch.Tensor]:
    """The contents of every block the cache's rows hold, in table order, every layer (full precision, then
    the quantized fields): equal before and after an operation that moves blocks without changing them."""
    out = []
    for name, group in cache.groups.items():
        for layer in cache.group_layers(name):
            for row in group.rows:
                out += [layer.key_blocks[row.blocks.ids].clone(), layer.value_blocks[row.blocks.ids].clone()]
                if row.quantized is not None:
                    out += [t[row.quantized.ids].clone() for t in (*layer.qkey.values(), *layer.qvalue.values())]
    return out


def _pool(pool) -> tuple | None:
    return None if pool is None else (pool.num_blocks, pool.num_free, pool.ref_counts(), pool.free_ids())


def _tensor(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    data = tensor.detach().cpu().contiguous()
    return tuple(tensor.shape), str(tensor.dtype), data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
