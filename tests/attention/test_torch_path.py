"""The shared torch attention against a dense softmax written out here: masks, soft-capping, grouped heads,
the online softmax over chunks, and the attention mass."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged_cache.attention.torch_path import (
    OnlineSoftmax,
    attend,
    attention,
    attention_mass,
    causal_mask,
    merge_partials,
    partial_attention,
    visible_columns,
)


def _dense(query, key, value, visible, scale, softcap):
    """[heads, q, d] over [kv_heads, n, d] with visible [q, n]: probabilities and output, by the book."""
    group = query.shape[0] // key.shape[0]
    key, value = key.repeat_interleave(group, 0), value.repeat_interleave(group, 0)
    logits = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return probs, probs @ value


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attend_matches_a_dense_softmax_and_zeroes_rows_that_see_nothing(softcap, kv_heads):
    heads, q_len, n, d = 4, 3, 7, 8
    query, key, value = torch.randn(2, heads, q_len, d), torch.randn(2, kv_heads, n, d), torch.randn(2, kv_heads, n, d)
    mask = causal_mask(q_len, n, torch.device("cpu")).expand(2, 1, q_len, n).clone()
    mask[1, 0, 0] = False  # a query of row 1 sees no key (left padding)
    out = attend(query, key, value, mask, 0.3, softcap)
    for row in range(2):
        _probs, expected = _dense(query[row], key[row], value[row], mask[row, 0], 0.3, softcap)
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-5)
    assert torch.all(out[1, :, 0] == 0)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_causal_flag_is_the_square_causal_mask(softcap):
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(1, h, 7, 8, generator=gen) for h in (4, 2, 2))
    expected = attention(query, key, value, causal_mask(7, 7, query.device), 0.3, softcap)
    dense = _dense(query[0], key[0], value[0], causal_mask(7, 7, query.device)[0, 0], 0.3, softcap)[1]
    assert torch.allclose(attention(query, key, value, None, 0.3, softcap, causal=True), expected, atol=1e-6)
    assert torch.allclose(expected[0], dense, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_online_softmax_over_chunks_equals_attention_over_the_whole(softcap):
    heads, kv_heads, q_len, n, d = 4, 2, 3, 11, 8
    query, key, value = torch.randn(heads, q_len, d), torch.randn(kv_heads, n, d), torch.randn(kv_heads, n, d)
    visible = causal_mask(q_len, n, torch.device("cpu"))[0, 0]
    softmax = OnlineSoftmax(query, 0.3, softcap)
    for lo, hi in ((0, 4), (4, 9), (9, 11)):
        softmax.update(key[:, lo:hi], value[:, lo:hi], visible[:, lo:hi])
    _probs, expected = _dense(query, key, value, visible, 0.3, softcap)
    torch.testing.assert_close(softmax.result(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_partial_attentions_merged_equal_attention_over_both_parts(softcap):
    """A batch of rows over a part every row sees and a padded part of its own (the key mask broadcast over the
    grouped queries), merged by log-sum-exp, is each row's attention over both; a part a row sees none of adds 0."""
    gen = torch.Generator().manual_seed(7)
    rows, heads, kv_heads, q_len, d = 3, 4, 2, 2, 8
    query = torch.randn(rows, heads, q_len, d, generator=gen)
    shared = [torch.randn(1, kv_heads, 6, d, generator=gen) for _ in range(2)]
    own = [torch.randn(rows, kv_heads, 5, d, generator=gen) for _ in range(2)]
    lengths = torch.tensor([5, 2, 0])  # the last row has nothing of its own
    keys_seen = (torch.arange(5)[None, :] < lengths[:, None])[:, None, None, :]  # [rows, 1, 1, 5]
    grouped = query.reshape(rows, kv_heads, -1, d)
    everyone = grouped.transpose(0, 1).reshape(1, kv_heads, -1, d)  # every row's queries, per KV head
    first, first_lse = partial_attention(everyone, *shared, None, 0.3, softcap)
    first = first.reshape(kv_heads, rows, -1, d).transpose(0, 1)  # back to rows: [rows, kv_heads, g * q, d]
    first_lse = first_lse.reshape(kv_heads, rows, -1).transpose(0, 1)
    second, second_lse = partial_attention(grouped, *own, keys_seen, 0.3, softcap)
    assert torch.all(torch.isinf(second_lse[2]))
    merged, _lse = merge_partials(first, first_lse, second, second_lse)
    for row in range(rows):
        n = int(lengths[row])
        key = torch.cat([shared[0][0], own[0][row, :, :n]], dim=1)
        value = torch.cat([shared[1][0], own[1][row, :, :n]], dim=1)
        _probs, expected = _dense(query[row], key, value, torch.ones(q_len, 6 + n, dtype=torch.bool), 0.3, softcap)
        torch.testing.assert_close(merged[row].reshape(heads, q_len, d), expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), cuts=st.lists(st.integers(0, 24), max_size=3), seed=st.integers(0, 2**16))
def test_merging_partial_attentions_over_any_split_of_the_keys_is_the_whole(n, cuts, seed):
    """However the keys are cut into parts (empty ones included), the parts' partial attentions merged in order are the
    attention over all of them, and the log-sum-exps add up to the whole's."""
    gen = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen),
                         torch.randn(1, 2, n, 8, generator=gen))  # fmt: skip
    whole, whole_lse = partial_attention(query, key, value, None, 0.3, None)
    bounds = [0, *sorted(min(cut, n) for cut in cuts), n]
    out = lse = None
    for lo, hi in zip(bounds, bounds[1:]):
        part, part_lse = partial_attention(query, key[:, :, lo:hi], value[:, :, lo:hi],
                                           torch.ones(1, 1, 6, hi - lo, dtype=torch.bool), 0.3, None)  # fmt: skip
        out, lse = (part, part_lse) if out is None else merge_partials(out, lse, part, part_lse)
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_attention_mass_is_the_probability_summed_over_the_group_and_queries():
    heads, kv_heads, q_len, n, d = 4, 2, 3, 9, 8
    query, key = torch.randn(heads, q_len, d), torch.randn(kv_heads, n, d)
    visible = causal_mask(q_len, n, torch.device("cpu"))[0, 0]
    probs, _ = _dense(query, key, key, visible, 0.3, None)
    expected = probs.reshape(kv_heads, heads // kv_heads * q_len, n).sum(1)
    grouped = query.reshape(kv_heads, -1, d)
    mass = attention_mass(grouped, lambda: iter([key[:, :5], key[:, 5:]]), visible, heads // kv_heads, 0.3, None)
    torch.testing.assert_close(mass, expected)


def test_visible_columns_hides_columns_left_of_the_read():
    mask = torch.tensor([[True, False, True]])
    assert visible_columns(mask, 1, 2).tolist() == [[False, True]]
    assert visible_columns(mask, -2, 3).tolist() == [[False, False, True]]
