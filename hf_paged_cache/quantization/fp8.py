"""float8 codes with a float16 scale (the format vLLM's fp8 KV cache stores); they name the "fp8" specs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import FieldSpec, KernelFormat, KVFormat, QuantFormat, head_major_float
from .registry import register_format
from .scales import META_DTYPE, absmax_scale, nonzero

__all__ = ["FP8"]

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

    SPECS = "'fp8', 'fp8_e4m3', 'fp8_e5m2'"

    fmt: str = "e4m3"
    granularity: str = "token"

    def __post_init__(self) -> None:
        if self.fmt not in _FP8_DTYPES:
            raise ValueError(f"FP8 fmt must be one of {sorted(_FP8_DTYPES)}, got {self.fmt!r}")
        if self.granularity not in ("token", "head"):
            raise ValueError(f"FP8 granularity must be 'token' or 'head', got {self.granularity!r}")

    @classmethod
    def parse_spec(cls, text: str) -> KVFormat | None:
        """"fp8" (= "fp8_e4m3") and "fp8_e5m2": per-token scales on both sides."""
        fmt = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}.get(text)
        return None if fmt is None else KVFormat(key=cls(fmt), value=cls(fmt))

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
            "scale": (scale_shape, META_DTYPE),
        }

    def kernel_format(self, block_size: int, head_dim: int) -> KernelFormat:
        return KernelFormat(  # fmt "e<exponent bits>m<mantissa bits>"
            bits=8, exponent_bits=int(self.fmt[1]), zero_point=False, qmax=torch.finfo(self.fp8_dtype).max,
            per_token=self.granularity == "token", group=head_dim,
        )  # fmt: skip

    def _encode(self, x: Tensor) -> dict[str, Tensor]:
        fp8_max = torch.finfo(self.fp8_dtype).max
        dims = (-1,) if self.granularity == "token" else (1, -1)  # head: over [n, block, heads, dim]'s block and dim
        scale = absmax_scale(x, dims, fp8_max)
        codes = (x / nonzero(scale)).clamp_(-fp8_max, fp8_max).to(self.fp8_dtype).view(torch.uint8)
        scale = scale.squeeze(-1) if self.granularity == "token" else scale.squeeze(-1).squeeze(1)
        return {"codes": codes, "scale": scale}

    def _decode(self, fields: dict[str, Tensor], out: Tensor | None = None) -> Tensor:
        scale = fields["scale"].float()
        scale = scale.unsqueeze(-1) if self.granularity == "token" else scale[..., None, :, None]
        codes = fields["codes"].view(self.fp8_dtype)
        return head_major_float(codes, codes.shape[-1], out).copy_(codes).mul_(scale)


register_format("fp8", FP8)
