"""Memory accounting: what a cache holds (`CacheMetrics`) and what it would hold (`estimate_kv_bytes`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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

    @property
    def kv_bytes(self) -> int:
        """Bytes the cache's contents occupy: blocks in use plus their tables."""
        return self.used_bytes + self.table_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_bytes": self.kv_bytes}


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype = torch.float16) -> int:
    """Keys + values of one token over all attention layers of `config`, in bytes."""
    shapes = _attention_layer_shapes(config)
    element = torch.empty((), dtype=dtype).element_size()
    return sum(2 * heads * head_dim * element for _, heads, head_dim in shapes)


def estimate_kv_bytes(
    config: PretrainedConfig,
    batch_size: int,
    seq_len: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
) -> int:
    """Bytes of blocks a `PagedCache` holds for `batch_size` rows of `seq_len` stored tokens (no padding).

    Full layers hold every token, rounded up to whole blocks; sliding layers hold at most their window
    plus the block being filled and the one leaving the window.
    """
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for window, heads, head_dim in _attention_layer_shapes(config):
        blocks = -(-seq_len // block_size)
        if window is not None:
            blocks = min(blocks, -(-(window + block_size - 1) // block_size) + 1)
        total += batch_size * blocks * block_size * 2 * heads * head_dim * element
    return total


def _attention_layer_shapes(config: PretrainedConfig) -> list[tuple[int | None, int, int]]:
    """(sliding window or None, KV heads, head dim) of every layer that stores K/V."""
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    shapes = []
    for layer_type, kwargs in zip(layer_types, layer_kwargs):
        if layer_type == "full_attention":
            shapes.append((None, heads, head_dim))
        elif layer_type in SLIDING_TYPES:
            shapes.append((kwargs["sliding_window"], heads, head_dim))
    return shapes
