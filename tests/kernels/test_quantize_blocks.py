"""quantize_blocks (the seal kernel) against quantize_blocks_ref, i.e. the formats' own ``quantize``.

Scales and zero points must be bit-identical. Codes must be identical under the interpreter (IEEE
float32, as torch on CPU); on a GPU the kernel's docstring allows a code one step away where the value
lies within a float32 ulp of a rounding tie, and ``assert_codes_match`` accepts exactly that there.
Blocks hold outlier channels, an all-zero token, a constant token, tiny negative values (whose float16
rounding is -0) and, in float32 caches, values beyond the float16 range; the pools start out filled with
junk that must survive outside the destination blocks.
"""

import pytest
import torch
from kernel_testing import DEVICE
from quantized_testing import Int8PerHead

from hf_paged_cache.kernels import quantize_blocks, quantize_blocks_ref
from hf_paged_cache.kernels.layout import allocate_kv_blocks
from hf_paged_cache.quantization import FP8, Int8, IntN, KVFormat, format_from_spec, unpack_codes

_CASES = [
    # (key format, value format, cache dtype, head_dim, block_size)
    ("int8", None, torch.float32, 64, 16),
    ("int4", None, torch.float16, 128, 32),
    ("int2", None, torch.bfloat16, 64, 32),  # Hadamard-rotated values
    ("K2rV4", None, torch.float32, 128, 16),  # rotated keys beyond the float16 range, plain values
    ("K2rV2r", None, torch.float16, 64, 16),
    ("fp8_e4m3", None, torch.float16, 64, 16),
    ("fp8_e5m2", None, torch.float32, 128, 16),
    ("K4V2", None, torch.float32, 64, 32),
    ("K8V4", None, torch.bfloat16, 128, 16),
    (FP8("e4m3", "head"), IntN(4, "token", group_size=32), torch.float16, 64, 16),
    (IntN(2, "channel", group_size=1), FP8("e5m2", "head"), torch.float32, 64, 16),
    (IntN(4, "channel"), IntN(2, "token"), torch.float16, 80, 16),  # head_dim 80: groups 4 and 80
    (Int8PerHead(), FP8("e5m2"), torch.float16, 64, 16),  # a format declared in the tests only
]


def _formats(key, value):
    return format_from_spec(key) if isinstance(key, str) else KVFormat(key, value)


def _case_id(case):
    key, value, dtype, head_dim, block_size = case
    name = key if isinstance(key, str) else f"{key!r}+{value!r}".replace(" ", "")
    return f"{name}-{str(dtype)[6:]}-d{head_dim}-bs{block_size}"


def _blocks(generator, num_blocks, block_size, kv_heads, head_dim, dtype):
    """Head-major cache blocks with outlier channels and the special tokens of the module docstring."""
    data = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    data[..., 3] *= 20.0  # an outlier channel (keys)
    data[:, 0] = 0.0  # an all-zero token
    data[:, 1] = 0.75  # a constant token
    data[:, 2, :, ::2] = -1e-30  # rounds to -0.0 in float16
    if dtype == torch.float32:
        data[0, 3, 0, :4] = torch.tensor([1e5, -2e5, 7e4, 3e6])  # beyond float16: IntN clamps, Int8 / FP8 scale
    cache = allocate_kv_blocks(num_blocks, block_size, kv_heads, head_dim, dtype)
    cache.copy_(data)
    return cache


def _junk_pools(fmt, generator, num_blocks, block_size, kv_heads, head_dim):
    """Two identical pools of ``fmt`` filled with random bytes (finite float16 metadata)."""
    pool = fmt.allocate(num_blocks, block_size, kv_heads, head_dim)
    for tensor in pool.values():
        if tensor.is_floating_point():
            tensor.copy_(torch.rand(tensor.shape, generator=generator))
        else:
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.shape, generator=generator, dtype=torch.uint8))
    return {name: t.to(DEVICE) for name, t in pool.items()}, {name: t.clone() for name, t in pool.items()}


def _codes(fmt, codes):
    """Comparable integer codes: unpacked IntN codes, int8 codes, fp8 bit patterns as ordered integers."""
    codes = codes.cpu()
    if isinstance(fmt, IntN):
        return unpack_codes(codes, fmt.bits).int()
    if isinstance(fmt, FP8):  # sign-magnitude bit patterns -> integers ordered like the values
        magnitude = (codes & 0x7F).int()
        return torch.where(codes >= 0x80, -magnitude, magnitude)
    return codes.int()


def assert_codes_match(fmt, actual, expected):
    a, e = _codes(fmt, actual), _codes(fmt, expected)
    if DEVICE == "cpu":  # the interpreter: IEEE float32 throughout, exactly as the reference
        assert torch.equal(a, e), f"{(a != e).sum()} codes differ"
    else:  # a GPU may land a value within one ulp of a tie on its other side
        assert (a - e).abs().max() <= 1 and (a != e).float().mean() < 1e-3


def assert_pools_match(fmt, actual, expected):
    for name, tensor in expected.items():
        if name == "codes":
            assert_codes_match(fmt, actual[name], tensor)
        else:  # metadata: bit-identical
            assert torch.equal(actual[name].cpu().view(torch.uint8), tensor.view(torch.uint8)), f"{name} differs"


def run_both(k_cache, v_cache, src, dst, formats, generator):
    _, block_size, kv_heads, head_dim = k_cache.shape
    pools = {}
    for side, fmt in (("key", formats.key), ("value", formats.value)):
        pools[side] = _junk_pools(fmt, generator, 5, block_size, kv_heads, head_dim)
    quantize_blocks(k_cache.to(DEVICE), v_cache.to(DEVICE), src, pools["key"][0], pools["value"][0], dst,
                    formats.key, formats.value)  # fmt: skip
    quantize_blocks_ref(k_cache, v_cache, src, pools["key"][1], pools["value"][1], dst, formats.key, formats.value)
    assert_pools_match(formats.key, pools["key"][0], pools["key"][1])
    assert_pools_match(formats.value, pools["value"][0], pools["value"][1])


@pytest.mark.parametrize("key, value, dtype, head_dim, block_size", _CASES, ids=[_case_id(c) for c in _CASES])
def test_quantize_blocks_matches_reference(generator, key, value, dtype, head_dim, block_size):
    formats = _formats(key, value)
    kv_heads = 2 if head_dim == 64 else 1  # the interpreter's cost grows with blocks x heads
    k_cache = _blocks(generator, 3, block_size, kv_heads, head_dim, dtype)
    v_cache = _blocks(generator, 3, block_size, kv_heads, head_dim, dtype)
    src, dst = torch.tensor([2, 0], device=DEVICE), [4, 1]  # tensors or lists; blocks 0, 2, 3 of the pools untouched
    run_both(k_cache, v_cache, src, dst, formats, generator)


@pytest.mark.parametrize("formats", [
    KVFormat(Int8(), IntN(4, "token")), KVFormat(IntN(2, "channel"), FP8("e4m3")), KVFormat(FP8("e5m2"), FP8("e4m3")),
], ids=["int8-int4", "int2ch-e4m3", "e5m2-e4m3"])  # fmt: skip
def test_rounding_ties_go_to_even(generator, formats):
    """Values exactly halfway between two codes (or two fp8 values): round half to even, as torch.round and
    torch's fp8 conversion do. Each token spans a range that makes scale 1 and zero 0 exactly."""
    block_size, head_dim = 16, 64
    ties = torch.randint(-30, 31, (1, block_size, 1, head_dim), generator=generator) / 2  # k + 0.5 and integers
    fp8_ties = torch.tensor([1.0625, 1.1875, 2**-10, 3 * 2**-10, 0.5625, 1.125, 2**-17, 3 * 2**-17])
    cache = {}
    for side, fmt in (("key", formats.key), ("value", formats.value)):
        x = ties.clone()
        if isinstance(fmt, IntN):  # zero 0, scale 1: codes are x itself
            x = x.abs().clamp(max=2**fmt.bits - 1)
            x[..., 0], x[..., 1] = 0.0, 2**fmt.bits - 1
        elif isinstance(fmt, FP8):  # absmax = fp8 max: scale 1; the rest are fp8 rounding ties
            x[..., : len(fp8_ties)] = fp8_ties * torch.where(torch.arange(len(fp8_ties)) % 2 == 0, 1.0, -1.0)
            x[..., -1] = torch.finfo(fmt.fp8_dtype).max
        else:  # absmax 127: scale 1
            x[..., -1] = 127.0
        cache[side] = allocate_kv_blocks(1, block_size, 1, head_dim, torch.float32)
        cache[side].copy_(x)
    run_both(cache["key"], cache["value"], [0], [2], formats, generator)


def test_unsupported_format_raises_naming_it():
    cache = allocate_kv_blocks(1, 16, 1, 96, torch.float16, fill=0.0)
    fmt = IntN(4, "token", group_size=48)
    pool = fmt.allocate(1, 16, 1, 96)
    with pytest.raises(ValueError, match=r"IntN\(bits=4, axis='token', group_size=48, scale_bits=16, rotate=False\)"):
        quantize_blocks(cache, cache, [0], pool, pool, [0], fmt, fmt)


@pytest.mark.parametrize("head_dim, message", [(80, "rotate=True needs a power-of-two head_dim"), (8, "at least 16")])
def test_rotated_format_needs_a_power_of_two_head_dim(head_dim, message):
    """The format rejects a head it cannot rotate; the kernels also a head smaller than their smallest tile."""
    cache = allocate_kv_blocks(1, 16, 1, head_dim, torch.float16, fill=0.0)
    plain, rotated = IntN(4, "token"), IntN(4, "token", rotate=True)
    pool = plain.allocate(1, 16, 1, head_dim)
    with pytest.raises(ValueError, match=message):
        quantize_blocks(cache, cache, [0], pool, pool, [0], rotated, plain)


def test_keys_and_values_laid_out_differently_are_refused():
    """The kernel addresses values by the keys' strides: a value view of other strides is refused, not misread."""
    keys = allocate_kv_blocks(1, 16, 2, 64, torch.float32, fill=1.0)
    values = torch.ones(1, 16, 2, 64)  # token-major, where the keys are head-major
    pool = Int8().allocate(1, 16, 2, 64)
    before = {name: t.clone() for name, t in pool.items()}
    with pytest.raises(ValueError, match="same strides"):
        quantize_blocks(keys, values, [0], pool, pool, [0], Int8(), Int8())
    assert all(torch.equal(pool[name], before[name]) for name in pool)


def test_no_blocks_is_a_no_op():
    cache = allocate_kv_blocks(1, 16, 1, 64, torch.float16, fill=1.0).to(DEVICE)
    pool = {name: t.to(DEVICE) for name, t in Int8().allocate(1, 16, 1, 64).items()}
    quantize_blocks(cache, cache, [], pool, pool, [], Int8(), Int8())
    assert all(not t.any() for t in pool.values())
