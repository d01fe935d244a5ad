"""Planar sub-byte code packing (`quantization/packing.py`)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hf_paged_cache.quantization import pack_codes, unpack_codes


def test_pack_layout_is_planar_low_bits_first():
    # byte i holds codes i, i + m, ... (m = bytes per row), the first in the low bits
    assert pack_codes(torch.tensor([0xA, 0x5], dtype=torch.uint8), 4).tolist() == [0x5A]
    assert pack_codes(torch.tensor([1, 2, 3, 0, 3, 3, 3, 3], dtype=torch.uint8), 4).tolist() == [
        1 | 3 << 4,
        2 | 3 << 4,
        3 | 3 << 4,
        0 | 3 << 4,
    ]
    assert pack_codes(torch.tensor([1, 2, 3, 0, 3, 3, 3, 3], dtype=torch.uint8), 2).tolist() == [
        1 | 3 << 2 | 3 << 4 | 3 << 6,
        2 | 0 << 2 | 3 << 4 | 3 << 6,
    ]


@pytest.mark.parametrize("bits", [2, 4])
@given(codes=st.lists(st.integers(0, 15), min_size=8, max_size=8 * 6).filter(lambda c: len(c) % 8 == 0))
def test_unpack_inverts_pack(bits, codes):
    codes = torch.tensor(codes, dtype=torch.uint8).reshape(-1, 8) % (1 << bits)
    packed = pack_codes(codes, bits)
    assert packed.shape == (codes.shape[0], 8 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
