"""The kernel variants that are supported, compile-checked and tested -- listed once.

Each axis below is a constexpr specialisation of the kernels (the cache dtype picks the dot dtype).
``example_launches`` turns one point of the grid into the launches the real launchers would issue,
by calling the launchers' own ``plan_*`` functions on tiny CPU tensors; ``compile_check`` compiles
exactly those and the tests parametrise over the same axes.

The quantized variants (a quantized prefix read by decode / prefill, and the seal kernel writing it) add
a KV-format axis on a smaller grid of their own (``quantized_grid``): the formats multiply the variants,
and the unquantized grid is not multiplied by them.
"""

from __future__ import annotations

import itertools

import torch

from hf_paged_cache.quantization import format_from_spec

from .attention_mass import plan_paged_attention_mass
from .cache_write import plan_write_kv
from .launch import Launch
from .layout import allocate_kv_blocks
from .paged_decode import plan_paged_decode
from .paged_prefill import plan_paged_prefill
from .quantized import QuantizedKV
from .seal import plan_quantize_blocks

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 80, 128, 256)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 4, 8)
# Split counts for the decode variants: a single pass, and split-K (decode kernel + reduce kernel).
DECODE_SPLITS = (1, 4)
# Soft-capping (Gemma-2 style) is a constexpr too. It only adds elementwise work, independent of the
# block size, so its variants are built at the first block size only (see ``grid``); so are those with learned
# sink logits (gpt-oss, HAS_SINKS), which only change where each online softmax starts.
SOFTCAP = 30.0

# The quantized grid: KV formats (hf_paged_cache.quantization.registry.format_from_spec specs) on 16-bit caches.
# "int2" rotates its values (hf_paged_cache.quantization.int_n.IntN.rotate), "K2rV4" its keys only, "K2rV2r" both (the
# read path rotates the query for keys and the output for values); "K2V2" is 2-bit without rotation.
QUANT_FORMATS = ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2", "K4V2", "K8V4", "K2V2", "K2rV4", "K2rV2r")
QUANT_DTYPES = (torch.float16, torch.bfloat16)
QUANT_HEAD_DIMS = (64, 128)
QUANT_GROUPS = (1, 8)

_NUM_KV_HEADS = 2  # shapes below only have to be valid: compilation depends on dtypes and constexprs
_BATCH = 2
_NUM_BLOCKS = 4


def grid(dtypes=DTYPES, head_dims=HEAD_DIMS, block_sizes=BLOCK_SIZES, groups=GROUPS):
    """(dtype, head_dim, block_size, group, softcap, sinks) points: the full product without soft-capping or
    sinks, plus soft-capping and sinks (each alone) at ``block_sizes[0]``."""
    for dtype, head_dim, block_size, group in itertools.product(dtypes, head_dims, block_sizes, groups):
        yield dtype, head_dim, block_size, group, 0.0, False
        if block_size == block_sizes[0]:
            yield dtype, head_dim, block_size, group, SOFTCAP, False
            yield dtype, head_dim, block_size, group, 0.0, True


def example_launches(
    dtype: torch.dtype, head_dim: int, block_size: int, group: int, softcap: float = 0.0, sinks: bool = False
) -> list[tuple[str, Launch]]:
    """(label, launch) for every kernel launch a model with these parameters triggers (``sinks``: learned sink
    logits, one per query head)."""
    q_heads = _NUM_KV_HEADS * group
    k_cache = allocate_kv_blocks(_NUM_BLOCKS, block_size, _NUM_KV_HEADS, head_dim, dtype, fill=0.0)
    v_cache = allocate_kv_blocks(_NUM_BLOCKS, block_size, _NUM_KV_HEADS, head_dim, dtype, fill=0.0)
    block_tables = torch.zeros(_BATCH, _NUM_BLOCKS // _BATCH, dtype=torch.int32)
    seq_lens = torch.ones(_BATCH, dtype=torch.int32)
    token_kv = torch.zeros(_BATCH, _NUM_KV_HEADS, head_dim, dtype=dtype)
    logits = dict(softcap=softcap, sinks=torch.zeros(q_heads) if sinks else None)

    labelled = [("write_kv", launch) for launch in plan_write_kv(k_cache, v_cache, token_kv, token_kv, seq_lens.long())]
    for num_splits in DECODE_SPLITS:
        query = torch.zeros(_BATCH, q_heads, head_dim, dtype=dtype)
        _, launches = plan_paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, 1.0, num_splits=num_splits, **logits
        )
        names = ["decode_split", "reduce_splits"] if num_splits > 1 else ["decode"]
        labelled += zip(names, launches)
    query = torch.zeros(_BATCH, 3, q_heads, head_dim, dtype=dtype)
    _, launches = plan_paged_prefill(query, k_cache, v_cache, block_tables, seq_lens, seq_lens, 1.0, **logits)
    labelled += [("prefill", launch) for launch in launches]
    _, launches = plan_paged_attention_mass(query, k_cache, block_tables, seq_lens, seq_lens, 1.0, **logits)
    labelled += zip(["mass_lse", "mass"], launches)
    return labelled


def quantized_grid(
    formats=QUANT_FORMATS, dtypes=QUANT_DTYPES, head_dims=QUANT_HEAD_DIMS, block_sizes=BLOCK_SIZES, groups=QUANT_GROUPS
):
    """(kv_format, dtype, head_dim, block_size, group) points of the quantized variants.

    Per format, two complementary points: each axis takes its first value in one and its second in the
    other, in a pattern cycled over the formats (``_PATTERNS``) so that every pair of axis values meets
    somewhere in the grid. Two points per format instead of the product's 16 keep compile_check's time
    bounded; register use depends mostly on the format, the head dim and the block size.
    """
    axes = (dtypes, head_dims, block_sizes, groups)
    if not all(axes):  # an axis narrowed to values outside the quantized grid: no quantized points
        return
    seen = set()
    for f, kv_format in enumerate(formats):
        pattern = _PATTERNS[f % len(_PATTERNS)]
        for flip in (0, 1):
            point = (kv_format, *(axis[(bit ^ flip) % len(axis)] for axis, bit in zip(axes, pattern)))
            if point not in seen:  # axes narrowed to one value (compile_check's options) repeat points
                seen.add(point)
                yield point


# Which value (0 / 1) each axis (dtype, head dim, block size, group) takes in a format's first point.
_PATTERNS = ((0, 0, 0, 0), (0, 1, 0, 1), (0, 0, 1, 1), (0, 1, 1, 0))


def quantized_example_launches(
    kv_format: str, dtype: torch.dtype, head_dim: int, block_size: int, group: int
) -> list[tuple[str, Launch]]:
    """(label, launch) for the launches of a model whose history is stored in ``kv_format``: decode (single
    pass and split-K) and prefill over a quantized prefix, and the seal kernel."""
    formats = format_from_spec(kv_format)
    q_heads = _NUM_KV_HEADS * group
    k_cache = allocate_kv_blocks(_NUM_BLOCKS, block_size, _NUM_KV_HEADS, head_dim, dtype, fill=0.0)
    v_cache = allocate_kv_blocks(_NUM_BLOCKS, block_size, _NUM_KV_HEADS, head_dim, dtype, fill=0.0)
    block_tables = torch.zeros(_BATCH, _NUM_BLOCKS // _BATCH, dtype=torch.int32)
    seq_lens = torch.ones(_BATCH, dtype=torch.int32)
    shape = (block_size, _NUM_KV_HEADS, head_dim)
    pools = [fmt.allocate(_NUM_BLOCKS, *shape) for fmt in (formats.key, formats.value)]
    quantized = QuantizedKV(formats.key, formats.value, *pools, block_tables, torch.zeros(_BATCH, dtype=torch.int32))

    labelled = []
    for num_splits in DECODE_SPLITS:
        query = torch.zeros(_BATCH, q_heads, head_dim, dtype=dtype)
        _, launches = plan_paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, 1.0, num_splits=num_splits, quantized=quantized
        )
        labelled += zip(["qdecode_split", "reduce_splits"] if num_splits > 1 else ["qdecode"], launches)
    query = torch.zeros(_BATCH, 3, q_heads, head_dim, dtype=dtype)
    _, launches = plan_paged_prefill(
        query, k_cache, v_cache, block_tables, seq_lens, seq_lens, 1.0, quantized=quantized
    )
    labelled += [("qprefill", launch) for launch in launches]
    blocks = torch.zeros(1, dtype=torch.int32)
    seal = plan_quantize_blocks(
        k_cache, v_cache, blocks, quantized.key_fields, quantized.value_fields, blocks, formats.key, formats.value
    )
    labelled += [("seal", launch) for launch in seal]
    return labelled
