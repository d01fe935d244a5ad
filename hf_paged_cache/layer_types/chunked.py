"""`chunked_attention` (Llama-4): stored like a sliding window of the chunk size, in the same groups as sliding
layers of that window; it masks by chunk, which only transformers' mask knows, so neither the kernels (they mask
by window) nor the batch generator (it builds its own masks) serve it."""

from __future__ import annotations

from transformers.cache_utils import CacheLayerMixin

from .sliding import SlidingAttention


class ChunkedAttention(SlidingAttention):
    kernels_read = False

    def packing_refusal(self, layer: CacheLayerMixin) -> str:
        return "chunked attention"
