"""paged_attention_mass against paged_attention_mass_ref, and the reference against a dense loop.

Rows are ragged (empty, one token, mid-block, a warm prefix extended by a few queries, a fresh
prompt) in the right-aligned padded query layout of paged_prefill_attention. Besides matching the
reference, every result must conserve probability: each selected query spreads exactly 1 per query
head over the keys, so a KV head's row sums to ``group x selected queries``.
"""

import pytest
import torch
from kernel_testing import DEVICE, assert_close

from hf_paged_cache.kernels import paged_attention_mass, paged_attention_mass_ref

# (dtype, head_dim, block_size, group, last_queries, sliding_window, softcap): every dtype, head dim,
# block size, group and last_queries mode appears; window and softcap alone and together.
CASES = [
    pytest.param(torch.float32, 64, 16, 1, None, 0, 0.0, id="fp32-d64-bs16-g1-all"),
    pytest.param(torch.float32, 80, 32, 8, 3, 5, 0.0, id="fp32-d80-bs32-g8-last3-window"),
    pytest.param(torch.float16, 128, 16, 4, 1, 0, 2.0, id="fp16-d128-bs16-g4-last1-softcap"),
    pytest.param(torch.float16, 256, 32, 1, None, 7, 1.5, id="fp16-d256-bs32-g1-all-window-softcap"),
    pytest.param(torch.bfloat16, 64, 32, 4, 4, 0, 0.0, id="bf16-d64-bs32-g4-last4"),
]


def run_both(query, k_cache, block_tables, seq_lens, query_lens, scale, **kwargs):
    query_lens = torch.tensor(query_lens, dtype=torch.int32, device=DEVICE)
    out = paged_attention_mass(query, k_cache, block_tables, seq_lens, query_lens, scale, **kwargs)
    expected = paged_attention_mass_ref(query, k_cache, block_tables, seq_lens, query_lens, scale, **kwargs)
    return out, expected


def assert_conserved(out, seq_lens, query_lens, group, last_queries=None):
    """Zero past each row's length; each selected query contributes ``group`` in total per KV head."""
    for b, (n, ql) in enumerate(zip(seq_lens, query_lens)):
        selected = ql if last_queries is None else min(ql, last_queries)
        assert (out[b, :, n:] == 0).all(), "keys past seq_len must get 0"
        sums = out[b].sum(-1).cpu()
        torch.testing.assert_close(sums, torch.full_like(sums, float(group * selected)), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype, head_dim, block_size, group, last_queries, window, softcap", CASES)
def test_mass_matches_reference(make_paged, randn, dtype, head_dim, block_size, group, last_queries, window, softcap):
    # (stored tokens, real queries): empty; one token; warm prefix + 5 (mid-block); fresh prompt; 2 of 6 queries
    rows = [(0, 0), (1, 1), (block_size + 7, 5), (6, 6), (3, 2)]
    seq_lens, query_lens = [n for n, _ in rows], [ql for _, ql in rows]
    num_kv_heads = 2 if group == 1 else 1
    paged = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    query = randn(len(rows), 6, num_kv_heads * group, head_dim, dtype=dtype)
    kwargs = dict(last_queries=last_queries, sliding_window=window, softcap=softcap)
    out, expected = run_both(query, paged.k_cache, paged.block_tables, paged.seq_lens, query_lens, 0.3, **kwargs)
    assert out.dtype == torch.float32 and out.shape == (len(rows), num_kv_heads, paged.block_tables.shape[1] * block_size)
    # fp32 probabilities from the same logits: well inside the attention tolerances even for 16-bit caches
    assert_close(out, expected, torch.float32)
    assert_conserved(out, seq_lens, query_lens, group, last_queries)


def test_decode_mass(make_paged, randn):
    """max_q = 1: each row's last token over a long context (several key tiles); TOVA's score."""
    seq_lens = [0, 1, 45]
    paged = make_paged(seq_lens, 2, 64, 16, torch.float16)
    query = randn(3, 1, 8, 64, dtype=torch.float16)
    out, expected = run_both(query, paged.k_cache, paged.block_tables, paged.seq_lens, [0, 1, 1], 0.125)
    assert_close(out, expected, torch.float32)
    assert_conserved(out, seq_lens, [0, 1, 1], 4)


def test_strided_query_and_long_window(make_paged, randn):
    """HF's [batch, heads, q_len, head_dim] query used as a transposed view; more queries than one tile
    (SnapKV's observation window of 40 over a 70-token chunk)."""
    seq_lens, query_lens = [80], [70]
    paged = make_paged(seq_lens, 1, 64, 16, torch.float32)
    query = randn(1, 8, 70, 64).transpose(1, 2)
    out, expected = run_both(query, paged.k_cache, paged.block_tables, paged.seq_lens, query_lens, 0.2, last_queries=40)
    assert_close(out, expected, torch.float32)
    assert_conserved(out, seq_lens, query_lens, 8, 40)


def test_no_selected_queries_gives_zeros(make_paged, randn):
    paged = make_paged([5], 1, 64, 16, torch.float32)
    out = paged_attention_mass(randn(1, 0, 1, 64), paged.k_cache, paged.block_tables, paged.seq_lens,
                               torch.zeros(1, dtype=torch.int32), 1.0)  # fmt: skip
    assert out.shape == (1, 1, 32) and (out == 0).all()
    with pytest.raises(ValueError, match="last_queries"):
        paged_attention_mass(randn(1, 1, 1, 64), paged.k_cache, paged.block_tables, paged.seq_lens,
                             torch.ones(1, dtype=torch.int32), 1.0, last_queries=0)  # fmt: skip


@pytest.mark.parametrize("window, softcap, last_queries", [(0, 0.0, None), (4, 3.0, 2)])
def test_reference_matches_dense_loop(make_paged, randn, window, softcap, last_queries):
    """The reference (batched gather + masked softmax) against a per-(query, head) loop on dense K."""
    seq_lens, query_lens, group, scale = [0, 7, 21], [0, 7, 3], 2, 0.25
    paged = make_paged(seq_lens, 2, 16, 16, torch.float32)
    query = randn(3, 7, 4, 16)
    out = paged_attention_mass_ref(
        query, paged.k_cache, paged.block_tables, paged.seq_lens, torch.tensor(query_lens, dtype=torch.int32),
        scale, sliding_window=window, softcap=softcap, last_queries=last_queries,
    )  # fmt: skip
    expected = torch.zeros_like(out)
    for b, (n, ql) in enumerate(zip(seq_lens, query_lens)):
        selected = ql if last_queries is None else min(ql, last_queries)
        for i in range(7 - selected, 7):
            p = n - 7 + i  # stored index of query position i
            lo = max(0, p - window + 1) if window else 0
            for h in range(4):
                logits = paged.dense_k[b][lo : p + 1, h // group].float() @ query[b, i, h].float() * scale
                if softcap:
                    logits = softcap * torch.tanh(logits / softcap)
                expected[b, h // group, lo : p + 1] += torch.softmax(logits, dim=0)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("window", [0, 5], ids=["full", "window"])
def test_mass_with_sinks(make_paged, randn, window):
    """Sink logits take their share of each softmax: the keys' mass is the model's probabilities (reference),
    so each selected query gives the keys less than `group` in total."""
    rows = [(0, 0), (1, 1), (23, 5), (6, 6)]
    seq_lens, query_lens = [n for n, _ in rows], [ql for _, ql in rows]
    paged = make_paged(seq_lens, 1, 64, 16, torch.float32)
    query = randn(len(rows), 6, 4, 64)
    sinks = randn(4) * 2
    args = (query, paged.k_cache, paged.block_tables, paged.seq_lens, query_lens, 0.3)
    out, expected = run_both(*args, sliding_window=window, sinks=sinks)
    assert_close(out, expected, torch.float32)
    without, _ = run_both(*args, sliding_window=window)
    for b, (n, ql) in enumerate(rows):
        if ql:
            assert (out[b, :, :n].sum() < without[b, :, :n].sum() - 1e-3).item(), "the sinks take a share"
