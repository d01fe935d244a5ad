"""Options and eviction policies as the JSON of a saved file's header, and back.

A policy is named by its class and rebuilt from its fields by a class found among the imported `EvictionPolicy`
subclasses, so a name in a file never imports or runs anything; its random generators are its only state beyond
its fields.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping

import torch

from ..config import PagedCacheConfig
from ..errors import CacheFileError
from ..eviction import EvictionPolicy
from .header import dtype_name, dtype_of


def options_to_json(options: PagedCacheConfig) -> dict:
    values = {}
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if isinstance(value, torch.dtype):
            value = dtype_name(value)
        elif isinstance(value, torch.device):
            value = str(value)
        elif isinstance(value, EvictionPolicy):
            value = _policy_to_json(value)
        elif isinstance(value, Mapping):  # `quant_layers`, `share_with`: keyed by layer index
            value = {str(layer): entry for layer, entry in value.items()}
        values[field.name] = value
    return values


def options_from_json(values: dict) -> dict:
    values = dict(values)
    for name, value in values.items():
        if name == "dtype" and value is not None:
            values[name] = dtype_of(value)
        elif name == "eviction" and value is not None:
            values[name] = _policy_from_json(value)
        elif isinstance(value, dict):
            values[name] = {int(layer): entry for layer, entry in value.items()}
    return values


def _policy_to_json(policy: EvictionPolicy) -> dict:
    cls = type(policy)
    fields = {field.name: getattr(policy, field.name) for field in dataclasses.fields(policy)}
    try:
        fields = json.loads(json.dumps(fields))
    except TypeError as error:
        raise ValueError(f"the eviction policy {cls.__name__} has a field JSON cannot hold ({error})") from None
    return {"class": _policy_name(cls), "fields": fields}


# The library's own policies are saved under the name they were saved under before the package had one module per
# policy (the module they lived in then), so a file does not depend on where a class's source file is today.
LIBRARY_POLICIES = "hf_paged_cache.eviction.policies"


def _policy_name(cls: type) -> str:
    """The name a file records for a policy class: the library's by their public class name, others by module."""
    if cls.__module__.startswith(LIBRARY_POLICIES + "."):
        return f"{LIBRARY_POLICIES}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _policy_from_json(saved: dict) -> EvictionPolicy:
    """The saved policy, built from its fields by a class found among the imported `EvictionPolicy`
    subclasses (a name in a file never imports or runs anything)."""
    classes, pending = {}, [EvictionPolicy]
    while pending:
        cls = pending.pop()
        classes[_policy_name(cls)] = cls
        pending.extend(cls.__subclasses__())
    cls = classes.get(saved["class"])
    if cls is None:
        raise CacheFileError(
            f"the file's eviction policy is {saved['class']!r}, a class that is not imported: import the module that "
            "defines it before loading, or pass the policy in the options (e.g. `eviction=...`)"
        )
    return cls(**saved["fields"])


def describe_option(name: str, value) -> str:
    """An option's JSON form as the user writes it."""
    if name == "dtype" and value is not None:
        return f"torch.{value}"
    if name == "eviction" and value is not None:
        fields = ", ".join(f"{key}={field!r}" for key, field in value["fields"].items())
        return f"{value['class'].rsplit('.', 1)[-1]}({fields})"
    return repr(value)


def policy_state(policy: EvictionPolicy) -> Iterator[tuple[str, torch.Generator]]:
    """A policy's state beyond its fields: random generators (whose state is saved), nothing else."""
    fields = {field.name for field in dataclasses.fields(policy)}
    for name, value in vars(policy).items():
        if name in fields:
            continue
        if not isinstance(value, torch.Generator):
            raise ValueError(
                f"PagedCache.save: the eviction policy {type(policy).__name__} holds `{name}` "
                f"({type(value).__name__}), state that is neither a dataclass field nor a torch.Generator, so it "
                "cannot be saved: keep a policy's settings in its fields."
            )
        yield name, value
