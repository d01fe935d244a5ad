"""float16 metadata (`quantization/scales.py`): outward rounding never clips and costs little error."""

import math

import pytest
import torch
from hypothesis import given

from hf_paged_cache.quantization import FP8, Int8, IntN
from quantization.format_testing import FAST, F16_ULP_REL, F16_TINY, blocks_of_kv, roundtrip


@pytest.mark.parametrize("fmt", [Int8(), FP8("e4m3"), FP8("e5m2"), FP8("e4m3", "head")], ids=repr)
@FAST
@given(data=blocks_of_kv())
def test_symmetric_scales_never_clip_and_fp8_uses_the_full_range(fmt, data):
    x, pattern = data
    _, pool = roundtrip(fmt, x)
    x = x.float()
    dims = (1, -1) if fmt.needs_full_block else (-1,)
    absmax = x.abs().amax(dims)
    qmax = 127 if isinstance(fmt, Int8) else torch.finfo(fmt.fp8_dtype).max
    scale = pool["scale"][1:].float()
    assert (scale * qmax >= absmax * (1 - 2.0**-23)).all()
    assert (scale <= absmax / qmax * (1 + F16_ULP_REL) + F16_TINY).all()
    if isinstance(fmt, FP8):
        codes = pool["codes"][1:].view(fmt.fp8_dtype).float().abs()
        biggest = codes.amax(dims)
        normal = scale > 2.0**-14  # below that the float16 scale itself is coarse
        assert (biggest[normal] == qmax).all(), "the largest value of a row should map to the fp8 max"


def test_float16_metadata_costs_little_error():
    """The scales' float16 rounding is outward and relative 2**-10: int4's error stays within 0.1% of fp32 scales'."""
    x = torch.randn(8, 16, 2, 64) * 3 + 1
    fmt = IntN(4, "token")
    y, pool = roundtrip(fmt, x)
    lo = x.unflatten(-1, (1, 64)).amin(-1)
    hi = x.unflatten(-1, (1, 64)).amax(-1)
    exact_step = (hi - lo) / 15
    assert (pool["scale"][1:].float() / exact_step).max() <= 1 + 2 * F16_ULP_REL
    assert math.isclose((y - x).abs().mean().item(), exact_step.mean().item() / 4, rel_tol=0.05)
