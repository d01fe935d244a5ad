"""Looking into a cache from outside: where each row's blocks lie, which tokens a layer kept, and the bytes
any transformers cache holds. For notebooks, plots and evaluation; nothing here changes a cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .cache import PagedCache
from .layers.paged import PagedLayer


@dataclass(frozen=True)
class GroupLayout:
    """The block tables of one layer group of a `PagedCache`, copied out.

    `tables[b]` lists row b's full-precision block ids in order; `quantized_tables[b]` its sealed
    (quantized) block ids, which precede them (empty lists for unquantized groups). `pads[b]` counts
    row b's left padding, which occupies no block. Block ids index the group's pool of `num_blocks`.
    """

    name: str
    layers: list[int]
    block_size: int
    num_blocks: int
    tables: list[list[int]]
    quantized_tables: list[list[int]]
    pads: list[int]
    stored_tokens: list[int]


def block_layout(cache: PagedCache) -> dict[str, GroupLayout]:
    """Every layer group's block tables, by group name (e.g. `"full_attention"`)."""
    layouts = {}
    for name, group in cache.groups.items():
        layouts[name] = GroupLayout(
            name=name,
            layers=[index for index, layer in enumerate(cache.layers)
                    if isinstance(layer, PagedLayer) and layer.tables is group],  # fmt: skip
            block_size=group.block_size,
            num_blocks=group.pool.num_blocks if group.pool is not None else 0,
            tables=[list(table) for table in group.tables],
            quantized_tables=[list(table) for table in group.qtables],  # empty per row in a group that seals nothing
            pads=list(group.pads),
            stored_tokens=[group.stored_count(row) for row in range(len(group.tables))],
        )
    return layouts


def kept_positions(cache: PagedCache, layer_idx: int, row: int = 0) -> torch.Tensor:
    """Logical positions (int64, ascending) of the tokens `layer_idx` stores for `row`: every position of
    the row without eviction, the survivors (plus the tokens stored since) after an eviction; `[kv_heads, n]`,
    one row per KV head, after a per-head eviction (`per_head=True`)."""
    layer = cache.layers[layer_idx] if 0 <= layer_idx < len(cache.layers) else None
    if not isinstance(layer, PagedLayer):
        raise ValueError(f"layer_idx={layer_idx}: not a paged attention layer of this {len(cache.layers)}-layer cache")
    if not 0 <= row < len(layer.tables.tables):
        raise ValueError(f"row={row}: the cache holds {len(layer.tables.tables)} rows")
    return layer.tables.stored_positions(row)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor, including tensor subclasses made of inner tensors (quanto's packed codes and scales)."""
    if hasattr(tensor, "__tensor_flatten__") and type(tensor) is not torch.Tensor:
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def cache_bytes(cache: Cache) -> dict[str, int]:
    """`{"kv_bytes", "pool_bytes", "table_bytes"}`: what a cache's contents occupy and what it allocated.

    A `PagedCache` reports its own `metrics()` (blocks in use; the pool may be larger). Any other cache
    is measured by adding up the tensors its layers hold (DynamicCache: the padded keys/values;
    QuantizedCache: codes, scales and the full-precision residual window).
    """
    if isinstance(cache, PagedCache):
        metrics = cache.metrics()
        return {"kv_bytes": metrics.used_bytes, "pool_bytes": metrics.pool_bytes, "table_bytes": metrics.table_bytes}
    tensors = [value for layer in cache.layers for value in vars(layer).values() if isinstance(value, torch.Tensor)]
    total = sum(tensor_bytes(tensor) for tensor in tensors)
    return {"kv_bytes": total, "pool_bytes": total, "table_bytes": 0}
