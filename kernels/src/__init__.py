"""Triton kernels of hf_paged_cache, each beside a torch reference with the same signature.

Kernels (CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1``):

- ``write_kv(k_cache, v_cache, key, value, slot_mapping)`` -- store a step's K/V at their slots.
- ``paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=0,
  softcap=0.0, num_splits=None, quantized=None, sinks=None)`` -- one query per row; GQA-aware, split-K for small
  batches.
- ``paged_prefill_attention(query, k_cache, v_cache, block_tables, seq_lens, query_lens, scale,
  sliding_window=0, softcap=0.0, quantized=None, sinks=None)`` -- several causal queries per row (prefill, chunked
  prefill, warm-cache extension, speculative verification).
- ``quantize_blocks(k_cache, v_cache, src_blocks, key_fields, value_fields, dst_blocks, key_format,
  value_format)`` -- seal whole blocks: quantize them into the quantized pools in one pass.
- ``paged_attention_mass(query, k_cache, block_tables, seq_lens, query_lens, scale, sliding_window=0,
  softcap=0.0, last_queries=None, sinks=None)`` -- per-key attention probability summed over each KV head's
  query group and the (last ``last_queries``) queries: the score of H2O / TOVA / SnapKV-style eviction.

``sinks``: learned sink logits ``[num_q_heads]`` (gpt-oss's ``s_aux``), one more logit in each head's softmax
with no value: the online softmax starts from it (max = sink, sum = 1); split-K adds it once, in the reduce.

References (any device, plain torch): ``write_kv_ref``, ``paged_decode_attention_ref``,
``paged_prefill_attention_ref``, ``paged_attention_mass_ref``, ``quantize_blocks_ref``.

One C++ kernel for the CPU (module ``cpu_attention``, built at first use where a compiler and ninja are found):
``paged_attention_cpu(query, k_cache, v_cache, block_tables, query_starts, seq_lens, first_tokens, scale)`` --
row r's float32 queries ``query[query_starts[r]:query_starts[r + 1]]``, the last of its tokens
``first_tokens[r]:seq_lens[r]``, each attending causally over them: the torch path's read of the batch generator's
decode tokens and prompt chunks; reference ``paged_attention_cpu_ref``. With ``quantized=QuantizedRows(...)`` each
row first reads sealed blocks (int8, unrotated int4 / 2-bit), decoded in the kernel, and with
``transition=TransitionRows(...)`` blocks some of its queries read decoded and the others exact.
``paged_partial_attention_cpu(..., causal=True)`` also returns each query's log-sum-exp, so parts merge exactly;
``causal=False`` lets every query of a row see all of it (decode tokens over a prefix they share, read once);
reference ``paged_partial_attention_cpu_ref``. Module
``cpu_quantize``: ``quantize_blocks_cpu(fmt, x, sources, fields, targets)`` seals blocks as the format's torch encode
does, bit for bit. Module ``cpu_layer`` (the same extension): ``rms_norm_cpu`` and ``rotary_cpu``, a Llama decoder
layer's norm and rotary embedding in one pass each (the batch generator's fused layers); references ``rms_norm_ref``,
``rotary_ref``. Module ``cpu_write``: ``write_kv_cpu(k_cache, v_cache, key, value, slot_mapping)``, ``write_kv`` for CPU
tensors in one call with the destinations prefetched (the torch path's write where the extension is loaded already);
reference ``write_kv_ref``.

Quantized history: ``quantized=QuantizedKV(key_format, value_format, key_fields, value_fields,
block_tables, lens)`` makes each row's first ``lens[row]`` stored tokens come from whole quantized blocks
(formats and pools of ``hf_paged_cache.quantization``), dequantized in registers; the paged cache then
holds the row's remaining tokens. See ``quantized.py``.

Layout: ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` (fp32/fp16/bf16;
any strides with a contiguous head dim, the same for both; ``allocate_kv_blocks`` makes the head-major storage the
cache uses); ``block_tables`` int32 ``[batch, max_blocks_per_row]``; ``seq_lens`` int32
``[batch]`` counts each row's stored tokens including this step's; token ``s`` of row ``b`` lives at
``block_tables[b, s // block_size]``, offset ``s % block_size``.

Names are resolved lazily (PEP 562): importing this package imports neither triton nor a kernel
module, so the references work without triton, and TRITON_INTERPRET (read by ``@triton.jit`` when a
kernel module is imported) can still be set by whoever imports a kernel first.
``python -m hf_paged_cache.kernels.compile_check`` compiles every kernel variant for sm80 / sm90.
"""

from importlib import import_module

_EXPORTS = {
    "write_kv": ".cache_write",
    "paged_decode_attention": ".paged_decode",
    "paged_prefill_attention": ".paged_prefill",
    "paged_attention_mass": ".attention_mass",
    "allocate_kv_blocks": ".layout",
    "write_kv_ref": ".reference",
    "paged_decode_attention_ref": ".reference",
    "paged_prefill_attention_ref": ".reference",
    "paged_attention_mass_ref": ".reference",
    "QuantizedKV": ".quantized",
    "quantize_blocks": ".seal",
    "quantize_blocks_ref": ".reference",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
