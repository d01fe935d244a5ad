"""Types the paged store does not hold (linear attention, convolutional and hybrid states, indexed or compressed
attention, layers without attention): transformers' own `DYNAMIC_LAYER_TYPE_MAPPING` layers serve them."""

from __future__ import annotations

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, CacheLayerMixin, LinearAttentionCacheLayerMixin

from .base import LayerSpec, LayerType


class DelegatedType(LayerType):
    """Its layer's state (recurrent or convolutional, with or without K/V of its own) belongs to one sequence, so the
    batch generator runs it once per request, with that request's cache (`serving/recurrent.py`)."""

    stored = False
    per_request = True

    def build_layer(self, spec: LayerSpec) -> CacheLayerMixin:
        return DYNAMIC_LAYER_TYPE_MAPPING[self.name](**spec.kwargs)

    def packing_refusal(self, layer: CacheLayerMixin) -> str | None:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):  # e.g. indexed attention, whose masks are its own
            return f"not stored in blocks ({type(layer).__name__}: K/V the paged store does not hold)"
        # A request's call gets no mask (it is causal and unpadded), which a windowed attention would need.
        if isinstance(layer, CacheLayerMixin) and layer.is_sliding:
            return (f"a recurrent state with sliding-window attention in one layer ({type(layer).__name__}), whose "
                    "window the batch generator's per-request call does not mask")  # fmt: skip
        return None


class CompressedAttention(DelegatedType):
    """The model appends its compressor's K/V entries (and their mask) to what `update()` returns, which the
    "paged" attention, reading the history from the blocks, would never see."""

    paged_readable = False


COMPRESSED_NAMES = ("compressed_sparse_attention", "heavily_compressed_attention")
