"""write_kv_cpu (the torch path's C++ K/V write) against write_kv_ref: exact copies, padding skipped, bad slots
refused."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.kernels.cpu_write import write_kv_cpu
from hf_paged_cache.kernels.layout import allocate_kv_blocks
from hf_paged_cache.kernels.reference import write_kv_ref

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the C++ CPU kernels could not be built here")  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(1, 4), st.sampled_from([8, 64, 40]), st.sampled_from([8, 64, 12]),
       st.sampled_from([1, 16]), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.booleans(), st.integers(0, 2**16))  # fmt: skip
def test_write_kv_cpu_is_write_kv_ref(tokens, heads, head_dim, value_dim, block_size, dtype, strided, seed):
    """Head-major storage (the cache's layout), values of another width, states as the layers hand them (a transposed
    `[1, heads, q, d]`) or contiguous, padding slots, and more tokens than the prefetch runs ahead of."""
    generator = torch.Generator().manual_seed(seed)
    blocks = 1 + -(-tokens // block_size) + 2
    k_cache = allocate_kv_blocks(blocks, block_size, heads, head_dim, dtype, "cpu", fill=0.0)
    v_cache = allocate_kv_blocks(blocks, block_size, heads, value_dim, dtype, "cpu", fill=0.0)
    states = [torch.randn(1, heads, tokens, dim, generator=generator).to(dtype) for dim in (head_dim, value_dim)]
    key, value = (s.transpose(1, 2)[0] if strided else s.transpose(1, 2)[0].contiguous() for s in states)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    slots[torch.rand(tokens, generator=generator) < 0.2] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(expected_k, expected_v, key, value, slots)
    write_kv_cpu(k_cache, v_cache, key, value, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_a_slot_past_the_cache_is_refused_before_anything_is_written():
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key, value = torch.ones(3, 1, 8), torch.ones(3, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 of token 2 is past the cache's 8 slots"):
        write_kv_cpu(k_cache, v_cache, key, value, torch.tensor([0, 1, 8]))
    assert not k_cache.any() and not v_cache.any()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda k, v, key, value, slots: (k, v, key.double(), value, slots), "states must have the cache's dtype"),
        (lambda k, v, key, value, slots: (k, v, key[:, :, :4], value, slots), "the cache's heads and head dim"),
        (lambda k, v, key, value, slots: (k, v, key, value, slots.int()), "slot_mapping must be a CPU int64"),
        (lambda k, v, key, value, slots: (k, v, key, value, slots[:1]), "must agree on tokens"),
        (lambda k, v, key, value, slots: (k, v[:1], key, value, slots), "the same blocks"),
    ],
)
def test_mismatched_arguments_are_refused(change, message):
    arguments = (torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), torch.ones(2, 1, 8), torch.ones(2, 1, 8),
                 torch.tensor([0, 5]))  # fmt: skip
    with pytest.raises(RuntimeError, match=message):
        write_kv_cpu(*change(*arguments))
