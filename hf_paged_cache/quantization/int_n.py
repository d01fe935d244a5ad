"""Integer formats: symmetric int8 per token, and KIVI's asymmetric 4 / 2-bit codes (keys per channel over a
block, values per token), optionally Hadamard-rotated; they name the "int8" / "int4" / "int2" / "K<b>V<b>" specs.

The specs quantize keys strictly per channel with 8-bit scales: a scale shared by even two adjacent key channels
lets one outlier channel blur its neighbour (docs/BENCHMARKS.md has the measurements). "int2" also rotates its
values, which halves the error of 2-bit values at the same bytes; rotating the per-channel keys gained nothing,
so keys are not rotated by default ("K2rV2r" asks for it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import FieldSpec, KernelFormat, KVFormat, QuantFormat, head_major_float
from .packing import pack_codes, unpack_codes
from .registry import register_format
from .rotation import hadamard
from .scales import META_DTYPE, absmax_scale, affine_encode, nonzero

__all__ = ["Int8", "IntN"]


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
            "scale": ((block_size, kv_heads), META_DTYPE),
        }

    def kernel_format(self, block_size: int, head_dim: int) -> KernelFormat:
        return KernelFormat(
            bits=8, exponent_bits=0, zero_point=False, qmax=float(self.QMAX), per_token=True, group=head_dim
        )

    def _encode(self, x: Tensor) -> dict[str, Tensor]:
        scale = absmax_scale(x, (-1,), float(self.QMAX))
        codes = torch.round(x / nonzero(scale)).clamp_(-self.QMAX, self.QMAX).to(torch.int8)
        return {"codes": codes, "scale": scale.squeeze(-1)}

    def _decode(self, fields: dict[str, Tensor], out: Tensor | None = None) -> Tensor:
        codes = fields["codes"]
        out = head_major_float(codes, codes.shape[-1], out).copy_(codes)
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
    outputs instead of every decoded token: `code_space`). head_dim must be a power of two. A rotated value
    can be up to sqrt(head_dim) times the largest input; beyond the float16 range it is clamped like any input.

    Default `group_size` (None): the fewest channels, dividing head_dim, such that one (scale, zero) pair
    covers at least `ELEMENTS_PER_SCALE` = 64 elements, so metadata costs at most 1/32 of float16:
    "token": 64 channels (head_dim if smaller); "channel": ceil(64 / block_size) channels, i.e. 4 at
    block 16, 2 at block 32, 1 (strict per-channel) from block 64 on. Channel groups trade key error for
    bytes; per-token keys at the same cost are worse still.

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
    SPECS = (
        "'int8', 'int4', 'int2', or 'K<bits>V<bits>' with bits 2, 4 or 8, an 'r' after 2 or 4 bits for a "
        "Hadamard-rotated side (e.g. 'K4V2', 'K8V4', 'K2rV2r')"
    )

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

    @classmethod
    def parse_spec(cls, text: str) -> KVFormat | None:
        """"int8" (= "K8V8"), "int4" (= "K4V4"), "int2" (= "K2V2r") and "k<b>[r]v<b>[r]" (b in 2, 4, 8): 8 bits
        -> `Int8`; 4 / 2 bits -> strict per-channel keys with 8-bit scales, per-token values, rotated where the
        side's bits are followed by "r"."""
        text = {"int8": "k8v8", "int4": "k4v4", "int2": "k2v2r"}.get(text, text)
        match = re.fullmatch(r"k(?:([24])(r?)|(8))v(?:([24])(r?)|(8))", text)
        if match is None:
            return None
        key_bits, key_rotate, key8, value_bits, value_rotate, value8 = match.groups()
        if key8:
            key = Int8()
        else:
            key = cls(int(key_bits), axis="channel", group_size=1, scale_bits=8, rotate=key_rotate == "r")
        value = Int8() if value8 else cls(int(value_bits), axis="token", rotate=value_rotate == "r")
        return KVFormat(key=key, value=value)

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
            return {"codes": codes, "scale": ((kv_heads, groups + 1), torch.uint8), "zero": ((kv_heads, groups + 1), META_DTYPE)}
        meta_shape = (block_size, kv_heads, groups) if self.axis == "token" else (kv_heads, groups)
        return {"codes": codes, "scale": (meta_shape, META_DTYPE), "zero": (meta_shape, META_DTYPE)}

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
        codes, scale, zero, unit = affine_encode(grouped, dims, self.bits, (-2,) if self.scale_bits == 8 else None)
        if self.axis == "channel":
            scale, zero = scale.squeeze(1), zero.squeeze(1)
        scale, zero = scale.squeeze(-1), zero.squeeze(-1)  # [..., heads, groups]
        if unit is not None:  # the unit goes after the zero points (see the class docstring)
            zero = torch.cat([zero, unit.reshape(*zero.shape[:-1], 1)], -1)
            scale = torch.cat([scale, scale.new_zeros(*scale.shape[:-1], 1)], -1)
        return {"codes": pack_codes(codes.flatten(-2), self.bits), "scale": scale, "zero": zero}

    def _decode(self, fields: dict[str, Tensor], out: Tensor | None = None) -> Tensor:
        packed = fields["codes"]
        codes = unpack_codes(packed, self.bits, head_major_float(packed, packed.shape[-1] * 8 // self.bits, out))
        scale, zero = fields["scale"], fields["zero"]  # [..., (block,) heads, groups]
        if self.scale_bits == 8:  # steps x unit, the unit after the zero points
            scale, zero = scale[..., :-1].float() * zero[..., -1:].float(), zero[..., :-1]
        if self.axis == "channel":  # one per block: broadcast over its tokens
            scale, zero = scale.unsqueeze(-3), zero.unsqueeze(-3)
        if 1 < scale.shape[-1] < codes.shape[-1]:  # several groups: expand the (small) metadata per channel
            group = codes.shape[-1] // scale.shape[-1]
            scale, zero = scale.repeat_interleave(group, -1), zero.repeat_interleave(group, -1)
        return codes.mul_(scale.float()).add_(zero.float())


register_format("int8", Int8)
register_format("intn", IntN)
