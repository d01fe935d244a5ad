"""float8 formats (`quantization/fp8.py`): exact codes."""

import torch

from hf_paged_cache.quantization import FP8
from quantization.format_testing import roundtrip


def test_fp8_codes_are_exact():
    fp8 = FP8("e4m3")
    values = torch.randn(1, 4, 2, 8).to(fp8.fp8_dtype).float()
    values[..., 0] = 448.0
    _, pool = roundtrip(fp8, values / 64)  # scale 448 / 64 / 448 = 2**-6, exact in float16
    assert (pool["scale"][1:] == 2.0**-6).all()
    assert torch.equal(pool["codes"][1:], values.to(fp8.fp8_dtype).view(torch.uint8))
