"""Types the paged store does not hold (linear attention, convolutional and hybrid states, indexed or compressed
attention, layers without attention): transformers' own `DYNAMIC_LAYER_TYPE_MAPPING` layers serve them."""

from __future__ import annotations

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, CacheLayerMixin

from .base import LayerSpec, LayerType


class DelegatedType(LayerType):
    stored = False

    def build_layer(self, spec: LayerSpec) -> CacheLayerMixin:
        return DYNAMIC_LAYER_TYPE_MAPPING[self.name](**spec.kwargs)

    def packing_refusal(self, layer: CacheLayerMixin) -> str:
        return (f"not stored in blocks ({type(layer).__name__}: linear attention, a recurrent or convolutional "
                "state)")  # fmt: skip


class CompressedAttention(DelegatedType):
    """The model appends its compressor's K/V entries (and their mask) to what `update()` returns, which the
    "paged" attention, reading the history from the blocks, would never see."""

    paged_readable = False


COMPRESSED_NAMES = ("compressed_sparse_attention", "heavily_compressed_attention")
