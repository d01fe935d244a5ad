"""Integer formats (`quantization/int_n.py`): exact codes, scales and zero points, default groups."""

import pytest
import torch

from hf_paged_cache.quantization import Int8, IntN
from quantization.format_testing import roundtrip


@pytest.mark.parametrize("fmt", [IntN(4, "token"), IntN(2, "token"), IntN(4, "channel"), IntN(2, "channel", 1)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_constant_groups_of_float16_values_are_exact(fmt, dtype):
    x = torch.full((2, 16, 2, 64), 1234.5, dtype=dtype)
    x[1] = -0.0625
    y, _ = roundtrip(fmt, x)
    assert torch.equal(y, x.float())


def _pack_by_hand(codes: list[int], bits: int) -> list[int]:
    """Planar: byte i holds codes i, i + m, i + 2m, ... (m bytes), the first in the low bits."""
    m = len(codes) * bits // 8
    return [sum(codes[i + k * m] << (bits * k) for k in range(8 // bits)) for i in range(m)]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_intn_codes_scales_and_zeros_are_exact(bits, axis):
    """Data on a known float16 grid (plus noise under a third of a step): every stored number is predictable."""
    gen = torch.Generator().manual_seed(bits)
    levels = (1 << bits) - 1
    zero, scale = -1.5, 0.25
    fmt = IntN(bits, axis, group_size=4)
    n, block_size, heads, head_dim = 2, 4, 2, 8
    codes = torch.randint(0, levels + 1, (n, block_size, heads, head_dim), generator=gen)
    # Every group must reach both ends of the grid so that its min / max are exactly zero / zero + scale * levels.
    if axis == "token":
        codes[..., 0::4], codes[..., 1::4] = 0, levels
    else:
        codes[:, 0], codes[:, 1] = 0, levels
    noise = (torch.rand(codes.shape, generator=gen) - 0.5) * 0.6
    noise[codes == 0] = 0
    noise[codes == levels] = 0
    x = zero + scale * (codes + noise)
    _, pool = roundtrip(fmt, x)
    expected = [_pack_by_hand(row, bits) for row in codes.reshape(-1, head_dim).tolist()]
    assert pool["codes"][1:].reshape(-1, head_dim * bits // 8).tolist() == expected
    assert (pool["scale"][1:] == scale).all() and (pool["zero"][1:] == zero).all()
    assert pool["scale"].shape[1:] == ((block_size, heads, 2) if axis == "token" else (heads, 2))


def test_int8_codes_are_exact():
    scale = 0.5
    codes = torch.randint(-127, 128, (1, 4, 2, 8))
    codes[..., 0] = 127  # absmax = 127 * scale in every row
    _, pool = roundtrip(Int8(), scale * codes.float())
    assert torch.equal(pool["codes"][1:], codes.to(torch.int8)) and (pool["scale"][1:] == scale).all()


def test_default_channel_groups_follow_the_block_size():
    assert [IntN(4, "channel").group(64, b) for b in (1, 8, 16, 24, 32, 64, 256)] == [64, 8, 4, 4, 2, 1, 1]
    assert [IntN(4, "token").group(d, 16) for d in (32, 64, 80, 128)] == [32, 64, 80, 64]
    assert IntN(4, "channel", group_size=1).group(64, 16) == 1
