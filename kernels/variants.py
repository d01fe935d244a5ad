"""The kernel variants that are supported, compile-checked and tested -- listed once.

Each axis below is a constexpr specialisation of the kernels (the cache dtype picks the dot dtype).
``example_launches`` turns one point of the grid into the launches the real launchers would issue,
by calling the launchers' own ``plan_*`` functions on tiny CPU tensors; ``compile_check`` compiles
exactly those and the tests parametrise over the same axes.
"""

from __future__ import annotations

import itertools

import torch

from .cache_write import plan_write_kv
from .common import Launch
from .layout import allocate_kv_blocks
from .paged_decode import plan_paged_decode
from .paged_prefill import plan_paged_prefill

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 80, 128, 256)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 4, 8)
# Split counts for the decode variants: a single pass, and split-K (decode kernel + reduce kernel).
DECODE_SPLITS = (1, 4)
# Soft-capping (Gemma-2 style) is a constexpr too. It only adds elementwise work, independent of the
# block size, so its variants are built at the first block size only (see ``grid``).
SOFTCAP = 30.0

_NUM_KV_HEADS = 2  # shapes below only have to be valid: compilation depends on dtypes and constexprs
_BATCH = 2
_NUM_BLOCKS = 4


def grid(dtypes=DTYPES, head_dims=HEAD_DIMS, block_sizes=BLOCK_SIZES, groups=GROUPS):
    """(dtype, head_dim, block_size, group, softcap) points: the full product without soft-capping,
    plus soft-capping at ``block_sizes[0]``."""
    for dtype, head_dim, block_size, group in itertools.product(dtypes, head_dims, block_sizes, groups):
        yield dtype, head_dim, block_size, group, 0.0
        if block_size == block_sizes[0]:
            yield dtype, head_dim, block_size, group, SOFTCAP


def example_launches(
    dtype: torch.dtype, head_dim: int, block_size: int, group: int, softcap: float = 0.0
) -> list[tuple[str, Launch]]:
    """(label, launch) for every kernel launch a model with these parameters triggers."""
    q_heads = _NUM_KV_HEADS * group
    k_cache = allocate_kv_blocks(_NUM_BLOCKS, block_size, _NUM_KV_HEADS, head_dim, dtype, fill=0.0)
    v_cache = allocate_kv_blocks(_NUM_BLOCKS, block_size, _NUM_KV_HEADS, head_dim, dtype, fill=0.0)
    block_tables = torch.zeros(_BATCH, _NUM_BLOCKS // _BATCH, dtype=torch.int32)
    seq_lens = torch.ones(_BATCH, dtype=torch.int32)
    token_kv = torch.zeros(_BATCH, _NUM_KV_HEADS, head_dim, dtype=dtype)

    labelled = [("write_kv", launch) for launch in plan_write_kv(k_cache, v_cache, token_kv, token_kv, seq_lens.long())]
    for num_splits in DECODE_SPLITS:
        query = torch.zeros(_BATCH, q_heads, head_dim, dtype=dtype)
        _, launches = plan_paged_decode(
            query, k_cache, v_cache, block_tables, seq_lens, 1.0, softcap=softcap, num_splits=num_splits
        )
        names = ["decode_split", "reduce_splits"] if num_splits > 1 else ["decode"]
        labelled += zip(names, launches)
    query = torch.zeros(_BATCH, 3, q_heads, head_dim, dtype=dtype)
    _, launches = plan_paged_prefill(query, k_cache, v_cache, block_tables, seq_lens, seq_lens, 1.0, softcap=softcap)
    labelled += [("prefill", launch) for launch in launches]
    return labelled
