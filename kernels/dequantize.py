"""Reading quantized K/V inside the attention kernels: a tile of codes is loaded and dequantized in registers.

Nothing dequantized ever reaches memory: per tile of BLOCK_N tokens the kernel loads the codes (1, 1/2 or
1/4 byte per element) and the float16 scales / zero points, and hands ``tl.dot`` a ``[BLOCK_N, BLOCK_D]``
tile in the dot dtype -- the same tile shape the full-precision path loads, so the attention step after it
is shared code (``common.online_softmax_step``).

Packed codes (IntN, planar layout, see ``hf_paged_cache.quantization.pack_codes``): channel d of a head is
in byte ``d % m`` at bit ``(d // m) * bits``, with ``m = head_dim * bits / 8`` bytes per token and head.
The loader reads byte ``d % m`` for every channel (each byte is read 8 / bits times, from L1; DRAM traffic
is unchanged) and shifts per column. Because planes are contiguous, a thread's run of adjacent channels is
a run of adjacent bytes, so these loads vectorize; no register de-interleaving is needed.

Metadata is loaded at its own granularity -- ``[tokens, groups]`` per token, ``[blocks of the tile, groups]``
per block -- and broadcast over the tile in the multiply (``apply_meta``), never gathered element by element.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def small_int_to_float(x):
    """int32 ``x`` with |x| < 2**22 as float32, exactly.

    1.5 * 2**23 + x has x in the low mantissa bits of a float32, so an integer add, a bit cast and a float
    subtract convert it: full-rate ALU work, where an int-to-float conversion runs at a quarter of that
    rate and would bound how fast decode can dequantize.
    """
    return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def fp8_to_float(code, KIND: tl.constexpr):
    """float8 bit patterns (uint8) as float32, through float16 bit fields (exact, and on every GPU
    generation: native fp8 conversions need sm_89).

    e5m2 is the high byte of a float16. e4m3 (exponent bias 7, no infinities) moved into a float16's
    exponent and mantissa fields (bias 15) reads 2**8 too small, subnormals included; its NaN patterns
    never occur (codes are clamped to +-448 when written).
    """
    bits = code.to(tl.uint16)
    if KIND == "e5m2":
        value = (bits << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        tl.static_assert(KIND == "e4m3", "unknown fp8 kind")
        half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
        value = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return value


@triton.jit
def apply_meta(x, scale, zero, ROWS: tl.constexpr, REPEAT: tl.constexpr, GROUPS: tl.constexpr, HAS_ZERO: tl.constexpr):
    """``x [ROWS * REPEAT, BLOCK_D] * scale (+ zero)`` with scale / zero ``[ROWS, GROUPS]``: row r of the
    metadata covers REPEAT consecutive tokens (a block's), group g covers BLOCK_D // GROUPS consecutive
    channels. The tile is viewed as ``[ROWS, REPEAT, GROUPS, channels]`` so that the metadata broadcasts
    in the multiply instead of being expanded to a full tile of registers."""
    if REPEAT * GROUPS == 1:  # one value per token: a [BLOCK_N, 1] column broadcasts as it is
        y = x * scale
        if HAS_ZERO:
            y += zero
    else:
        x4 = tl.reshape(x, [ROWS, REPEAT, GROUPS, x.shape[1] // GROUPS])
        y = x4 * scale[:, None, :, None]
        if HAS_ZERO:
            y += zero[:, None, :, None]
        y = tl.reshape(y, [ROWS * REPEAT, x.shape[1]])
    return y


@triton.jit
def load_quantized_tile(
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    table_ptr,
    start,
    key_hi,
    block_id,
    tok,
    valid,
    stride_code_block,
    stride_code_tok,
    stride_meta_block,
    stride_meta_tok,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_D]`` tile of one KV head's quantized keys or values, dequantized to DOT_DTYPE.

    The tile holds stored indices ``start + arange(BLOCK_N)``; those ``>= key_hi`` read as 0. ``block_id``
    (int64), ``tok`` and ``valid`` are each token's quantized block, offset in it, and ``< key_hi``.
    ``codes_ptr`` / ``scales_ptr`` / ``zeros_ptr`` point at the KV head's slice of the pool (zeros only for
    KIND "uint"). ``start`` must be a multiple of BLOCK_N: the tile is then NB whole blocks of TB tokens,
    or lies inside one block (NB = 1), and per-block metadata is read once per block of the tile.
    Dequantization runs in float32 (x = scale * code (+ zero)), rounded once to DOT_DTYPE.
    """
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    token_codes = codes_ptr + (block_id * stride_code_block + tok * stride_code_tok)[:, None]
    if KIND == "uint":
        BYTES: tl.constexpr = HEAD_DIM * BITS // 8  # planar: channel d is in byte d % BYTES, plane d // BYTES
        raw = tl.load(token_codes + (offs_d % BYTES)[None, :], mask=mask, other=0).to(tl.int32)
        x = small_int_to_float((raw >> ((offs_d // BYTES) * BITS)[None, :]) & ((1 << BITS) - 1))
    elif KIND == "int8":
        x = small_int_to_float(tl.load(token_codes + offs_d[None, :], mask=mask, other=0).to(tl.int32))
    else:
        x = fp8_to_float(tl.load(token_codes + offs_d[None, :], mask=mask, other=0), KIND)

    # Metadata rows: one per token, or one per block of the tile; GROUPS values per row (the last
    # GROUPS - NUM_GROUPS pad a head_dim that is not a power of two).
    NUM_GROUPS: tl.constexpr = HEAD_DIM // GROUP
    GROUPS: tl.constexpr = BLOCK_D // GROUP if NUM_GROUPS > 1 else 1
    TB: tl.constexpr = BLOCK_N if BLOCK_N < BLOCK_SIZE else BLOCK_SIZE
    NB: tl.constexpr = BLOCK_N // TB
    if PER_TOKEN:
        rows = block_id * stride_meta_block + tok * stride_meta_tok
        rows_valid = valid
    else:
        block_start = start + tl.arange(0, NB) * TB
        rows_valid = block_start < key_hi
        rows = tl.load(table_ptr + block_start // BLOCK_SIZE, mask=rows_valid, other=0).to(tl.int64)
        rows = rows * stride_meta_block
    offs_g = tl.arange(0, GROUPS)
    meta_offs = rows[:, None] + offs_g[None, :]
    meta_mask = rows_valid[:, None] & (offs_g < NUM_GROUPS)[None, :]
    scale = tl.load(scales_ptr + meta_offs, mask=meta_mask, other=0.0).to(tl.float32)
    if KIND == "uint":
        zero = tl.load(zeros_ptr + meta_offs, mask=meta_mask, other=0.0).to(tl.float32)
    else:
        zero = scale  # unused
    x = apply_meta(x, scale, zero, BLOCK_N if PER_TOKEN else NB, 1 if PER_TOKEN else TB, GROUPS, KIND == "uint")
    return x.to(DOT_DTYPE)
