"""Shared by the format tests: the formats under test, hypothesis inputs that cover the edge cases, round trips and
error bounds computed from the input alone.

Inputs are drawn by hypothesis as (shape, value pattern, magnitude, dtype, seed), so one example builds a
whole tensor in microseconds while the patterns cover the edge cases: all zeros, constant rows, a single
huge outlier, outlier channels (KIVI keys), values near the float16 limit, tiny values, offset data.
Bounds are computed from the input alone (group min / max / absmax), not from the stored scales.
"""

import torch
from hypothesis import settings
from hypothesis import strategies as st

from hf_paged_cache.quantization import FP8, Int8, IntN

FAST = settings(max_examples=60, deadline=None)
F16_ULP_REL = 2.0**-10  # float16 rounding of a scale (outward) costs at most this much, relatively
F16_TINY = 2.0**-24  # smallest float16 subnormal: the floor of a nonzero scale
PER_TOKEN = [Int8(), IntN(4, "token"), IntN(2, "token"), IntN(4, "token", 16), FP8("e4m3"), FP8("e5m2")]
PER_BLOCK = [
    IntN(4, "channel"), IntN(2, "channel"), IntN(4, "channel", 1), IntN(2, "channel", 1, scale_bits=8),
    IntN(4, "channel", 2, scale_bits=8), FP8("e4m3", "head"), FP8("e5m2", "head"),
]  # fmt: skip
ALL_FORMATS = PER_TOKEN + PER_BLOCK
# Hadamard-rotated formats: their error bound holds in the rotated space (see the rotation tests).
ROTATED = [IntN(2, "token", rotate=True), IntN(4, "token", rotate=True), IntN(2, "channel", 1, 8, rotate=True)]
PATTERNS = ["normal", "zeros", "constant_rows", "outlier", "outlier_channel", "near_fp16_max", "offset"]


@st.composite
def blocks_of_kv(draw):
    """`[n, block_size, kv_heads, head_dim]` in float32 / float16 / bfloat16, plus its pattern name."""
    shape = (
        draw(st.integers(1, 3)),
        draw(st.sampled_from([1, 2, 5, 16])),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([8, 16, 64])),
    )
    pattern = draw(st.sampled_from(PATTERNS))
    magnitude = draw(st.sampled_from([1e-6, 1e-2, 1.0, 40.0, 3e3]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(shape, generator=gen) * magnitude
    if pattern == "zeros":
        x.zero_()
    elif pattern == "constant_rows":
        x = x[..., :1].expand(shape).clone()
    elif pattern == "outlier":
        x.view(-1)[torch.randint(x.numel(), (1,), generator=gen)] = 1e3 * magnitude * (1 if magnitude < 50 else 20)
    elif pattern == "outlier_channel":
        x[..., torch.randint(shape[-1], (1,), generator=gen)] *= 100.0
    elif pattern == "near_fp16_max":
        x = (torch.rand(shape, generator=gen) * 2 - 1) * 6e4
        x.view(-1)[0] = 6e4
    elif pattern == "offset":
        x += 50 * magnitude
    # Stay inside float16's range in every dtype (bfloat16 rounds 65504 up to 65536).
    return x.clamp(-6e4, 6e4).to(dtype), pattern


def roundtrip(fmt, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Write x's blocks into ids 1..n of a pool with a spare block 0, read them back in float32."""
    n, block_size, kv_heads, head_dim = x.shape
    pool = fmt.allocate(n + 1, block_size, kv_heads, head_dim)
    fmt.quantize(x, pool, torch.arange(1, n + 1))
    return fmt.dequantize(pool, range(1, n + 1)), pool


def error_bound(fmt, x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |dequantize(quantize(x)) - x|, from the input's groups alone (float64)."""
    x = x.double()
    if isinstance(fmt, Int8):
        step = x.abs().amax(-1, keepdim=True) / 127
        return step * (1 + F16_ULP_REL) / 2 + F16_TINY + x.abs().amax(-1, keepdim=True) * 2.0**-22
    if isinstance(fmt, IntN):
        grouped = x.unflatten(-1, (-1, fmt.group(x.shape[-1], x.shape[1])))
        dims = (-1,) if fmt.axis == "token" else (1, -1)
        lo, hi = grouped.amin(dims, keepdim=True), grouped.amax(dims, keepdim=True)
        # (max - min) / levels / 2, widened by the zero point's float16 rounding (<= one ulp of min).
        span = hi - lo + lo.abs() * F16_ULP_REL + F16_TINY
        step = span / ((1 << fmt.bits) - 1) * (1 + F16_ULP_REL)
        if fmt.scale_bits == 8:  # rounded up to a whole unit: the head's largest step / 255, float16 rounded up
            step = step + step.amax(-2, keepdim=True) / 255 * (1 + F16_ULP_REL) + F16_TINY
        slack = (hi.abs() + lo.abs()) * 2.0**-22
        return (step / 2 + F16_TINY + slack).expand_as(grouped).flatten(-2)
    if isinstance(fmt, FP8):
        mantissa_bits, subnormal_step = {"e4m3": (3, 2.0**-9), "e5m2": (2, 2.0**-16)}[fmt.fmt]
        dims = (-1,) if fmt.granularity == "token" else (1, -1)
        scale = x.abs().amax(dims, keepdim=True) / torch.finfo(fmt.fp8_dtype).max * (1 + F16_ULP_REL) + F16_TINY
        return x.abs() * 2.0 ** -(mantissa_bits + 1) + scale * subnormal_step / 2 + x.abs() * 2.0**-22
    raise TypeError(fmt)
