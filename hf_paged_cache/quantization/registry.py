"""Formats by name: the spec strings users pass (`format_from_spec`) and the names and fields files save them by.

A format class is registered once (`register_format`), in its own module; each class that names cache-wide
formats in spec strings parses them itself (`QuantFormat.parse_spec`), so a new format is one module and one
`register_format` line, and nothing here names a concrete format.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import KVFormat, QuantFormat

__all__ = ["format_fields", "format_from_fields", "format_from_spec", "kv_format_fields", "kv_format_from_fields",
           "register_format"]  # fmt: skip

_CLASSES: dict[str, type[QuantFormat]] = {}  # saved name -> class, in registration order
_NAMES: dict[type[QuantFormat], str] = {}


def register_format(name: str, cls: type[QuantFormat]) -> None:
    """Make `cls` (a frozen dataclass `QuantFormat`) the format saved and loaded as `name`, and let its
    `parse_spec` read spec strings."""
    if not (isinstance(cls, type) and issubclass(cls, QuantFormat) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"a format must be a QuantFormat dataclass, got {cls!r}")
    if _CLASSES.get(name, cls) is not cls or _NAMES.get(cls, name) != name:
        raise ValueError(f"format name {name!r} or class {cls.__name__} is registered already")
    _CLASSES[name], _NAMES[cls] = cls, name


def format_from_spec(spec: str) -> KVFormat:
    """The key and value formats a spec string names (any case, surrounding spaces ignored), e.g. "int8", "int4",
    "int2", "fp8", "K4V2": the first registered family that reads it decides. Anything else raises a ValueError
    listing the choices."""
    text = spec.strip().lower() if isinstance(spec, str) else None
    for cls in _CLASSES.values():
        parsed = cls.parse_spec(text) if text else None
        if parsed is not None:
            return parsed
    choices = "; ".join(cls.SPECS for cls in _CLASSES.values() if cls.SPECS)
    raise ValueError(f"unknown KV cache quantization format {spec!r}; valid formats: {choices}")


def format_fields(fmt: QuantFormat) -> dict[str, Any]:
    """`{"name": ..., "fields": {...}}`: what a file saves a format as (JSON-able), read by `format_from_fields`."""
    name = _NAMES.get(type(fmt))
    if name is None:
        raise ValueError(f"{type(fmt).__name__} is not a registered format (see `register_format`)")
    return {"name": name, "fields": dataclasses.asdict(fmt)}


def format_from_fields(name: str, fields: dict[str, Any]) -> QuantFormat:
    """The format registered as `name` with dataclass fields `fields`; a ValueError for an unknown name, unknown
    fields or values the format refuses."""
    cls = _CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown quantization format name {name!r}; known: {sorted(_CLASSES)}")
    known = {field.name for field in dataclasses.fields(cls)}
    if not isinstance(fields, dict) or not set(fields) <= known:
        raise ValueError(f"format {name!r} takes fields {sorted(known)}, got {fields!r}")
    return cls(**fields)


def kv_format_fields(kv_format: KVFormat) -> dict[str, dict[str, Any]]:
    """`{"key": format_fields(key), "value": format_fields(value)}`."""
    return {"key": format_fields(kv_format.key), "value": format_fields(kv_format.value)}


def kv_format_from_fields(saved: dict[str, Any]) -> KVFormat:
    """Inverse of `kv_format_fields`; a ValueError for anything else."""
    if not isinstance(saved, dict) or set(saved) != {"key", "value"}:
        raise ValueError(f"a KV format is saved as {{'key': ..., 'value': ...}}, got {saved!r}")
    sides = []
    for side in ("key", "value"):
        entry = saved[side]
        if not isinstance(entry, dict) or set(entry) != {"name", "fields"}:
            raise ValueError(f"a format is saved as {{'name': ..., 'fields': {{...}}}}, got {entry!r}")
        sides.append(format_from_fields(entry["name"], entry["fields"]))
    return KVFormat(*sides)
