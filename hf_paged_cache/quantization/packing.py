"""Sub-byte integer codes packed into uint8, in the planar layout the Triton kernels read."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_codes", "unpack_codes"]


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
        if k == per_byte - 1:  # the top plane needs no mask
            out[..., k * m :] = packed >> (k * bits)
        else:
            out[..., k * m : (k + 1) * m] = (packed >> (k * bits)) & mask if k else packed & mask
    return out
