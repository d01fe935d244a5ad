"""Per-key attention mass over paged K: what token-eviction policies (H2O, TOVA, SnapKV) score keys by.

``out[b, h, s]`` is the softmax probability key s of row b received, summed over the query heads of
KV head h's group and over the selected queries of the row. It is computed from the paged cache
itself, without eager attention and without ever holding a ``[queries, keys]`` matrix in memory,
in two passes as FlashAttention's backward pass does:

1. ``_mass_lse_kernel`` -- one program per (row, KV head, tile of queries), laid out exactly like the
   prefill kernel (a tile of TILE_Q positions x the GROUP heads as the BLOCK_M rows of one ``tl.dot``)
   -- walks the keys its queries see with the online max / sum and stores each (row, query, head)'s
   log-sum-exp: O(batch x queries x heads) fp32.
2. ``_mass_kernel`` -- one program per (row, KV head, tile of BLOCK_N keys) -- loads its key tile once,
   loops over the tiles of selected queries that can see it, recomputes the logits and accumulates
   ``exp(logit - lse)``, the exact probabilities, then writes the tile's column sums once. No atomics:
   each output element has a single owner, so results are deterministic.

Queries follow ``paged_prefill_attention``'s layout (right-aligned ragged batch, the cache's own
convention): the last ``query_lens[b]`` of the ``q_len`` positions of row b are real and are its
stored tokens ``seq_len - query_lens[b] .. seq_len - 1``; leading positions are padding. Both kernels
reuse the prefill kernel's tile sizes (``prefill_meta``): they hold less (no V tile, and a
``[BLOCK_M, BLOCK_N]`` accumulator instead of ``[BLOCK_M, BLOCK_D]``). One exception, measured with
``compile_check``: pass 2 with fp32 (FMA) dots runs single-stage, see ``plan_paged_attention_mass``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    first_visible_key,
    load_kv_tile,
    paged_offsets,
    row_max,
    row_sum,
    softcap_logits,
    softmax_start,
    visible,
)
from .launch import Launch, check_paged_kv, dot_dtype, is_interpreted, last_dim_contiguous, sink_logits
from .paged_prefill import prefill_meta


@triton.jit
def _load_keys(k_head_ptr, table_ptr, k_pos, key_hi, stride_kv_block, stride_kv_tok,
               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Keys ``k_pos`` (those >= key_hi masked to 0) of one row and KV head, gathered through the block table."""
    offs_d = tl.arange(0, BLOCK_D)
    k_valid = k_pos < key_hi
    tok_off = paged_offsets(table_ptr, k_pos, k_valid, stride_kv_block, stride_kv_tok, BLOCK_SIZE)
    return load_kv_tile(k_head_ptr, tok_off, offs_d, k_valid[:, None] & (offs_d[None, :] < HEAD_DIM), DOT_DTYPE)


@triton.jit
def _query_tile(q_row, lse_row, j0, q_off, first_sel, q_len, pos_to_stored, kv_head, stride_qm, stride_qh,
                num_q_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                TILE_Q: tl.constexpr, BLOCK_M: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """The tile of selected queries from window index ``j0`` on, as the BLOCK_M rows of a ``tl.dot``.

    Row r is position ``q_off + j0 + r // GROUP`` and query head ``kv_head * GROUP + r % GROUP``; it is
    selected iff that position lies in ``[first_sel, q_len)``. Returns the queries (0 where not
    selected), their stored indices (-1 where not selected, so they see no key), the selection mask and
    pointers to their log-sum-exp slots (layout ``[batch, num_selected, num_q_heads]``).
    """
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = q_off + j0 + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    selected = (offs_r < TILE_Q * GROUP) & (pos >= first_sel) & (pos < q_len)
    q = tl.load(
        q_row + pos[:, None] * stride_qm + heads[:, None] * stride_qh + offs_d[None, :],
        mask=selected[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    ).to(DOT_DTYPE)
    q_pos = tl.where(selected, pos + pos_to_stored, -1)
    return q, q_pos, selected, lse_row + (pos - q_off) * num_q_heads + heads


@triton.jit
def _logits(q, k, q_pos, k_pos, scale, softcap, window, USE_SOFTCAP: tl.constexpr):
    """[BLOCK_M, BLOCK_N] scaled (soft-capped) logits, -inf where the key is not visible from the query."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if USE_SOFTCAP:
        s = softcap_logits(s, softcap)
    return tl.where(visible(q_pos, k_pos, q_pos * 0 + window), s, float("-inf"))  # one window for every query


@triton.jit
def _row_selection(seq_lens, query_lens, row, q_len, num_sel):
    """(seq_len, first selected query position, stored index minus query position) of one row.

    The selected queries are the row's last ``min(query_lens[row], num_sel)`` positions.
    """
    seq_len = tl.load(seq_lens + row)
    first_sel = q_len - tl.minimum(tl.load(query_lens + row), num_sel)
    return seq_len, first_sel, seq_len - q_len


@triton.jit
def _mass_lse_kernel(
    q_ptr,
    k_cache,
    block_tables,
    seq_lens,
    query_lens,
    lse_ptr,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_table,
    q_len,
    num_sel,
    num_kv_heads,
    scale,
    softcap,
    window,
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
    HAS_SINKS: tl.constexpr,
):
    """Pass 1, grid (cdiv(num_sel, TILE_Q), batch * num_kv_heads): the log-sum-exp of each selected query row,
    its head's sink logit included (HAS_SINKS), so pass 2's probabilities are the model's."""
    j0 = tl.program_id(0) * TILE_Q
    pid = tl.program_id(1)
    row = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    seq_len, first_sel, pos_to_stored = _row_selection(seq_lens, query_lens, row, q_len, num_sel)
    q_off = q_len - num_sel  # position of the first query of the selection window
    q, q_pos, selected, lse_ptrs = _query_tile(
        q_ptr + row.to(tl.int64) * stride_qb, lse_ptr + row.to(tl.int64) * num_sel * num_kv_heads * GROUP,
        j0, q_off, first_sel, q_len, pos_to_stored, kv_head, stride_qm, stride_qh, num_kv_heads * GROUP,
        HEAD_DIM, BLOCK_D, GROUP, TILE_Q, BLOCK_M, DOT_DTYPE,
    )  # fmt: skip

    # Keys seen by the tile's selected queries: [window start of the first, last + 1); empty if none.
    first_pos = tl.maximum(q_off + j0, first_sel)
    last_pos = tl.minimum(q_off + j0 + TILE_Q, q_len) - 1
    key_lo = first_visible_key(first_pos + pos_to_stored, window) // BLOCK_N * BLOCK_N
    key_hi = tl.where(first_pos <= last_pos, last_pos + pos_to_stored + 1, key_lo)

    m_i, l_i = softmax_start(sinks, kv_head * GROUP + tl.arange(0, BLOCK_M) % GROUP, selected, BLOCK_M, HAS_SINKS)
    for start in range(key_lo, key_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k = _load_keys(
            k_cache + kv_head * stride_kv_head, block_tables + row * stride_table, k_pos, key_hi,
            stride_kv_block, stride_kv_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_D, DOT_DTYPE,
        )  # fmt: skip
        s = _logits(q, k, q_pos, k_pos, scale, softcap, window, USE_SOFTCAP)
        m_new = tl.maximum(m_i, row_max(s))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0 so exp() gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_shift) + row_sum(tl.exp(s - m_shift[:, None]))
        m_i = m_new
    # Every selected query sees at least its own key (l > 0); rows that see none (padding rows of the
    # tile, inconsistent input) get 0 instead of log(0), and their logits are -inf anyway.
    seen = l_i > 0.0
    lse = tl.where(seen, m_i, 0.0) + tl.log(tl.where(seen, l_i, 1.0))
    tl.store(lse_ptrs, lse, mask=selected)


@triton.jit
def _mass_kernel(
    q_ptr,
    k_cache,
    block_tables,
    seq_lens,
    query_lens,
    lse_ptr,
    out_ptr,
    stride_qb,
    stride_qm,
    stride_qh,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_table,
    q_len,
    num_sel,
    num_kv_heads,
    num_keys,
    scale,
    softcap,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    TILE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Pass 2, grid (cdiv(num_keys, BLOCK_N), batch * num_kv_heads): the mass of one tile of keys.

    Writes every key of its tile: 0 for keys at or past seq_len (their block-table entries are not read).
    """
    key_start = tl.program_id(0) * BLOCK_N
    pid = tl.program_id(1)
    row = pid // num_kv_heads
    kv_head = pid % num_kv_heads
    seq_len, first_sel, pos_to_stored = _row_selection(seq_lens, query_lens, row, q_len, num_sel)
    q_off = q_len - num_sel

    k_pos = key_start + tl.arange(0, BLOCK_N)
    k = _load_keys(
        k_cache + kv_head * stride_kv_head, block_tables + row * stride_table, k_pos, seq_len,
        stride_kv_block, stride_kv_tok, BLOCK_SIZE, HEAD_DIM, BLOCK_D, DOT_DTYPE,
    )  # fmt: skip

    # Window indices of the selected queries that see some key of the tile: stored index >= key_start
    # (causal) and, with a sliding window, < last key + window. Past seq_len the range is empty.
    j_lo = tl.maximum(first_sel, key_start - pos_to_stored) - q_off
    last_key = tl.minimum(key_start + BLOCK_N, seq_len) - 1
    j_hi = tl.where(window > 0, tl.minimum(num_sel, last_key + window - pos_to_stored - q_off), num_sel)

    # Probabilities are summed elementwise across query tiles and reduced over rows once at the end.
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    lse_row = lse_ptr + row.to(tl.int64) * num_sel * num_kv_heads * GROUP
    for j0 in range(j_lo, j_hi, TILE_Q):
        q, q_pos, selected, lse_ptrs = _query_tile(
            q_ptr + row.to(tl.int64) * stride_qb, lse_row,
            j0, q_off, first_sel, q_len, pos_to_stored, kv_head, stride_qm, stride_qh, num_kv_heads * GROUP,
            HEAD_DIM, BLOCK_D, GROUP, TILE_Q, BLOCK_M, DOT_DTYPE,
        )  # fmt: skip
        lse = tl.load(lse_ptrs, mask=selected, other=0.0)
        acc += tl.exp(_logits(q, k, q_pos, k_pos, scale, softcap, window, USE_SOFTCAP) - lse[:, None])
    out_row = out_ptr + (row * num_kv_heads + kv_head).to(tl.int64) * num_keys
    tl.store(out_row + k_pos, row_sum(tl.trans(acc)), mask=k_pos < num_keys)


def plan_paged_attention_mass(
    query, k_cache, block_tables, seq_lens, query_lens, scale, sliding_window=0, softcap=0.0, last_queries=None,
    sinks=None,
) -> tuple[torch.Tensor, list[Launch]]:
    """Validate inputs, allocate the output and the log-sum-exp buffer and describe the two launches."""
    check_paged_kv(k_cache, k_cache)
    batch, q_len, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    if kv_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not match a cache with {num_kv_heads} KV heads of dim {kv_head_dim}"
        )
    if last_queries is not None and last_queries < 1:
        raise ValueError(f"last_queries must be None or >= 1, got {last_queries}")
    query = last_dim_contiguous(query)
    sinks = sink_logits(sinks, num_q_heads, query.device)
    num_sel = q_len if last_queries is None else min(int(last_queries), q_len)
    num_keys = block_tables.shape[1] * block_size
    out = query.new_empty((batch, num_kv_heads, num_keys), dtype=torch.float32)
    if out.numel() == 0 or num_sel == 0:
        return out.zero_(), []
    constexprs, num_warps, num_stages = prefill_meta(
        head_dim, block_size, num_q_heads // num_kv_heads, softcap,
        dot_dtype(k_cache.dtype, is_interpreted(_mass_kernel)),
    )  # fmt: skip
    lse = query.new_empty((batch, num_sel, num_q_heads), dtype=torch.float32)
    args = dict(
        q_ptr=query, k_cache=k_cache, block_tables=block_tables, seq_lens=seq_lens, query_lens=query_lens,
        lse_ptr=lse, stride_qb=query.stride(0), stride_qm=query.stride(1), stride_qh=query.stride(2),
        stride_kv_block=k_cache.stride(0), stride_kv_tok=k_cache.stride(1), stride_kv_head=k_cache.stride(2),
        stride_table=block_tables.stride(0), q_len=q_len, num_sel=num_sel, num_kv_heads=num_kv_heads,
    )  # fmt: skip
    scalars = dict(scale=float(scale), softcap=float(softcap), window=int(sliding_window))
    rows = batch * num_kv_heads
    # Software-pipelining pass 2's query loads (num_stages=2) makes its fp32 (FMA-dot) variants spill
    # 150-2500 bytes per thread next to the resident key tile; one stage keeps them at ~60 registers.
    mass_stages = 1 if constexprs["DOT_DTYPE"] == tl.float32 else num_stages
    lse_pass = Launch(
        _mass_lse_kernel, (triton.cdiv(num_sel, constexprs["TILE_Q"]), rows),
        dict(args, **scalars, sinks=sinks), dict(constexprs, HAS_SINKS=sinks is not None), num_warps, num_stages,
    )  # fmt: skip
    mass_pass = Launch(
        _mass_kernel, (triton.cdiv(num_keys, constexprs["BLOCK_N"]), rows),
        dict(args, out_ptr=out, num_keys=num_keys, **scalars), constexprs, num_warps, mass_stages,
    )  # fmt: skip
    return out, [lse_pass, mass_pass]


def paged_attention_mass(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    last_queries: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probability each stored key receives, summed over query heads per KV head and over queries.

    query ``[batch, q_len, num_q_heads, head_dim]`` (decode: q_len 1; any strides, contiguous head dim),
    laid out as for ``paged_prefill_attention``: the last ``query_lens[b]`` positions of row b are real
    and are its stored tokens ``seq_lens[b] - query_lens[b] ..``; leading positions are padding and
    contribute nothing. ``last_queries`` W: only each row's last W real queries contribute (SnapKV's
    observation window); None: all of them. Masking, ``sliding_window``, ``softcap`` and GQA as in the
    attention kernels. ``sinks``: learned sink logits ``[num_q_heads]`` that take their share of each
    softmax, as in the attention kernels. Returns fp32 ``[batch, num_kv_heads, block_tables.shape[1] * block_size]``;
    ``out[b, h, s]`` is 0 for s >= seq_lens[b], and each selected query adds exactly ``group`` in total (less
    what the sinks take).
    """
    out, launches = plan_paged_attention_mass(
        query, k_cache, block_tables, seq_lens, query_lens, scale, sliding_window, softcap, last_queries, sinks
    )
    for launch in launches:
        launch.run()
    return out
