"""Layers that read another layer's K/V instead of storing their own: transformers' "dummy" layers that a model
makes reuse an earlier layer's K/V (Gemma-3n; "dummy" layers without attention keep transformers' `DummyLayer`),
and the layers `share_with` maps to a source."""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin

from ..layers.paged import PagedLayer
from ..layers.shared_kv import SharedKVLayer
from .base import LayerSpec
from .delegated import DelegatedType


class ReusedKV(DelegatedType):
    """transformers' "dummy": a KV-shared consumer reads its producer's blocks; any other stores nothing."""

    per_request = False

    def build_layer(self, spec: LayerSpec) -> CacheLayerMixin:
        producer = stored_layer(spec.built[spec.reused[spec.index]]) if spec.index in spec.reused else None
        return super().build_layer(spec) if producer is None else SharedKVLayer(producer)

    def packing_refusal(self, layer: CacheLayerMixin) -> str | None:
        """None: a consumer reads its producer's blocks through the packed cache, and a layer without attention
        (Nemotron-H's MLP layers) touches no cache, so the packed row serves it as it is."""
        return None


def share_with(spec: LayerSpec, source: int, types: list[str], layer_kwargs: list[dict]) -> SharedKVLayer:
    """Layer `spec.index` reading layer `source`'s blocks (`share_with`), which must be an earlier attention layer
    of the same kind and window that stores its own K/V."""
    index, built = spec.index, spec.built
    if types[index] != types[source] or layer_kwargs[index] != layer_kwargs[source] or not isinstance(
        built[source], PagedLayer
    ):
        raise ValueError(
            f"`share_with` maps layer {index} ({types[index]!r}) to layer {source} ({types[source]!r}): "
            "the source must be an attention layer of the same kind and window that the cache stores in blocks"
        )
    return SharedKVLayer(built[source])


def stored_layer(layer: CacheLayerMixin) -> PagedLayer | None:
    """The paged layer whose blocks hold `layer`'s K/V (itself, or a `share_with` layer's source); None if not paged."""
    layer = layer.source if isinstance(layer, SharedKVLayer) else layer
    return layer if isinstance(layer, PagedLayer) else None
