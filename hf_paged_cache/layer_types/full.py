"""`full_attention`: every token stays; all such layers share one group's tables (one per layer under eviction,
since each layer then keeps different tokens)."""

from __future__ import annotations

from ..layers.paged import PagedLayer
from ..layers.quantized import QuantizedLayer
from .base import LayerSpec, LayerType


class FullAttention(LayerType):
    evictable = True

    def group_name(self, spec: LayerSpec) -> str:
        return f"{self.name}@{spec.index}" if spec.options.eviction else self.name

    def build_layer(self, spec: LayerSpec) -> PagedLayer:
        tables = spec.group(self.group_name(spec), self.reach(spec.kwargs), spec.quant)
        return (QuantizedLayer if spec.quant else PagedLayer)(tables, spec.options, self)
