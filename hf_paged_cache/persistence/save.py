"""Saving a `PagedCache` to one safetensors file (`PagedCache.save`); `load.py` reads it back.

The file holds only the blocks in use: each group's block ids are renumbered densely (in ascending order,
so runs of consecutive ids stay runs) and every layer writes just those blocks, quantized ones as their
codes, scales and zero points. A JSON header in the safetensors metadata holds the rest: the options,
the model's shapes, each group's tables and per-row state (padding, base, kept positions, quantized
prefix), and the evictor's counters; its scores are tensors. A SHA-256 over the header and every tensor
makes a corrupted file fail before anything is built. The groups and layers say what they hold
(`state_dict`); this module lays that out as the file's header and tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.cache_utils import Cache

from ..blocks.sealing import QuantizedBlockTables

from ..blocks.tables import BlockTables
from ..layers.paged import PagedLayer
from .header import dtype_name
from .options import options_to_json, policy_state

FORMAT = "hf_paged_cache"  # metadata key of the JSON header
DIGEST = "sha256"  # metadata key of the digest of header and tensors
VERSION = 3  # 2: quantized layers record their resolved format ("int2" came to mean rotated values); 3: by name and fields


def save_cache(cache: Cache, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write `cache` to `path` (replaced atomically: a failed save leaves any earlier file as it was). An existing
    file is replaced when it is writable, a write-protected one only with `overwrite=True`: the rename that makes
    the save atomic would otherwise replace a file whose permissions forbid writing it."""
    path = Path(path)
    _check_target(path, overwrite)
    _check_savable(cache)
    tensors: dict[str, torch.Tensor] = {}
    groups = list(cache.groups.values())
    used = [group.used_blocks() for group in groups]
    header = {
        "version": VERSION,
        "model": {"model_type": cache.model_config.model_type, "layers": len(cache.layers), "tp_size": cache.tp_size},
        "options": options_to_json(cache.options),
        "groups": [_save_group(group, *used[index], f"groups.{index}", tensors) for index, group in enumerate(groups)],
        "layers": [],
        "eviction": _save_evictor(cache.evictor, tensors) if cache.evictor is not None else None,
    }
    position = {id(group): index for index, group in enumerate(groups)}
    for index, layer in enumerate(cache.layers):
        group = position.get(id(layer.tables)) if isinstance(layer, PagedLayer) else None
        saved = group is not None and layer.is_initialized
        header["layers"].append(_save_layer(layer, group, *used[group], f"layers.{index}", tensors) if saved else None)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    text = json.dumps(header)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # beside it: os.replace stays atomic
    try:
        save_file(tensors, temporary, metadata={FORMAT: text, DIGEST: digest(text, tensors)})
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def digest(header: str, tensors: dict[str, torch.Tensor]) -> str:
    """The SHA-256 over the header text and every tensor's name, dtype, shape and bytes (no key: it catches
    corruption, not a crafted file)."""
    sha = hashlib.sha256(header.encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        sha.update(f"{name}:{dtype_name(tensor.dtype)}:{tuple(tensor.shape)};".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return sha.hexdigest()


def _check_target(path: Path, overwrite: bool) -> None:
    """Refuse a directory, and a write-protected file unless `overwrite` (no write bit counts even for root)."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"PagedCache.save: `overwrite` must be a bool, got {overwrite!r}")
    if path.is_dir():
        raise IsADirectoryError(f"PagedCache.save: {str(path)!r} is a directory; give the path of a file to write")
    if path.exists() and not overwrite:
        if not os.access(path, os.W_OK) or not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(
                f"PagedCache.save: {str(path)!r} exists and is write-protected; pass `overwrite=True` to replace it, "
                "or save to another path"
            )


def _check_savable(cache: Cache) -> None:
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, PagedLayer):
            if _holds_tensors(layer):
                raise ValueError(
                    f"PagedCache.save: layer {index} is a transformers {type(layer).__name__} (not stored in blocks) "
                    "and holds state; only caches whose filled layers are all paged can be saved."
                )
        elif layer.seq_len != layer.tables.length:
            raise RuntimeError(
                f"PagedCache.save: layer {index} holds {layer.seq_len} tokens but its group {layer.tables.length}: "
                "the cache is in the middle of a forward step (or one was interrupted). Save between steps, or call "
                "`cache.reset()` first."
            )


def _holds_tensors(layer) -> bool:
    """Whether a layer transformers stores (not in blocks) holds any state, as tensors or dicts of them. A scalar is
    bookkeeping, not state (transformers 5.25's linear layers count their tokens in one from the start)."""
    values = [v for value in vars(layer).values() for v in (value.values() if isinstance(value, dict) else [value])]
    return any(isinstance(value, torch.Tensor) and value.dim() > 0 for value in values)


def _save_group(group: BlockTables, used: list[int], qused: list[int], prefix: str,
                tensors: dict[str, torch.Tensor]) -> dict:  # fmt: skip
    """The group's state with its rows' tables as lengths, their ids (by index in `used` / `qused`) as tensors."""
    state = group.state_dict()
    quantized = isinstance(group, QuantizedBlockTables)
    dense = {block: index for index, block in enumerate(used)}
    qdense = {block: index for index, block in enumerate(qused)}
    rows, ids, qids, kept = [], [], [], []
    for row in state["rows"]:
        positions = row["kept_positions"]  # [n], or [kv_heads, n] after a per-head eviction
        sealed = row["quantized"]
        rows.append({
            "pads": row["pads"], "base": row["base"], "blocks": len(row["blocks"]["ids"]),
            "run_from": row["blocks"]["run_from"],
            "quantized": len(sealed["ids"]) if quantized else None,
            "quantized_run_from": sealed["run_from"] if quantized else None,
            "kept": None if positions is None else positions.shape[-1],
            "kept_heads": None if positions is None or positions.dim() == 1 else positions.shape[0],
        })  # fmt: skip
        ids += [dense[block] for block in row["blocks"]["ids"]]
        qids += [qdense[block] for block in sealed["ids"]] if quantized else []
        kept += [positions.cpu().flatten()] if positions is not None else []
    tensors[f"{prefix}.blocks"] = torch.tensor(ids, dtype=torch.long)
    if quantized:
        tensors[f"{prefix}.quantized"] = torch.tensor(qids, dtype=torch.long)
    if kept:
        tensors[f"{prefix}.kept"] = torch.cat(kept)
    return {
        "name": state["name"], "length": state["length"], "record_past": state["record_past"],
        "padding_exact": state["padding_exact"], "rows": rows,
        "blocks": len(used), "quantized_blocks": len(qused) if quantized else None,
    }  # fmt: skip


def _save_layer(layer: PagedLayer, group: int, used: list[int], qused: list[int], prefix: str,
                tensors: dict[str, torch.Tensor]) -> dict:  # fmt: skip
    state, stored = layer.state_dict(used, qused)
    tensors.update({f"{prefix}.{name}": tensor for name, tensor in stored.items()})
    return {"group": group, **state, "dtype": dtype_name(state["dtype"]), "device": str(state["device"])}


def _save_evictor(evictor, tensors: dict[str, torch.Tensor]) -> dict:
    scored = []
    for index, stats in evictor.stats.items():
        if stats.scores is not None:
            tensors[f"eviction.scores.{index}"] = stats.scores
            scored.append(index)
    generators = []
    for name, value in policy_state(evictor.policy):
        tensors[f"eviction.policy.{name}"] = value.get_state()
        generators.append(name)
    return {"counts": evictor.counts, "decode_steps": evictor.decode_steps, "last_q_len": evictor.last_q_len,
            "scored_layers": scored, "generators": generators}  # fmt: skip
