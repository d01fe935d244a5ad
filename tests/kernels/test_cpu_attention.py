"""paged_attention_cpu (the C++ attention of the CPU torch path) against paged_attention_cpu_ref."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hf_paged_cache.attention.torch_path import merge_partials
from hf_paged_cache.kernels import cpu_attention
from hf_paged_cache.kernels.layout import allocate_kv_blocks
from hf_paged_cache.quantization import format_from_spec

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
    # Scale 1 over up to 80 channels gives logits of up to ~30, whose float32 rounding alone moves an output by ~1e-5
    # (the kernel's worst error against a float64 reference on such rows, before and after its prompt tiles changed).
    tolerance = 1e-5 if scale < 1 else 2e-5
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=tolerance)
    empty = torch.repeat_interleave(stops <= firsts, starts.diff())  # the queries of a row that reads nothing: 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


@settings(max_examples=60, deadline=None)
@given(packed_batches(), st.booleans())
def test_partial_attention_gives_each_querys_log_sum_exp_causal_or_not(batch, causal):
    """The log-sum-exp of the logits each query saw (-inf where none), with its reference; not causal, every query of a
    row sees every key the row reads."""
    query, keys, values, tables, starts, stops, firsts = batch
    args = (query, keys, values, tables, starts, stops, firsts, 0.125)
    out, lse = cpu_attention.paged_partial_attention_cpu(*args, causal=causal)
    expected, expected_lse = cpu_attention.paged_partial_attention_cpu_ref(*args, causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    if causal:
        assert torch.equal(out, cpu_attention.paged_attention_cpu(*args))


def test_queries_not_causal_see_the_whole_row_and_merge_with_the_rest():
    """Three queries over a row's 6 tokens, not causal: each sees all 6; merged by log-sum-exp with each one's own
    further keys, the result is attention over both."""
    keys = allocate_kv_blocks(4, 4, 1, 8, torch.float32)
    keys.copy_(torch.randn(keys.shape))
    query = torch.randn(3, 2, 8)
    shared, lse = cpu_attention.paged_partial_attention_cpu(query, keys, keys, torch.tensor([[2, 1]]),
                                                            torch.tensor([0, 3]), torch.tensor([7]), torch.tensor([1]),
                                                            0.5, causal=False)  # fmt: skip
    stored = torch.cat([keys[2], keys[1]])[1:7, 0]
    for i in range(3):
        torch.testing.assert_close(shared[i], torch.softmax(query[i] @ stored.T * 0.5, -1) @ stored, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[i], torch.logsumexp(query[i] @ stored.T * 0.5, -1), rtol=1e-5, atol=1e-5)
    # each query's own keys: block 3's first i + 1 tokens, one decode row each
    own, own_lse = cpu_attention.paged_partial_attention_cpu(query, keys, keys, torch.tensor([[3], [3], [3]]),
                                                             torch.arange(4), torch.tensor([1, 2, 3]),
                                                             torch.zeros(3, dtype=torch.long), 0.5)  # fmt: skip
    merged, _lse = merge_partials(shared, lse, own, own_lse)
    for i in range(3):
        seen = torch.cat([stored, keys[3, : i + 1, 0]])
        torch.testing.assert_close(merged[i], torch.softmax(query[i] @ seen.T * 0.5, -1) @ seen, rtol=1e-5, atol=1e-5)


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
    with pytest.raises(RuntimeError, match="has 6 queries but reads 5 keys"):
        cpu_attention.paged_attention_cpu(torch.randn(6, 2, 8), keys, keys, torch.tensor([[1, 2]]),
                                          torch.tensor([0, 6]), stops, firsts, 1.0)  # fmt: skip
    with pytest.raises(RuntimeError, match="query_starts must run from 0"):
        cpu_attention.paged_attention_cpu(query, keys, keys, torch.tensor([[1, 2]]), torch.tensor([0, 2]), stops,
                                          firsts, 1.0)  # fmt: skip


@st.composite
def quantized_batches(draw):
    """Rows of a quantized cache: sealed blocks of a drawn format (a row's read may start mid-block), then at times a
    transition (whole blocks, given exact and decoded), then full-precision tokens, with a decode token or a chunk of
    causal queries at the end."""
    spec = draw(st.sampled_from(["int4", "int8", "K4V2", "K2V4", "K8V4"]))
    fmt = format_from_spec(spec)
    block_size, kv_heads = draw(st.sampled_from([4, 16])), draw(st.integers(1, 3))
    group, head_dim = draw(st.sampled_from([1, 3])), draw(st.sampled_from([16, 64]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20), st.integers(0, 3), st.integers(0, 40),
                                   st.integers(1, 70)), min_size=1, max_size=4))  # fmt: skip
    sealed = sum(blocks for blocks, *_rest in rows)
    pools = []
    for side in (fmt.key, fmt.value):
        pool = side.allocate(sealed + 1, block_size, kv_heads, head_dim)
        if sealed:
            side.quantize(torch.randn(sealed, block_size, kv_heads, head_dim, generator=generator), pool,
                          torch.arange(1, sealed + 1))  # fmt: skip
        pools.append(pool)
    ids = (torch.randperm(sealed, generator=generator) + 1).tolist()
    q_width = max(blocks for blocks, *_rest in rows) or 1
    q_tables, q_reads, t_counts, counts, ranges = torch.zeros(len(rows), q_width, dtype=torch.long), [], [], [], []
    for index, (blocks, skip, transition, stored, queries) in enumerate(rows):
        q_tables[index, :blocks] = torch.tensor([ids.pop() for _ in range(blocks)], dtype=torch.long)
        q_reads.append([min(skip, blocks * block_size), blocks * block_size])
        t_counts.append(transition * block_size)
        ranges.append((0, stored))
        reads = q_reads[-1][1] - q_reads[-1][0] + t_counts[-1] + stored
        counts.append(1 if reads <= 1 else min(queries, reads))
    width = max(-(-stop // block_size) for _first, stop in ranges) or 1
    num_blocks = len(rows) * width + 1
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    tables = (torch.randperm(num_blocks - 1, generator=generator)[: len(rows) * width] + 1).view(len(rows), width)
    t_starts = torch.tensor([0, *t_counts]).cumsum(0)
    exact = [torch.randn(kv_heads, int(t_starts[-1]), head_dim, generator=generator) for _ in range(2)]
    decoded = [part + 0.1 * torch.randn(part.shape, generator=generator) for part in exact]
    quantized = cpu_attention.QuantizedRows(fmt.key, fmt.value, pools[0], pools[1], q_tables, torch.tensor(q_reads))
    transition = cpu_attention.TransitionRows(tuple(exact), tuple(decoded), t_starts, draw(st.sampled_from([0, 5, 16])))
    query = torch.randn(sum(counts), kv_heads * group, head_dim, generator=generator)
    starts = torch.tensor([0, *counts]).cumsum(0)
    firsts, stops = (torch.tensor([r[side] for r in ranges]) for side in (0, 1))
    return query, keys, values, tables, starts, stops, firsts, quantized, transition


def decoded_from_codes(quantized, transition, block_size):
    """`transition` turned into one whose decoded tokens are the last whole blocks of each row's quantized read."""
    counts = []
    for row, (first, stop) in enumerate(quantized.reads.tolist()):
        wanted = int(transition.starts[row + 1] - transition.starts[row]) // block_size
        counts.append(min(wanted, (stop - first) // block_size) * block_size)
    starts = torch.tensor([0, *counts]).cumsum(0)
    exact = tuple(part[:, : int(starts[-1])] for part in transition.exact)
    return cpu_attention.TransitionRows(exact, None, starts, transition.window)


@settings(max_examples=60, deadline=None)
@given(quantized_batches(), st.sampled_from(["none", "arrays", "codes"]))
def test_cpu_attention_reads_quantized_blocks_and_transitions_as_its_reference(batch, mode):
    *plain, quantized, transition = batch
    if mode == "codes":
        transition = decoded_from_codes(quantized, transition, plain[1].shape[1])
    if mode == "none":
        transition = None
    # a row needs keys of its own for its queries: keep the batches that have them
    counts = plain[4].diff()
    reads = quantized.reads.diff(dim=1)[:, 0] + plain[5] - plain[6]
    if mode == "arrays":
        reads = reads + transition.starts.diff()
    assume(not bool(((counts > 1) & (reads < counts)).any()) and bool((reads > 0).any()))
    out = cpu_attention.paged_attention_cpu(*plain, 0.25, quantized, transition)
    expected = cpu_attention.paged_attention_cpu_ref(*plain, 0.25, quantized, transition)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cpu_attention_decodes_int4_blocks_as_the_format_does():
    """One row of two sealed int4 blocks and no full-precision token: the kernel's output is attention over the
    format's own decode of the blocks (checked by hand, not by the reference)."""
    fmt = format_from_spec("int4")
    pools = [side.allocate(3, 16, 1, 64) for side in (fmt.key, fmt.value)]
    for side, pool in zip((fmt.key, fmt.value), pools):
        side.quantize(torch.randn(2, 16, 1, 64), pool, torch.tensor([1, 2]))
    quantized = cpu_attention.QuantizedRows(fmt.key, fmt.value, pools[0], pools[1], torch.tensor([[2, 1]]),
                                            torch.tensor([[0, 32]]))  # fmt: skip
    empty = torch.zeros(1, 16, 1, 64)
    query = torch.randn(1, 1, 64)
    out = cpu_attention.paged_attention_cpu(query, empty, empty, torch.zeros(1, 1, dtype=torch.long),
                                            torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0]), 0.125,
                                            quantized)  # fmt: skip
    keys = fmt.key.dequantize(pools[0], [2, 1]).flatten(0, 2)  # [32, 64]
    values = fmt.value.dequantize(pools[1], [2, 1]).flatten(0, 2)
    torch.testing.assert_close(out[0, 0], torch.softmax(keys @ query[0, 0] * 0.125, 0) @ values, rtol=1e-5, atol=1e-5)


def test_a_long_prompt_row_reads_its_sealed_blocks_decoded_once_as_each_tile_would():
    """A prompt chunk of many query tiles over sealed blocks (some sealed as they arrived, read both ways) next to a
    short chunk and a decode token: the long row's blocks are decoded once for all its tiles, the others' per tile,
    all as the reference reads them."""
    fmt, block_size, kv_heads, head_dim = format_from_spec("int4"), 16, 2, 64
    generator = torch.Generator().manual_seed(0)
    pools = [side.allocate(13, block_size, kv_heads, head_dim) for side in (fmt.key, fmt.value)]
    for side, pool in zip((fmt.key, fmt.value), pools):
        side.quantize(torch.randn(12, block_size, kv_heads, head_dim, generator=generator), pool, torch.arange(1, 13))
    tables = torch.tensor([[3, 1, 7, 2, 9, 4, 12], [5, 6, 0, 0, 0, 0, 0], [8, 10, 11, 0, 0, 0, 0]])
    reads = torch.tensor([[5, 112], [0, 32], [0, 48]])  # the long row's read starts mid-block
    quantized = cpu_attention.QuantizedRows(fmt.key, fmt.value, pools[0], pools[1], tables, reads)
    starts = torch.tensor([0, 48, 80, 96])  # its last two blocks and the short row's two: sealed as they arrived
    exact = tuple(torch.randn(kv_heads, 96, head_dim, generator=generator) for _ in range(2))
    transition = cpu_attention.TransitionRows(exact, None, starts, 0)
    counts = [100, 20, 1]
    query = torch.randn(sum(counts), kv_heads * 3, head_dim, generator=generator)
    storage = torch.zeros(1, block_size, kv_heads, head_dim)
    plain = (query, storage, storage, torch.zeros(3, 1, dtype=torch.long), torch.tensor([0, *counts]).cumsum(0),
             torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))  # fmt: skip
    out = cpu_attention.paged_attention_cpu(*plain, 0.125, quantized, transition)
    expected = cpu_attention.paged_attention_cpu_ref(*plain, 0.125, quantized, transition)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cpu_attention_refuses_formats_it_cannot_decode():
    fmt = format_from_spec("int2")  # rotated values
    assert not cpu_attention.reads_format(fmt.value, 16, 64) and cpu_attention.reads_format(fmt.key, 16, 64)
    pools = [side.allocate(2, 16, 1, 64) for side in (fmt.key, fmt.value)]
    quantized = cpu_attention.QuantizedRows(fmt.key, fmt.value, pools[0], pools[1], torch.tensor([[1]]),
                                            torch.tensor([[0, 16]]))  # fmt: skip
    empty = torch.zeros(1, 16, 1, 64)
    with pytest.raises(ValueError, match="cannot decode"):
        cpu_attention.paged_attention_cpu(torch.randn(1, 1, 64), empty, empty, torch.zeros(1, 1, dtype=torch.long),
                                          torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0]), 1.0, quantized)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="a machine that runs AVX-512 can build and run the AVX2 variant too")  # fmt: skip
def test_the_avx2_variant_builds_and_matches_the_references():
    """A machine where torch runs at AVX2 builds that variant of the extension (at::vec's AVX2 header converts float16
    with F16C instructions, so the build needs their flag): a child process told to run at AVX2 builds it and runs the
    kernels' reference comparisons."""
    here = Path(__file__).parent
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    tests = [str(here / name) for name in ("test_cpu_attention.py", "test_cpu_quantize.py", "test_cpu_linear.py")]
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
                            "error::UserWarning", "-k", "not avx2", *tests], env=env, capture_output=True, text=True)  # fmt: skip
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert "skipped" not in child.stdout.splitlines()[-1], child.stdout[-1000:]
