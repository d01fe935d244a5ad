"""The layer types by transformers' `layer_types` name: `layer_type_for(name)` is how every part of the cache
learns what a layer is, `register_layer_type(name, cls)` how a new kind of layer joins (or replaces one)."""

from __future__ import annotations

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

from .base import LayerType
from .chunked import ChunkedAttention
from .delegated import COMPRESSED_NAMES, CompressedAttention, DelegatedType
from .full import FullAttention
from .shared import ReusedKV
from .sliding import SlidingAttention

_TYPES: dict[str, LayerType] = {}


def register_layer_type(name: str, cls: type[LayerType]) -> None:
    """Serve the layers transformers types `name` with `cls` (a `LayerType` subclass), from the next cache built."""
    if not (isinstance(cls, type) and issubclass(cls, LayerType)):
        raise TypeError(f"register_layer_type({name!r}, ...) takes a LayerType subclass, got {cls!r}")
    layer_type = cls()
    layer_type.name = name
    _TYPES[name] = layer_type


def layer_type_for(name: str) -> LayerType:
    """The type serving transformers' layer type `name`; a name transformers maps to a layer class of its own but
    no module here knows is served by that class (`DelegatedType`)."""
    if name in _TYPES:
        return _TYPES[name]
    if name not in DYNAMIC_LAYER_TYPE_MAPPING:
        known = ", ".join(sorted(set(_TYPES) | set(DYNAMIC_LAYER_TYPE_MAPPING)))
        raise ValueError(
            f"PagedCache does not know the layer type {name!r}: known types are {known}. Register one with "
            "`hf_paged_cache.layer_types.registry.register_layer_type(name, cls)`."
        )
    delegated = DelegatedType()
    delegated.name = name
    return delegated


def is_known(name: str) -> bool:
    """Whether `layer_type_for(name)` finds a type (for checks on a config's raw, unmapped `layer_types`)."""
    return name in _TYPES or name in DYNAMIC_LAYER_TYPE_MAPPING


for _name, _cls in (("full_attention", FullAttention), ("sliding_attention", SlidingAttention),
                    ("chunked_attention", ChunkedAttention), ("dummy", ReusedKV),
                    *((name, CompressedAttention) for name in COMPRESSED_NAMES)):  # fmt: skip
    register_layer_type(_name, _cls)
