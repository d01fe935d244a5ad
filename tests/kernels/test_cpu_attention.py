"""paged_attention_cpu (the C++ attention of the CPU torch path) against paged_attention_cpu_ref."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.kernels.layout import allocate_kv_blocks

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the CPU attention kernel could not be built here")  # fmt: skip


@st.composite
def packed_batches(draw):
    """Rows reading ranges (starting mid-block, empty, whole blocks) through shuffled tables of head-major storage, each
    with a decode token or a chunk of causal queries (longer than a kernel tile, or than a chunk of keys, at times);
    the queries token-major or heads-major."""
    block_size, kv_heads = draw(st.sampled_from([1, 4, 16])), draw(st.integers(1, 3))
    group, head_dim = draw(st.sampled_from([1, 3, 4])), draw(st.sampled_from([8, 64, 80]))
    rows = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 90), st.integers(1, 70)), min_size=1, max_size=5))
    ranges = [(first, first + length) for first, length, _queries in rows]
    counts = [1 if length == 0 else min(queries, length) for _first, length, queries in rows]
    width = max(-(-stop // block_size) for _first, stop in ranges) or 1
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    num_blocks = len(ranges) * width + 1
    keys = allocate_kv_blocks(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    values = allocate_kv_blocks(num_blocks, block_size, kv_heads, head_dim, torch.float32)
    keys.copy_(torch.randn(keys.shape, generator=generator))
    values.copy_(torch.randn(values.shape, generator=generator))
    tables = (torch.randperm(num_blocks - 1, generator=generator)[: len(ranges) * width] + 1).view(len(ranges), width)
    query = torch.randn(sum(counts), kv_heads * group, head_dim, generator=generator)
    if draw(st.booleans()):  # heads-major, as a packed forward's queries lie: read through their strides
        query = query.transpose(0, 1).contiguous().transpose(0, 1)
    starts = torch.tensor([0, *counts]).cumsum(0)
    firsts = torch.tensor([first for first, _stop in ranges])
    stops = torch.tensor([stop for _first, stop in ranges])
    return query, keys, values, tables, starts, stops, firsts


@settings(max_examples=80, deadline=None)
@given(packed_batches(), st.sampled_from([0.125, 1.0]))
def test_cpu_attention_matches_its_reference(batch, scale):
    query, keys, values, tables, starts, stops, firsts = batch
    out = cpu_attention.paged_attention_cpu(query, keys, values, tables, starts, stops, firsts, scale)
    expected = cpu_attention.paged_attention_cpu_ref(query, keys, values, tables, starts, stops, firsts, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    empty = torch.repeat_interleave(stops <= firsts, starts.diff())  # the queries of a row that reads nothing: 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


def test_a_chunk_of_queries_sees_each_its_own_prefix():
    """Query i of a row's n queries sees the row's tokens up to its own: the i-th of the last n stored."""
    keys = allocate_kv_blocks(3, 4, 1, 8, torch.float32)
    keys.copy_(torch.randn(keys.shape))
    query, table = torch.randn(3, 2, 8), torch.tensor([[2, 1]])
    out = cpu_attention.paged_attention_cpu(query, keys, keys, table, torch.tensor([0, 3]), torch.tensor([7]),
                                            torch.tensor([1]), 0.5)  # fmt: skip
    stored = torch.cat([keys[2], keys[1]])[1:7, 0]  # tokens 1..6 of the row, [6, d]
    for i in range(3):  # query i sees tokens 1 .. 4 + i
        seen = stored[: 4 + i]
        weights = torch.softmax(query[i] @ seen.T * 0.5, dim=-1)
        torch.testing.assert_close(out[i], weights @ seen, rtol=1e-5, atol=1e-5)


def test_cpu_attention_refuses_reads_outside_its_table_or_storage_and_queries_without_keys():
    keys = allocate_kv_blocks(3, 4, 1, 8, torch.float32, fill=0.0)
    query, one, stops, firsts = torch.randn(1, 2, 8), torch.tensor([0, 1]), torch.tensor([6]), torch.tensor([1])
    with pytest.raises(RuntimeError, match="reads tokens 1..9 of a table of 2 blocks"):
        cpu_attention.paged_attention_cpu(query, keys, keys, torch.tensor([[1, 2]]), one, torch.tensor([9]), firsts,
                                          1.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="block id 7 out of range"):
        cpu_attention.paged_attention_cpu(query, keys, keys, torch.tensor([[1, 7]]), one, stops, firsts, 1.0)
    with pytest.raises(RuntimeError, match="has 6 queries but reads 5 tokens"):
        cpu_attention.paged_attention_cpu(torch.randn(6, 2, 8), keys, keys, torch.tensor([[1, 2]]),
                                          torch.tensor([0, 6]), stops, firsts, 1.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="query_starts must run from 0"):
        cpu_attention.paged_attention_cpu(query, keys, keys, torch.tensor([[1, 2]]), torch.tensor([0, 2]), stops,
                                          firsts, 1.0)  # fmt: skip
