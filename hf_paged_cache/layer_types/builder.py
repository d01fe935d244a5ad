"""The layers of a `PagedCache`, built from the model's config: each layer's type (`layer_type_for`) builds it,
after the options that name layers were checked against the model."""

from __future__ import annotations

from typing import Callable

from transformers import PretrainedConfig
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from ..attention.contract import caches_latents, kv_sharing_sources, model_name
from ..blocks.reach import Reach
from ..blocks.tables import BlockTables
from ..config import PagedCacheConfig
from .base import LayerSpec, LayerType
from .registry import layer_type_for
from .shared import share_with


def build_layers(
    config: PretrainedConfig, options: PagedCacheConfig, group: Callable[[str, Reach | None, str | None], BlockTables]
) -> tuple[list[CacheLayerMixin], list[LayerType]]:
    """(the cache layers, their types) for the text config `config`; `group(name, reach, quant)` gives the block
    tables of a group, creating them once."""
    names, layer_kwargs = get_layer_types_and_kwargs(config)
    _check_layer_counts(options, len(names))
    types = [layer_type_for(name) for name in names]
    _check_quant_layers(options, names, types)
    # Layers the model itself makes reuse an earlier layer's K/V (transformers types them "dummy"): they call
    # no `update()`, so they read the producer's blocks whatever `sharing` says.
    reused = kv_sharing_sources(config)
    _check_blocks_take_options(config, options, names, types)
    _check_eviction(config, options, reused)
    layers: list[CacheLayerMixin] = []
    for index, (layer_type, kwargs) in enumerate(zip(types, layer_kwargs)):
        spec = LayerSpec(index, kwargs, options, options.layer_quant(index), layers, reused, group)
        source = options.shares_from(index)
        layers.append(layer_type.build_layer(spec) if source is None else share_with(spec, source, names, layer_kwargs))
    return layers, types


def _check_blocks_take_options(config: PretrainedConfig, options: PagedCacheConfig, names: list[str],
                               types: list[LayerType]) -> None:  # fmt: skip
    """Options that act on blocks are refused for a model whose layers would leave them without effect, rather than
    accepted and ignored: with no layer stored in blocks (each keeps its own state in transformers' layers: Falcon-H1's
    hybrid layers, Mamba's), there is no pool to size, quantize or evict from; with no layer eviction may drop tokens
    of (sliding-window and chunked layers only), there is nothing to evict."""
    kinds = ", ".join(sorted(set(names)))
    if not any(layer_type.stored for layer_type in types):
        given = [name for name, value in (("num_blocks", options.num_blocks), ("max_memory", options.max_memory),
                                          ("initial_blocks", options.initial_blocks), ("quant", options.quant),
                                          ("eviction", options.eviction), ("share_with", options.share_with))
                 if value is not None]  # fmt: skip
        if given:
            raise ValueError(
                f"`{given[0]}` cannot take effect for {model_name(config)}: none of its layers ({kinds}) stores K/V "
                "in blocks (each keeps its own state, in transformers' layer), so there is no pool to size, quantize, "
                f"evict from or share: leave {' and '.join(f'`{name}`' for name in given)} out"
            )
    if options.eviction is not None and not any(layer_type.evictable for layer_type in types):
        raise ValueError(
            f"`eviction` cannot take effect for {model_name(config)}: none of its layers ({kinds}) lets eviction drop "
            "tokens (sliding-window and chunked layers keep their window and evict nothing more; other kinds keep "
            "their own state): leave `eviction` out"
        )


def _check_eviction(config: PretrainedConfig, options: PagedCacheConfig, reused: dict[int, int]) -> None:
    """Eviction moves a layer's tokens at its attention, which models reading K/V other than the blocks miss."""
    if reused and options.eviction is not None:
        raise ValueError(
            f"`eviction` cannot serve {model_name(config)}: its layers {sorted(reused)} reuse the K/V "
            "of earlier layers within the same forward, after those layers' eviction may already have moved "
            "their tokens. Build the cache without `eviction` for this model."
        )
    if caches_latents(config) and options.eviction is not None:
        raise ValueError(
            f"`eviction` cannot serve {model_name(config)}: it caches compressed latents and expands "
            "them into K/V after `update()`, so its attention reads the gathered history, not the blocks eviction "
            "scores and leaves gaps in. Build the cache without `eviction` for this model."
        )


def _check_quant_layers(options: PagedCacheConfig, names: list[str], types: list[LayerType]) -> None:
    for index, spec in (options.quant_layers or {}).items():
        if index >= len(types) or (spec is not None and not types[index].stored):
            kind = "does not exist" if index >= len(types) else f"is a {names[index]!r} layer"
            raise ValueError(
                f"`quant_layers` names layer {index}, which {kind}: only the attention layers of this model's "
                f"{len(types)} layers are stored in blocks and can be quantized"
            )


def _check_layer_counts(options: PagedCacheConfig, num_layers: int) -> None:
    """Options that count layers must fit the model: checked when the cache learns its layer count."""
    if options.full_precision_layers > num_layers:
        raise ValueError(
            f"`full_precision_layers`={options.full_precision_layers} but this model has {num_layers} layers: "
            f"at most {num_layers} (which quantizes nothing), or use `quant_layers` to choose layers one by one"
        )
    outside = [layer for pair in (options.share_with or {}).items() for layer in pair if layer >= num_layers]
    if outside:
        raise ValueError(
            f"`share_with` names layer {outside[0]}, but this model has {num_layers} layers (0 to {num_layers - 1})"
        )
    budgets = options.eviction.layer_budgets if options.eviction is not None else None
    if budgets is not None and len(budgets) != num_layers:
        raise ValueError(
            f"`layer_budgets` of the eviction policy has {len(budgets)} multipliers but this model has {num_layers} "
            f"layers: give one per layer (e.g. `pyramid_budgets({num_layers})`)"
        )
