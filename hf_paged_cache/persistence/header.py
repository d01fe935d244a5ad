"""Checking a saved cache file's JSON header before anything is allocated from it.

The file's SHA-256 has no key, so a crafted header passes it: every value is checked here for its type and range,
against the others and against the tensors the file actually holds, and any failure is a `CacheFileError` that
names the field. Every size the loader allocates from is thereby bounded by the tensors present.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CacheFileError

# The end of every message about a header that passed the digest but is inconsistent: the digest has no key.
CRAFTED = "the file was crafted or damaged before its digest was computed; save the cache again"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CacheFileError(f"the file names an unknown dtype {name!r}: it is corrupted")
    return dtype


@contextlib.contextmanager
def malformed_header() -> Iterator[None]:
    """The safety net behind the explicit checks: an error that reading a header value raised (a missing key, a
    value of the wrong type, JSON nested too deeply) is the file's fault, so it becomes a `CacheFileError`. Errors
    of other kinds (the options' `ValueError`, a device's `RuntimeError`) are not about the file and pass."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, IndexError, RecursionError, OverflowError) as error:
        raise CacheFileError(f"its header is malformed ({type(error).__name__}: {error}): {CRAFTED}") from None


def check_header(header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a header whose values have the wrong type or range, or disagree with each other or with the tensors
    the file holds, before anything is allocated from them: the digest has no key, so a crafted file passes it.
    Every size that is allocated from is thereby bounded by the tensors in the file."""
    model = _value(header, "model", "header", dict)
    _value(model, "model_type", "model", str)
    count = _value(model, "layers", "model", int, 0)
    _value(model, "tp_size", "model", int, 1)
    options = _value(header, "options", "header", dict)
    block_size = _value(options, "block_size", "options", int, 1)
    for name in ("dtype", "device"):
        _value(options, name, "options", str, optional=True)
    policy = _value(options, "eviction", "options", dict, optional=True)
    if policy is not None:
        _value(policy, "class", "options.eviction", str)
        _value(policy, "fields", "options.eviction", dict)
    groups = _value(header, "groups", "header", list)
    names = [_check_group(group, index, block_size, tensors) for index, group in enumerate(groups)]
    if len(set(names)) != len(names):
        raise CacheFileError(f"the header names a group twice ({names}): {CRAFTED}")
    layers = _value(header, "layers", "header", list)
    if len(layers) != count:
        raise CacheFileError(f"the header's `layers` has {len(layers)} entries, `model.layers` {count}: {CRAFTED}")
    for index, layer in enumerate(layers):
        if layer is not None:
            _check_layer(layer, index, groups, block_size, tensors)
    eviction = _value(header, "eviction", "header", dict, optional=True)
    if eviction is not None:
        _check_eviction_state(eviction, layers, tensors)


def _check_group(saved: dict, index: int, block_size: int, tensors: dict[str, torch.Tensor]) -> str:
    """A group's fields, rows and tables; returns its name."""
    where = f"groups[{index}]"
    name = _value(saved, "name", where, str)
    length = _value(saved, "length", where, int, 0)
    _value(saved, "record_past", where, bool)
    _value(saved, "padding_exact", where, bool)
    rows = _value(saved, "rows", where, list)
    quantized = _value(saved, "quantized_blocks", where, int, 0, optional=True) is not None
    for number, row in enumerate(rows):
        _check_row(row, f"{where}.rows[{number}]", length, block_size, quantized)
    for key, table in (("blocks", "blocks"), ("quantized_blocks", "quantized"))[: 1 + quantized]:
        count = _value(saved, key, where, int, 0)
        if rows or key == "blocks":  # a group without rows saved an empty table (a quantized one none)
            _check_table(tensors, f"groups.{index}.{table}", [row[table] for row in rows], count, f"{where}.{key}")
        elif count:
            raise CacheFileError(f"the header's `{where}.{key}` is {count} but the group has no rows: {CRAFTED}")
    if any(row["kept"] is not None for row in rows):  # saved whenever a row was evicted, empty or not
        kept = sum(row["kept"] * (row.get("kept_heads") or 1) for row in rows if row["kept"] is not None)
        positions = checked_tensor(tensors, f"groups.{index}.kept", (kept,), torch.long)
        if kept and (int(positions.min()) < 0 or int(positions.max()) >= length):
            raise CacheFileError(f"tensor 'groups.{index}.kept' holds positions outside [0, {length}): {CRAFTED}")
    return name


def _check_row(row: dict, where: str, length: int, block_size: int, quantized: bool) -> None:
    """A row's fields against the group's length: its full-precision blocks hold exactly the tokens from `base` to
    `length` (rounded up to whole blocks), its sealed blocks whole blocks before `base`, none of them padding."""
    pads, base = _value(row, "pads", where, int, 0), _value(row, "base", where, int, 0)
    blocks = _value(row, "blocks", where, int, 0)
    _value(row, "run_from", where, int, 0, high=max(blocks - 1, 0))
    sealed = _value(row, "quantized", where, int, 0, optional=not quantized) or 0
    _value(row, "quantized_run_from", where, int, 0, high=max(sealed - 1, 0), optional=not quantized)
    if not quantized and (row.get("quantized"), row.get("quantized_run_from")) != (None, None):
        raise CacheFileError(f"the header's `{where}` has sealed blocks in a group that is not quantized: {CRAFTED}")
    kept = _value(row, "kept", where, int, 0, optional=True)
    heads = _value(row, "kept_heads", where, int, 1, optional=True)
    first = base - sealed * block_size  # the first position the row stores (virtual after an eviction)
    stored = max(length - base, 0)  # full-precision tokens (none where a crop cut into the left padding)
    problem = None
    if not pads <= first or base > max(length, pads):
        problem = f"pads {pads} <= base {base} - sealed tokens {sealed * block_size} and base <= max(length, pads)"
    elif blocks != -(-stored // block_size):
        problem = f"{blocks} blocks of {block_size} tokens to hold the {stored} from base {base} to {length}"
    elif kept is None and (first - pads) % block_size:
        problem = f"base {base} a whole number of blocks after pads {pads} (the row was never evicted)"
    elif kept is None and heads is not None:
        problem = "kept_heads only with kept positions"
    elif kept is not None and kept > sealed * block_size + stored:
        problem = f"no more than the {sealed * block_size + stored} stored tokens kept, not {kept}"
    if problem is not None:
        raise CacheFileError(f"the header's `{where}` is inconsistent: expected {problem}: {CRAFTED}")


def _check_table(tensors: dict[str, torch.Tensor], name: str, lengths: list[int], count: int, where: str) -> None:
    """A table tensor of the rows' `lengths`: the file's blocks renumbered densely, so together the rows name each
    of the `count` blocks (rows may share blocks: forks, reordered batches), and no row names one block twice."""
    ids = checked_tensor(tensors, name, (sum(lengths),), torch.long).tolist()
    if len(set(ids)) != count or any(not 0 <= block < count for block in ids):  # `count` may be huge: no range set
        raise CacheFileError(f"tensor {name!r} does not name each of the {count} blocks of `{where}` (the file's "
                             f"blocks, numbered densely) and no others: {CRAFTED}")  # fmt: skip
    start = 0
    for number, length in enumerate(lengths):
        if len(set(ids[start : start + length])) != length:
            raise CacheFileError(f"tensor {name!r} names one block twice in row {number}: {CRAFTED}")
        start += length


def _check_layer(saved: dict, index: int, groups: list[dict], block_size: int, tensors: dict[str, torch.Tensor]):
    """A layer's fields, and its tensors' shapes and dtype against them and its group's blocks."""
    where, prefix = f"layers[{index}]", f"layers.{index}"
    group = groups[_value(saved, "group", where, int, 0, high=len(groups) - 1)]
    dtype = dtype_of(_value(saved, "dtype", where, str))
    if not dtype.is_floating_point:
        raise CacheFileError(f"the header's `{where}.dtype` is {saved['dtype']!r}, not a floating dtype: {CRAFTED}")
    try:
        torch.device(_value(saved, "device", where, str))
    except (RuntimeError, ValueError):
        raise CacheFileError(f"the header's `{where}.device` is {show_value(saved['device'])}: {CRAFTED}") from None
    heads = _value(saved, "kv_heads", where, int, 1)
    dims = {"keys": _value(saved, "head_dim", where, int, 1), "values": _value(saved, "value_dim", where, int, 1)}
    for name, dim in dims.items():
        checked_tensor(tensors, f"{prefix}.{name}", (heads, group["blocks"], block_size, dim), dtype)
    if any(row.get("kept_heads") not in (None, heads) for row in group["rows"]):
        raise CacheFileError(f"a row of {group['name']!r} keeps positions of other than {heads} KV heads: {CRAFTED}")
    sealed = group["quantized_blocks"]
    for name, tensor in tensors.items():
        if name.startswith((f"{prefix}.qkey.", f"{prefix}.qvalue.")) and tensor.shape[:1] != (sealed,):
            raise CacheFileError(f"tensor {name!r} is {tuple(tensor.shape)}, but its group holds {sealed} sealed "
                                 f"blocks: {CRAFTED}")  # fmt: skip
    if not isinstance(saved.get("kv_format"), dict):  # a dict (name and fields) is read by `kv_format_from_fields`
        _value(saved, "kv_format", where, str, optional=True)  # or the format's repr (earlier version 2 files)
    stats = _value(saved, "error_stats", where, dict, optional=True)
    if stats is not None:
        for side in ("key", "value"):
            if not _numbers(stats.get(side), 3, (int, float)):
                raise CacheFileError(f"the header's `{where}.error_stats.{side}` is {show_value(stats.get(side))}, expected "
                                     f"[total, samples, worst]: {CRAFTED}")  # fmt: skip


def _check_eviction_state(saved: dict, layers: list, tensors: dict[str, torch.Tensor]) -> None:
    """The evictor's counters, and its scores and random states against the saved layers and tensors."""
    for name, pair in _value(saved, "counts", "eviction", dict).items():
        if not _numbers(pair, 2, int) or min(pair) < 0:
            raise CacheFileError(f"the header's `eviction.counts.{name}` is {show_value(pair)}, expected [compactions, "
                                 f"tokens evicted]: {CRAFTED}")  # fmt: skip
    _value(saved, "decode_steps", "eviction", int, 0)
    _value(saved, "last_q_len", "eviction", int, 0)
    scored = _value(saved, "scored_layers", "eviction", list)
    for number in range(len(scored)):
        index = _value(scored, number, "eviction.scored_layers", int, 0, high=len(layers) - 1)
        if layers[index] is None:
            raise CacheFileError(f"the header's `eviction.scored_layers` names layer {index}, which it does not hold: "
                                 f"{CRAFTED}")  # fmt: skip
        scores, heads = tensors.get(f"eviction.scores.{index}"), layers[index]["kv_heads"]
        if scores is None or scores.dim() != 3 or not scores.dtype.is_floating_point or scores.shape[1] != heads:
            found = "missing" if scores is None else f"{scores.dtype} {tuple(scores.shape)}"
            raise CacheFileError(f"tensor 'eviction.scores.{index}' is {found}, expected floating scores of [rows, "
                                 f"{heads} KV heads, tokens]: {CRAFTED}")  # fmt: skip
    if len(set(scored)) != len(scored):
        raise CacheFileError(f"the header's `eviction.scored_layers` names a layer twice ({scored}): {CRAFTED}")
    generators = _value(saved, "generators", "eviction", list)
    for number in range(len(generators)):
        _value(generators, number, "eviction.generators", str)


def _value(entry: dict | list, key: str | int, where: str, kind: type, low: int | None = None,
           high: int | None = None, optional: bool = False) -> Any:  # fmt: skip
    """`entry[key]` if it is a `kind` (a bool is no int) within [`low`, `high`] (None or absent where `optional`),
    else a `CacheFileError` naming the field and its value."""
    value = entry.get(key) if isinstance(entry, dict) else entry[key] if isinstance(entry, list) else None
    if value is None and optional:
        return None
    if isinstance(entry, dict) and key not in entry:
        raise CacheFileError(f"the header lacks `{where}.{key}`: {CRAFTED}")
    wrong = not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
    if wrong or (low is not None and value < low) or (high is not None and value > high):
        bounds = "".join(f" {sign} {bound}" for sign, bound in ((">=", low), ("<=", high)) if bound is not None)
        expected = f"{kind.__name__}{bounds}{' or null' if optional else ''}"
        raise CacheFileError(f"the header's `{where}.{key}` is {show_value(value)}, expected {expected}: {CRAFTED}")
    return value


def _numbers(value: Any, count: int, kind: type | tuple[type, ...]) -> bool:
    """Whether `value` is a list of `count` numbers of `kind` (no bools)."""
    return (isinstance(value, list) and len(value) == count
            and all(isinstance(v, kind) and not isinstance(v, bool) for v in value))  # fmt: skip


def show_value(value: Any) -> str:
    """A header value for a message, cut short (a crafted one may be huge)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def checked_tensor(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        found = "missing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
        raise CacheFileError(f"tensor {name!r} is {found}, expected {dtype} {tuple(shape)}: {CRAFTED}")
    return tensor
