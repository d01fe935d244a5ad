"""The Hadamard rotation (`quantization/rotation.py`) and the rotating formats built on it."""

import math

import pytest
import torch
from hypothesis import given

from hf_paged_cache.quantization import IntN, format_from_spec, hadamard, rotate_heads
from quantization.format_testing import FAST, ROTATED, blocks_of_kv, roundtrip, error_bound


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128])
def test_hadamard_is_sylvesters_orthonormal_involution(d):
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < d:  # Sylvester: [[H, H], [H, -H]]
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)])
    matrix = matrix / math.sqrt(d)
    x = torch.randn(5, 3, d, dtype=torch.float64)
    torch.testing.assert_close(hadamard(x), x @ matrix.double())
    torch.testing.assert_close(hadamard(hadamard(x)), x)
    q, k = torch.randn(2, d, dtype=torch.float64)
    torch.testing.assert_close(hadamard(q) @ hadamard(k), q @ k)  # attention logits are unchanged


@pytest.mark.parametrize("fmt", ROTATED, ids=repr)
@FAST
@given(data=blocks_of_kv())
def test_rotated_round_trip_error_is_bounded_in_the_rotated_space(fmt, data):
    """A rotated format quantizes H x with the unrotated format's elementwise bound; rotating back is
    orthogonal, so each token's L2 error stays within the L2 norm of that bound (plus float32 rounding).
    Rotated values beyond the float16 range (up to sqrt(head_dim) times the largest input) are clamped to it,
    which adds their excess."""
    x, pattern = data
    y, _ = roundtrip(fmt, x)
    plain = IntN(fmt.bits, fmt.axis, fmt.group_size, fmt.scale_bits)
    rotated_x = hadamard(x.float())
    clamped = rotated_x.clamp(-65504, 65504)
    elementwise = error_bound(plain, clamped) + (rotated_x - clamped).abs().double()
    bound = elementwise.norm(dim=-1) + x.double().norm(dim=-1) * 1e-6
    err = (y.double() - x.double()).norm(dim=-1)
    assert (err <= bound).all(), f"{pattern}: error exceeds the bound by {(err - bound).max().item():.3g}"
    if pattern == "zeros":
        assert torch.equal(y, torch.zeros_like(y))


def test_rotation_lowers_the_error_of_per_token_groups_with_outlier_channels():
    """Outlier channels (two channels 20x the others, as in LLM K/V) set each token's range and crush the
    other channels; spread over the head by the rotation, they cost well under half as much (int2: 0.33 vs
    0.73 relative L2). Strict per-channel groups (the specs' keys) already give an outlier channel its own
    range: there the rotation gains nothing (0.33 vs 0.32), which is why keys are not rotated by default."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, 2, 64, generator=gen)
    x[..., [5, 40]] *= 20.0

    def error(fmt):
        return ((roundtrip(fmt, x)[0] - x).norm() / x.norm()).item()

    for bits in (2, 4):
        assert error(IntN(bits, "token", rotate=True)) < 0.5 * error(IntN(bits, "token"))
    assert error(IntN(2, "channel", 1, 8, rotate=True)) > 0.95 * error(IntN(2, "channel", 1, 8))


@pytest.mark.parametrize("fmt", ROTATED + [IntN(2, "token")], ids=repr)
def test_rotated_reads_are_the_stored_vectors(fmt):
    """`dequantize(rotated=True)` returns a rotated format's vectors as stored, which `rotate_heads` turns
    into the ordinary read (a format without rotation ignores the flag)."""
    x = torch.randn(3, 16, 2, 64, generator=torch.Generator().manual_seed(1))
    _, pool = roundtrip(fmt, x)
    stored = fmt.dequantize(pool, [1, 2, 3], rotated=True)
    expected = fmt.dequantize(pool, [1, 2, 3])
    torch.testing.assert_close(rotate_heads(stored) if fmt.rotate else stored, expected, atol=1e-5, rtol=1e-5)
    assert fmt.rotate or torch.equal(stored, expected)


def test_rotation_stores_nothing_and_needs_a_power_of_two_head_dim():
    for fmt in ROTATED:
        plain = IntN(fmt.bits, fmt.axis, fmt.group_size, fmt.scale_bits)
        assert fmt.fields(16, 3, 64) == plain.fields(16, 3, 64)
    assert format_from_spec("int2").bytes_per_block(16, 3, 64) == format_from_spec("K2V2").bytes_per_block(16, 3, 64)
    with pytest.raises(ValueError, match="rotate=True needs a power-of-two head_dim.*got head_dim 80"):
        IntN(2, "token", rotate=True).fields(16, 1, 80)
    with pytest.raises(ValueError, match="rotate=True needs a power-of-two head_dim"):
        IntN(2, "token", rotate=True).quantize(torch.randn(1, 16, 1, 96), IntN(2).allocate(1, 16, 1, 96), [0])
    with pytest.raises(ValueError, match="rotate must be a bool"):
        IntN(2, rotate=1)
