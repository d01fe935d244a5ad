"""Paged prefill attention: several causal queries per row over the row's cached keys.

One kernel covers every multi-token step: a fresh prompt, chunked prefill, extending a warm cache
and speculative verification. The step's K/V are already in the cache, so queries and keys are
addressed by *stored index*: the last ``query_lens[b]`` of the ``q_len`` query positions of row b
are its stored tokens ``seq_len - query_lens[b] .. seq_len - 1``; the leading positions are padding
(right-aligned ragged batch) and produce 0.

Layout: a program owns one (row, KV head) and a tile of TILE_Q query positions x the GROUP query
heads sharing that KV head, flattened into BLOCK_M = TILE_Q * GROUP rows of one ``tl.dot`` (row r is
position r // GROUP, head r % GROUP), so each K/V tile is loaded once for the whole group. It walks
the keys the tile can see -- from the first query's window start to the last query -- in BLOCK_N
tiles with the shared online-softmax step; the causal / window mask is applied per element.
"""

from __future__ import annotations

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


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_lens,
    out_ptr,
    k_codes,
    k_scales,
    k_zeros,
    v_codes,
    v_scales,
    v_zeros,
    quant_tables,
    quant_lens,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_table,
    stride_ob,
    stride_om,
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
    q_len,
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
    TILE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    """Grid (cdiv(q_len, TILE_Q), batch * num_kv_heads). QUANTIZED, HAS_SINKS: as in the decode kernel."""
    q_tile = tl.program_id(0)
    pid = tl.program_id(1)
    row = pid // num_kv_heads
    kv_head = pid % num_kv_heads

    # The row offset in int64: batch x q_len x heads x head_dim may exceed 2**31 elements.
    q_row = q_ptr + row.to(tl.int64) * stride_qb
    out_row = out_ptr + row.to(tl.int64) * stride_ob
    seq_len = tl.load(seq_lens + row)
    first_real = q_len - tl.load(query_lens + row)  # query position of the row's first real query
    pos_to_stored = seq_len - q_len  # stored index = query position + pos_to_stored

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = q_tile * TILE_Q + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    in_tile = (offs_r < TILE_Q * GROUP) & (pos < q_len)
    real = in_tile & (pos >= first_real)
    q = tl.load(
        q_row + pos[:, None] * stride_qm + heads[:, None] * stride_qh + offs_d[None, :],
        mask=real[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = tl.where(real, pos + pos_to_stored, -1)

    # Keys seen by the tile's real queries: [window start of the first, last + 1); empty if none is real.
    first_pos = tl.maximum(q_tile * TILE_Q, first_real)
    last_pos = tl.minimum(q_tile * TILE_Q + TILE_Q, q_len) - 1
    chunk_offset = tl.load(chunk_offsets + row, mask=chunk > 0, other=0)
    first_window = query_window(first_pos + pos_to_stored, window, chunk, chunk_offset)  # later ones reach no further
    key_lo = first_visible_key(first_pos + pos_to_stored, first_window) // BLOCK_N * BLOCK_N
    key_hi = tl.where(first_pos <= last_pos, last_pos + pos_to_stored + 1, key_lo)

    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    m_i, l_i = softmax_start(sinks, heads, real, BLOCK_M, HAS_SINKS)
    acc, m_i, l_i = attend_stored_keys(
        acc, m_i, l_i, q, q_pos, key_lo, key_hi, row, kv_head,
        k_cache, v_cache, block_tables, stride_kv_block, stride_kv_tok, stride_kv_head, stride_table,
        k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros,
        stride_kcode_block, stride_kcode_tok, stride_kcode_head,
        stride_kmeta_block, stride_kmeta_tok, stride_kmeta_head,
        stride_vcode_block, stride_vcode_tok, stride_vcode_head,
        stride_vmeta_block, stride_vmeta_tok, stride_vmeta_head,
        quant_tables, quant_lens, stride_quant_table,
        scale, softcap, query_window(q_pos, window, chunk, chunk_offset),
        BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, USE_SOFTCAP, DOT_DTYPE,
        QUANTIZED, K_BITS, K_EXPONENT_BITS, K_ZERO_POINT, K_PER_TOKEN, K_GROUP, K_SCALE_BITS, K_ROTATE,
        V_BITS, V_EXPONENT_BITS, V_ZERO_POINT, V_PER_TOKEN, V_GROUP, V_SCALE_BITS, V_ROTATE,
    )  # fmt: skip

    out = normalize(acc, l_i)  # padding rows: 0
    out_ptrs = out_row + pos[:, None] * stride_om + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=in_tile[:, None] & (offs_d[None, :] < HEAD_DIM))


def prefill_meta(
    head_dim: int, block_size: int, group: int, softcap: float, dot_dtype, quantized: bool = False
) -> tuple[dict, int, int]:
    """Constexprs, num_warps and num_stages of the prefill kernel (shared by the launcher and compile_check)."""
    # Query rows and keys per tile are bounded by registers (q, acc, K, V and the logits all live
    # there). fp32 dots (ieee) run on FMA units and hold fp32 operand tiles: smaller tiles, more warps.
    fma = dot_dtype == tl.float32
    rows = 32 if fma or head_dim > 128 else 64
    block_m = max(rows, triton.next_power_of_2(group))
    constexprs = dict(
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d(head_dim),
        GROUP=group,
        TILE_Q=block_m // group,
        BLOCK_M=block_m,
        BLOCK_N=MIN_DOT if fma else 32,
        USE_SOFTCAP=softcap > 0,
        DOT_DTYPE=dot_dtype,
    )
    # Quantized tiles are dequantized in float32 registers before the dot: 8 warps and no software
    # pipelining (whose prefetched tiles would sit in registers too; prefill is compute-bound) keep them
    # within ~200 registers on sm80.
    return constexprs, 8 if fma or quantized else 4, 1 if quantized else 2


def plan_paged_prefill(
    query, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, sliding_window=0, softcap=0.0,
    quantized=None, sinks=None, chunk_size=0, chunk_offsets=None,
) -> tuple[torch.Tensor, list[Launch]]:
    """Validate inputs, allocate the output and describe the launch."""
    check_paged_kv(k_cache, v_cache)
    batch, q_len, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not match a cache with {num_kv_heads} KV heads of dim {kv_head_dim}"
        )
    query = last_dim_contiguous(query)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    quant_args, quant_constexprs = attention_args(quantized, batch, block_size, num_kv_heads, head_dim, query.device)
    sinks = sink_logits(sinks, num_q_heads, query.device)
    chunking = chunk_args(chunk_size, chunk_offsets, sliding_window, seq_lens)
    if batch == 0 or q_len == 0:
        return out, []
    constexprs, num_warps, num_stages = prefill_meta(
        head_dim, block_size, num_q_heads // num_kv_heads, softcap,
        dot_dtype(k_cache.dtype, is_interpreted(_paged_prefill_kernel)), quantized is not None,
    )  # fmt: skip
    launch = Launch(
        _paged_prefill_kernel,
        grid=(triton.cdiv(q_len, constexprs["TILE_Q"]), batch * num_kv_heads),
        args=dict(
            q_ptr=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, seq_lens=seq_lens,
            query_lens=query_lens, out_ptr=out,
            stride_qb=query.stride(0), stride_qm=query.stride(1), stride_qh=query.stride(2),
            stride_kv_block=k_cache.stride(0), stride_kv_tok=k_cache.stride(1), stride_kv_head=k_cache.stride(2),
            stride_table=block_tables.stride(0),
            stride_ob=out.stride(0), stride_om=out.stride(1), stride_oh=out.stride(2),
            q_len=q_len, num_kv_heads=num_kv_heads,
            scale=float(scale), softcap=float(softcap), window=int(sliding_window),
            **chunking, **quant_args, sinks=sinks,
        ),
        constexprs=dict(constexprs, **quant_constexprs, HAS_SINKS=sinks is not None),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out, [launch]


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    quantized: QuantizedKV | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query [batch, q_len, num_q_heads, head_dim]`` over paged K/V.

    ``query_lens`` int32 ``[batch]``: the last ``query_lens[b]`` positions of row b are real and are its
    last stored tokens; the others are padding and return 0. The real query with stored index p sees
    keys s <= p (and s > p - sliding_window when sliding_window > 0). Returns the query's shape and
    dtype (fp32 accumulation). ``quantized``: a quantized prefix per row, and ``sinks``: learned sink logits
    ``[num_q_heads]``, and ``chunk_size`` / ``chunk_offsets``: chunked attention, as in ``paged_decode_attention``.
    """
    out, launches = plan_paged_prefill(
        query, k_cache, v_cache, block_tables, seq_lens, query_lens, scale, sliding_window, softcap, quantized, sinks,
        chunk_size, chunk_offsets,
    )
    for launch in launches:
        launch.run()
    return out
