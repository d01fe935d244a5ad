"""paged_decode_attention against paged_decode_attention_ref.

Every pair of (dtype, head dim, block size, group) values meets in the parametrised cases; each case
runs single-pass and split-K over ragged rows (empty, one token, mid-block, whole blocks), alternating
MQA (one KV head) and two KV heads.
"""

import itertools

import pytest
import torch
from kernel_testing import DEVICE, assert_close, pairwise_cases

from hf_paged_cache.kernels import paged_decode_attention, paged_decode_attention_ref
from hf_paged_cache.kernels.paged_decode import MAX_SPLITS, choose_num_splits
from hf_paged_cache.kernels.variants import BLOCK_SIZES, DTYPES, GROUPS, HEAD_DIMS

CASES = pairwise_cases(DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS)


def run_both(query, paged, scale, **kwargs):
    out = paged_decode_attention(query, *paged.cache_args(), scale, **kwargs)
    expected = paged_decode_attention_ref(query, *paged.cache_args(), scale, **kwargs)
    return out, expected


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype, head_dim, block_size, group", CASES)
def test_decode_matches_reference(make_paged, randn, dtype, head_dim, block_size, group, num_splits):
    num_kv_heads = 1 if (head_dim + group) % 2 else 2
    seq_lens = [0, 1, 2 * block_size + 5, block_size]
    paged = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    query = randn(len(seq_lens), num_kv_heads * group, head_dim, dtype=dtype)
    out, expected = run_both(query, paged, head_dim**-0.5, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == query.shape
    assert (out[0] == 0).all(), "a row without tokens must give 0"
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(
    "dtype, sliding_window, softcap",
    [
        pytest.param(torch.float32, 7, 0.0, id="fp32-window-starts-mid-tile"),
        pytest.param(torch.bfloat16, 40, 0.0, id="bf16-window-longer-than-some-rows"),
        pytest.param(torch.float16, 0, 1.5, id="fp16-softcap"),
        pytest.param(torch.float32, 20, 2.0, id="fp32-window-and-softcap"),
    ],
)
def test_decode_window_and_softcap(make_paged, randn, dtype, sliding_window, softcap, num_splits):
    seq_lens = [3, 37, 66]
    paged = make_paged(seq_lens, 2, 64, 16, dtype)
    query = randn(3, 8, 64, dtype=dtype)
    out, expected = run_both(query, paged, 0.5, sliding_window=sliding_window, softcap=softcap, num_splits=num_splits)
    assert_close(out, expected, dtype)


def test_decode_more_splits_than_tiles(make_paged, randn):
    """Splits left without a tile write an empty partial that the reduce must ignore."""
    paged = make_paged([0, 5, 40], 1, 32, 16, torch.float32)
    query = randn(3, 4, 32)
    out, expected = run_both(query, paged, 0.3, num_splits=9)
    assert_close(out, expected, torch.float32)


def test_decode_default_heuristic_and_strided_query(make_paged, randn):
    """num_splits=None picks a split count; the query is a head-strided view (as sliced from a fused QKV)."""
    paged = make_paged([30, 61], 2, 80, 16, torch.float16)
    query = randn(2, 16, 80, dtype=torch.float16)[:, ::2]
    assert not query.is_contiguous()
    out, expected = run_both(query, paged, 0.1)
    assert_close(out, expected, torch.float16)


def test_cases_cover_every_pair_of_axis_values():
    axes = (DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS)
    cases = [case.values for case in CASES]
    for (i, axis_i), (j, axis_j) in itertools.combinations(enumerate(axes), 2):
        assert {(c[i], c[j]) for c in cases} == set(itertools.product(axis_i, axis_j))


def test_choose_num_splits():
    assert choose_num_splits(batch=64, num_kv_heads=8, max_context=32768, num_sms=132) == 1  # enough programs
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=32768, num_sms=132) == 33  # ~2 programs per SM
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context=1024, num_sms=132) == 4  # >= 256 keys per split
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context=10**6, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context=100, num_sms=132) == 1


def test_decode_empty_batch():
    cache = torch.zeros(1, 16, 1, 64, device=DEVICE)
    table = torch.zeros(0, 1, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(torch.zeros(0, 2, 64, device=DEVICE), cache, cache, table, table[:, 0], 1.0)
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("sliding_window", [0, 7], ids=["full", "window"])
def test_decode_with_sinks(make_paged, randn, sliding_window, num_splits):
    """Learned sink logits (gpt-oss) join each head's softmax once, split-K included; the window never hides them."""
    paged = make_paged([0, 3, 37], 2, 32, 16, torch.float32)
    query = randn(3, 4, 32)
    sinks = randn(4) * 2
    kwargs = dict(sliding_window=sliding_window, num_splits=num_splits)
    out, expected = run_both(query, paged, 0.5, sinks=sinks, **kwargs)
    assert_close(out, expected, torch.float32)
    assert (out[0] == 0).all(), "a row without tokens must give 0"
    without = paged_decode_attention(query, *paged.cache_args(), 0.5, **kwargs)
    assert (out[1:] - without[1:]).abs().max() > 1e-2, "the sinks must change the output"


def test_decode_refuses_sinks_of_another_shape(make_paged, randn):
    paged = make_paged([3], 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head: shape \(4,\), got \(2,\)"):
        paged_decode_attention(randn(1, 4, 32), *paged.cache_args(), 0.5, sinks=randn(2))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(("dtype", "chunk_size"), [
    pytest.param(torch.float32, 8, id="fp32-chunk8"), pytest.param(torch.float16, 20, id="fp16-chunk20"),
])  # fmt: skip
def test_decode_masks_by_chunk(make_paged, randn, dtype, chunk_size, num_splits):
    """Chunked attention: the query sees its own chunk only, chunks shifted per row (left padding, dropped blocks);
    a row whose query starts a chunk sees itself alone."""
    seq_lens = [3, 37, 66, 41]
    paged = make_paged(seq_lens, 2, 64, 16, dtype)
    query = randn(4, 8, 64, dtype=dtype)
    offsets = torch.tensor([0, 5, 13, 0 - 40 % chunk_size + chunk_size], dtype=torch.int32, device=DEVICE)
    out, expected = run_both(query, paged, 0.5, chunk_size=chunk_size, chunk_offsets=offsets, num_splits=num_splits)
    assert_close(out, expected, dtype)
    full, _ = run_both(query, paged, 0.5, num_splits=num_splits)
    assert not torch.allclose(out.float(), full.float(), atol=1e-2)  # the chunk hid something


def test_chunk_size_and_a_sliding_window_are_refused_together(make_paged, randn):
    paged = make_paged([5], 1, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        paged_decode_attention(randn(1, 1, 32), *paged.cache_args(), 0.5, sliding_window=4, chunk_size=8)
