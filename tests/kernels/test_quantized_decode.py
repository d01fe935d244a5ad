"""paged_decode_attention over a quantized prefix, against paged_decode_attention_ref(quantized=...).

Each KV format of the kernels' format axis runs once, the dtype, head dim, block size and group cycled
(bf16 runs fp32 dots under the interpreter, see kernels/src/common.py). Rows are ragged: full precision only,
quantized only (no full-precision token), both with the prefix ending inside a 64-key tile, a partial
last block, and an empty row. The reference itself is checked against dense attention over the
dequantized K/V.
"""

import dataclasses

import pytest
import torch
from kernel_testing import DEVICE, assert_close
from quantized_testing import Int8PerHead, QuantizedPagedKV, format_params, sdpa_row

from hf_paged_cache.kernels import QuantizedKV, paged_decode_attention, paged_decode_attention_ref
from hf_paged_cache.kernels.paged_decode import plan_paged_decode
from hf_paged_cache.kernels.quantized import format_constexprs
from hf_paged_cache.quantization import Int8, IntN, KVFormat


def rows_for(block_size):
    """(quantized blocks, full-precision tokens) per row."""
    return [(0, 5), (2, 0), (1, 13), (3, block_size + 1), (0, 0)]


def run_both(query, paged, scale, **kwargs):
    args = (query, *paged.cache_args(), scale)
    out = paged_decode_attention(*args, quantized=paged.quantized, **kwargs)
    expected = paged_decode_attention_ref(*args, quantized=paged.quantized, **kwargs)
    return out, expected


@pytest.mark.parametrize("kv_format, dtype, head_dim, block_size, group", format_params())
def test_quantized_decode_matches_reference(generator, randn, kv_format, dtype, head_dim, block_size, group):
    num_kv_heads = 1 if group == 8 else 2
    paged = QuantizedPagedKV(rows_for(block_size), num_kv_heads, head_dim, block_size, dtype, kv_format, generator)
    query = randn(5, num_kv_heads * group, head_dim, dtype=dtype)
    out, expected = run_both(query, paged, head_dim**-0.5, num_splits=1)
    assert out.dtype == dtype and out.shape == query.shape
    assert (out[4] == 0).all(), "a row without tokens must give 0"
    assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    "kv_format, dtype, num_splits, sliding_window, softcap",
    [
        pytest.param("int4", torch.float32, 3, 0, 0.0, id="int4-fp32-split3"),
        pytest.param("K4V2", torch.float16, 4, 7, 0.0, id="K4V2-fp16-split4-window-in-prefix"),
        pytest.param("fp8_e5m2", torch.bfloat16, 2, 40, 2.0, id="fp8_e5m2-bf16-split2-window-softcap"),
        pytest.param("K8V4", torch.float16, 1, 0, 1.5, id="K8V4-fp16-softcap"),
    ],
)
def test_quantized_decode_split_window_softcap(generator, randn, kv_format, dtype, num_splits, sliding_window, softcap):
    """Splits share out the whole (quantized + full-precision) range; a split boundary falls inside the prefix."""
    paged = QuantizedPagedKV([(4, 3), (1, 30), (2, 0)], 2, 64, 16, dtype, kv_format, generator)
    query = randn(3, 4, 64, dtype=dtype)
    out, expected = run_both(
        query, paged, 0.3, num_splits=num_splits, sliding_window=sliding_window, softcap=softcap
    )
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_quantized_decode_masks_by_chunk(generator, randn, num_splits):
    """Chunks counted over the whole stored range: a chunk may start inside the quantized prefix or after it."""
    paged = QuantizedPagedKV([(4, 3), (1, 30), (2, 0)], 2, 64, 16, torch.float16, "K4V2", generator)
    query = randn(3, 4, 64, dtype=torch.float16)
    offsets = torch.tensor([2, 7, 0], dtype=torch.int32, device=DEVICE)
    out, expected = run_both(query, paged, 0.3, num_splits=num_splits, chunk_size=20, chunk_offsets=offsets)
    assert_close(out, expected, torch.float16)


def test_no_quantized_tokens_equals_unquantized(generator, randn):
    """Rows without a quantized prefix read the paged cache as the unquantized kernel does."""
    paged = QuantizedPagedKV([(0, 21), (0, 40)], 2, 64, 16, torch.float32, "int4", generator)
    query = randn(2, 4, 64)
    out = paged_decode_attention(query, *paged.cache_args(), 0.2, quantized=paged.quantized)
    assert_close(out, paged_decode_attention(query, *paged.cache_args(), 0.2), torch.float32)


def test_unquantized_launch_is_unchanged():
    """quantized=None: no quantized argument, QUANTIZED=False, today's tile, warps and stages."""
    cache = torch.zeros(2, 16, 2, 128, dtype=torch.float16, device=DEVICE)
    table = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    query = torch.zeros(1, 8, 128, dtype=torch.float16, device=DEVICE)
    (launch,) = plan_paged_decode(query, cache, cache, table, table[:, 0], 1.0, num_splits=1)[1]
    assert launch.constexprs["QUANTIZED"] is False and launch.constexprs["BLOCK_N"] == 32
    assert (launch.num_warps, launch.num_stages) == (4, 2)
    assert all(launch.args[name] is None for name in ("k_codes", "v_scales", "quant_tables", "stride_kcode_tok"))


@pytest.mark.parametrize("window", [0, 10])
def test_quantized_decode_reference_matches_dense(generator, randn, window):
    paged = QuantizedPagedKV([(2, 5), (1, 0), (0, 9)], 2, 32, 16, torch.float32, "K4V2", generator)
    query = randn(3, 4, 32)
    out = paged_decode_attention_ref(query, *paged.cache_args(), 0.25, sliding_window=window, quantized=paged.quantized)
    for b, n in enumerate(paged.seq_lens.tolist()):
        expected = sdpa_row(query[b, None], torch.tensor([n - 1]), paged.dense_k[b], paged.dense_v[b], 0.25, window)
        assert_close(out[b], expected[0], torch.float32)


def test_a_format_declares_its_own_kernel_constants(generator, randn):
    """A format class the kernels have never seen, of an encoding they know, gets its constexprs from its own
    ``kernel_format`` and decodes like its reference: no kernel change."""
    assert format_constexprs(Int8PerHead(), 16, 64) == dict(
        BITS=8, EXPONENT_BITS=0, ZERO_POINT=False, QMAX=127.0, PER_TOKEN=False, GROUP=64, SCALE_BITS=16, ROTATE=False
    )
    formats = KVFormat(Int8PerHead(), IntN(4, "token"))
    paged = QuantizedPagedKV(rows_for(16), 2, 64, 16, torch.float16, formats, generator)
    query = randn(5, 4, 64, dtype=torch.float16)
    out, expected = run_both(query, paged, 0.125, num_splits=2)
    assert_close(out, expected, torch.float16)


def test_an_encoding_the_kernels_lack_is_refused():
    class FP4(Int8PerHead):
        def kernel_format(self, block_size, head_dim):
            return dataclasses.replace(super().kernel_format(block_size, head_dim), bits=4, exponent_bits=2)

    with pytest.raises(ValueError, match=r"FP4\(\).*not an encoding the kernels implement"):
        format_constexprs(FP4(), 16, 64)

    class TokenScales8(IntN):  # 8-bit scales need a per-block unit: per-token metadata has none
        def kernel_format(self, block_size, head_dim):
            return dataclasses.replace(super().kernel_format(block_size, head_dim), scale_bits=8)

    with pytest.raises(ValueError, match=r"TokenScales8.*not an encoding the kernels implement"):
        format_constexprs(TokenScales8(4, "token"), 16, 64)


def test_unsupported_format_names_it():
    with pytest.raises(ValueError, match="group_size=48"):
        format_constexprs(IntN(4, "token", group_size=48), 16, 96)
    with pytest.raises(ValueError, match="Int8.*block_size 24"):
        format_constexprs(Int8(), 24, 64)


def test_mismatched_fields_are_rejected(generator, randn):
    paged = QuantizedPagedKV([(1, 2)], 1, 64, 16, torch.float32, "int4", generator)
    wrong = QuantizedKV(
        paged.quantized.value_format, paged.quantized.value_format, paged.quantized.key_fields,
        paged.quantized.value_fields, paged.quantized.block_tables, paged.quantized.lens,
    )  # fmt: skip
    with pytest.raises(ValueError, match="key field 'scale'"):
        paged_decode_attention(randn(1, 2, 64), *paged.cache_args(), 1.0, quantized=wrong)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_quantized_decode_with_sinks(generator, randn, num_splits):
    """Sinks over an int8 prefix and its full-precision rest: one share of each softmax, once, split or not."""
    paged = QuantizedPagedKV([(2, 3), (1, 30), (0, 0)], 2, 64, 16, torch.float16, "int8", generator)
    query = randn(3, 4, 64, dtype=torch.float16)
    sinks = randn(4) * 2
    out, expected = run_both(query, paged, 0.3, num_splits=num_splits, sliding_window=20, sinks=sinks)
    assert_close(out, expected, torch.float16)
    without, _ = run_both(query, paged, 0.3, num_splits=num_splits, sliding_window=20)
    assert (out[:2].float() - without[:2].float()).abs().max() > 1e-2, "the sinks must change the output"
