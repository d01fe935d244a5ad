"""quantize_blocks_cpu (the C++ seal of the CPU path) against the formats' own torch encode."""

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.kernels.cpu_quantize import quantize_blocks_cpu
from hf_paged_cache.quantization import FP8, Int8, IntN, format_from_spec

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the CPU attention kernel could not be built here")  # fmt: skip

FORMATS = [Int8(), IntN(4, "token"), IntN(2, "token"), IntN(4, "token", group_size=16),
           IntN(4, "channel", group_size=1, scale_bits=8), IntN(2, "channel", group_size=1, scale_bits=8),
           IntN(4, "channel"), IntN(2, "channel", group_size=4)]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(FORMATS), st.sampled_from([4, 16]), st.integers(1, 3), st.sampled_from([16, 64]),
       st.sampled_from([1e-6, 1e-2, 1.0, 300.0]), st.integers(0, 2**16))  # fmt: skip
def test_quantize_blocks_cpu_writes_the_codes_of_the_torch_encode_bit_for_bit(fmt, block_size, heads, head_dim,
                                                                             magnitude, seed):  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, block_size, heads, head_dim, generator=generator) * magnitude
    x[0, 0, 0, :4] = torch.tensor([0.0, 7e4, -7e4, 1e-8])  # beyond the float16 range, and a tiny value
    x[1] = 0  # a block of zeros: zero scales
    x[2, :, :, 1] = 3.0  # a constant channel
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # head-major storage, as a layer's blocks lie
    expected, written = fmt.allocate(7, block_size, heads, head_dim), fmt.allocate(7, block_size, heads, head_dim)
    sources, targets = torch.tensor([3, 0, 1, 2]), torch.tensor([6, 2, 4, 1])
    fmt.quantize(x[sources], expected, targets)
    errors = quantize_blocks_cpu(fmt, x, sources, written, targets)
    for name in expected:
        assert torch.equal(written[name], expected[name]), name
    # the first block's error, as the layer samples it: |decoded - x| per token over the head's mean |x|
    sample = x[sources[:1]].float()
    scale = sample.norm(dim=-1).mean(dim=1, keepdim=True).clamp(min=1e-12)
    error = ((fmt.dequantize(expected, targets[:1]) - sample).norm(dim=-1) / scale)[0]
    torch.testing.assert_close(errors, error, rtol=1e-4, atol=1e-6)


@dataclass(frozen=True)
class NarrowInt8(Int8):
    """Int8's layout over a narrower code range: the C++ encode (+-127) would write codes the format never does."""

    QMAX: ClassVar[int] = 63


@pytest.mark.parametrize("fmt", [format_from_spec("int2").value, FP8(), NarrowInt8()])
def test_quantize_blocks_cpu_refuses_formats_it_cannot_encode(fmt):
    pool = fmt.allocate(2, 16, 1, 64)
    with pytest.raises(ValueError, match="cannot encode"):
        quantize_blocks_cpu(fmt, torch.zeros(1, 16, 1, 64), torch.tensor([0]), pool, torch.tensor([1]))
