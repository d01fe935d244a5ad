"""paged_decode_cpu (the C++ decode of the CPU torch path) against paged_decode_cpu_ref."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.kernels import cpu_decode
from hf_paged_cache.kernels.layout import allocate_kv_blocks

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="the CPU decode kernel could not be built here")


@st.composite
def decode_batches(draw):
    """Rows reading ranges (starting mid-block, empty, whole blocks) through shuffled tables of head-major storage."""
    block_size, kv_heads = draw(st.sampled_from([1, 4, 16])), draw(st.integers(1, 3))
    group, head_dim = draw(st.sampled_from([1, 3, 4])), draw(st.sampled_from([8, 64, 80]))
    rows = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 70)), min_size=1, max_size=5))
    ranges = [(first, first + length) for first, length in rows]
    width = max(-(-stop // block_size) for _first, stop in ranges) or 1
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    num_blocks = len(ranges) * width + 1
    keys = allocate_kv_blocks(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    values = allocate_kv_blocks(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    keys.copy_(torch.randn(keys.shape, generator=generator))
    values.copy_(torch.randn(values.shape, generator=generator))
    tables = (torch.randperm(num_blocks - 1, generator=generator)[: len(ranges) * width] + 1).view(len(ranges), width)
    query = torch.randn(len(ranges), kv_heads * group, head_dim, generator=generator)
    firsts = torch.tensor([first for first, _stop in ranges])
    stops = torch.tensor([stop for _first, stop in ranges])
    return query, keys, values, tables, stops, firsts


@settings(max_examples=60, deadline=None)
@given(decode_batches(), st.sampled_from([0.125, 1.0]))
def test_cpu_decode_matches_its_reference(batch, scale):
    query, keys, values, tables, stops, firsts = batch
    out = cpu_decode.paged_decode_cpu(query, keys, values, tables, stops, firsts, scale)
    expected = cpu_decode.paged_decode_cpu_ref(query, keys, values, tables, stops, firsts, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[stops <= firsts], torch.zeros_like(out[stops <= firsts]))  # a row that reads nothing: 0


def test_cpu_decode_refuses_reads_outside_its_table_or_storage():
    keys = allocate_kv_blocks(3, 4, 1, 8, torch.float32, fill=0.0)
    query, stops, firsts = torch.randn(1, 2, 8), torch.tensor([6]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="reads tokens 1..9 of a table of 2 blocks"):
        cpu_decode.paged_decode_cpu(query, keys, keys, torch.tensor([[1, 2]]), torch.tensor([9]), firsts, 1.0)
    with pytest.raises(RuntimeError, match="block id 7 out of range"):
        cpu_decode.paged_decode_cpu(query, keys, keys, torch.tensor([[1, 7]]), stops, firsts, 1.0)
