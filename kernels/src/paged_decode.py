"""Paged decode attention: one query per row (its last stored token) over the row's cached keys.

Decode is memory-bound: every KV byte of the context is read once per step. So the work is laid out
to read each KV head exactly once:

* GQA-aware programs. One program owns a (row, KV head) pair and computes the whole query group of
  that head at once -- the group is the M dimension of a ``tl.dot``, padded up to 16 rows (the GPU's
  minimum) with masked rows. K/V tiles are loaded once per group instead of once per query head.
* Split-K ("flash-decoding"). With few (row, KV head) pairs a single pass leaves most SMs idle, so the
  context of each row is cut into ``num_splits`` chunks handled by separate programs; each writes a
  partial (max, sum, unnormalised output) in fp32 and a small reduce kernel merges them.
  ``choose_num_splits`` is the heuristic; ``num_splits`` overrides it (1 = single pass, which writes
  the output directly).

Keys visible from the query (stored index ``seq_len - 1``): s < seq_len, and with a sliding window
``s > seq_len - 1 - sliding_window``. Rows with seq_len 0 produce 0.

With a quantized history (``quantized=QuantizedKV``) each program walks the quantized prefix of its
range, then the full-precision rest; splits cut the whole range, so a split may hold only quantized
keys, only full-precision ones, or both. The quantized variants use larger key tiles and 8 warps (see
``decode_meta``); without ``quantized`` the kernel, its tiles and its launch are exactly the unquantized ones.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import attend_stored_keys, first_visible_key, normalize, query_window, softmax_start
from .launch import (
    MIN_DOT,
    Launch,
    block_d,
    check_paged_kv,
    dot_dtype,
    is_interpreted,
    chunk_args,
    last_dim_contiguous,
    sink_logits,
)
from .quantized import QuantizedKV, attention_args

# Split-K heuristic knobs (see choose_num_splits).
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Used when the device reports no SM count (CPU / interpreter): an H100-class GPU.
DEFAULT_NUM_SMS = 132
# Keys per tile of the quantized variants with tensor-core dots (see decode_meta).
QUANTIZED_BLOCK_N = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    out_ptr,
    part_acc,
    part_ml,
    k_codes,
    k_scales,
    k_zeros,
    v_codes,
    v_scales,
    v_zeros,
    quant_tables,
    quant_lens,
    stride_qb,
    stride_qh,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_table,
    stride_ob,
    stride_oh,
    stride_kcode_block,
    stride_kcode_tok,
    stride_kcode_head,
    stride_kmeta_block,
    stride_kmeta_tok,
    stride_kmeta_head,
    stride_vcode_block,
    stride_vcode_tok,
    stride_vcode_head,
    stride_vmeta_block,
    stride_vmeta_tok,
    stride_vmeta_head,
    stride_quant_table,
    num_kv_heads,
    scale,
    softcap,
    window,
    chunk,
    chunk_offsets,
    sinks,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    K_BITS: tl.constexpr,
    K_EXPONENT_BITS: tl.constexpr,
    K_ZERO_POINT: tl.constexpr,
    K_QMAX: tl.constexpr,
    K_PER_TOKEN: tl.constexpr,
    K_GROUP: tl.constexpr,
    K_SCALE_BITS: tl.constexpr,
    K_ROTATE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_EXPONENT_BITS: tl.constexpr,
    V_ZERO_POINT: tl.constexpr,
    V_QMAX: tl.constexpr,
    V_PER_TOKEN: tl.constexpr,
    V_GROUP: tl.constexpr,
    V_SCALE_BITS: tl.constexpr,
    V_ROTATE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Grid (batch * num_kv_heads, num_splits). SPLIT=False writes ``out``; SPLIT=True writes partials.

    HAS_SINKS: each head's softmax starts from its sink logit (``softmax_start``); split partials are
    launched without it, and the reduce kernel folds the sink in once.

    QUANTIZED: the first ``quant_lens[row]`` stored tokens are read from the quantized pools (``k_*`` /
    ``v_*``, formats given by the K_* / V_* constexprs of ``quantized.format_constexprs``, of which reading
    needs all but QMAX); the splits share out the whole range.
    """
    pid = tl.program_id(0)
    row = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)

    seq_len = tl.load(seq_lens + row)
    q_last = seq_len - 1
    window = query_window(q_last, window, chunk, tl.load(chunk_offsets + row, mask=chunk > 0, other=0))
    # Whole tiles from the first visible key to the end, shared out evenly between the splits.
    key_lo = first_visible_key(q_last, window) // BLOCK_N * BLOCK_N
    num_tiles = (seq_len - key_lo + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (num_tiles + num_splits - 1) // num_splits
    lo = key_lo + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    io_mask = g_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0
    ).to(DOT_DTYPE)
    q_pos = tl.where(g_mask, q_last, -1)

    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, dtype=tl.float32)
    m_i, l_i = softmax_start(sinks, heads, g_mask, BLOCK_G, HAS_SINKS)
    acc, m_i, l_i = attend_stored_keys(
        acc, m_i, l_i, q, q_pos, lo, hi, row, kv_head,
        k_cache, v_cache, block_tables, stride_kv_block, stride_kv_tok, stride_kv_head, stride_table,
        k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros,
        stride_kcode_block, stride_kcode_tok, stride_kcode_head,
        stride_kmeta_block, stride_kmeta_tok, stride_kmeta_head,
        stride_vcode_block, stride_vcode_tok, stride_vcode_head,
        stride_vmeta_block, stride_vmeta_tok, stride_vmeta_head,
        quant_tables, quant_lens, stride_quant_table,
        scale, softcap, q_pos * 0 + window,
        BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, USE_SOFTCAP, DOT_DTYPE,
        QUANTIZED, K_BITS, K_EXPONENT_BITS, K_ZERO_POINT, K_PER_TOKEN, K_GROUP, K_SCALE_BITS, K_ROTATE,
        V_BITS, V_EXPONENT_BITS, V_ZERO_POINT, V_PER_TOKEN, V_GROUP, V_SCALE_BITS, V_ROTATE,
    )  # fmt: skip

    if SPLIT:
        # Partials are laid out [batch, num_q_heads, num_splits, (HEAD_DIM | 2)].
        part = (row * num_kv_heads * GROUP + heads) * num_splits + split
        tl.store(part_acc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=io_mask)
        tl.store(part_ml + part * 2, m_i, mask=g_mask)
        tl.store(part_ml + part * 2 + 1, l_i, mask=g_mask)
    else:
        out = normalize(acc, l_i)
        out_ptrs = out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _reduce_splits_kernel(
    part_acc,
    part_ml,
    out_ptr,
    stride_ob,
    stride_oh,
    num_q_heads,
    num_splits,
    sinks,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Grid (batch * num_q_heads,): merge the split partials of one (row, query head), and its sink logit
    (HAS_SINKS: one more partial, of sum 1 and output 0, at max = the sink)."""
    pid = tl.program_id(0)
    row = pid // num_q_heads
    head = pid % num_q_heads
    first = pid * num_splits

    m_max = tl.full([], float("-inf"), dtype=tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks + head)
        m_max = tl.maximum(m_max, sink)
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(part_ml + (first + s) * 2))
    # All splits empty (seq_len 0): weights exp(-inf - 0) = 0 and the output stays 0.
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)

    offs_d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = offs_d < HEAD_DIM
    acc = tl.full([1, BLOCK_D], 0.0, dtype=tl.float32)
    l_sum = tl.full([1], 0.0, dtype=tl.float32)
    if HAS_SINKS:
        l_sum += tl.exp(sink - m_shift)
    for s in range(num_splits):
        w = tl.exp(tl.load(part_ml + (first + s) * 2) - m_shift)
        l_sum += w * tl.load(part_ml + (first + s) * 2 + 1)
        acc += w * tl.load(part_acc + (first + s) * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
    out = normalize(acc, l_sum)
    out_ptrs = out_ptr + row * stride_ob + head * stride_oh + offs_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Flash-decoding heuristic: how many programs share one (row, KV head) context.

    With at least one (row, KV head) program per SM the single pass already fills the GPU: 1.
    Otherwise aim at about two programs per SM, but give every split at least MIN_KEYS_PER_SPLIT keys
    of the longest possible context (so the partial writes and the reduce stay cheap next to the KV
    reads) and never more than MAX_SPLITS. ``max_context`` is an upper bound read from shapes
    (block-table width x block size) so that choosing needs no device-to-host sync.
    """
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, programs)
    by_length = max_context // MIN_KEYS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@functools.lru_cache
def _num_sms(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_meta(
    head_dim: int, block_size: int, group: int, softcap: float, dot_dtype, quantized: bool = False
) -> tuple[dict, int, int]:
    """Constexprs, num_warps and num_stages of the decode kernel (shared by the launcher and compile_check);
    the launcher adds SPLIT and HAS_SINKS."""
    tensor_cores = dot_dtype != tl.float32 and head_dim <= 128
    constexprs = dict(
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d(head_dim),
        GROUP=group,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        # Keys per tile. fp32 dots (ieee) run on FMA units and need registers for whole fp32 tiles,
        # as do 256-wide heads: 16 keys keeps them spill-free. Tiles are aligned, so a tile never
        # straddles two cache blocks when block_size >= BLOCK_N. Quantized tiles carry 2-4x fewer bytes
        # per key, so they take QUANTIZED_BLOCK_N keys to keep more bytes in flight per iteration.
        BLOCK_N=(QUANTIZED_BLOCK_N if quantized else 32) if tensor_cores else MIN_DOT,
        USE_SOFTCAP=softcap > 0,
        DOT_DTYPE=dot_dtype,
    )
    # Quantized tiles are dequantized in float32 registers before the dot: 8 warps keep 64-key tiles
    # spill-free (at most ~180 registers at head_dim 128, where 4 warps spill).
    return constexprs, 8 if quantized and tensor_cores else 4, 2


def plan_paged_decode(
    query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=0, softcap=0.0, num_splits=None,
    quantized=None, sinks=None, chunk_size=0, chunk_offsets=None,
) -> tuple[torch.Tensor, list[Launch]]:
    """Validate inputs, allocate the output (and split partials) and describe the launches."""
    check_paged_kv(k_cache, v_cache)
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not match a cache with {num_kv_heads} KV heads of dim {kv_head_dim}"
        )
    query = last_dim_contiguous(query)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    quant_args, quant_constexprs = attention_args(quantized, batch, block_size, num_kv_heads, head_dim, query.device)
    sinks = sink_logits(sinks, num_q_heads, query.device)
    chunking = chunk_args(chunk_size, chunk_offsets, sliding_window, seq_lens)
    if batch == 0:
        return out, []
    if num_splits is None:
        num_sms = _num_sms(query.device.index) if query.is_cuda else DEFAULT_NUM_SMS
        max_blocks = block_tables.shape[1] + (quantized.block_tables.shape[1] if quantized is not None else 0)
        num_splits = choose_num_splits(batch, num_kv_heads, max_blocks * block_size, num_sms)

    constexprs, num_warps, num_stages = decode_meta(
        head_dim, block_size, num_q_heads // num_kv_heads, softcap,
        dot_dtype(k_cache.dtype, is_interpreted(_paged_decode_kernel)), quantized is not None,
    )  # fmt: skip
    split = num_splits > 1
    part_acc = query.new_empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32) if split else None
    part_ml = query.new_empty((batch, num_q_heads, num_splits, 2), dtype=torch.float32) if split else None
    decode = Launch(
        _paged_decode_kernel,
        grid=(batch * num_kv_heads, num_splits),
        args=dict(
            q_ptr=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
            out_ptr=out, part_acc=part_acc, part_ml=part_ml,
            stride_qb=query.stride(0), stride_qh=query.stride(1),
            stride_kv_block=k_cache.stride(0), stride_kv_tok=k_cache.stride(1), stride_kv_head=k_cache.stride(2),
            stride_table=block_tables.stride(0), stride_ob=out.stride(0), stride_oh=out.stride(1),
            num_kv_heads=num_kv_heads, scale=float(scale), softcap=float(softcap), window=int(sliding_window),
            **chunking, **quant_args, sinks=None if split else sinks,
        ),
        constexprs=dict(constexprs, SPLIT=split, **quant_constexprs, HAS_SINKS=sinks is not None and not split),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if not split:
        return out, [decode]
    reduce = Launch(
        _reduce_splits_kernel,
        grid=(batch * num_q_heads,),
        args=dict(
            part_acc=part_acc, part_ml=part_ml, out_ptr=out, stride_ob=out.stride(0), stride_oh=out.stride(1),
            num_q_heads=num_q_heads, num_splits=num_splits, sinks=sinks,
        ),
        constexprs=dict(HEAD_DIM=head_dim, BLOCK_D=constexprs["BLOCK_D"], HAS_SINKS=sinks is not None),
        num_warps=1 if head_dim <= 128 else 2,
        num_stages=1,
    )  # fmt: skip
    return out, [decode, reduce]


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
    quantized: QuantizedKV | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each row's last token over its paged K/V.

    query ``[batch, num_q_heads, head_dim]``; k/v_cache ``[num_blocks, block_size, num_kv_heads,
    head_dim]``; block_tables int32 ``[batch, max_blocks_per_row]``; seq_lens int32 ``[batch]``
    (stored tokens per row, this step's included). ``sliding_window`` 0 = none; ``softcap`` > 0 applies
    ``softcap * tanh(logits / softcap)`` after scaling; ``num_splits`` None = heuristic, 1 = single
    pass. Returns ``[batch, num_q_heads, head_dim]`` in the query's dtype (fp32 accumulation).

    ``quantized``: each row's first ``quantized.lens[row]`` stored tokens are read, dequantized in
    registers, from the quantized pools (see ``QuantizedKV``); ``block_tables`` then lists only the
    full-precision blocks that follow, and ``seq_lens`` counts both parts.
    ``sinks``: learned sink logits ``[num_q_heads]`` (gpt-oss's ``s_aux``), one extra logit per head in every
    softmax's denominator with no value (not a key: never masked by causality or the window).
    ``chunk_size`` > 0: chunked attention (Llama-4, no ``sliding_window``): a query sees only the keys of its own
    chunk, stored index s lying in chunk ``(s + chunk_offsets[row]) // chunk_size`` (int32 ``[batch]``, zeros
    when None).
    """
    out, launches = plan_paged_decode(
        query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, num_splits, quantized, sinks,
        chunk_size, chunk_offsets,
    )
    for launch in launches:
        launch.run()
    return out
