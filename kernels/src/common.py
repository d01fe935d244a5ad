"""The per-tile attention step the paged kernels share, as ``@triton.jit`` helpers.

Why one module: decode and prefill differ only in which query rows a program owns and which key
range it walks. Everything done per tile of keys -- gather K/V through the block table, scale,
soft-cap, causal / sliding-window / chunked masking, the online-softmax update -- is identical, so it lives
here once as ``@triton.jit`` helpers that both kernels inline. ``attend_stored_keys`` is their entry
point: it walks a row's quantized prefix (``attend_quantized_range``, tiles dequantized in registers by
``dequantize.py``) and then its full-precision tokens (``attend_key_range``); both feed the same
``online_softmax_step``. Every loaded value is converted to the *dot dtype* (``launch.dot_dtype``) right
after the load and every softmax statistic is fp32. The host side the launchers share is ``launch.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dequantize import hadamard, load_quantized_tile

# Reductions go through tl.reduce with combine functions defined here, not tl.max / tl.sum, and the
# kernels avoid tl.zeros / tl.cdiv: those are @jit functions of triton's standard library, created
# when triton is first imported. If that import came before TRITON_INTERPRET=1 was set (importing
# transformers imports triton), the interpreter cannot call them ("Cannot call @triton.jit'd outside
# of the scope of a kernel"); functions defined in this package are decorated late enough.
@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def row_max(x):
    return tl.reduce(x, 1, _max_combine)


@triton.jit
def row_sum(x):
    return tl.reduce(x, 1, _add_combine)


@triton.jit
def softcap_logits(x, softcap):
    """``softcap * tanh(x / softcap)``; tanh is written with exp because libdevice fails in the interpreter.

    tanh(y) = 1 - 2 / (exp(2y) + 1) saturates correctly: exp overflowing to inf gives 1, underflowing
    to 0 gives -1.
    """
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))


@triton.jit
def first_visible_key(q_pos, window):
    """Smallest stored index that query ``q_pos`` may attend to (window == 0: no sliding window)."""
    return tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)


@triton.jit
def query_window(q_pos, window, chunk, chunk_offset):
    """The window of query ``q_pos`` (a scalar or a vector): ``window``, or with chunked attention (``chunk`` > 0)
    the query's place in its chunk plus one, chunks starting where ``q_pos + chunk_offset`` is a multiple of
    ``chunk``. A chunk is a window that shrinks to one key at each chunk start, so every mask goes by windows."""
    return tl.where(chunk > 0, (q_pos + chunk_offset) % tl.maximum(chunk, 1) + 1, window)


@triton.jit
def visible(q_pos, k_pos, window):
    """[M, N] mask: key k_pos[n] is visible from query q_pos[m] (causal, and inside the query's window
    ``window[m]``, see ``query_window``; 0: none).

    A query row with q_pos == -1 (padding, or a padded row of a query group) sees nothing.
    """
    causal = k_pos[None, :] <= q_pos[:, None]
    return causal & ((window[:, None] <= 0) | (k_pos[None, :] > q_pos[:, None] - window[:, None]))


@triton.jit
def block_slots(table_ptr, k_pos, valid, BLOCK_SIZE: tl.constexpr):
    """Where stored indices ``k_pos`` of one row live: (block id as int64, slot inside the block), read
    through the row's block table at ``table_ptr``; invalid positions read block 0 and must stay masked."""
    block_id = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block_id, k_pos % BLOCK_SIZE


@triton.jit
def paged_offsets(table_ptr, k_pos, valid, stride_block, stride_tok, BLOCK_SIZE: tl.constexpr):
    """Element offsets of tokens ``k_pos`` of one row in a ``[blocks, tokens, ...]`` pool (``block_slots``)."""
    block_id, tok = block_slots(table_ptr, k_pos, valid, BLOCK_SIZE)
    return block_id * stride_block + tok * stride_tok


@triton.jit
def load_kv_tile(head_ptr, tok_off, offs_d, mask, DOT_DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] tile of one KV head; ``tok_off`` holds each token's offset in the cache."""
    return tl.load(head_ptr + tok_off[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DOT_DTYPE)


# Stored index given to the keys of a tile that lie past the range walked: no query reaches it.
BEYOND_ALL_QUERIES = tl.constexpr(2**31 - 1)


@triton.jit
def online_softmax_step(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_pos,
    key_hi,
    k,
    v,
    scale,
    softcap,
    window,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Fold one tile of keys ``k`` / values ``v`` ``[BLOCK_N, BLOCK_D]`` (DOT_DTYPE) at stored indices ``k_pos``
    into the online-softmax state (acc, m_i, l_i). A key is used where ``visible`` says so and ``k_pos <
    key_hi``: a tile may run past the range it belongs to (into the next split, or from the quantized
    prefix into the full-precision tokens), and those keys belong to another walk."""
    k_pos = tl.where(k_pos < key_hi, k_pos, BEYOND_ALL_QUERIES)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if USE_SOFTCAP:
        s = softcap_logits(s, softcap)
    s = tl.where(visible(q_pos, k_pos, window), s, float("-inf"))

    m_new = tl.maximum(m_i, row_max(s))
    # Rows that have seen no visible key yet keep m = -inf; shift them by 0 so exp() gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_shift)
    p = tl.exp(s - m_shift[:, None])
    l_i = l_i * alpha + row_sum(p)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def attend_key_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    key_lo,
    key_hi,
    k_head_ptr,
    v_head_ptr,
    table_ptr,
    stride_kv_block,
    stride_kv_tok,
    scale,
    softcap,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Fold keys ``[key_lo, key_hi)`` of one row and one KV head into an online-softmax state.

    acc [M, BLOCK_D], m_i [M], l_i [M] (fp32): unnormalised output, running max and running sum.
    q [M, BLOCK_D] (DOT_DTYPE): the query rows sharing this KV head; q_pos [M]: their stored indices.
    table_ptr points at the row's block table; k/v_head_ptr at the cache plus the KV head's offset.
    Keys are gathered token by token (block id from the table, offset inside the block), so BLOCK_N
    is independent of the cache block size and any key_lo is correct; a multiple of BLOCK_N keeps
    every tile inside aligned cache blocks.
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for start in range(key_lo, key_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < key_hi
        tok_off = paged_offsets(table_ptr, k_pos, k_valid, stride_kv_block, stride_kv_tok, BLOCK_SIZE)
        kv_mask = k_valid[:, None] & d_mask[None, :]
        k = load_kv_tile(k_head_ptr, tok_off, offs_d, kv_mask, DOT_DTYPE)
        v = load_kv_tile(v_head_ptr, tok_off, offs_d, kv_mask, DOT_DTYPE)
        acc, m_i, l_i = online_softmax_step(
            acc, m_i, l_i, q, q_pos, k_pos, key_hi, k, v, scale, softcap, window, USE_SOFTCAP, DOT_DTYPE
        )
    return acc, m_i, l_i


@triton.jit
def attend_quantized_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    key_lo,
    key_hi,
    table_ptr,
    k_codes,
    k_scales,
    k_zeros,
    v_codes,
    v_scales,
    v_zeros,
    stride_kcode_block,
    stride_kcode_tok,
    stride_kmeta_block,
    stride_kmeta_tok,
    stride_vcode_block,
    stride_vcode_tok,
    stride_vmeta_block,
    stride_vmeta_tok,
    scale,
    softcap,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    K_BITS: tl.constexpr,
    K_EXPONENT_BITS: tl.constexpr,
    K_ZERO_POINT: tl.constexpr,
    K_PER_TOKEN: tl.constexpr,
    K_GROUP: tl.constexpr,
    K_SCALE_BITS: tl.constexpr,
    K_ROTATE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_EXPONENT_BITS: tl.constexpr,
    V_ZERO_POINT: tl.constexpr,
    V_PER_TOKEN: tl.constexpr,
    V_GROUP: tl.constexpr,
    V_SCALE_BITS: tl.constexpr,
    V_ROTATE: tl.constexpr,
):
    """``attend_key_range`` over quantized keys ``[key_lo, key_hi)``: tiles are dequantized in registers.

    ``table_ptr`` points at the row's quantized block table; ``k_*`` / ``v_*`` at the KV head's slice of
    the key / value pools (see ``dequantize.load_quantized_tile``); key_lo must be a multiple of BLOCK_N.
    Rotated formats (``*_ROTATE``, see ``hf_paged_cache.quantization.int_n.IntN.rotate``) are read in the rotated
    space, which is orthogonal: rotated keys meet the rotated query (``Rq . Rk = q . k``), and rotated values
    are summed into the rotated state, rotated back after the range (``acc`` is linear in the values and
    the rotation its own inverse), so no decoded tile is ever rotated.
    """
    if K_ROTATE:
        q = hadamard(q.to(tl.float32)).to(DOT_DTYPE)
    if V_ROTATE:
        acc = hadamard(acc)
    for start in range(key_lo, key_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        valid = k_pos < key_hi
        block_id, tok = block_slots(table_ptr, k_pos, valid, BLOCK_SIZE)
        k = load_quantized_tile(
            k_codes, k_scales, k_zeros, table_ptr, start, key_hi, block_id, tok, valid,
            stride_kcode_block, stride_kcode_tok, stride_kmeta_block, stride_kmeta_tok,
            K_BITS, K_EXPONENT_BITS, K_ZERO_POINT, K_PER_TOKEN, K_GROUP, K_SCALE_BITS,
            BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_DTYPE,
        )  # fmt: skip
        v = load_quantized_tile(
            v_codes, v_scales, v_zeros, table_ptr, start, key_hi, block_id, tok, valid,
            stride_vcode_block, stride_vcode_tok, stride_vmeta_block, stride_vmeta_tok,
            V_BITS, V_EXPONENT_BITS, V_ZERO_POINT, V_PER_TOKEN, V_GROUP, V_SCALE_BITS,
            BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_DTYPE,
        )  # fmt: skip
        acc, m_i, l_i = online_softmax_step(
            acc, m_i, l_i, q, q_pos, k_pos, key_hi, k, v, scale, softcap, window, USE_SOFTCAP, DOT_DTYPE
        )
    if V_ROTATE:
        acc = hadamard(acc)
    return acc, m_i, l_i


@triton.jit
def attend_stored_keys(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    key_lo,
    key_hi,
    row,
    kv_head,
    k_cache,
    v_cache,
    block_tables,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_table,
    k_codes,
    k_scales,
    k_zeros,
    v_codes,
    v_scales,
    v_zeros,
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
    quant_tables,
    quant_lens,
    stride_quant_table,
    scale,
    softcap,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    K_BITS: tl.constexpr,
    K_EXPONENT_BITS: tl.constexpr,
    K_ZERO_POINT: tl.constexpr,
    K_PER_TOKEN: tl.constexpr,
    K_GROUP: tl.constexpr,
    K_SCALE_BITS: tl.constexpr,
    K_ROTATE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_EXPONENT_BITS: tl.constexpr,
    V_ZERO_POINT: tl.constexpr,
    V_PER_TOKEN: tl.constexpr,
    V_GROUP: tl.constexpr,
    V_SCALE_BITS: tl.constexpr,
    V_ROTATE: tl.constexpr,
):
    """Fold stored keys ``[key_lo, key_hi)`` of (row, kv_head) into the state: the kernels' one entry point;
    ``window`` holds each query row's window (``query_window``).

    Without QUANTIZED this is ``attend_key_range`` over the paged cache. With it, the row's first
    ``quant_lens[row]`` stored tokens come from the quantized pools (see ``quantized.py``), walked first,
    and the rest from the paged cache in its own index space ``s - quant_lens[row]``: queries and keys are
    shifted alike, which keeps every causal and sliding-window relation (and a query at -1 - quant_len,
    padding, still sees nothing). key_lo must be a multiple of BLOCK_N.
    """
    fp_table = block_tables + row * stride_table
    k_head = k_cache + kv_head * stride_kv_head
    v_head = v_cache + kv_head * stride_kv_head
    if QUANTIZED:
        quant_len = tl.load(quant_lens + row)
        acc, m_i, l_i = attend_quantized_range(
            acc, m_i, l_i, q, q_pos, key_lo, tl.minimum(key_hi, quant_len), quant_tables + row * stride_quant_table,
            k_codes + kv_head * stride_kcode_head, k_scales + kv_head * stride_kmeta_head,
            k_zeros + kv_head * stride_kmeta_head if K_ZERO_POINT else k_zeros,
            v_codes + kv_head * stride_vcode_head, v_scales + kv_head * stride_vmeta_head,
            v_zeros + kv_head * stride_vmeta_head if V_ZERO_POINT else v_zeros,
            stride_kcode_block, stride_kcode_tok, stride_kmeta_block, stride_kmeta_tok,
            stride_vcode_block, stride_vcode_tok, stride_vmeta_block, stride_vmeta_tok,
            scale, softcap, window, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, USE_SOFTCAP, DOT_DTYPE,
            K_BITS, K_EXPONENT_BITS, K_ZERO_POINT, K_PER_TOKEN, K_GROUP, K_SCALE_BITS, K_ROTATE,
            V_BITS, V_EXPONENT_BITS, V_ZERO_POINT, V_PER_TOKEN, V_GROUP, V_SCALE_BITS, V_ROTATE,
        )  # fmt: skip
        acc, m_i, l_i = attend_key_range(
            acc, m_i, l_i, q, q_pos - quant_len, tl.maximum(key_lo, quant_len) - quant_len, key_hi - quant_len,
            k_head, v_head, fp_table, stride_kv_block, stride_kv_tok, scale, softcap, window,
            BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, USE_SOFTCAP, DOT_DTYPE,
        )  # fmt: skip
    else:
        acc, m_i, l_i = attend_key_range(
            acc, m_i, l_i, q, q_pos, key_lo, key_hi, k_head, v_head, fp_table, stride_kv_block, stride_kv_tok,
            scale, softcap, window, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, USE_SOFTCAP, DOT_DTYPE,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def softmax_start(sinks, heads, rows, M: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The (running max, running sum) an online softmax of M query rows (query heads ``heads``) starts from.

    Without sinks: nothing seen (-inf, 0). With them: the head's sink logit already folded in as a key whose
    value is 0 (max = sink, sum = 1), so it adds to the denominator only. The sink is not a key: no causal or
    sliding-window mask applies to it. Rows outside ``rows`` (padding) start empty.
    """
    if HAS_SINKS:
        m_i = tl.load(sinks + heads, mask=rows, other=float("-inf"))
        l_i = tl.where(rows, 1.0, 0.0)
    else:
        m_i = tl.full([M], float("-inf"), dtype=tl.float32)
        l_i = tl.full([M], 0.0, dtype=tl.float32)
    return m_i, l_i


@triton.jit
def normalize(acc, l_i):
    """Final softmax normalisation; rows that saw no key (l == 0, acc == 0) come out as 0, never NaN."""
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
