"""Loading a cache `save.py` wrote (`PagedCache.load`).

Every header value is checked against the others and the tensors present (`header.py`) before anything is
allocated from it, and the digest makes a corrupted file fail before anything is built (it has no key, so it does
not stop a crafted file). Loading reads tensors and JSON only -- no pickle, no code from the file: an eviction
policy is named by its class, which must already be imported.

A loaded cache is standalone, with its own pools sized to the blocks it holds (or by `num_blocks` /
`max_memory`), and continues exactly as the saved one would have: the file's blocks are allocated in its pools
and the groups and layers take their saved state (`load_state_dict`). `PagedCache.load` hands `load_cache` its
class, so this module sits below `cache.py` in the import graph.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from ..blocks.sealing import QuantizedBlockTables
from ..blocks.tables import BlockTables
from ..config import PagedCacheConfig, check_device_exists
from ..errors import CacheFileError
from ..layers.paged import PagedLayer
from ..layers.quantized import QuantizedLayer
from ..quantization.registry import kv_format_from_fields
from ..accounting import stored_kv_shapes
from .header import CRAFTED, check_header, checked_tensor, dtype_of, malformed_header, show_value
from .options import describe_option, options_from_json, options_to_json
from .save import DIGEST, FORMAT, digest

READS = (1, 2, 3)  # the format versions this version reads
# Policy fields added after format version 1, with the behaviour a file that lacks them was saved with
# (a policy's current default may differ: `per_head` is True for H2O, SnapKV and KeepRatio now).
POLICY_FIELDS_BEFORE = {"per_head": False, "protect_novel": 0.0, "rotary": "half"}
# Options that say where and how large the loaded cache's storage is; every other option shapes what the
# cache stores or how it continues, so it must equal the file's.
PLACEMENT = ("num_blocks", "max_memory", "initial_blocks", "device", "backend")
# Options a file sizes the loaded pool by (unless the load overrides one), and the allocator's bookkeeping per
# block (four list entries), which a pool costs even before any storage is allocated.
POOL_SIZE = ("num_blocks", "initial_blocks", "max_memory")
BOOKKEEPING = 32


def load_cache(
    cache_class: type[Cache], path: str | os.PathLike, config: PretrainedConfig,
    options: PagedCacheConfig | None = None, **overrides: Any,
) -> Cache:  # fmt: skip
    """The cache saved at `path`, for the model of `config`: with the file's options, the given
    `PagedCacheConfig` (checked against the file), or the file's options with keyword `overrides`."""
    if options is not None and overrides:
        raise ValueError("Pass either a `PagedCacheConfig` or keyword options to PagedCache.load, not both")
    if options is not None and not isinstance(options, PagedCacheConfig):
        raise TypeError(f"`options` must be a PagedCacheConfig, got {type(options).__name__}")
    names = [field.name for field in dataclasses.fields(PagedCacheConfig)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; PagedCache options are: {', '.join(names)}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"PagedCache.load: {str(path)!r} is a directory; give the path of a file that "
                                "`PagedCache.save` wrote")  # fmt: skip
    try:
        header, tensors = _read(path)
        options = _resolve_options(header, options, overrides)
        try:
            cache = cache_class(config, options)
        except CacheFileError:
            raise
        except ValueError as error:  # options equal to the file's that this config cannot take
            _check_model_type(header, config.get_text_config(decoder=True))  # another model's config, said as such
            raise CacheFileError(f"its options do not fit this config ({error}): load the file with the config of "
                                 "the model that saved it") from None  # fmt: skip
        with malformed_header():
            _rename_chunked_groups(header, cache)
            _check_model(header, tensors, cache)
            _restore(cache, header, tensors)
    except CacheFileError as error:
        raise CacheFileError(f"PagedCache.load({str(path)!r}): {error}") from None
    return cache


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of a file `save_cache` wrote, checked against each other, or a `CacheFileError`
    saying what is wrong."""
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            if FORMAT not in metadata:
                raise CacheFileError("a safetensors file without a PagedCache header: only files written by "
                                     "`PagedCache.save` can be loaded")  # fmt: skip
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except SafetensorError as error:
        raise CacheFileError(
            f"not a readable safetensors file ({error}); it is truncated or corrupted, or was not written by "
            "`PagedCache.save`: save the cache again"
        ) from None
    text = metadata[FORMAT]
    if metadata.get(DIGEST) != digest(text, tensors):
        raise CacheFileError(
            "the file's checksum does not match its contents, so it was corrupted after it was written: save the "
            "cache again"
        )
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise CacheFileError(f"its header is not JSON a PagedCache wrote ({type(error).__name__}): {CRAFTED}") from None
    version = header.get("version") if isinstance(header, dict) else None
    if version not in READS:
        raise CacheFileError(
            f"the file has format version {show_value(version)}, but this hf_paged_cache reads versions "
            f"{', '.join(map(str, READS))}: "
            "load it with the hf_paged_cache version that saved it, or save the cache again with this one"
        )
    with malformed_header():
        check_header(header, tensors)
    return header, tensors


def _resolve_options(header: dict, options: PagedCacheConfig | None, overrides: dict) -> PagedCacheConfig:
    """The loaded cache's options: the given ones, checked against the file's, or the file's with `overrides`."""
    saved = header["options"]
    if saved.get("eviction") is not None:  # a policy saved before a field existed ran as the field's first value
        fields = saved["eviction"]["fields"]
        fields.update({name: value for name, value in POLICY_FIELDS_BEFORE.items() if name not in fields})
    try:  # the file's own options; its device is only parsed (it may be one this machine lacks)
        own = PagedCacheConfig(**options_from_json({name: value for name, value in saved.items() if name != "device"}))
        if saved.get("device") is not None:
            torch.device(saved["device"])
    except (TypeError, ValueError, RuntimeError) as error:
        raise CacheFileError(f"its options are not valid PagedCache options ({error}): {CRAFTED}") from None
    if options is None:
        placement = {"device": saved["device"]} if saved.get("device") is not None else {}
        options = dataclasses.replace(own, **{**placement, **overrides})
        if not set(overrides) & set(POOL_SIZE):
            _check_pool_size(header, options)
    given = options_to_json(options)
    dtypes = {layer["dtype"] for layer in header["layers"] if layer is not None}
    for name, value in saved.items():
        if name in PLACEMENT or (name == "dtype" and (given[name] is None or {given[name]} >= dtypes)):
            continue
        if given[name] != value:
            saved_text, given_text = describe_option(name, value), describe_option(name, given[name])
            raise CacheFileError(
                f"the file was saved with {name}={saved_text} but the options give {name}={given_text}, and the "
                f"cached contents depend on it: load with {name}={saved_text} (or give no options, to use the "
                "file's), or build a new cache with the options you want"
            )
    if options.eviction is not None:  # the loaded cache gets its own policy (and random state)
        options = dataclasses.replace(options, eviction=copy.deepcopy(options.eviction))
    return options


def _check_pool_size(header: dict, options: PagedCacheConfig) -> None:
    """Refuse a pool the file's own size options ask for that this machine's memory cannot hold: honouring a crafted
    `num_blocks` would allocate without bound before any block is read."""
    limit = _machine_memory()
    per_block = BOOKKEEPING + options.block_size * sum(
        layer["kv_heads"] * (layer["head_dim"] + layer["value_dim"]) * dtype_of(layer["dtype"]).itemsize
        for layer in header["layers"] if layer is not None
    )  # fmt: skip
    for name in POOL_SIZE:
        value = getattr(options, name)
        size = None if value is None else value if name == "max_memory" else value * per_block
        if limit is not None and size is not None and size > limit:
            raise CacheFileError(
                f"the file sizes its pool by {name}={value} ({size:,} bytes), more than this machine's memory "
                f"({limit:,} bytes): pass `num_blocks` or `max_memory` to size the loaded cache's pool"
            )


def _machine_memory() -> int | None:
    """Bytes of host memory plus those of every visible accelerator (None where the platform does not say)."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() else ()
    return host + sum(torch.cuda.get_device_properties(index).total_memory for index in devices)


def _rename_chunked_groups(header: dict, cache: Cache) -> None:
    """Chunked layers were stored in the sliding group of their chunk size before they had a group of their own:
    such a group of a file takes the chunked group's name where this cache has no sliding group of that name."""
    for saved in header["groups"]:
        chunked = saved["name"].replace("sliding_attention[", "chunked_attention[", 1)
        if saved["name"] not in cache.groups and chunked in cache.groups:
            saved["name"] = chunked


def _check_model_type(header: dict, config: PretrainedConfig, layers: int | None = None) -> None:
    """Raise if the file's model type (or its layer count, where `layers` is known) is not the config's."""
    model = header["model"]
    if model["model_type"] != config.model_type or (layers is not None and model["layers"] != layers):
        counted = "" if layers is None else f" with {layers} layers"
        raise CacheFileError(
            f"the file holds a cache of a {model['model_type']!r} model with {model['layers']} layers, but the config "
            f"is of a {config.model_type!r} model{counted}: load the file with the config of the model that saved it "
            "(`model.config`)"
        )


def _check_model(header: dict, tensors: dict[str, torch.Tensor], cache: Cache) -> None:
    """Raise if `cache` (built from the given config and options) cannot hold the file's groups and layers."""
    model, config = header["model"], cache.model_config
    remedy = "load the file with the config of the model that saved it (`model.config`)"
    _check_model_type(header, config, len(cache.layers))
    if model["tp_size"] != cache.tp_size:
        raise CacheFileError(
            f"the file was saved by one of {model['tp_size']} tensor-parallel ranks, but this config runs on "
            f"{cache.tp_size}: load each rank's file under the same tensor parallelism"
        )
    for index, saved in enumerate(header["groups"]):
        group = cache.groups.get(saved["name"])
        if group is None or isinstance(group, QuantizedBlockTables) != (saved["quantized_blocks"] is not None):
            raise CacheFileError(f"the file's groups[{index}] is {saved['name']!r}, a group this config and these "
                                 f"options do not make ({', '.join(cache.groups)}): {remedy}")  # fmt: skip
    names = [group["name"] for group in header["groups"]]
    shapes = {shape.index: shape[2:] for shape in stored_kv_shapes(config, cache.tp_size)}
    filled = {group["name"] for group in header["groups"] if group["rows"]}
    for index, (layer, saved) in enumerate(zip(cache.layers, header["layers"])):
        group = layer.tables if isinstance(layer, PagedLayer) else None
        if saved is None:
            if group is not None and group.name in filled:
                raise CacheFileError(f"the header's `layers[{index}]` is null, but its group holds rows: {CRAFTED}")
            continue
        if group is None or group.name != names[saved["group"]]:
            kind = group.name if group is not None else f"a {type(layer).__name__}"
            raise CacheFileError(f"layer {index} is stored as {names[saved['group']]!r} in the file, but this config "
                                 f"makes it {kind!r}: {remedy}")  # fmt: skip
        if shapes.get(index) != (saved["kv_heads"], saved["head_dim"], saved["value_dim"]):
            raise CacheFileError(
                f"layer {index} stores {saved['kv_heads']} KV heads of key size {saved['head_dim']} and value size "
                f"{saved['value_dim']} in the file, but this config has {shapes.get(index)} (heads, key size, value "
                f"size) per rank: {remedy}"
            )
        if isinstance(layer, QuantizedLayer) and saved.get("error_stats") is None:
            raise CacheFileError(f"layer {index} is quantized but the header's `layers[{index}]` has no `error_stats`: "
                                 f"{CRAFTED}")  # fmt: skip
        _check_format(index, layer, saved)
    _check_evictor(header["eviction"], tensors, cache.evictor)


def _check_evictor(saved: dict | None, tensors: dict[str, torch.Tensor], evictor) -> None:
    """Raise if the file's eviction state does not fit the cache's evictor (built from the same options)."""
    if (saved is None) != (evictor is None):
        raise CacheFileError(f"the header's `eviction` is {'absent' if saved is None else 'present'} but the options "
                             f"{'do' if saved is None else 'do not'} evict: {CRAFTED}")  # fmt: skip
    if saved is None:
        return
    for index in saved["scored_layers"]:
        if index not in evictor.stats:
            raise CacheFileError(f"eviction scores of layer {index} are misplaced (it is not evicted): {CRAFTED}")
    for name in saved["generators"]:
        generator = getattr(evictor.policy, name, None)
        state = tensors.get(f"eviction.policy.{name}")
        expected = generator.get_state() if isinstance(generator, torch.Generator) else None
        if expected is None or state is None or (state.dtype, state.shape) != (expected.dtype, expected.shape):
            raise CacheFileError(f"the policy's random state {name!r} does not fit {type(evictor.policy).__name__}: "
                                 f"{CRAFTED}")  # fmt: skip


def _check_format(index: int, layer, saved: dict) -> None:
    """A quantized layer's codes are read only in the format that wrote them: the same `quant` text whose meaning
    changed since the file was written (version 1 files predate rotated formats and record none) is refused.
    Version 3 files record the format by name and fields (`kv_format_fields`); version 2 files, by its repr."""
    if not isinstance(layer, QuantizedLayer):  # the options (compared before) decide which layers are quantized
        return
    fmt = layer.kv_format
    written = saved.get("kv_format")
    if isinstance(written, dict):
        try:
            written = kv_format_from_fields(written)
        except ValueError as error:
            message = f"the header's `layers[{index}].kv_format` is no format ({error}): {CRAFTED}"
            raise CacheFileError(message) from None
    if written in (fmt, repr(fmt)) or (written is None and not fmt.rotates):  # version 1: unrotated formats only
        return
    if written is None:
        raise CacheFileError(
            f"layer {index} was quantized before rotated formats existed (format version 1), but its `quant` spec now "
            f"means {fmt!r}, which would decode the file's codes wrongly: load the file with the hf_paged_cache "
            "version that saved it"
        )
    raise CacheFileError(
        f"layer {index} was quantized as {written} in the file, but the options make it {fmt!r}: load with the "
        "file's `quant` (or give no options, to use the file's)"
    )


def _restore(cache: Cache, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Fill the fresh `cache` with the file's groups, blocks and eviction state."""
    layers = [(index, saved) for index, saved in enumerate(header["layers"]) if saved is not None]
    if layers:  # a `max_memory` cache sizes its pools at its first step, by the dtype of its K/V: the file's
        cache.ensure_storage(dtype_of(layers[0][1]["dtype"]))
    slots = {}  # group name -> (full-precision pool ids, quantized pool ids) of the file's blocks, by file index
    for index, saved in enumerate(header["groups"]):
        group = cache.groups[saved["name"]]
        slots[group.name] = _restore_group(group, saved, tensors, f"groups.{index}", cache.options.growable)
    for index, saved in layers:
        layer = cache.layers[index]
        _restore_layer(layer, saved, *slots[layer.tables.name], tensors, f"layers.{index}")
    if header["eviction"] is not None:
        _restore_evictor(cache.evictor, header["eviction"], tensors)


def _restore_group(group: BlockTables, saved: dict, tensors: dict[str, torch.Tensor], prefix: str, growable: bool):
    """Allocate the file's blocks in the group's pools and give it the saved rows on them (`load_state_dict`);
    returns the pool ids of the file's blocks (full precision, quantized)."""
    rows = saved["rows"]
    quantized = saved["quantized_blocks"] is not None
    blocks = tensors[f"{prefix}.blocks"].tolist()  # tables, rows and tensors were checked with the header
    # Without rows nothing is allocated (the pools of a `max_memory` cache that never ran do not exist yet).
    slots = _allocate(group.pool, blocks, saved["blocks"], group.name, growable) if rows else []
    qblocks, qslots = [], []
    if quantized and rows:
        count = saved["quantized_blocks"]
        qblocks = tensors[f"{prefix}.quantized"].tolist()
        qslots = _allocate(group.qpool, qblocks, count, f"{group.name} (quantized)", growable)
    kept = tensors.get(f"{prefix}.kept")
    states, fp_from, q_from, kept_from = [], 0, 0, 0
    for row in rows:
        fp = {"ids": [slots[b] for b in blocks[fp_from : fp_from + row["blocks"]]], "run_from": row["run_from"]}
        fp_from += row["blocks"]
        sealed = None
        if quantized:
            ids = [qslots[b] for b in qblocks[q_from : q_from + row["quantized"]]]
            sealed = {"ids": ids, "run_from": row["quantized_run_from"]}
            q_from += row["quantized"]
        positions = None
        if row["kept"] is not None:
            heads = row.get("kept_heads")  # per-head eviction: one row of positions per KV head
            positions = kept[kept_from : kept_from + row["kept"] * (heads or 1)].clone()
            positions = positions if heads is None else positions.view(heads, row["kept"])
            kept_from += positions.numel()
        states.append({"pads": row["pads"], "base": row["base"], "blocks": fp, "quantized": sealed,
                       "kept_positions": positions})  # fmt: skip
    group.load_state_dict({"name": saved["name"], "length": saved["length"], "record_past": saved["record_past"],
                           "padding_exact": saved["padding_exact"], "rows": states})  # fmt: skip
    return slots, qslots


def _allocate(pool, references: list[int], count: int, name: str, growable: bool) -> list[int]:
    """Pool ids for the file's `count` blocks, each referenced as often as the tables do (rows share blocks)."""
    if count > pool.num_free:
        if not growable:
            raise CacheFileError(
                f"the file holds {count} blocks of the {name} layers but the pool has {pool.num_free}: raise "
                "`num_blocks` or `max_memory`, or give neither to size the pool by the file"
            )
        pool.grow(count - pool.num_free)
    slots = pool.allocate(count)
    pool.fork([slots[block] for block, refs in Counter(references).items() for _ in range(refs - 1)])
    return slots


def _restore_layer(layer: PagedLayer, saved: dict, slots: list[int], qslots: list[int],
                   tensors: dict[str, torch.Tensor], prefix: str) -> None:  # fmt: skip
    device = layer.options.device or _device(saved["device"], prefix)
    layer.options.check_backend(device)
    layer.lazy_initialization(*_empty_states(saved, device))
    stored = {name: checked_tensor(tensors, f"{prefix}.{name}", shape, dtype)
              for name, (shape, dtype) in layer.storage_shapes(len(slots), len(qslots)).items()}  # fmt: skip
    layer.load_state_dict(saved, stored, slots, qslots)


def _restore_evictor(evictor, saved: dict, tensors: dict[str, torch.Tensor]) -> None:
    for index in saved["scored_layers"]:  # checked by `check_header` and `_check_evictor`
        evictor.stats[index].scores = tensors[f"eviction.scores.{index}"].to(evictor.layers[index].device, copy=True)
    for name in saved["generators"]:
        getattr(evictor.policy, name).set_state(tensors[f"eviction.policy.{name}"])
    evictor.counts = {name: list(counts) for name, counts in saved["counts"].items()}
    evictor.decode_steps, evictor.last_q_len = saved["decode_steps"], saved["last_q_len"]


def _empty_states(saved: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-token K/V of a saved layer's shapes and dtype: what a layer's storage is allocated from."""
    dtype = dtype_of(saved["dtype"])
    return (torch.empty(1, saved["kv_heads"], 0, saved["head_dim"], dtype=dtype, device=device),
            torch.empty(1, saved["kv_heads"], 0, saved["value_dim"], dtype=dtype, device=device))  # fmt: skip


def _device(name: str, prefix: str) -> torch.device:
    device = torch.device(name)
    try:
        check_device_exists(device)
    except ValueError:
        raise CacheFileError(
            f"{prefix} was saved on {name}, which this machine lacks: load with device='cpu' (or another device)"
        ) from None
    return device
