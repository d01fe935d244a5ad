"""Scales and zero points in float16, rounded outward so that the stored grid always covers the data.

Each is rounded before the codes are computed (scales up, zero points down), so the round-trip error stays
within half a step of the stored scale, at most 2**-10 (relative) larger than the exact one. An asymmetric
group's zero point may sit up to one float16 ulp below its minimum. Asymmetric formats clamp inputs to the
float16 range (+-65504); symmetric scales saturate at 65504. Inputs must be finite.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["META_DTYPE", "SCALE_STEPS", "absmax_scale", "affine_encode", "fp16_down", "fp16_up", "nonzero"]

FP16_MAX = torch.finfo(torch.float16).max
META_DTYPE = torch.float16  # dtype of every scale and zero point (but 8-bit scales, see `affine_encode`)
SCALE_STEPS = 255  # the largest 8-bit scale, in units


def fp16_up(x: Tensor) -> Tensor:
    """The smallest float16 >= x for x >= 0 (saturating at the float16 max)."""
    x = x.clamp(max=FP16_MAX)
    h = x.to(META_DTYPE)
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def fp16_down(x: Tensor) -> Tensor:
    """The largest float16 <= x (for x within the float16 range)."""
    h = x.clamp(-FP16_MAX, FP16_MAX).to(META_DTYPE)
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def nonzero(scale: Tensor) -> Tensor:
    """`scale` as float32 with zeros replaced by 1: a zero scale means every code is 0 (exact zeros)."""
    scale = scale.float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def absmax_scale(x: Tensor, dims: tuple[int, ...], qmax: float) -> Tensor:
    """float16 scale = absmax / qmax over `dims` (kept), rounded up so |x| / scale <= qmax."""
    return fp16_up(x.abs().amax(dim=dims, keepdim=True) / qmax)


def affine_encode(
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
    x = x.clamp(-FP16_MAX, FP16_MAX)
    zero = fp16_down(x.amin(dim=dims, keepdim=True))
    exact = (x.amax(dim=dims, keepdim=True) - zero.float()) / levels
    if unit_dims is None:
        scale, unit = fp16_up(exact), None
        value = scale.float()
    else:
        unit = fp16_up(exact.amax(dim=unit_dims, keepdim=True) / SCALE_STEPS)
        scale = torch.ceil(exact / nonzero(unit)).clamp_(0, SCALE_STEPS).to(torch.uint8)
        value = scale.float() * unit.float()
    codes = torch.round((x - zero.float()) / nonzero(value)).clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero, unit
