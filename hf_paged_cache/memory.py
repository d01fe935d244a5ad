"""Memory accounting: what a cache holds (`CacheMetrics`) and what it would hold (`estimate_kv_bytes`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

SLIDING_TYPES = ("sliding_attention", "chunked_attention")


@dataclass(frozen=True)
class CacheMetrics:
    """A snapshot of a `PagedCache`'s memory. Byte counts cover keys and values of every paged layer.

    - `pool_bytes`: storage allocated for the pool (what the process holds);
    - `used_bytes`: bytes of the blocks in use;
    - `ideal_bytes`: tokens stored x bytes per token (no partial blocks);
    - `waste_bytes`: `used_bytes - ideal_bytes`, the unfilled tails of partial blocks;
    - `table_bytes`: block-table entries, counted as int32.

    Quantized layers: the byte counts above include their quantized blocks (codes, scales, zero points);
    `quantized_bytes` is that part alone (`quantized_blocks_used` x bytes of one quantized block of every
    layer of the group), `quantized_tokens` the tokens it holds, and `quant_error` maps each quantized
    layer's index to the mean / max relative L2 error of K and V (per token and head, relative to the
    head's mean token norm in the block), sampled on the first block sealed at each step.

    Eviction: `evictions` counts row compactions and `evicted_tokens` the tokens they dropped (summed
    over layers); the freed blocks show as a drop in `blocks_used` / `used_bytes`. Token and block
    counts are sums over groups, and with eviction every full-attention layer is its own group, so
    `tokens_stored` then counts each layer's tokens (per-group figures are in `groups`).
    """

    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    tokens_stored: int
    pool_bytes: int
    used_bytes: int
    ideal_bytes: int
    waste_bytes: int
    table_bytes: int
    groups: dict[str, dict[str, int]]
    quantized_blocks_total: int = 0
    quantized_blocks_used: int = 0
    quantized_tokens: int = 0
    quantized_bytes: int = 0
    evictions: int = 0
    evicted_tokens: int = 0
    quant_error: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def kv_bytes(self) -> int:
        """Bytes the cache's contents occupy: blocks in use plus their tables."""
        return self.used_bytes + self.table_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_bytes": self.kv_bytes}

    def summary(self) -> str:
        """One readable line (also `str(metrics)`): tokens, blocks, and the bytes in use next to the pool's."""
        ratio = f"{self.pool_bytes / self.used_bytes:.2f}x in use" if self.used_bytes else "none in use"
        line = (
            f"{self.tokens_stored:,} tokens in {self.blocks_used:,} of {self.blocks_total:,} blocks of "
            f"{self.block_size}: {self.used_bytes:,} B in use (ideal {self.ideal_bytes:,} B, tables "
            f"{self.table_bytes:,} B), pool {self.pool_bytes:,} B ({ratio})"
        )
        if self.quantized_blocks_used:
            line += f"; {self.quantized_tokens:,} tokens quantized into {self.quantized_bytes:,} B"
        if self.evictions:
            line += f"; {self.evicted_tokens:,} tokens evicted in {self.evictions:,} compactions"
        return line

    __str__ = summary


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype = torch.float16) -> int:
    """Keys + values of one token over all attention layers of `config`, in bytes."""
    shapes = _attention_layer_shapes(config)
    element = torch.empty((), dtype=dtype).element_size()
    return sum(2 * heads * head_dim * element for _, _, heads, head_dim in shapes)


def estimate_kv_bytes(
    config: PretrainedConfig,
    batch_size: int,
    seq_len: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    *,
    quant: str | None = None,
    quant_layers: Mapping[int, str | None] | None = None,
    full_precision_layers: int = 0,
    residual_length: int = 128,
) -> int:
    """Bytes of blocks a `PagedCache` holds for `batch_size` rows of `seq_len` stored tokens (no padding).

    Full layers hold every token, rounded up to whole blocks; sliding layers hold at most their window
    plus the block being filled and the one leaving the window. With the quantization options of
    `PagedCacheConfig`, a quantized layer holds its full blocks older than the last `residual_length`
    tokens quantized (the format's exact bytes per block) and the rest in `dtype`.
    """
    from .config import PagedCacheConfig  # config imports quantization only; avoid a cycle at import time

    options = PagedCacheConfig(
        block_size=block_size, quant=quant, quant_layers=quant_layers,
        full_precision_layers=full_precision_layers, residual_length=residual_length,
    )  # fmt: skip
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for index, window, heads, head_dim in _attention_layer_shapes(config):
        blocks = -(-seq_len // block_size)
        held = blocks if window is None else min(blocks, -(-(window + block_size - 1) // block_size) + 1)
        kv_format = options.layer_format(index)
        sealed = 0
        if kv_format is not None:  # the held blocks are the last `held`; the oldest of all may be sealed
            full_precision = blocks - max((seq_len - residual_length) // block_size, 0)
            sealed = held - min(held, full_precision)
            total += batch_size * sealed * kv_format.bytes_per_block(block_size, heads, head_dim)
        total += batch_size * (held - sealed) * block_size * 2 * heads * head_dim * element
    return total


def _attention_layer_shapes(config: PretrainedConfig) -> list[tuple[int, int | None, int, int]]:
    """(layer index, sliding window or None, KV heads, head dim) of every layer that stores K/V."""
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    shapes = []
    for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        if layer_type == "full_attention":
            shapes.append((index, None, heads, head_dim))
        elif layer_type in SLIDING_TYPES:
            shapes.append((index, kwargs["sliding_window"], heads, head_dim))
    return shapes
