"""write_kv against write_kv_ref: exact copies, padding slots skipped, nothing else touched."""

import pytest
import torch
from kernel_testing import DEVICE

from hf_paged_cache.kernels import write_kv, write_kv_ref
from hf_paged_cache.kernels.variants import BLOCK_SIZES, DTYPES, HEAD_DIMS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
def test_write_kv_matches_reference(randn, dtype, head_dim, block_size, slot_dtype):
    num_kv_heads = 3  # not a power of two: the head tile is padded and masked
    k_cache = randn(4, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = randn(4, block_size, num_kv_heads, head_dim, dtype=dtype)
    key, value = randn(6, num_kv_heads, head_dim, dtype=dtype), randn(6, num_kv_heads, head_dim, dtype=dtype)
    slots = [0, -1, block_size - 1, 3 * block_size + 2, -5, 2 * block_size]  # negative: padding, skipped
    slots = torch.tensor(slots, dtype=slot_dtype, device=DEVICE)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(expected_k, expected_v, key, value, slots)
    write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_strided_input(randn):
    """K/V sliced out of a fused projection: token and head strides are not the contiguous ones."""
    fused = randn(5, 2, 4, 16)  # [tokens, k|v, heads, head_dim]
    key, value = fused[:, 0], fused[:, 1]
    k_cache, v_cache = torch.zeros(2, 16, 4, 16, device=DEVICE), torch.zeros(2, 16, 4, 16, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, 6, 7, -1, 20], device=DEVICE)
    write_kv_ref(expected_k, expected_v, key, value, slots)
    write_kv(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_rejects_dtype_mismatch(randn):
    cache = torch.zeros(1, 16, 1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError):
        slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        write_kv(cache, cache.clone(), randn(1, 1, 16), randn(1, 1, 16), slots)
