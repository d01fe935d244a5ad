"""`TRITON`: the Triton kernels over a layer's blocks (quantized blocks dequantized in registers): the decode kernel
for one query per row, the prefill kernel for several."""

from __future__ import annotations

import torch

from ..layers.handle import PagedKV


def attend(query: torch.Tensor, paged_kv: PagedKV, scale: float, softcap: float | None,
           sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """`query` `[batch, heads, q, d]` over the blocks of `paged_kv`; returns `[batch, q, heads, d]`."""
    from ..kernels import paged_decode_attention, paged_prefill_attention

    plan, layer, device = paged_kv.plan, paged_kv.layer, query.device
    tables, seq_lens = plan.tensor("block_tables", device), plan.tensor("seq_lens", device)
    window, softcap = paged_kv.kernel_window, softcap or 0.0
    quantized = layer.quantized_kv(plan, device) if layer.is_quantized else None
    chunk = paged_kv.kernel_chunk  # chunks start where a stored index plus the row's origin is a multiple of it
    chunking = dict(chunk_size=chunk, chunk_offsets=plan.tensor("stored_origins", device) if chunk else None)
    if query.shape[2] == 1:
        out = paged_decode_attention(
            query[:, :, 0], layer.key_blocks, layer.value_blocks, tables, seq_lens, scale, window, softcap,
            quantized=quantized, sinks=sinks, **chunking,
        )  # fmt: skip
        return out.unsqueeze(1)
    return paged_prefill_attention(
        query.transpose(1, 2), layer.key_blocks, layer.value_blocks, tables, seq_lens,
        plan.tensor("query_lens", device), scale, window, softcap, quantized=quantized, sinks=sinks, **chunking,
    )  # fmt: skip
