"""paged_prefill_attention against paged_prefill_attention_ref.

Rows mix a fresh prompt, a warm prefix extended by a few tokens (chunked prefill / speculative
verification), a single-token row and an all-padding row, in a right-aligned padded batch.
"""

import pytest
import torch
from kernel_testing import DEVICE, assert_close, pairwise_cases

from hf_paged_cache.kernels import paged_decode_attention, paged_prefill_attention, paged_prefill_attention_ref
from hf_paged_cache.kernels.variants import BLOCK_SIZES, DTYPES, GROUPS, HEAD_DIMS

CASES = pairwise_cases(DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS)


def run_both(query, paged, query_lens, scale, **kwargs):
    query_lens = torch.tensor(query_lens, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(query, *paged.cache_args(), query_lens, scale, **kwargs)
    expected = paged_prefill_attention_ref(query, *paged.cache_args(), query_lens, scale, **kwargs)
    return out, expected


@pytest.mark.parametrize("dtype, head_dim, block_size, group", CASES)
def test_prefill_matches_reference(make_paged, randn, dtype, head_dim, block_size, group):
    num_kv_heads = 1 if (head_dim + group) % 2 else 2
    # (stored tokens, real queries): fresh prompt, warm prefix + 5 new tokens, one new token, padding only
    rows = [(6, 6), (2 * block_size + 3, 5), (block_size, 1), (4, 0)]
    paged = make_paged([n for n, _ in rows], num_kv_heads, head_dim, block_size, dtype)
    query = randn(len(rows), 6, num_kv_heads * group, head_dim, dtype=dtype)
    out, expected = run_both(query, paged, [ql for _, ql in rows], head_dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    assert (out[1, :1] == 0).all() and (out[3] == 0).all(), "padding queries must give 0"
    assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    "dtype, group, sliding_window, softcap",
    [
        pytest.param(torch.float32, 1, 0, 0.0, id="fp32-g1"),
        pytest.param(torch.bfloat16, 1, 9, 0.0, id="bf16-g1-window"),
        pytest.param(torch.float16, 4, 5, 1.5, id="fp16-g4-window-softcap"),
        pytest.param(torch.float32, 8, 0, 2.0, id="fp32-g8-softcap"),
    ],
)
def test_long_prefill_spans_query_tiles(make_paged, randn, dtype, group, sliding_window, softcap):
    """A 70-token chunk over a 10-token warm prefix: several query tiles and key tiles per program."""
    paged = make_paged([80], 1, 64, 16, dtype)
    query = randn(1, 70, group, 64, dtype=dtype)
    out, expected = run_both(query, paged, [70], 0.3, sliding_window=sliding_window, softcap=softcap)
    assert_close(out, expected, dtype)


def test_prefill_strided_query(make_paged, randn):
    """HF hands queries as [batch, heads, q_len, head_dim]; the transposed view is used without a copy."""
    paged = make_paged([12, 20], 2, 80, 16, torch.float16)
    query = randn(2, 4, 7, 80, dtype=torch.float16).transpose(1, 2)
    out, expected = run_both(query, paged, [7, 3], 0.1, sliding_window=4)
    assert_close(out, expected, torch.float16)


def test_single_query_prefill_equals_decode(make_paged, randn):
    paged = make_paged([1, 29, 48], 2, 64, 16, torch.float32)
    query = randn(3, 1, 8, 64)
    prefill = paged_prefill_attention(query, *paged.cache_args(), paged.seq_lens.clamp(max=1), 0.2, softcap=3.0)
    decode = paged_decode_attention(query[:, 0], *paged.cache_args(), 0.2, softcap=3.0)
    assert_close(prefill[:, 0], decode, torch.float32)


@pytest.mark.parametrize("sliding_window", [0, 5], ids=["full", "window"])
def test_prefill_with_sinks(make_paged, randn, sliding_window):
    """Learned sink logits join every query's softmax, whatever its window; padding queries still give 0."""
    rows = [(6, 6), (21, 5), (4, 0)]
    paged = make_paged([n for n, _ in rows], 2, 32, 16, torch.float16)
    query = randn(len(rows), 6, 4, 32, dtype=torch.float16)
    sinks = randn(4) * 2
    query_lens = [ql for _, ql in rows]
    out, expected = run_both(query, paged, query_lens, 0.3, sliding_window=sliding_window, sinks=sinks)
    assert_close(out, expected, torch.float16)
    assert (out[1, :1] == 0).all() and (out[2] == 0).all(), "padding queries must give 0"
    without, _ = run_both(query, paged, query_lens, 0.3, sliding_window=sliding_window)
    assert (out.float() - without.float()).abs().max() > 1e-2, "the sinks must change the output"


@pytest.mark.parametrize(("dtype", "group", "chunk_size"), [
    pytest.param(torch.float32, 1, 8, id="fp32-g1-chunk8"), pytest.param(torch.float16, 4, 12, id="fp16-g4-chunk12"),
])  # fmt: skip
def test_prefill_masks_by_chunk(make_paged, randn, dtype, group, chunk_size):
    """Chunked attention over a warm prefix: queries cross chunk boundaries, each sees its own chunk only; chunks
    shifted per row."""
    paged = make_paged([80, 23], 2, 64, 16, dtype)
    query = randn(2, 40, 2 * group, 64, dtype=dtype)
    offsets = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    out, expected = run_both(query, paged, [40, 17], 0.3, chunk_size=chunk_size, chunk_offsets=offsets)
    assert_close(out, expected, dtype)
