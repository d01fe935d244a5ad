"""The format interface (`quantization/base.py`) over every format: round-trip bounds, bytes, token vs block
writes, what `kernel_format` promises, reads, shape checks, the code space."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hf_paged_cache.quantization import FP8, Int8, IntN, rotate_heads, unpack_codes
from quantization.format_testing import (
    ALL_FORMATS, FAST, PER_BLOCK, PER_TOKEN, ROTATED, blocks_of_kv, error_bound, roundtrip,
)  # fmt: skip


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=repr)
@FAST
@given(data=blocks_of_kv())
def test_round_trip_error_is_bounded(fmt, data):
    x, pattern = data
    y, _ = roundtrip(fmt, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    err = (y.double() - x.double()).abs()
    bound = error_bound(fmt, x)
    worst = (err - bound).max()
    assert worst <= 0, f"{pattern}: error exceeds the bound by {worst.item():.3g} (max error {err.max().item():.3g})"
    if pattern == "zeros":
        assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=repr)
def test_a_single_outlier_changes_only_its_own_group(fmt):
    """A 1e4 outlier at (block 0, token 3, head 1, channel 7) leaves every value outside its scale group as is."""
    clean = torch.randn(2, 16, 2, 64)
    x = clean.clone()
    x[0, 3, 1, 7] = 1e4
    y, _ = roundtrip(fmt, x)
    y_clean, _ = roundtrip(fmt, clean)
    tokens = slice(None) if fmt.needs_full_block else 3
    group = fmt.group(64, 16) if isinstance(fmt, IntN) else 64
    shares_scale = torch.zeros_like(x, dtype=torch.bool)
    shares_scale[0, tokens, 1, 7 // group * group : 7 // group * group + group] = True
    if fmt.kernel_format(16, 64).scale_bits == 8:  # the outlier's group sets the unit of every scale of its head
        shares_scale[0, :, 1] = True
    assert torch.equal(y[~shares_scale], y_clean[~shares_scale])
    assert abs(y[0, 3, 1, 7] - 1e4) <= 1e4 / 16


@pytest.mark.parametrize("fmt", ALL_FORMATS + ROTATED, ids=repr)
@pytest.mark.parametrize("shape", [(16, 3, 64), (32, 1, 128), (1, 2, 8), (5, 4, 16)])
def test_bytes_per_block_is_the_sum_of_the_pool_fields(fmt, shape):
    block_size, heads, head_dim = shape
    pool = fmt.allocate(7, block_size, heads, head_dim)
    assert sum(t.nbytes for t in pool.values()) == 7 * fmt.bytes_per_block(block_size, heads, head_dim)
    assert fmt.bytes_per_token(heads, head_dim, block_size) == fmt.bytes_per_block(block_size, heads, head_dim) / block_size
    assert all(t.count_nonzero() == 0 for t in pool.values())
    assert torch.equal(fmt.dequantize(pool, [0, 6]), torch.zeros(2, *shape))  # zero fields read as zeros


def test_byte_costs_match_the_documented_arithmetic():
    """head_dim 64, 3 KV heads: codes + float16 metadata, per token per head."""
    per_head = {
        Int8(): 64 + 2,
        FP8(): 64 + 2,
        FP8(granularity="head"): 64 + 2 / 16,
        IntN(4, "token"): 32 + 4,  # one (scale, zero) per 64 channels
        IntN(4, "token", 32): 32 + 8,
        IntN(2, "token"): 16 + 4,
        IntN(4, "channel"): 32 + 4 * (64 / 4) / 16,  # 16 channel groups per head, amortized over 16 tokens
        IntN(4, "channel", 1): 32 + 4 * 64 / 16,
        IntN(2, "channel"): 16 + 4,
        IntN(2, "channel", 1, scale_bits=8): 16 + 3 * 65 / 16,  # uint8 scale + float16 zero per channel, the unit
    }
    for fmt, expected in per_head.items():
        assert fmt.bytes_per_token(3, 64, 16) == 3 * expected, fmt


@pytest.mark.parametrize("fmt", PER_TOKEN + ROTATED[:2], ids=repr)
@FAST
@given(data=blocks_of_kv(), chunks=st.integers(1, 4), seed=st.integers(0, 1000))
def test_token_writes_equal_whole_block_writes(fmt, data, chunks, seed):
    x, _ = data
    n, block_size, heads, head_dim = x.shape
    blocks = torch.tensor([4, 1, 3][:n])
    whole = fmt.allocate(5, block_size, heads, head_dim)
    fmt.quantize(x, whole, blocks)
    tokens = fmt.allocate(5, block_size, heads, head_dim)
    order = torch.randperm(n * block_size, generator=torch.Generator().manual_seed(seed))
    token_blocks = blocks.repeat_interleave(block_size)[order]
    token_offsets = torch.arange(block_size).repeat(n)[order]
    flat = x.reshape(n * block_size, heads, head_dim)[order]
    for part in torch.arange(len(order)).tensor_split(chunks):  # several writes, in shuffled token order
        fmt.quantize(flat[part], tokens, token_blocks[part].tolist(), token_offsets[part])
    for name in whole:
        assert torch.equal(whole[name], tokens[name]), name
    read = fmt.dequantize(tokens, blocks, dtype=x.dtype)
    assert read.dtype == x.dtype and torch.equal(read, fmt.dequantize(whole, blocks).to(x.dtype))


@pytest.mark.parametrize("fmt", PER_TOKEN, ids=repr)
def test_token_writes_touch_only_their_slots(fmt):
    pool = fmt.allocate(3, 4, 2, 16)
    fmt.quantize(torch.randn(2, 2, 16) + 3, pool, [2, 1], [3, 0])
    read = fmt.dequantize(pool, [0, 1, 2])
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[2, 3] = written[1, 0] = True
    assert (read[written].abs() > 0).all() and (read[~written] == 0).all()


@pytest.mark.parametrize("fmt", PER_BLOCK, ids=repr)
def test_per_block_formats_refuse_token_writes(fmt):
    assert fmt.needs_full_block
    pool = fmt.allocate(2, 4, 1, 8)
    with pytest.raises(ValueError, match="whole blocks"):
        fmt.quantize(torch.randn(1, 1, 8), pool, [1], [0])


def test_needs_full_block_only_for_block_wide_scales():
    assert [f.needs_full_block for f in PER_TOKEN] == [False] * len(PER_TOKEN)
    assert IntN(4, "channel").needs_full_block and not IntN(4, "token").needs_full_block


@pytest.mark.parametrize("fmt", ALL_FORMATS + ROTATED, ids=repr)
def test_kernel_format_describes_what_quantize_writes(fmt):
    """The constants a format hands the kernels agree with its own torch encoding: metadata layout, zero
    point, code range (reached by each row's extreme), and for float codes the float8 type of that width."""
    block_size, kv_heads, head_dim = 16, 2, 64
    kernel = fmt.kernel_format(block_size, head_dim)
    spec = fmt.fields(block_size, kv_heads, head_dim)
    assert kernel.per_token == (spec["scale"][0][0] == block_size) == (not fmt.needs_full_block)
    assert kernel.zero_point == ("zero" in spec)
    groups = math.prod(spec["scale"][0][2 if kernel.per_token else 1 :])
    if kernel.scale_bits == 8:  # uint8 scales and one more zero-field slot per head: the float16 unit
        assert spec["scale"][1] == torch.uint8 and spec["zero"] == ((kv_heads, groups), torch.float16)
        groups -= 1
    assert kernel.group * groups == head_dim
    assert kernel.rotate == fmt.rotate
    x = torch.randn(1, block_size, kv_heads, head_dim, generator=torch.Generator().manual_seed(0))
    _, pool = roundtrip(fmt, x)
    codes = pool["codes"][1:]
    if kernel.exponent_bits:  # uint8 bit patterns of the float8 type of that exponent width
        codes = codes.view({4: torch.float8_e4m3fn, 5: torch.float8_e5m2}[kernel.exponent_bits]).float()
    elif kernel.bits < 8:
        codes = unpack_codes(codes, kernel.bits)
    assert codes.min() >= (0 if kernel.zero_point else -kernel.qmax) and codes.abs().max() == kernel.qmax


def test_dequantize_reads_any_blocks_in_any_order_and_dtype():
    fmt = IntN(4, "channel")
    x = torch.randn(4, 16, 2, 64)
    pool = fmt.allocate(5, 16, 2, 64)
    fmt.quantize(x, pool, [1, 2, 3, 4])
    all_blocks = fmt.dequantize(pool, [1, 2, 3, 4])
    picked = fmt.dequantize(pool, torch.tensor([3, 1, 3]), dtype=torch.bfloat16)
    assert picked.dtype == torch.bfloat16 and torch.equal(picked, all_blocks[[2, 0, 2]].bfloat16())


def test_shape_mismatches_are_reported():
    fmt = Int8()
    pool = fmt.allocate(2, 4, 2, 16)
    with pytest.raises(ValueError, match="tokens per block"):
        fmt.quantize(torch.randn(1, 3, 2, 16), pool, [1])
    with pytest.raises(ValueError, match="len\\(blocks\\)"):
        fmt.quantize(torch.randn(2, 4, 2, 16), pool, [1])
    with pytest.raises(ValueError, match="pool field"):
        fmt.quantize(torch.randn(1, 4, 2, 32), pool, [1])
    with pytest.raises(ValueError, match="len\\(offsets\\)"):
        fmt.quantize(torch.randn(2, 2, 16), pool, [1, 1], [0])
    with pytest.raises(ValueError, match="multiple"):
        IntN(4, "token", group_size=24).fields(16, 1, 64)
    with pytest.raises(ValueError, match="bits"):
        IntN(3)
    with pytest.raises(ValueError, match="axis"):
        IntN(4, "row")
    with pytest.raises(ValueError, match="fmt"):
        FP8("e3m4")


@pytest.mark.parametrize("fmt", ROTATED + [Int8(), IntN(2, "token"), FP8("e4m3")], ids=repr)
def test_code_space_rotates_for_rotating_formats_only(fmt):
    """`code_space` is where a rotating format's codes live (the Hadamard rotation, its own inverse); other formats
    leave vectors as they are, so a reader can map its queries and outputs without asking which format it has."""
    x = torch.randn(2, 16, 2, 64, dtype=torch.float16)
    mapped = fmt.code_space(x)
    if fmt.rotate:
        torch.testing.assert_close(mapped, rotate_heads(x.float()))
        torch.testing.assert_close(fmt.code_space(mapped), x.float(), atol=1e-3, rtol=1e-3)
    else:
        assert mapped is x


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=repr)
def test_dequantize_into_a_view_of_a_larger_buffer_writes_what_it_returns(fmt):
    """`out=` (a view of a reader's head-major buffer with room for more tokens) gets exactly the decoded blocks
    as stored, and leaves the rest of the buffer alone; a rotating side asks for `rotated=True`."""
    blocks, bs, heads, dim, extra = 3, 16, 2, 32, 5
    pool = fmt.allocate(blocks + 1, bs, heads, dim)
    fmt.quantize(torch.randn(blocks, bs, heads, dim, generator=torch.Generator().manual_seed(0)), pool, range(1, 4))
    buffer = torch.full((heads, blocks * bs + extra, dim), 7.0)
    target = buffer[:, : blocks * bs].unflatten(1, (blocks, bs)).permute(1, 2, 0, 3)
    fmt.dequantize(pool, slice(1, 4), torch.float32, rotated=True, out=target)
    assert torch.equal(target, fmt.dequantize(pool, slice(1, 4), torch.float32, rotated=True))
    assert torch.all(buffer[:, blocks * bs :] == 7.0)
    if fmt.rotate:
        with pytest.raises(ValueError, match="rotated=True"):
            fmt.dequantize(pool, slice(1, 4), torch.float32, out=target)


@pytest.mark.parametrize("fmt", ALL_FORMATS + ROTATED, ids=repr)
def test_dequantize_reads_a_table_of_rows_into_a_strided_batch(fmt):
    """A 2-D table of ids (rows of a batch, null-padded) decodes as its rows do one by one, into a view of a
    batch whose rows hold more tokens (a batched read of several sequences' quantized histories)."""
    bs, heads, dim = 16, 2, 32
    pool = fmt.allocate(6, bs, heads, dim)
    fmt.quantize(torch.randn(5, bs, heads, dim, generator=torch.Generator().manual_seed(1)), pool, range(1, 6))
    table = torch.tensor([[4, 1, 2], [5, 0, 0]])
    decoded = fmt.dequantize(pool, table)
    assert decoded.shape == (2, 3, bs, heads, dim)
    # A rotating format rotates back with one matrix product, whose rounding depends on the shape BLAS is handed
    # (AMD EPYC's kernel for few rows rounds differently): equal to float32 rounding there, bit-equal otherwise.
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if fmt.rotate else {"rtol": 0, "atol": 0}
    for row, ids in zip(decoded, table):
        torch.testing.assert_close(row, fmt.dequantize(pool, ids), **tolerance)
    assert torch.equal(decoded[1, 1:], torch.zeros(2, bs, heads, dim))  # the null block decodes to zeros
    batch = torch.full((2, 3 * bs + 4, heads, dim), 7.0)
    target = batch[:, : 3 * bs].unflatten(1, (3, bs))
    fmt.dequantize(pool, table, torch.float32, rotated=True, out=target)
    assert torch.equal(target, fmt.dequantize(pool, table, rotated=True))
    assert torch.all(batch[:, 3 * bs :] == 7.0)


def test_a_format_whose_decode_takes_no_buffer_is_copied_into_one():
    """A format written before `out=` existed (`_decode(fields)`) still decodes into a reader's buffer."""

    class Plain(Int8):
        def _decode(self, fields):
            return super()._decode(fields)

    fmt = Plain()
    pool = fmt.allocate(3, 4, 2, 8)
    fmt.quantize(torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(0)), pool, [1, 2])
    target = torch.empty(2, 4, 2, 8)
    assert fmt.dequantize(pool, [1, 2], out=target) is target
    assert torch.equal(target, Int8().dequantize(pool, [1, 2]))
