"""Quantized storage formats for KV-cache blocks: codes + scales (+ zero points), block by block.

Why these formats (KIVI, Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache"):
- Keys have a few *outlier channels* whose magnitude is large for every token. Quantizing a key per token
  lets that one channel set the scale of the whole token, crushing the other channels to a few codes;
  quantizing per channel (over the tokens of a group) gives the outlier channel its own scale.
- Values show no such channel structure, and the attention output is a per-token weighted sum of value
  rows, so per-token quantization keeps each token's error local to that token.
- A per-channel group needs all of its tokens first. Here the group is one cache block: a key block is
  quantized once it is full, and the partially filled last block stays in full precision until then
  (KIVI's full-precision "residual" window). Keeping that window is the storage layer's job.

transformers' `QuantizedCache` (quanto / HQQ) re-quantizes a growing residual in chunks; vLLM's fp8 KV
cache stores e4m3/e5m2 with a scale. Here quantization happens exactly once, when a token (per-token
formats) or a full block (per-block formats) is written; history is never re-quantized.

Storage. Each format describes the storage of ONE block as named fields, `fields(block_size, kv_heads,
head_dim) -> {name: (shape, dtype)}`. A pool of `num_blocks` blocks holds, per field, a tensor
`[num_blocks, *shape]` (see `allocate`). All-zero fields dequantize to exact zeros, so a zero-filled
null block stays zero. Field names are "codes", "scale" and, for asymmetric formats, "zero".

Writes (`quantize(x, out, blocks, offsets=None)`) are one vectorized call either way:
- whole blocks: `x` is `[n, block_size, kv_heads, head_dim]`, `blocks` holds n block ids;
- single tokens (per-token formats only, `needs_full_block` False): `x` is `[T, kv_heads, head_dim]`
  and token t goes to slot `offsets[t]` of block `blocks[t]`.
Per-token formats encode every token independently, so writing a block token by token gives exactly the
codes of writing it whole. Reads (`dequantize(fields, blocks, dtype)`) return
`[len(blocks), block_size, kv_heads, head_dim]`. `kernel_format(block_size, head_dim)` tells the Triton
kernels how the codes are encoded (a `KernelFormat`), so they read and write the format without naming it.

Metadata precision. Scales and zero points are float16. Each is rounded *outward* before the codes are
computed (scales up, zero points down), so the stored grid always covers the data and the round-trip
error stays within half a step of the stored scale, which is at most 2**-10 (relative) larger than the
exact one. On SmolLM2-135M's K/V (all 30 layers, 1024 tokens), float32 metadata changed the
attention-output error of every format by < 1% of itself (e.g. int4 keys 0.1287 vs 0.1299), while
costing +2 bytes per scale (int4 would go from 0.281x to 0.313x). The one cost: an asymmetric group's
zero point may sit up to one float16 ulp below the group minimum, widening its range by that much
(negligible unless |min| is ~1000x the group's range). Asymmetric formats clamp inputs to the float16
range (+-65504); symmetric scales saturate at 65504 (|x| > 127 * 65504 for int8). Inputs must be finite.

Bytes per token per KV head vs float16 (2 * head_dim bytes) at head_dim 64, block 16 (block 32):
    Int8()                              (64 + 2) / 128          = 0.516x  (0.516x)
    FP8() per token                     (64 + 2) / 128          = 0.516x  (0.516x)
    FP8(granularity="head")             (64 + 2/16) / 128       = 0.501x  (0.500x)
    IntN(4, "token") values, g=64       (32 + 4) / 128          = 0.281x  (0.281x)
    IntN(4, "channel") keys, default    (32 + 4*64/4/16) / 128  = 0.281x  (0.281x: c=2)
    IntN(4, "channel", 1) strict        (32 + 4*64/16) / 128    = 0.375x  (0.313x)
    IntN(2, "token") values, g=64       (16 + 4) / 128          = 0.156x  (0.156x)
    IntN(2, "channel") keys, default    (16 + 4) / 128          = 0.156x  (0.156x: c=2)
    IntN(4, "channel", 1, scale_bits=8)  (32 + 3*65/16) / 128   = 0.345x  (0.298x)
    IntN(2, "channel", 1, scale_bits=8)  (16 + 3*65/16) / 128   = 0.220x  (0.173x)
A float16 (scale, zero) pair per 64 elements (1/32 of float16) is what the 0.28x (int4) / 0.16x (int2)
budgets allow, so that is the IntN default: value groups of 64 channels of one token, key groups of
ceil(64 / block_size) channels over the block's tokens (4 at block 16, 2 at 32, strict per-channel from
64). Strict per-channel keys cost 4 * head_dim bytes per block: 16 bytes per token at block 16.

The specs "int4", "int2" and K<b>V<b> nevertheless quantize keys strictly per channel, with 8-bit scales
(a uint8 number of steps of a float16 unit per block and KV head, `IntN.scale_bits`): on SmolLM2-135M a
scale shared by even 2 adjacent key channels costs 2-bit keys +134% perplexity against +16% for one per
channel (eval/quant_probe.py), and through the cache int2 went from +164% to +10.7%, int4 from +0.97% to
+0.44% (docs/BENCHMARKS.md). Keys + values at head dim 64: int2 0.188x at block 16 (0.164x at 32), int4
0.313x (0.289x at 32, 0.277x at 64).

"int2" also rotates its values by a fixed Hadamard matrix (`IntN.rotate`, spec "K2V2r"): at the same bytes
that took int2 from +10.7% to +5.8%, and its pass-key retrieval from 5/6 and 4/6 to 6/6 and 5/6 (question
with the context / read token by token). Rotating the per-channel keys too ("K2rV2r") read +4.5% but kept
only 1 pass key of 6 read token by token, so keys are not rotated by default.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

__all__ = [
    "FP8",
    "FieldSpec",
    "Int8",
    "IntN",
    "KVFormat",
    "KernelFormat",
    "QuantFormat",
    "hadamard",
    "pack_codes",
    "parse_kv_format",
    "rotate_heads",
    "unpack_codes",
]

FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]
BlockIds = Union[Tensor, Sequence[int]]

_FP16_MAX = torch.finfo(torch.float16).max
_META_DTYPE = torch.float16  # dtype of every scale and zero point (but 8-bit scales, see `IntN.scale_bits`)
_SCALE_STEPS = 255  # the largest 8-bit scale, in units


# --------------------------------------------------------------------------------------------------
# Shared helpers: code packing, outward float16 rounding, safe division.
# --------------------------------------------------------------------------------------------------


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack unsigned `bits`-bit codes (values < 2**bits) along the last dim, 8 // bits codes per uint8.

    Planar layout: with n codes packed into m = n * bits / 8 bytes, byte i holds code i + k * m in bits
    [k * bits, (k + 1) * bits), for k = 0 .. 8 // bits - 1 (the first m codes in the low bits). So
    unpacking writes each of the 8 // bits slices of the output contiguously (a fast copy on CPU) and a
    kernel splits a head into 8 // bits contiguous parts instead of de-interleaving registers.
    The last dim must be a multiple of 8 // bits.
    """
    per_byte = 8 // bits if bits in (1, 2, 4, 8) else 0
    if not per_byte or codes.shape[-1] % per_byte:
        raise ValueError(f"cannot pack {codes.shape[-1]} {bits}-bit codes into whole bytes")
    planes = codes.to(torch.uint8).unflatten(-1, (per_byte, -1))  # [..., per_byte, m]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)[:, None]
    return (planes << shifts).sum(-2, dtype=torch.uint8)  # the shifted codes share no bits: sum == or


def unpack_codes(packed: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """Inverse of `pack_codes`: uint8 `[..., m]` -> uint8 codes `[..., m * 8 // bits]`, or written into
    `out` (any dtype and strides, converted in the same pass): one scalar shift and mask per plane."""
    per_byte, m = 8 // bits, packed.shape[-1]
    if out is None:
        out = packed.new_empty((*packed.shape[:-1], m * per_byte))
    mask = (1 << bits) - 1
    for k in range(per_byte):
        out[..., k * m : (k + 1) * m] = (packed >> (k * bits)) & mask if k else packed & mask
    return out


def hadamard(x: Tensor) -> Tensor:
    """`x` times the normalized Hadamard matrix (Sylvester's, divided by sqrt(d)) along its last dim d, a power
    of two: symmetric and orthogonal, so it is its own inverse and `hadamard(q) . hadamard(k) == q . k`.

    A butterfly of log2(d) rounds of neighbour sums and differences (then one multiply), the same float32
    operations in the same order as the seal kernel's (`kernels.dequantize.hadamard`), so both rotate a
    block bit-identically before quantizing it.
    """
    d = x.shape[-1]
    for _ in range(d.bit_length() - 1):  # after log2(d) rounds of (a + b, a - b), Sylvester's ordering
        a, b = x.unflatten(-1, (d // 2, 2)).unbind(-1)
        x = torch.cat([a + b, a - b], -1)
    return x * d**-0.5  # the float32 of the same double as the kernel's constant


@functools.lru_cache(maxsize=None)
def _hadamard_matrix(d: int, device: torch.device) -> Tensor:
    """The float32 `[d, d]` matrix of `hadamard`: one matmul rotates many vectors."""
    return hadamard(torch.eye(d, device=device))


def rotate_heads(x: Tensor) -> Tensor:
    """`hadamard` of float32 `x [..., head_dim]` as one matmul (rotating, or rotating back: the same), keeping
    a head-major layout head-major (`[n, block, heads, d]` viewed from a contiguous `[heads, n, block, d]`)."""
    matrix = _hadamard_matrix(x.shape[-1], x.device)
    if x.dim() == 4 and x.permute(2, 0, 1, 3).is_contiguous():
        return (x.permute(2, 0, 1, 3) @ matrix).permute(1, 2, 0, 3)
    return x @ matrix


def _head_major_float(codes: Tensor, head_dim: int) -> Tensor:
    """An uninitialised float32 `[n, block, heads, head_dim]` laid out head-major in memory (a permuted
    view of `[heads, n, block, head_dim]`), so that each head's decoded tokens are contiguous for the
    attention matmuls that read them."""
    n, block, heads = codes.shape[:3]
    return torch.empty((heads, n, block, head_dim), dtype=torch.float32, device=codes.device).permute(1, 2, 0, 3)


def _fp16_up(x: Tensor) -> Tensor:
    """The smallest float16 >= x for x >= 0 (saturating at the float16 max)."""
    x = x.clamp(max=_FP16_MAX)
    h = x.to(_META_DTYPE)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def _fp16_down(x: Tensor) -> Tensor:
    """The largest float16 <= x (for x within the float16 range)."""
    h = x.clamp(-_FP16_MAX, _FP16_MAX).to(_META_DTYPE)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def _nonzero(scale: Tensor) -> Tensor:
    """`scale` as float32 with zeros replaced by 1: a zero scale means every code is 0 (exact zeros)."""
    scale = scale.float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _affine_encode(
    x: Tensor, dims: tuple[int, ...], bits: int, unit_dims: tuple[int, ...] | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Asymmetric `bits`-bit codes of float32 `x`, one (scale, zero) per slice reduced over `dims`.

    x ~= zero + scale * code, code in [0, 2**bits - 1]; zero is the slice minimum rounded down to
    float16 and scale covers [zero, max] rounded up, so |error| <= scale / 2. Scale and zero keep the
    reduced dims (size 1) for broadcasting.

    With `unit_dims`, scales are stored in 8 bits: `steps` (uint8) times a float16 `unit` shared over
    `unit_dims` (the largest scale / 255, rounded up), `steps` = ceil(exact scale / unit). The product is
    exact in float32 (8 x 11 significant bits), so any implementation decodes the same scale. Returns
    (codes, scale, zero, unit): `scale` is then the uint8 steps and `unit` the float16 unit, else None.
    """
    levels = (1 << bits) - 1
    x = x.clamp(-_FP16_MAX, _FP16_MAX)
    zero = _fp16_down(x.amin(dim=dims, keepdim=True))
    exact = (x.amax(dim=dims, keepdim=True) - zero.float()) / levels
    if unit_dims is None:
        scale, unit = _fp16_up(exact), None
        value = scale.float()
    else:
        unit = _fp16_up(exact.amax(dim=unit_dims, keepdim=True) / _SCALE_STEPS)
        scale = torch.ceil(exact / _nonzero(unit)).clamp_(0, _SCALE_STEPS).to(torch.uint8)
        value = scale.float() * unit.float()
    codes = torch.round((x - zero.float()) / _nonzero(value)).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero, unit


def _absmax_scale(x: Tensor, dims: tuple[int, ...], qmax: float) -> Tensor:
    """float16 scale = absmax / qmax over `dims` (kept), rounded up so |x| / scale <= qmax."""
    return _fp16_up(x.abs().amax(dim=dims, keepdim=True) / qmax)


def _as_ids(ids: BlockIds, device: torch.device) -> Tensor:
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)


@dataclass(frozen=True)
class KernelFormat:
    """A format's blocks as the Triton kernels (`hf_paged_cache.kernels`) read and write them.

    The kernels know *encodings*, not format classes: they compile one variant per `KernelFormat` and
    branch only on these fields, so a new format whose codes use an encoding below runs in them as it
    is -- its class returns its `KernelFormat` from `kernel_format`, and no kernel code changes.

    - Integer codes with a `zero_point`: x = zero + scale * code, unsigned codes in [0, qmax] (a "zero"
      field holds the zero points), `bits` 8 (uint8) or 2 / 4, packed planar into uint8 (`pack_codes`).
    - Integer codes without (`exponent_bits` 0): x = scale * code, int8 codes in [-qmax, qmax].
    - float8 codes (`exponent_bits` e > 0, 7 - e mantissa bits, exponent bias 2**(e - 1) - 1, as in
      e4m3fn / e5m2): their uint8 bit patterns, x = scale * code; `qmax` is the largest finite value.

    Metadata is float16: one scale (and zero point) per `group` adjacent channels of a KV head, per
    token (`per_token`) or per block (then shared by all of the block's tokens). `scale_bits` 8 (integer
    codes with a zero point, per block only): scales are uint8 numbers of steps of a float16 unit stored
    after the KV head's zero points (the zero field holds groups + 1 values, see `IntN`).
    `rotate`: the codes encode each token's head vector times the normalized Hadamard matrix
    (`hadamard`; head_dim a power of two), which readers undo (see `IntN.rotate`).
    """

    bits: int
    exponent_bits: int
    zero_point: bool
    qmax: float
    per_token: bool
    group: int
    scale_bits: int = 16
    rotate: bool = False


# --------------------------------------------------------------------------------------------------
# The interface every format implements.
# --------------------------------------------------------------------------------------------------


class QuantFormat:
    """Storage layout + encode / decode of one K or V block. Subclasses implement `fields`, `_encode`,
    `_decode` and `kernel_format`; this class does the byte accounting and the vectorized block / token
    indexing.

    `_encode` maps float32 `[..., block_size, kv_heads, head_dim]` (whole blocks) or, for per-token
    formats, `[..., kv_heads, head_dim]` to the field values with the same leading dims; `_decode`
    maps the fields of n blocks back to float32 `[n, block_size, kv_heads, head_dim]`.
    """

    needs_full_block: bool = False
    rotate: bool = False  # codes encode head vectors times the normalized Hadamard matrix (see `IntN.rotate`)

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> FieldSpec:
        raise NotImplementedError

    def kernel_format(self, block_size: int, head_dim: int) -> KernelFormat:
        """How the Triton kernels read and write this format's blocks of this size (see `KernelFormat`)."""
        raise NotImplementedError

    def bytes_per_block(self, block_size: int, kv_heads: int, head_dim: int) -> int:
        """Exact bytes of one block: the sum over fields of elements x element size."""
        spec = self.fields(block_size, kv_heads, head_dim)
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec.values())

    def bytes_per_token(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """`bytes_per_block / block_size`: per-block metadata amortized over the block's tokens."""
        return self.bytes_per_block(block_size, kv_heads, head_dim) / block_size

    def ratio_to_fp16(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """`bytes_per_token` relative to float16 storage (2 bytes per element)."""
        return self.bytes_per_token(kv_heads, head_dim, block_size) / (2 * kv_heads * head_dim)

    def allocate(
        self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, device=None
    ) -> dict[str, Tensor]:
        """Zero-filled pool tensors `[num_blocks, *shape]` per field (zeros dequantize to zeros)."""
        return {
            name: torch.zeros((num_blocks, *shape), dtype=dtype, device=device)
            for name, (shape, dtype) in self.fields(block_size, kv_heads, head_dim).items()
        }

    @torch.no_grad()
    def quantize(self, x: Tensor, out: dict[str, Tensor], blocks: BlockIds, offsets: BlockIds | None = None) -> None:
        """Write the codes of `x` into the pool tensors `out[name]` (one vectorized index_put per field).

        - `offsets is None`: `x` is `[n, block_size, kv_heads, head_dim]`, whole blocks `blocks[i]`;
        - otherwise (per-token formats only): `x` is `[T, kv_heads, head_dim]`, token t goes to slot
          `offsets[t]` of block `blocks[t]`. Duplicate (block, offset) pairs leave one of them unspecified.
        `x` may be float32, float16 or bfloat16; encoding runs in float32.
        """
        device = next(iter(out.values())).device
        blocks = _as_ids(blocks, device)
        if offsets is None:
            if x.dim() != 4 or x.shape[0] != blocks.numel():
                raise ValueError(
                    f"whole-block writes take x of shape [len(blocks)={blocks.numel()}, block_size, kv_heads, "
                    f"head_dim], got {tuple(x.shape)}"
                )
            index: tuple[Tensor, ...] = (blocks,)
        else:
            if self.needs_full_block:
                raise ValueError(f"{self!r} quantizes whole blocks only; write full blocks with offsets=None")
            offsets = _as_ids(offsets, device)
            if x.dim() != 3 or not x.shape[0] == blocks.numel() == offsets.numel():
                raise ValueError(
                    f"token writes take x [T, kv_heads, head_dim] with T = len(blocks) = len(offsets); got x "
                    f"{tuple(x.shape)}, {blocks.numel()} blocks, {offsets.numel()} offsets"
                )
            index = (blocks, offsets)
        block_size = out["codes"].shape[1]
        if offsets is None and x.shape[1] != block_size:
            raise ValueError(f"x has {x.shape[1]} tokens per block but the pool's blocks hold {block_size}")
        for name, (shape, dtype) in self.fields(block_size, x.shape[-2], x.shape[-1]).items():
            if name not in out or out[name].shape[1:] != shape or out[name].dtype != dtype:
                raise ValueError(
                    f"pool field {name!r} must be [num_blocks, *{shape}] of {dtype} for x {tuple(x.shape)} with "
                    f"{self!r}, got {None if name not in out else (tuple(out[name].shape), out[name].dtype)}"
                )
        for name, value in self._encode(x.float()).items():
            out[name].index_put_(index, value.to(device))

    @torch.no_grad()
    def dequantize(
        self,
        fields: dict[str, Tensor],
        blocks: BlockIds | slice,
        dtype: torch.dtype = torch.float32,
        rotated: bool = False,
    ) -> Tensor:
        """Blocks `blocks` (ids, or a slice of consecutive ids) of the pool `fields`, decoded:
        `[number of blocks, block_size, kv_heads, head_dim]`. A rotated format's vectors are rotated back,
        unless `rotated` (a reader that rotates its queries and outputs instead takes them as stored)."""
        if not isinstance(blocks, slice):  # a slice reads views of the pool; ids gather copies
            blocks = _as_ids(blocks, next(iter(fields.values())).device)
        decoded = self._decode({name: tensor[blocks] for name, tensor in fields.items()})
        if self.rotate and not rotated:
            decoded = rotate_heads(decoded)
        return decoded.to(dtype)

    def _encode(self, x: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def _decode(self, fields: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# The formats.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int8(QuantFormat):
    """Symmetric int8, one float16 scale per token per KV head: scale = absmax / 127, x ~= scale * code.

    Per token, so tokens can be quantized as they are written. |error| <= scale / 2 (scale rounded up
    to float16, i.e. <= absmax / 127 / 2 * (1 + 2**-10)).
    Fields per block: codes int8 [block, heads, head_dim], scale float16 [block, heads].
    Cost vs float16, head_dim 64 (any block size): (64 + 2) / 128 = 0.516x.
    """

    QMAX = 127

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> FieldSpec:
        return {
            "codes": ((block_size, kv_heads, head_dim), torch.int8),
            "scale": ((block_size, kv_heads), _META_DTYPE),
        }

    def kernel_format(self, block_size: int, head_dim: int) -> KernelFormat:
        return KernelFormat(
            bits=8, exponent_bits=0, zero_point=False, qmax=float(self.QMAX), per_token=True, group=head_dim
        )

    def _encode(self, x: Tensor) -> dict[str, Tensor]:
        scale = _absmax_scale(x, (-1,), float(self.QMAX))
        codes = torch.round(x / _nonzero(scale)).clamp_(-self.QMAX, self.QMAX).to(torch.int8)
        return {"codes": codes, "scale": scale.squeeze(-1)}

    def _decode(self, fields: dict[str, Tensor]) -> Tensor:
        codes = fields["codes"]
        out = _head_major_float(codes, codes.shape[-1]).copy_(codes)
        return out.mul_(fields["scale"].float().unsqueeze(-1))


@dataclass(frozen=True)
class IntN(QuantFormat):
    """Asymmetric `bits`-bit integers (2 or 4), x ~= zero + scale * code, codes packed 8 // bits per uint8
    along head_dim (planar, see `pack_codes`); float16 scale and zero per group. |error| <= scale / 2 per group,
    scale = (max - zero) / (2**bits - 1) rounded up, zero = group min rounded down to float16.

    `axis="token"` (KIVI values): one (scale, zero) per (token, KV head, `group_size` adjacent channels).
    Per token: tokens can be quantized as they are written.
    `axis="channel"` (KIVI keys): one (scale, zero) per (KV head, `group_size` adjacent channels) over all
    tokens of a block. Needs the full block. `group_size=1` is KIVI's strict per-channel.

    `scale_bits=8` ("channel" only): each scale is a uint8 number of steps of a float16 unit shared by the
    KV head's groups in the block (the largest scale / 255, rounded up), so a strict per-channel key costs
    3 bytes of metadata per channel and block instead of 4, plus the unit. Zero points stay float16: they
    carry the channels' offsets, which 8 bits would blur. The unit is stored after the zero points, in
    `zero[..., groups]` (`scale[..., groups]` is then unused), so both fields share their strides.
    Rounding the scale up to a whole step costs at most one step (<= 1/255 of the largest scale).

    `rotate=True`: each token's head vector is rotated by the normalized Hadamard matrix (`hadamard`) before
    it is quantized, and decoded vectors are rotated back by the same (self-inverse) matrix. The rotation
    spreads an outlier channel's energy over all channels, so a token's values share one range without
    one channel setting it; it is fixed, so it stores nothing. Codes, scales and zero points describe the
    rotated vectors (readers that know it, like the Triton kernels, may rotate queries and attention
    outputs instead of every decoded token). head_dim must be a power of two. A rotated value can be up to
    sqrt(head_dim) times the largest input; beyond the float16 range it is clamped like any input.

    Default `group_size` (None): the fewest channels, dividing head_dim, such that one (scale, zero) pair
    covers at least `ELEMENTS_PER_SCALE` = 64 elements, so metadata costs at most 1/32 of float16:
    "token": 64 channels (head_dim if smaller); "channel": ceil(64 / block_size) channels, i.e. 4 at
    block 16, 2 at block 32, 1 (strict per-channel) from block 64 on. On SmolLM2-135M keys at block 16,
    channel groups of 4 double the attention-output error of strict per-channel (int4: 0.13 vs 0.054)
    but cost 0.281x instead of 0.375x; per-token keys at the same cost are worse still (0.21).

    Fields per block: codes uint8 [block, heads, head_dim * bits / 8]; scale, zero float16
    [block, heads, head_dim / group] ("token") or [heads, head_dim / group] ("channel"); with 8-bit
    scales, scale uint8 and zero float16 [heads, head_dim / group + 1].
    Cost vs float16, head_dim 64, block 16 (per token: codes + 4 bytes per (scale, zero) pair):
      token, default g=64: int4 (32 + 4) / 128 = 0.281x, int2 (16 + 4) / 128 = 0.156x
      token g=32:          int4 (32 + 8) / 128 = 0.313x, int2 (16 + 8) / 128 = 0.188x
      channel, default c=4: int4 (32 + 4 * 16 / 16) / 128 = 0.281x, int2 0.156x  (block 32, c=2: same)
      channel c=1:          int4 (32 + 4 * 64 / 16) / 128 = 0.375x, int2 0.250x  (block 32: 0.313x, 0.188x)
      channel c=1, 8-bit scales: int2 (16 + 3 * 65 / 16) / 128 = 0.220x  (block 32: 0.173x, 64: 0.149x)
    """

    ELEMENTS_PER_SCALE = 64

    bits: int = 4
    axis: str = "token"
    group_size: int | None = None
    scale_bits: int = 16
    rotate: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"IntN supports bits 2 or 4 (use Int8 for 8 bits), got {self.bits!r}")
        if self.axis not in ("token", "channel"):
            raise ValueError(f"IntN axis must be 'token' or 'channel', got {self.axis!r}")
        if self.group_size is not None and (
            isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1
        ):
            raise ValueError(f"IntN group_size must be a positive int or None, got {self.group_size!r}")
        if self.scale_bits not in (8, 16) or (self.scale_bits == 8 and self.axis != "channel"):
            raise ValueError(
                f"IntN scale_bits must be 16, or 8 with axis='channel' (one unit per block and KV head), got "
                f"{self.scale_bits!r} with axis={self.axis!r}"
            )
        if not isinstance(self.rotate, bool):
            raise ValueError(f"IntN rotate must be a bool, got {self.rotate!r}")

    @property
    def needs_full_block(self) -> bool:  # type: ignore[override]
        return self.axis == "channel"

    def group(self, head_dim: int, block_size: int) -> int:
        """Channels per (scale, zero) for this head_dim and block size (see the class docstring)."""
        if head_dim % (8 // self.bits):
            raise ValueError(f"head_dim {head_dim} must be a multiple of {8 // self.bits} to pack {self.bits}-bit codes")
        if self.rotate and head_dim & (head_dim - 1):
            raise ValueError(
                f"{self!r}: rotate=True needs a power-of-two head_dim (a Hadamard rotation), got head_dim {head_dim}; "
                "use rotate=False (the spec without 'r', e.g. 'K2V2' instead of 'int2')"
            )
        if self.group_size is not None:
            group = min(self.group_size, head_dim)
            if head_dim % group:
                raise ValueError(f"head_dim {head_dim} must be a multiple of group_size {group} for {self!r}")
            return group
        tokens = 1 if self.axis == "token" else block_size
        wanted = min(-(-self.ELEMENTS_PER_SCALE // tokens), head_dim)
        return next(g for g in range(wanted, head_dim + 1) if head_dim % g == 0)

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> FieldSpec:
        groups = head_dim // self.group(head_dim, block_size)
        codes = ((block_size, kv_heads, head_dim * self.bits // 8), torch.uint8)
        if self.scale_bits == 8:  # one more slot per head: the unit, after the zero points
            return {"codes": codes, "scale": ((kv_heads, groups + 1), torch.uint8), "zero": ((kv_heads, groups + 1), _META_DTYPE)}
        meta_shape = (block_size, kv_heads, groups) if self.axis == "token" else (kv_heads, groups)
        return {"codes": codes, "scale": (meta_shape, _META_DTYPE), "zero": (meta_shape, _META_DTYPE)}

    def kernel_format(self, block_size: int, head_dim: int) -> KernelFormat:
        return KernelFormat(
            bits=self.bits, exponent_bits=0, zero_point=True, qmax=float((1 << self.bits) - 1),
            per_token=self.axis == "token", group=self.group(head_dim, block_size), scale_bits=self.scale_bits,
            rotate=self.rotate,
        )  # fmt: skip

    def _encode(self, x: Tensor) -> dict[str, Tensor]:
        # token: x is [..., heads, head_dim], reduce over each group's channels;
        # channel: x is [n, block, heads, head_dim], reduce over the group's channels and the block's tokens.
        group = self.group(x.shape[-1], x.shape[1] if self.axis == "channel" else 1)  # checks head_dim first
        x = hadamard(x) if self.rotate else x
        grouped = x.unflatten(-1, (-1, group))  # [..., heads, groups, group]
        dims = (-1,) if self.axis == "token" else (1, -1)
        codes, scale, zero, unit = _affine_encode(grouped, dims, self.bits, (-2,) if self.scale_bits == 8 else None)
        if self.axis == "channel":
            scale, zero = scale.squeeze(1), zero.squeeze(1)
        scale, zero = scale.squeeze(-1), zero.squeeze(-1)  # [..., heads, groups]
        if unit is not None:  # the unit goes after the zero points (see the class docstring)
            zero = torch.cat([zero, unit.reshape(*zero.shape[:-1], 1)], -1)
            scale = torch.cat([scale, scale.new_zeros(*scale.shape[:-1], 1)], -1)
        return {"codes": pack_codes(codes.flatten(-2), self.bits), "scale": scale, "zero": zero}

    def _decode(self, fields: dict[str, Tensor]) -> Tensor:
        packed = fields["codes"]
        codes = unpack_codes(packed, self.bits, _head_major_float(packed, packed.shape[-1] * 8 // self.bits))
        scale, zero = fields["scale"], fields["zero"]  # [n, (block,) heads, groups]
        if self.scale_bits == 8:  # steps x unit, the unit after the zero points
            scale, zero = scale[..., :-1].float() * zero[..., -1:].float(), zero[..., :-1]
        if self.axis == "channel":
            scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
        if 1 < scale.shape[-1] < codes.shape[-1]:  # several groups: expand the (small) metadata per channel
            group = codes.shape[-1] // scale.shape[-1]
            scale, zero = scale.repeat_interleave(group, -1), zero.repeat_interleave(group, -1)
        return codes.mul_(scale.float()).add_(zero.float())


_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class FP8(QuantFormat):
    """float8 codes (`fmt` "e4m3" = torch.float8_e4m3fn, max 448, or "e5m2" = torch.float8_e5m2, max 57344)
    stored as their uint8 bit patterns (`codes.view(torch.float8_e4m3fn)` reads them), x ~= scale * code,
    scale = absmax / fp8_max (float16, rounded up) so the codes use the full range and never overflow.

    `granularity="token"`: one scale per token per KV head (tokens can be written one at a time).
    `granularity="head"`: one scale per KV head per block (needs the full block).
    Error: rounding to 3 (e4m3) / 2 (e5m2) mantissa bits, |error| <= |x| / 16 (e4m3) or |x| / 8 (e5m2),
    plus half an fp8 subnormal step near 0 (scale * 2**-10 for e4m3, scale * 2**-17 for e5m2).
    Fields per block: codes uint8 [block, heads, head_dim]; scale float16 [block, heads] or [heads].
    Cost vs float16, head_dim 64, block 16: token (64 + 2) / 128 = 0.516x; head (64 + 2 / 16) / 128 = 0.501x.
    """

    fmt: str = "e4m3"
    granularity: str = "token"

    def __post_init__(self) -> None:
        if self.fmt not in _FP8_DTYPES:
            raise ValueError(f"FP8 fmt must be one of {sorted(_FP8_DTYPES)}, got {self.fmt!r}")
        if self.granularity not in ("token", "head"):
            raise ValueError(f"FP8 granularity must be 'token' or 'head', got {self.granularity!r}")

    @property
    def needs_full_block(self) -> bool:  # type: ignore[override]
        return self.granularity == "head"

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The torch float8 dtype whose bit patterns the uint8 codes hold."""
        return _FP8_DTYPES[self.fmt]

    def fields(self, block_size: int, kv_heads: int, head_dim: int) -> FieldSpec:
        scale_shape = (block_size, kv_heads) if self.granularity == "token" else (kv_heads,)
        return {
            "codes": ((block_size, kv_heads, head_dim), torch.uint8),
            "scale": (scale_shape, _META_DTYPE),
        }

    def kernel_format(self, block_size: int, head_dim: int) -> KernelFormat:
        return KernelFormat(  # fmt "e<exponent bits>m<mantissa bits>"
            bits=8, exponent_bits=int(self.fmt[1]), zero_point=False, qmax=torch.finfo(self.fp8_dtype).max,
            per_token=self.granularity == "token", group=head_dim,
        )  # fmt: skip

    def _encode(self, x: Tensor) -> dict[str, Tensor]:
        fp8_max = torch.finfo(self.fp8_dtype).max
        dims = (-1,) if self.granularity == "token" else (1, -1)  # head: over [n, block, heads, dim]'s block and dim
        scale = _absmax_scale(x, dims, fp8_max)
        codes = (x / _nonzero(scale)).clamp_(-fp8_max, fp8_max).to(self.fp8_dtype).view(torch.uint8)
        scale = scale.squeeze(-1) if self.granularity == "token" else scale.squeeze(-1).squeeze(1)
        return {"codes": codes, "scale": scale}

    def _decode(self, fields: dict[str, Tensor]) -> Tensor:
        scale = fields["scale"].float()
        scale = scale.unsqueeze(-1) if self.granularity == "token" else scale[:, None, :, None]
        codes = fields["codes"].view(self.fp8_dtype)
        return _head_major_float(codes, codes.shape[-1]).copy_(codes).mul_(scale)


# --------------------------------------------------------------------------------------------------
# Key / value pairs and the spec parser.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVFormat:
    """The formats of the key and of the value blocks of one cache (they differ: see the module docstring)."""

    key: QuantFormat
    value: QuantFormat

    def bytes_per_block(self, block_size: int, kv_heads: int, head_dim: int, value_dim: int | None = None) -> int:
        """Bytes of one key block plus one value block; `value_dim` is the values' head dim where it differs from
        the keys' (`head_dim`)."""
        return (self.key.bytes_per_block(block_size, kv_heads, head_dim)
                + self.value.bytes_per_block(block_size, kv_heads, value_dim or head_dim))  # fmt: skip

    def bytes_per_token(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """Bytes of one token's key and value, metadata amortized over the block."""
        return self.bytes_per_block(block_size, kv_heads, head_dim) / block_size

    def ratio_to_fp16(self, kv_heads: int, head_dim: int, block_size: int) -> float:
        """`bytes_per_token` relative to float16 keys + values (4 bytes per element pair)."""
        return self.bytes_per_token(kv_heads, head_dim, block_size) / (4 * kv_heads * head_dim)


_SPEC_CHOICES = (
    "'int8', 'int4', 'int2', 'fp8', 'fp8_e4m3', 'fp8_e5m2', or 'K<bits>V<bits>' with bits 2, 4 or 8, an 'r' after "
    "2 or 4 bits for a Hadamard-rotated side (e.g. 'K4V2', 'K8V4', 'K2rV2r')"
)


_INT_SPECS = {"int8": "k8v8", "int4": "k4v4", "int2": "k2v2r"}  # see `parse_kv_format`


def _key_format(bits: int, rotate: bool) -> QuantFormat:
    # Strict per-channel keys, 8-bit scales keeping int2 within 0.19x: see the module docstring.
    return Int8() if bits == 8 else IntN(bits, axis="channel", group_size=1, scale_bits=8, rotate=rotate)


def _value_format(bits: int, rotate: bool) -> QuantFormat:
    return Int8() if bits == 8 else IntN(bits, axis="token", rotate=rotate)


def parse_kv_format(spec: str) -> KVFormat:
    """"int8" | "int4" | "int2" | "fp8" (= "fp8_e4m3") | "fp8_e5m2" | "K<b>[r]V<b>[r]" (b in 2, 4, 8), any case.

    intN and K<b>V<b>: 8 bits -> `Int8`; 4 / 2 bits -> `IntN` per channel for keys, per token for values,
    Hadamard-rotated (`IntN.rotate`) where the side's bits are followed by "r" (2 or 4 bits only). "int2" is
    "K2V2r": rotated values halve the error of 2-bit values, while rotating strict per-channel keys gains
    nothing and lost pass keys on SmolLM2-135M (docs/BENCHMARKS.md); "int4" is "K4V4" (rotation measured no
    consistent gain there). fp8 -> `FP8` with per-token scales on both sides. Anything else raises a
    ValueError listing the choices.
    """
    text = spec.strip().lower() if isinstance(spec, str) else None
    if text in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        fp8 = FP8("e5m2" if text == "fp8_e5m2" else "e4m3")
        return KVFormat(key=fp8, value=fp8)
    text = _INT_SPECS.get(text, text)
    match = re.fullmatch(r"k(?:([24])(r?)|(8))v(?:([24])(r?)|(8))", text or "")
    if match is None:
        raise ValueError(f"unknown KV cache quantization format {spec!r}; valid formats: {_SPEC_CHOICES}")
    key_bits, key_rotate, key8, value_bits, value_rotate, value8 = match.groups()
    return KVFormat(
        key=_key_format(int(key_bits or key8), key_rotate == "r"),
        value=_value_format(int(value_bits or value8), value_rotate == "r"),
    )
