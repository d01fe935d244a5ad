"""Sealing: full-precision cache blocks quantized into the quantized pools, K and V, in one launch.

When a block of history leaves the full-precision window, every layer quantizes it once (see
``hf_paged_cache.layers.quantized``). This kernel reads whole blocks straight from the paged cache and
writes codes, scales and zero points in the same pass -- nothing full-precision is gathered or copied.
One program owns one (block, KV head) and quantizes its ``[block_size, head_dim]`` keys with the key
format and its values with the value format (the K_* / V_* constexprs of ``quantized.format_constexprs``).

Exactness against ``fmt.quantize`` (``hf_paged_cache.quantization``), the reference:

* Scales and zero points are bit-identical. They are float16 rounded *outward* (scales up, zero points
  down): the float32 statistic is rounded to nearest, then stepped one float16 ulp outward when that
  landed on the wrong side -- torch's ``nextafter``, done here as +-1 on the float16 bit pattern.
  Every float32 operation before that is the same correctly rounded one (divisions use ``div_rn``: a
  plain ``/`` compiles to the approximate ``div.full.f32``).
* 8-bit scales (``SCALE_BITS`` 8): the unit is the largest exact scale / 255 rounded up to float16 as
  above, each scale ``ceil(exact / unit)`` with a correctly rounded division; the decoded scale
  ``steps * unit`` is exact in float32, so these are bit-identical too.
* Codes are then computed from the stored float16 metadata exactly as the reference does: correctly
  rounded division, round-half-to-even (by adding and subtracting 1.5 * 2**23, since libdevice's
  ``rint`` is unavailable in the interpreter), clamping; fp8 codes are rounded to nearest-even onto the
  fp8 grid by the same trick with a per-binade constant. Under the interpreter (IEEE float32 numpy) the
  codes are identical. On a GPU they are too unless the compiler contracts or reassociates an operation
  the reference rounds separately; the only observable effect would be a value within one float32 ulp
  of a rounding tie landing on its other side: one code apart, at most (the tests accept no more).

Metadata is written first; after a CTA barrier (which also orders global memory within the CTA) the
codes are computed plane by plane (the planar packing of ``pack_codes``) from the metadata read back,
so each channel uses exactly the stored float16 values whatever its group.

Rotated formats (``ROTATE``, ``IntN.rotate``): the tile is rotated in registers right after it is loaded,
by the butterfly of the reference (``dequantize.hadamard``: the same float32 operations in the same order,
so the rotated tile, and with it every metadata value and code, is the reference's). The rotated tile
exists nowhere else, so its codes are computed for all channels at once and folded into the planes,
instead of plane by plane from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hf_paged_cache.quantization import QuantFormat

from .launch import Launch, block_d, check_paged_kv
from .dequantize import hadamard
from .quantized import check_fields, side_args

_FP16_MAX = tl.constexpr(65504.0)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def round_half_even(x):
    """``torch.round`` of float32 ``x`` with |x| < 2**22: adding 1.5 * 2**23 leaves no fraction bits, so the
    addition itself rounds half to even; subtracting the constant back is exact."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def fp16_up(x):
    """The smallest float16 >= x, for 0 <= x (saturating at the float16 maximum), as float32."""
    x = tl.minimum(x, _FP16_MAX)
    half = x.to(tl.float16)  # round to nearest even
    bits = half.to(tl.int16, bitcast=True).to(tl.int32)
    bits = tl.where(half.to(tl.float32) < x, bits + 1, bits)  # next float16 up: positive, so bits + 1
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp16_down(x):
    """The largest float16 <= x (x clamped to the float16 range), as float32."""
    x = tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX)
    half = x.to(tl.float16)
    bits = half.to(tl.int16, bitcast=True).to(tl.int32)  # sign bit set: negative (or -0)
    # The next float16 down: smaller magnitude if positive, larger if negative; +0 goes to -2**-24 (0x8001).
    down = tl.where(bits > 0, bits - 1, tl.where(bits == 0, -32767, bits + 1))
    bits = tl.where(half.to(tl.float32) > x, down, bits)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp8_encode(y, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr):
    """float32 ``y`` (within the fp8 range) rounded to nearest-even fp8, as its uint8 bit pattern (in int32).

    |y| is rounded onto the fp8 grid by adding and subtracting step * 2**23, step being the fp8 spacing in
    |y|'s binade (or the subnormal spacing); the result, scaled by 2**(bias - 15), is exactly a float16
    whose bit fields give the fp8 ones (the inverse of ``dequantize.fp8_to_float``). The sign comes from
    y's bits, so -0.0 gives 0x80 as in torch.
    """
    BIAS: tl.constexpr = (1 << (EXPONENT_BITS - 1)) - 1
    MIN_STEP_EXP: tl.constexpr = 1 - BIAS - MANTISSA_BITS  # the subnormal spacing, 2**(1 - bias - mantissa)
    y_bits = y.to(tl.int32, bitcast=True)
    magnitude = tl.abs(y)
    exponent = ((y_bits >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exponent - MANTISSA_BITS, MIN_STEP_EXP)
    magic = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    half = (rounded * (1.0 / (1 << (15 - BIAS)))).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    code = (half >> (10 - MANTISSA_BITS)) & 0x7F
    return code | ((y_bits >> 24) & 0x80)


@triton.jit
def encode_codes(x, scale, zero, EXPONENT_BITS: tl.constexpr, ZERO_POINT: tl.constexpr, QMAX: tl.constexpr):
    """float32 ``x`` as codes (int32) given its stored float16 metadata, rounded as the reference rounds:
    the one place that writes an encoding (``hf_paged_cache.quantization.base.KernelFormat``)."""
    if ZERO_POINT:
        x = tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX)
        code = round_half_even(tl.math.div_rn(x - zero, scale))
        code = tl.minimum(tl.maximum(code, 0.0), QMAX).to(tl.int32)
    elif EXPONENT_BITS > 0:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        code = fp8_encode(y, EXPONENT_BITS, 7 - EXPONENT_BITS)  # float8: 1 sign bit
    else:
        code = round_half_even(tl.math.div_rn(x, scale))
        code = tl.minimum(tl.maximum(code, -QMAX), QMAX).to(tl.int32)
    return code


@triton.jit
def _reduce(x, axis: tl.constexpr, OP: tl.constexpr, keep_dims: tl.constexpr):
    """``x`` reduced over ``axis`` with OP "min" or "max" (own combine functions: see common.py)."""
    if OP == "min":
        out = tl.reduce(x, axis, _min_combine, keep_dims=keep_dims)
    else:
        out = tl.reduce(x, axis, _max_combine, keep_dims=keep_dims)
    return out


@triton.jit
def group_stat(x, OP: tl.constexpr, PER_TOKEN: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr):
    """Reduce ``x [BLOCK_SIZE, BLOCK_D]`` with OP ("min" / "max") over each group's channels (and over the
    tokens unless PER_TOKEN): ``[BLOCK_SIZE or 1, groups]`` (groups = 1, or BLOCK_D // GROUP of which the
    first NUM_GROUPS are real)."""
    if NUM_GROUPS == 1:
        stat = _reduce(x, 1, OP, True)
    else:
        stat = _reduce(tl.reshape(x, [x.shape[0], x.shape[1] // GROUP, GROUP]), 2, OP, False)
    if not PER_TOKEN:
        stat = _reduce(stat, 0, OP, True)
    return stat


@triton.jit
def stored_meta(
    scales_ptr,
    zeros_ptr,
    tok,
    channel,
    mask,
    stride_meta_tok,
    PER_TOKEN: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_BITS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    ZERO_POINT: tl.constexpr,
):
    """The stored (scale, zero point) of tokens ``tok [BLOCK_SIZE, 1]`` and channels ``channel [1, n]`` as
    float32, read back from the block's metadata; a zero scale reads as 1 (every code is then 0, as in torch)."""
    meta = (tok * stride_meta_tok if PER_TOKEN else 0) + channel // GROUP
    scale = tl.load(scales_ptr + meta, mask=mask, other=1).to(tl.float32)
    if SCALE_BITS == 8:
        scale = scale * tl.load(zeros_ptr + NUM_GROUPS).to(tl.float32)
    scale = tl.where(scale == 0.0, 1.0, scale)
    if ZERO_POINT:
        zero = tl.load(zeros_ptr + meta, mask=mask, other=0.0).to(tl.float32)
    else:
        zero = scale  # unused
    return scale, zero


@triton.jit
def quantize_tile(
    src_ptr,
    stride_src_tok,
    codes_ptr,
    scales_ptr,
    zeros_ptr,
    stride_code_tok,
    stride_meta_tok,
    BITS: tl.constexpr,
    EXPONENT_BITS: tl.constexpr,
    ZERO_POINT: tl.constexpr,
    QMAX: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    GROUP: tl.constexpr,
    SCALE_BITS: tl.constexpr,
    ROTATE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Quantize one block of one KV head: ``src_ptr`` -> its block's codes / scales (/ zeros) slices.

    BITS ... ROTATE: the format's constants (``quantized.format_constexprs``); with ROTATE the block is
    rotated (``dequantize.hadamard``) before its metadata and codes are computed."""
    NUM_GROUPS: tl.constexpr = HEAD_DIM // GROUP
    tok = tl.arange(0, BLOCK_SIZE)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = offs_d < HEAD_DIM
    x = tl.load(src_ptr + tok * stride_src_tok + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if ROTATE:  # head_dim == BLOCK_D, a power of two (quantized.format_constexprs)
        x = hadamard(x)

    # 1. Metadata, stored as the reference computes it: one value per (token or block, group).
    offs_g = tl.arange(0, 1 if NUM_GROUPS == 1 else BLOCK_D // GROUP)[None, :]
    meta_ptrs = (tok * stride_meta_tok if PER_TOKEN else 0) + offs_g
    meta_mask = (tok >= 0 if PER_TOKEN else offs_g >= 0) & (offs_g < NUM_GROUPS)
    if ZERO_POINT:  # codes 0 .. QMAX over [min, max]
        x = tl.minimum(tl.maximum(x, -_FP16_MAX), _FP16_MAX)
        low = group_stat(tl.where(d_mask, x, float("inf")), "min", PER_TOKEN, GROUP, NUM_GROUPS)
        high = group_stat(tl.where(d_mask, x, float("-inf")), "max", PER_TOKEN, GROUP, NUM_GROUPS)
        zero = fp16_down(low)
        exact = tl.math.div_rn(high - zero, QMAX)
        tl.store(zeros_ptr + meta_ptrs, zero.to(tl.float16), mask=meta_mask)
        if SCALE_BITS == 8:  # uint8 steps of a float16 unit (per block: meta_ptrs is offs_g), stored after the zeros
            unit = fp16_up(tl.math.div_rn(tl.max(tl.where(meta_mask, exact, 0.0), axis=1, keep_dims=True), 255.0))
            steps = tl.ceil(tl.math.div_rn(exact, tl.where(unit == 0.0, 1.0, unit)))
            tl.store(scales_ptr + meta_ptrs, tl.minimum(tl.maximum(steps, 0.0), 255.0).to(tl.uint8), mask=meta_mask)
            tl.store(zeros_ptr + NUM_GROUPS + offs_g, unit.to(tl.float16), mask=offs_g == 0)
            tl.store(scales_ptr + NUM_GROUPS + offs_g, tl.zeros_like(offs_g).to(tl.uint8), mask=offs_g == 0)
        else:
            tl.store(scales_ptr + meta_ptrs, fp16_up(exact).to(tl.float16), mask=meta_mask)
    else:  # codes -QMAX .. QMAX over [-absmax, absmax]
        absmax = group_stat(tl.where(d_mask, tl.abs(x), 0.0), "max", PER_TOKEN, GROUP, NUM_GROUPS)
        tl.store(scales_ptr + meta_ptrs, fp16_up(tl.math.div_rn(absmax, QMAX)).to(tl.float16), mask=meta_mask)
    tl.debug_barrier()  # the metadata just stored is read back below, by other threads

    # 2. Codes of the planar packing: byte j holds channels j, j + BYTES, ...
    PLANES: tl.constexpr = 8 // BITS
    BYTES: tl.constexpr = HEAD_DIM // PLANES
    if ROTATE:  # the rotated tile exists in registers only: every channel's code at once, then the planes folded
        scale, zero = stored_meta(scales_ptr, zeros_ptr, tok, offs_d, d_mask, stride_meta_tok, PER_TOKEN, GROUP,
                                  SCALE_BITS, NUM_GROUPS, ZERO_POINT)  # fmt: skip
        code = encode_codes(x, scale, zero, EXPONENT_BITS, ZERO_POINT, QMAX) & 0xFF
        shifts = (tl.arange(0, PLANES) * BITS)[None, :, None]
        packed = tl.sum(tl.reshape(code, [BLOCK_SIZE, PLANES, BYTES]) << shifts, axis=1)  # disjoint bits: sum == or
        offs_byte = tl.arange(0, BYTES)[None, :]
        tl.store(codes_ptr + tok * stride_code_tok + offs_byte, packed.to(codes_ptr.dtype.element_ty))
    else:  # one plane at a time, its channels loaded again from the cache
        byte_mask = offs_d < BYTES
        packed = tl.full([BLOCK_SIZE, BLOCK_D], 0, dtype=tl.int32)
        for plane in tl.static_range(PLANES):
            channel = plane * BYTES + offs_d
            xp = tl.load(src_ptr + tok * stride_src_tok + channel, mask=byte_mask, other=0.0).to(tl.float32)
            scale, zero = stored_meta(scales_ptr, zeros_ptr, tok, channel, byte_mask, stride_meta_tok, PER_TOKEN,
                                      GROUP, SCALE_BITS, NUM_GROUPS, ZERO_POINT)  # fmt: skip
            code = encode_codes(xp, scale, zero, EXPONENT_BITS, ZERO_POINT, QMAX)
            packed = packed | ((code & 0xFF) << (plane * BITS))
        tl.store(codes_ptr + tok * stride_code_tok + offs_d, packed.to(codes_ptr.dtype.element_ty), mask=byte_mask)


@triton.jit
def _quantize_blocks_kernel(
    k_cache,
    v_cache,
    src_blocks,
    dst_blocks,
    k_codes,
    k_scales,
    k_zeros,
    v_codes,
    v_scales,
    v_zeros,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
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
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
):
    """Grid (num_blocks, num_kv_heads): block ``src_blocks[i]`` of the cache -> ``dst_blocks[i]`` of the pools."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    src = tl.load(src_blocks + i).to(tl.int64) * stride_kv_block + head * stride_kv_head
    dst = tl.load(dst_blocks + i).to(tl.int64)
    k_meta = dst * stride_kmeta_block + head * stride_kmeta_head
    quantize_tile(
        k_cache + src, stride_kv_tok,
        k_codes + dst * stride_kcode_block + head * stride_kcode_head, k_scales + k_meta,
        k_zeros + k_meta if K_ZERO_POINT else k_zeros,
        stride_kcode_tok, stride_kmeta_tok,
        K_BITS, K_EXPONENT_BITS, K_ZERO_POINT, K_QMAX, K_PER_TOKEN, K_GROUP, K_SCALE_BITS, K_ROTATE,
        BLOCK_SIZE, HEAD_DIM, BLOCK_D,
    )  # fmt: skip
    v_meta = dst * stride_vmeta_block + head * stride_vmeta_head
    quantize_tile(
        v_cache + src, stride_kv_tok,
        v_codes + dst * stride_vcode_block + head * stride_vcode_head, v_scales + v_meta,
        v_zeros + v_meta if V_ZERO_POINT else v_zeros,
        stride_vcode_tok, stride_vmeta_tok,
        V_BITS, V_EXPONENT_BITS, V_ZERO_POINT, V_QMAX, V_PER_TOKEN, V_GROUP, V_SCALE_BITS, V_ROTATE,
        BLOCK_SIZE, HEAD_DIM, BLOCK_D,
    )  # fmt: skip


def _block_ids(ids, device) -> torch.Tensor:
    """Block ids as a 1-D tensor on ``device``: a tensor keeps its dtype, a (possibly empty) sequence is int64."""
    return torch.as_tensor(ids, dtype=None if isinstance(ids, torch.Tensor) else torch.int64, device=device).reshape(-1)


def plan_quantize_blocks(
    k_cache, v_cache, src_blocks, key_fields, value_fields, dst_blocks, key_format, value_format
) -> list[Launch]:
    """Validate inputs and describe the launch."""
    check_paged_kv(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_fields(key_format, key_fields, block_size, num_kv_heads, head_dim, "key")
    check_fields(value_format, value_fields, block_size, num_kv_heads, head_dim, "value")
    src, dst = _block_ids(src_blocks, k_cache.device), _block_ids(dst_blocks, k_cache.device)
    if src.shape != dst.shape or src.is_floating_point() or dst.is_floating_point():
        raise ValueError(f"src_blocks and dst_blocks must be integer ids of equal length, got {src} and {dst}")
    if src.numel() == 0:
        return []
    k_args, k_constexprs = side_args("k", key_format, key_fields, block_size, head_dim)
    v_args, v_constexprs = side_args("v", value_format, value_fields, block_size, head_dim)
    constexprs = dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), **k_constexprs)
    constexprs.update(v_constexprs)
    args = dict(
        k_cache=k_cache, v_cache=v_cache, src_blocks=src, dst_blocks=dst, **k_args, **v_args,
        stride_kv_block=k_cache.stride(0), stride_kv_tok=k_cache.stride(1), stride_kv_head=k_cache.stride(2),
    )  # fmt: skip
    # A program holds a [block_size, head_dim] float32 tile and its packed codes: 8 warps keep a 32 x 128
    # block spill-free.
    return [Launch(_quantize_blocks_kernel, (src.numel(), num_kv_heads), args, constexprs, num_warps=8, num_stages=1)]


def quantize_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_blocks: torch.Tensor | Sequence[int],
    key_fields: dict[str, torch.Tensor],
    value_fields: dict[str, torch.Tensor],
    dst_blocks: torch.Tensor | Sequence[int],
    key_format: QuantFormat,
    value_format: QuantFormat,
) -> None:
    """Quantize full-precision blocks ``src_blocks[i]`` of ``k_cache`` / ``v_cache`` into blocks
    ``dst_blocks[i]`` of the pools ``key_fields`` / ``value_fields`` (``fmt.allocate`` layout), in place.

    k/v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides, the same for both; contiguous
    head dim).
    Same result as ``key_format.quantize(k_cache[src_blocks], key_fields, dst_blocks)`` (and likewise for
    values): metadata bit-identical, codes identical (see the module docstring for the GPU caveat).
    """
    for launch in plan_quantize_blocks(
        k_cache, v_cache, src_blocks, key_fields, value_fields, dst_blocks, key_format, value_format
    ):
        launch.run()
