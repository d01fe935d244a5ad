"""Memory accounting: what a cache holds (`CacheMetrics`) and what it would hold (`estimate_kv_bytes`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from .attention.contract import latent_key_shape
from .blocks.sealing import QuantizedBlockTables
from .blocks.tables import BlockTables
from .config import PagedCacheConfig, parse_bytes
from .layer_types.registry import layer_type_for
from .sequence_state import sequence_state

if TYPE_CHECKING:
    from .layers.paged import PagedLayer


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

    Sharing: a cache and its forks share pools, so pool figures (blocks, bytes) are the whole family's;
    `shared_blocks` counts blocks held by more than one table (forks, beams, identical rows), `shared_bytes_saved`
    the bytes those extra references would otherwise occupy, and `forks` the caches alive sharing the pools.

    Tensor parallelism: every figure is this rank's. A rank stores `kv_heads / tp_size` heads of every
    token, and all `tp_size` ranks hold the same blocks and tables, so `total_kv_bytes` (the contents
    summed over the ranks) is `kv_bytes * tp_size`.
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
    shared_blocks: int = 0
    shared_bytes_saved: int = 0
    forks: int = 1
    quant_error: dict[int, dict[str, float]] = field(default_factory=dict)
    tp_size: int = 1

    @property
    def kv_bytes(self) -> int:
        """Bytes the cache's contents occupy on this rank: blocks in use plus their tables."""
        return self.used_bytes + self.table_bytes

    @property
    def total_kv_bytes(self) -> int:
        """`kv_bytes` summed over the tensor-parallel ranks (equal to `kv_bytes` in one process)."""
        return self.kv_bytes * self.tp_size

    def as_dict(self) -> dict:
        return {**asdict(self), "kv_bytes": self.kv_bytes, "total_kv_bytes": self.total_kv_bytes}

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
        if self.shared_blocks:
            line += f"; {self.shared_blocks:,} blocks shared, saving {self.shared_bytes_saved:,} B"
        if self.forks > 1:
            line += f"; {self.forks} forks share the pool"
        return line

    __str__ = summary


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype = torch.float16, tp_size: int = 1) -> int:
    """Keys + values of one token over all attention layers of `config`, in bytes (one rank's with `tp_size` > 1)."""
    element = torch.empty((), dtype=dtype).element_size()
    shapes = stored_kv_shapes(config, tp_size)
    return sum(shape.heads * (shape.key_dim + shape.value_dim) * element for shape in shapes)


def blocks_in_budget(config: PretrainedConfig, max_memory: int, block_size: int, dtype: torch.dtype,
                     tp_size: int = 1) -> int:  # fmt: skip
    """The `num_blocks` of pools that fit `max_memory` bytes: every layer's storage holds `num_blocks + 1` blocks
    (one is the all-zero null block), each of the layer's own shape."""
    per_block = block_size * kv_bytes_per_token(config, dtype, tp_size)
    if per_block == 0:
        raise ValueError(
            "`max_memory` budgets blocks, but no layer of this model stores K/V in blocks (each keeps its own state, "
            "outside any pool): leave `max_memory` out"
        )
    if max_memory // per_block < 2:
        raise ValueError(
            f"`max_memory`={max_memory} bytes cannot hold two blocks of every layer (one of them the all-zero null "
            f"block), {2 * per_block} bytes: raise `max_memory` or lower `block_size`"
        )
    return max_memory // per_block - 1


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
    tp_size: int = 1,
) -> int:
    """Bytes a `PagedCache` holds for `batch_size` rows of `seq_len` stored tokens (no padding): its blocks, and
    for a hybrid model each row's recurrent / conv state (`sequence_state`) and the K/V its hybrid layers keep
    outside the blocks.

    Full layers hold every token, rounded up to whole blocks; sliding layers hold at most their window
    plus the block being filled and the one leaving the window. With the quantization options of
    `PagedCacheConfig`, a quantized layer holds its full blocks older than the last `residual_length`
    tokens quantized (the format's exact bytes per block) and the rest in `dtype`. With `tp_size` > 1
    (tensor parallelism) the bytes are one rank's (see `stored_kv_shapes`; a hybrid model's state is refused
    there: how a rank splits it is the model's own).
    """
    options = PagedCacheConfig(
        block_size=block_size, quant=quant, quant_layers=quant_layers,
        full_precision_layers=full_precision_layers, residual_length=residual_length,
    )  # fmt: skip
    element = torch.empty((), dtype=dtype).element_size()
    state = sequence_state(config, dtype)
    if tp_size > 1 and state.tensors:
        raise ValueError(f"`tp_size`={tp_size}: the recurrent state of a hybrid model is estimated for one rank only")
    total = batch_size * state.bytes_at(seq_len)
    for shape in stored_kv_shapes(config, tp_size):
        blocks = -(-seq_len // block_size)
        window = shape.window
        held = blocks if window is None else min(blocks, -(-(window + block_size - 1) // block_size) + 1)
        kv_format = options.layer_format(shape.index)
        sealed = 0
        if kv_format is not None:  # the held blocks are the last `held`; the oldest of all may be sealed
            # Sealed: the blocks ending R = max(residual_length, 1) or more tokens before the end.
            full_precision = blocks - max((seq_len - max(residual_length, 1)) // block_size, 0)
            sealed = held - min(held, full_precision)
            total += batch_size * sealed * kv_format.bytes_per_block(block_size, shape.heads, shape.key_dim,
                                                                     shape.value_dim)  # fmt: skip
        total += batch_size * (held - sealed) * block_size * shape.heads * (shape.key_dim + shape.value_dim) * element
    return total


def max_sequences(config: PretrainedConfig, seq_len: int, memory: int | str, block_size: int = 16,
                  dtype: torch.dtype = torch.float16, served: bool = False, **quant_options) -> int:  # fmt: skip
    """How many sequences of `seq_len` stored tokens fit in `memory` bytes of blocks (an int or "2GiB"):
    `memory // estimate_kv_bytes(one sequence)`. Linear in the length, counting KV heads only (see
    docs/GUIDE.md, "Planning memory"), plus a hybrid model's state per sequence; a pool also holds one all-zero
    null block per layer. `served`: as the batch generator holds them with prefix caching, a hybrid model's
    sequence also counts one state checkpoint (the default `checkpoint_memory`: a slot's bytes per sequence)."""
    per_sequence = estimate_kv_bytes(config, 1, seq_len, block_size, dtype, **quant_options)
    if served:
        state = sequence_state(config, dtype)
        per_sequence += state.nbytes if state.checkpointable(config.get_text_config(decoder=True).model_type) else 0
    return parse_bytes(memory, "memory") // per_sequence


class StoredKVShape(NamedTuple):
    """What one layer stores per token: `heads` heads of `key_dim` key and `value_dim` value elements."""

    index: int
    window: int | None  # the sliding window, or None for a full-attention layer
    heads: int
    key_dim: int
    value_dim: int


# Models whose code gives sliding layers more KV heads than `num_key_value_heads` says (no config field states it).
_SLIDING_KV_HEADS_FACTOR = {"mimo_v2_flash": 2}


def stored_kv_shapes(config: PretrainedConfig, tp_size: int = 1) -> list[StoredKVShape]:
    """The per-token shape of every layer of `config` that stores K/V, as one of `tp_size` tensor-parallel ranks
    stores it, read from each layer's config (a heterogeneous config, e.g. Gemma-4's wider full-attention heads,
    differs per layer). A model that caches latents stores one head of its latent (`kv_lora_rank`) as keys and of
    its positional key (`qk_rope_head_dim`) as values, whole on every rank (its attention is not split); the others
    store their KV heads, `tp_size` dividing them, with values `v_head_dim` wide where the config narrows them."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"`tp_size`={tp_size!r} must be a positive int (the tensor-parallel ranks)")
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    shapes = []
    for index, (name, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
        layer_type = layer_type_for(name)
        if not layer_type.stored:
            continue
        window = layer_type.window(kwargs)
        layer = text.per_layer_config[index]
        latent = latent_key_shape(layer)
        if latent is not None:
            shapes.append(StoredKVShape(index, window, *latent, layer.qk_rope_head_dim))
            continue
        heads = getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
        heads *= _SLIDING_KV_HEADS_FACTOR.get(text.model_type, 1) if window is not None else 1
        key_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
        value_dim = getattr(layer, "v_head_dim", None) or key_dim
        if heads % tp_size:
            raise ValueError(
                f"`tp_size`={tp_size} must divide the {heads} KV heads of layer {index} (tensor parallelism gives "
                "each rank whole heads)"
            )
        shapes.append(StoredKVShape(index, window, heads // tp_size, key_dim, value_dim))
    return shapes


_NO_GROUP = dict.fromkeys(("blocks_total", "blocks_used", "blocks_free", "tokens_stored", "pool_bytes", "used_bytes",
                           "ideal_bytes", "waste_bytes", "table_bytes"), 0)  # fmt: skip


def collect_metrics(
    block_size: int,
    groups: Mapping[str, tuple[BlockTables, Sequence[PagedLayer], tuple[int, int]]],
    quantized_layers: Mapping[int, PagedLayer],
    tp_size: int = 1,
    forks: int = 1,
) -> CacheMetrics:
    """A `CacheMetrics` snapshot from each group's tables, its layers and its (compactions, evicted
    tokens), the quantized layers by index (for their sampled reconstruction error), the number of
    tensor-parallel ranks holding the same tables, and the number of forks sharing the pools."""
    per_group = {name: _group_metrics(*entry) for name, entry in groups.items()}
    keys = next(iter(per_group.values()), _NO_GROUP)  # a model none of whose layers is stored has no group
    total = {key: sum(group[key] for group in per_group.values()) for key in keys}
    total.pop("layers", None)
    quant_error = {index: layer.quant_error() for index, layer in quantized_layers.items() if layer.error_stats["key"][1]}
    return CacheMetrics(block_size=block_size, groups=per_group, quant_error=quant_error, tp_size=tp_size,
                        forks=forks, **total)  # fmt: skip


def _group_metrics(group: BlockTables, layers: Sequence[PagedLayer], evictions: tuple[int, int]) -> dict[str, int]:
    pool, rows = group.pool, range(len(group.rows))
    block_bytes = sum(layer.storage.block_bytes for layer in layers)
    tokens = sum(group.stored_tokens(row) for row in rows)
    used = pool.num_used * block_bytes if pool else 0
    ideal = tokens * block_bytes // group.block_size
    table_entries = sum(len(table) for table in group.tables)
    quantized = {"quantized_blocks_total": 0, "quantized_blocks_used": 0, "quantized_tokens": 0, "quantized_bytes": 0}
    shared, saved = pool.sharing() if pool else (0, 0)
    saved *= block_bytes
    if isinstance(group, QuantizedBlockTables):
        qblock_bytes = sum(layer.sealed.block_bytes for layer in layers)
        qtokens = sum(group.quantized_tokens(row) for row in rows)
        quantized = {
            "quantized_blocks_total": group.qpool.num_blocks,
            "quantized_blocks_used": group.qpool.num_used,
            "quantized_tokens": qtokens,
            "quantized_bytes": group.qpool.num_used * qblock_bytes,
        }
        tokens += qtokens
        qshared, qsaved = group.qpool.sharing()
        shared += qshared
        saved += qsaved * qblock_bytes
        used += quantized["quantized_bytes"]
        ideal += qtokens * qblock_bytes // group.block_size
        table_entries += sum(len(table) for table in group.qtables)
    return {
        "layers": len(layers),
        "blocks_total": pool.num_blocks if pool else 0,
        "blocks_used": pool.num_used if pool else 0,
        "blocks_free": pool.num_free if pool else 0,
        "tokens_stored": tokens,
        "pool_bytes": sum(store.nbytes for layer in layers for store in layer.stores),
        "used_bytes": used,
        "ideal_bytes": ideal,
        "waste_bytes": max(used - ideal, 0),
        "table_bytes": 4 * table_entries,
        **quantized,
        "shared_blocks": shared,
        "shared_bytes_saved": saved,
        "evictions": evictions[0],
        "evicted_tokens": evictions[1],
    }
