"""paged_prefill_attention over a quantized prefix, against paged_prefill_attention_ref(quantized=...).

Rows mix a fresh prompt (nothing quantized), a quantized history extended by a few new tokens (the
usual chunked-prefill / warm-cache step), queries that reach back into the quantized tokens (a row with
no full-precision token), and padding only. The reference is checked against dense attention.
"""

import itertools

import pytest
import torch
from kernel_testing import DEVICE, assert_close
from quantized_testing import FORMAT_CASES, FORMATS, QuantizedPagedKV, format_params, sdpa_row

from hf_paged_cache.kernels import paged_decode_attention, paged_prefill_attention, paged_prefill_attention_ref
from hf_paged_cache.kernels.variants import BLOCK_SIZES, DTYPES, QUANT_FORMATS, QUANT_GROUPS, QUANT_HEAD_DIMS

# (quantized blocks, full-precision tokens, real queries) per row; q_len 6.
ROWS = [(0, 6, 6), (2, 9, 5), (1, 0, 3), (1, 4, 0)]


def run_both(query, paged, query_lens, scale, **kwargs):
    query_lens = torch.tensor(query_lens, dtype=torch.int32, device=DEVICE)
    args = (query, *paged.cache_args(), query_lens, scale)
    out = paged_prefill_attention(*args, quantized=paged.quantized, **kwargs)
    expected = paged_prefill_attention_ref(*args, quantized=paged.quantized, **kwargs)
    return out, expected


@pytest.mark.parametrize("kv_format, dtype, head_dim, block_size, group", format_params())
def test_quantized_prefill_matches_reference(generator, randn, kv_format, dtype, head_dim, block_size, group):
    num_kv_heads = 1 if group == 8 else 2
    paged = QuantizedPagedKV([r[:2] for r in ROWS], num_kv_heads, head_dim, block_size, dtype, kv_format, generator)
    query = randn(len(ROWS), 6, num_kv_heads * group, head_dim, dtype=dtype)
    out, expected = run_both(query, paged, [r[2] for r in ROWS], head_dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    assert (out[1, :1] == 0).all() and (out[3] == 0).all(), "padding queries must give 0"
    assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    "kv_format, dtype, sliding_window, softcap",
    [
        pytest.param("int4", torch.float16, 20, 0.0, id="int4-fp16-window"),
        pytest.param("fp8_e4m3", torch.float32, 9, 2.0, id="fp8_e4m3-fp32-window-softcap"),
    ],
)
def test_quantized_prefill_window_softcap(generator, randn, kv_format, dtype, sliding_window, softcap):
    """A 40-token chunk after 48 quantized tokens: several query tiles; windows start inside the prefix."""
    paged = QuantizedPagedKV([(3, 40)], 1, 64, 16, dtype, kv_format, generator)
    query = randn(1, 40, 4, 64, dtype=dtype)
    out, expected = run_both(query, paged, [40], 0.3, sliding_window=sliding_window, softcap=softcap)
    assert_close(out, expected, dtype)


def test_single_query_prefill_equals_decode(generator, randn):
    paged = QuantizedPagedKV([(2, 3), (1, 0)], 2, 64, 16, torch.float32, "K4V2", generator)
    query = randn(2, 1, 8, 64)
    ones = torch.ones(2, dtype=torch.int32, device=DEVICE)
    prefill = paged_prefill_attention(query, *paged.cache_args(), ones, 0.2, quantized=paged.quantized)
    decode = paged_decode_attention(query[:, 0], *paged.cache_args(), 0.2, quantized=paged.quantized)
    assert_close(prefill[:, 0], decode, torch.float32)


@pytest.mark.parametrize("window", [0, 7])
def test_quantized_prefill_reference_matches_dense(generator, randn, window):
    paged = QuantizedPagedKV([r[:2] for r in ROWS], 1, 32, 16, torch.float32, "int2", generator)
    query = randn(len(ROWS), 6, 2, 32)
    query_lens = torch.tensor([r[2] for r in ROWS], dtype=torch.int32)
    out = paged_prefill_attention_ref(
        query, *paged.cache_args(), query_lens, 0.3, sliding_window=window, quantized=paged.quantized
    )
    for b, (n, ql) in enumerate(zip(paged.seq_lens.tolist(), query_lens.tolist())):
        q_pos = torch.arange(n - ql, n)
        expected = sdpa_row(query[b, 6 - ql :], q_pos, paged.dense_k[b], paged.dense_v[b], 0.3, window)
        assert_close(out[b, 6 - ql :], expected, torch.float32)


def test_format_cases_cover_every_format_and_pair_of_axis_values():
    assert FORMATS == QUANT_FORMATS and [case[0] for case in FORMAT_CASES] == list(QUANT_FORMATS)
    axes = (DTYPES, QUANT_HEAD_DIMS, BLOCK_SIZES, QUANT_GROUPS)
    for (i, axis_i), (j, axis_j) in itertools.combinations(enumerate(axes, start=1), 2):
        assert {(case[i], case[j]) for case in FORMAT_CASES} == set(itertools.product(axis_i, axis_j))


def test_quantized_prefill_with_sinks(generator, randn):
    """Sinks over an int8 prefix: prefill queries spanning both parts give the reference's output."""
    paged = QuantizedPagedKV([(2, 6), (1, 3)], 2, 64, 16, torch.float16, "int8", generator)
    query = randn(2, 5, 4, 64, dtype=torch.float16)
    sinks = randn(4) * 2
    out, expected = run_both(query, paged, [5, 3], 0.3, sliding_window=9, sinks=sinks)
    assert_close(out, expected, torch.float16)
    without, _ = run_both(query, paged, [5, 3], 0.3, sliding_window=9)
    assert (out.float() - without.float()).abs().max() > 1e-2, "the sinks must change the output"


def test_quantized_prefill_masks_by_chunk(generator, randn):
    """A 40-token step over 48 quantized tokens with chunks of 12: early queries' chunks start in the prefix."""
    paged = QuantizedPagedKV([(3, 40)], 2, 64, 16, torch.float16, "int4", generator)
    query = randn(1, 40, 4, 64, dtype=torch.float16)
    offsets = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    out, expected = run_both(query, paged, [40], 0.3, chunk_size=12, chunk_offsets=offsets)
    assert_close(out, expected, torch.float16)
