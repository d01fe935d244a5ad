"""The torch references themselves, checked against torch SDPA on dense (non-paged) K/V.

The kernels are only as right as the references they are compared with, so the references are
validated independently: each row's dense K/V goes through ``scaled_dot_product_attention`` with an
explicit boolean mask, while the reference reads the same tokens through the shuffled block table.
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import assert_close

from hf_paged_cache.kernels import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref


def sdpa_rows(q, q_pos, k, v, scale, window):
    """SDPA (on CPU) for one row: q [Lq, Hq, D] at stored indices q_pos, dense k/v [Lk, Hkv, D]."""
    q = q.cpu()
    k_pos = torch.arange(k.shape[0])
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [0, 6])
def test_decode_reference_matches_sdpa(make_paged, randn, window):
    paged = make_paged([1, 21, 37], 2, 64, 16, torch.float32)
    query = randn(3, 8, 64)
    out = paged_decode_attention_ref(query, *paged.cache_args(), 0.125, sliding_window=window)
    for b, n in enumerate(paged.seq_lens.tolist()):
        expected = sdpa_rows(query[b, None], torch.tensor([n - 1]), paged.dense_k[b], paged.dense_v[b], 0.125, window)
        assert_close(out[b], expected[0], torch.float32)


@pytest.mark.parametrize("window", [0, 5])
def test_prefill_reference_matches_sdpa(make_paged, randn, window):
    paged = make_paged([9, 40], 1, 32, 16, torch.float32)
    query_lens = torch.tensor([9, 6], dtype=torch.int32)  # a fresh prompt; a warm prefix of 34 tokens
    query = randn(2, 9, 4, 32)
    out = paged_prefill_attention_ref(query, *paged.cache_args(), query_lens, 0.2, sliding_window=window)
    for b, (n, ql) in enumerate(zip(paged.seq_lens.tolist(), query_lens.tolist())):
        expected = sdpa_rows(query[b, 9 - ql :], torch.arange(n - ql, n), paged.dense_k[b], paged.dense_v[b], 0.2, window)
        assert_close(out[b, 9 - ql :], expected, torch.float32)
        assert (out[b, : 9 - ql] == 0).all()


def test_fresh_causal_prefill_reference_matches_sdpa_is_causal(make_paged, randn):
    paged = make_paged([12], 2, 16, 16, torch.float32)
    query = randn(1, 12, 2, 16)
    out = paged_prefill_attention_ref(query, *paged.cache_args(), torch.tensor([12], dtype=torch.int32), 0.25)
    expected = F.scaled_dot_product_attention(
        query[0].cpu().transpose(0, 1), paged.dense_k[0].transpose(0, 1), paged.dense_v[0].transpose(0, 1),
        is_causal=True, scale=0.25,
    )  # fmt: skip
    assert_close(out[0], expected.transpose(0, 1), torch.float32)


def test_empty_rows_give_zero(make_paged, randn):
    paged = make_paged([0, 3], 1, 16, 16, torch.float32)
    out = paged_decode_attention_ref(randn(2, 1, 16), *paged.cache_args(), 1.0)
    assert (out[0] == 0).all() and not out.isnan().any()


def test_write_kv_reference_places_tokens_at_slots():
    k_cache = torch.zeros(3, 4, 1, 2)
    v_cache = torch.zeros(3, 4, 1, 2)
    key, value = torch.randn(3, 1, 2), torch.randn(3, 1, 2)
    write_kv_ref(k_cache, v_cache, key, value, torch.tensor([9, -1, 0]))  # block 2 offset 1; skipped; block 0
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[0, 0], value[2])
    assert torch.count_nonzero(k_cache) == 4


@pytest.mark.parametrize("window", [0, 5])
def test_prefill_reference_with_sinks_matches_gpt_oss_eager_attention(make_paged, randn, window):
    """The sinks' semantics are transformers' gpt-oss `eager_attention_forward`: one logit per head appended to
    each query row's logits before the softmax, dropped after."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    paged = make_paged([6, 21], 2, 32, 16, torch.float32)
    query = randn(2, 6, 8, 32)
    sinks = randn(8) * 2
    query_lens = torch.tensor([6, 6], dtype=torch.int32, device=query.device)
    out = paged_prefill_attention_ref(query, *paged.cache_args(), query_lens, 0.3, sliding_window=window, sinks=sinks)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks.cpu(), 4, False
    for b, n in enumerate(paged.seq_lens.tolist()):
        q_pos, k_pos = torch.arange(n - 6, n), torch.arange(n)
        visible = (k_pos[None, :] <= q_pos[:, None]) & ((window == 0) | (k_pos[None, :] > q_pos[:, None] - window))
        additive = torch.zeros(1, 1, 6, n).masked_fill(~visible, float("-inf"))
        expected, _ = eager_attention_forward(
            module, query[b, None].cpu().transpose(1, 2), paged.dense_k[b].cpu().float().transpose(0, 1)[None],
            paged.dense_v[b].cpu().float().transpose(0, 1)[None], additive, 0.3,
        )  # fmt: skip
        assert_close(out[b], expected[0], torch.float32)
