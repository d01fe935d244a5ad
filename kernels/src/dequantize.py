"""Reading quantized K/V inside the attention kernels: a tile of codes is loaded and dequantized in registers.

Nothing dequantized ever reaches memory: per tile of BLOCK_N tokens the kernel loads the codes (1, 1/2 or
1/4 byte per element) and the float16 scales / zero points, and hands ``tl.dot`` a ``[BLOCK_N, BLOCK_D]``
tile in the dot dtype -- the same tile shape the full-precision path loads, so the attention step after it
is shared code (``common.online_softmax_step``).

Packed codes (IntN, planar layout, see ``hf_paged_cache.quantization.packing.pack_codes``): channel d of a head is
in byte ``d % m`` at bit ``(d // m) * bits``, with ``m = head_dim * bits / 8`` bytes per token and head.
The loader reads byte ``d % m`` for every channel (each byte is read 8 / bits times, from L1; DRAM traffic
is unchanged) and shifts per column. Because planes are contiguous, a thread's run of adjacent channels is
a run of adjacent bytes, so these loads vectorize; no register de-interleaving is needed.

Metadata is loaded at its own granularity -- ``[tokens, groups]`` per token, ``[blocks of the tile, groups]``
per block -- and broadcast over the tile in the multiply (``apply_meta``), never gathered element by element.
8-bit scales (``SCALE_BITS`` 8) are multiplied by their block's float16 unit once, at that granularity.
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
def fp8_to_float(code, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr):
    """float8 bit patterns (uint8; exponent bias 2**(EXPONENT_BITS - 1) - 1) as float32, through float16 bit
    fields (exact, and on every GPU generation: native fp8 conversions need sm_89).

    The exponent and mantissa fields moved into a float16's (bias 15, 10 mantissa bits) read
    2**(15 - bias) too small, subnormals included, which one multiply undoes (e5m2 is exactly the high
    byte of a float16: the multiply is by 1). Infinities and NaNs never occur (codes are clamped to
    +-qmax when written).
    """
    BIAS: tl.constexpr = (1 << (EXPONENT_BITS - 1)) - 1
    bits = code.to(tl.uint16)
    half = ((bits & 0x7F) << (10 - MANTISSA_BITS)) | ((bits & 0x80) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * (1 << (15 - BIAS))


@triton.jit
def decode_codes(
    token_codes, mask, BITS: tl.constexpr, EXPONENT_BITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    """The codes of ``[BLOCK_N, BLOCK_D]`` channels as float32 numbers (before scale and zero point are
    applied): the one place that reads an encoding (``hf_paged_cache.quantization.base.KernelFormat``).

    ``token_codes`` points at each token's codes of the KV head (a ``[BLOCK_N, 1]`` column of pointers).
    """
    offs_d = tl.arange(0, BLOCK_D)
    if BITS < 8:  # unsigned, planar: channel d is in byte d % BYTES, at bit (d // BYTES) * BITS
        BYTES: tl.constexpr = HEAD_DIM * BITS // 8
        raw = tl.load(token_codes + (offs_d % BYTES)[None, :], mask=mask, other=0).to(tl.int32)
        x = small_int_to_float((raw >> ((offs_d // BYTES) * BITS)[None, :]) & ((1 << BITS) - 1))
    elif EXPONENT_BITS > 0:
        raw = tl.load(token_codes + offs_d[None, :], mask=mask, other=0)
        x = fp8_to_float(raw, EXPONENT_BITS, 7 - EXPONENT_BITS)  # float8: 1 sign bit
    else:  # whole bytes, signed or not as stored (int8 / uint8)
        x = small_int_to_float(tl.load(token_codes + offs_d[None, :], mask=mask, other=0).to(tl.int32))
    return x


@triton.jit
def hadamard(x):
    """``x [rows, D]`` (float32, D a power of two) times the normalized Hadamard matrix, which is its own
    inverse: ``hf_paged_cache.quantization.rotation.hadamard``'s butterfly -- log2(D) rounds of neighbour sums and
    differences, then one multiply -- with the same float32 operations in the same order, so the seal kernel
    rotates a block bit-identically to the reference. Readers rotate queries (keys of a ``ROTATE`` format)
    and the attention output (values) with it, never a decoded tile."""
    ROWS: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    for level in tl.static_range(16):  # log2(D) rounds (D < 2**16): pairs (a, b) of neighbours -> a + b | a - b
        if (1 << level) < D:
            a, b = tl.split(tl.reshape(x, [ROWS, D // 2, 2]))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [ROWS, D])
    return x * (D**-0.5)


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
    BITS: tl.constexpr,
    EXPONENT_BITS: tl.constexpr,
    ZERO_POINT: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_BITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_D]`` tile of one KV head's quantized keys or values, dequantized to DOT_DTYPE.

    The tile holds stored indices ``start + arange(BLOCK_N)``; those ``>= key_hi`` read as 0. ``block_id``
    (int64), ``tok`` and ``valid`` are each token's quantized block, offset in it, and ``< key_hi``.
    ``codes_ptr`` / ``scales_ptr`` / ``zeros_ptr`` point at the KV head's slice of the pool (zeros only with
    ZERO_POINT). BITS ... SCALE_BITS: the format's constants (``quantized.format_constexprs``). ``start`` must be
    a multiple of BLOCK_N: the tile is then NB whole blocks of TB tokens, or lies inside one block (NB = 1),
    and per-block metadata is read once per block of the tile.
    Dequantization runs in float32 (x = scale * code (+ zero)), rounded once to DOT_DTYPE.
    """
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    token_codes = codes_ptr + (block_id * stride_code_block + tok * stride_code_tok)[:, None]
    x = decode_codes(token_codes, mask, BITS, EXPONENT_BITS, HEAD_DIM, BLOCK_D)

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
    scale = tl.load(scales_ptr + meta_offs, mask=meta_mask, other=0).to(tl.float32)
    if SCALE_BITS == 8:  # uint8 steps of the float16 unit stored after the zero points (per block only)
        unit = tl.load(zeros_ptr + rows + NUM_GROUPS, mask=rows_valid, other=0.0).to(tl.float32)
        scale = scale * unit[:, None]  # exact: 8 x 11 significant bits
    if ZERO_POINT:
        zero = tl.load(zeros_ptr + meta_offs, mask=meta_mask, other=0.0).to(tl.float32)
    else:
        zero = scale  # unused
    x = apply_meta(x, scale, zero, BLOCK_N if PER_TOKEN else NB, 1 if PER_TOKEN else TB, GROUPS, ZERO_POINT)
    return x.to(DOT_DTYPE)
