"""Helpers shared by the kernel tests (imported by name: conftest puts this folder on sys.path).

Paged K/V are built from dense per-row K/V scattered into a shuffled block pool whose unwritten
slots, spare block-table entries and spare block are NaN: a kernel that reads anything it should not
returns NaN instead of a plausible number.
"""

import pytest
import torch

from hf_paged_cache.kernels.layout import allocate_kv_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


class PagedKV:
    """Dense K/V per row (``dense_k[b]``: ``[seq_len, num_kv_heads, head_dim]``) and their paged copy."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, block_size, dtype, generator):
        blocks_per_row = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_row) + 1  # + one spare block, never referenced by a used entry
        order = torch.randperm(num_blocks, generator=generator)
        spare = int(order[0])
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = allocate_kv_blocks(*shape, dtype, fill=float("nan"))
        self.v_cache = allocate_kv_blocks(*shape, dtype, fill=float("nan"))
        # One spare column past the longest row: entries beyond a row's blocks point at the NaN block.
        self.block_tables = torch.full((len(seq_lens), max(blocks_per_row, default=0) + 1), spare, dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.dense_k, self.dense_v = [], []
        used = iter(order[1:].tolist())
        for b, n in enumerate(seq_lens):
            for j in range(blocks_per_row[b]):
                self.block_tables[b, j] = next(used)
            k = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
            s = torch.arange(n)
            self.k_cache[self.block_tables[b, s // block_size].long(), s % block_size] = k
            self.v_cache[self.block_tables[b, s // block_size].long(), s % block_size] = v
            self.dense_k.append(k)
            self.dense_v.append(v)
        for name in ("k_cache", "v_cache", "block_tables", "seq_lens"):
            setattr(self, name, getattr(self, name).to(DEVICE))

    def cache_args(self):
        return self.k_cache, self.v_cache, self.block_tables, self.seq_lens


def assert_close(actual, expected, dtype):
    assert not actual.isnan().any(), "kernel produced NaN"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def pairwise_cases(dtypes, head_dims, block_sizes, groups):
    """12 (dtype, head_dim, block_size, group) cases covering every pair of axis values.

    Walks dtype x head_dim and cycles through block_size x group; with 3 dtypes, 4 head dims and
    2 x 3 (block, group) combinations every pair of values meets at least once.
    """
    combos = [(bs, g) for bs in block_sizes for g in groups]
    cases = []
    for i, dtype in enumerate(dtypes):
        for j, head_dim in enumerate(head_dims):
            block_size, group = combos[(i * len(head_dims) + j) % len(combos)]
            case_id = f"{str(dtype)[6:]}-d{head_dim}-bs{block_size}-g{group}"
            cases.append(pytest.param(dtype, head_dim, block_size, group, id=case_id))
    return cases
