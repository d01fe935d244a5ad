"""Attention statistics: each `Statistic` folded by `AttentionStats` equals the dense softmax of the queries
it observes, step after step, and the scores follow their tokens through an eviction."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache.eviction import Accumulated, AttentionStats, LastQuery, ObservationWindow


class _Tables:
    def __init__(self, length: int):
        self.length = length

    def stored_count(self, row: int) -> int:
        return self.length


class _Layer:
    """What `AttentionStats.record` reads of a layer: its keys in stored order, on the torch path."""

    is_quantized = False
    device = torch.device("cpu")

    def __init__(self, keys: torch.Tensor):
        self.keys, self.kv_shape, self.tables = keys, (keys.shape[1], keys.shape[-1]), _Tables(keys.shape[2])

    def uses_kernels(self) -> bool:
        return False

    def stored_key_chunks(self, row: int):
        yield self.keys[row]


def _dense_mass(query: torch.Tensor, keys: torch.Tensor, observed: int, scale: float) -> torch.Tensor:
    """[kv_heads, n]: causal softmax of the last `observed` queries, summed over each KV head's group."""
    kv_heads, n = keys.shape[0], keys.shape[1]
    heads, q_len = query.shape[0], query.shape[1]
    positions = n - q_len + torch.arange(q_len)
    logits = query @ keys.repeat_interleave(heads // kv_heads, 0).transpose(-1, -2) * scale
    logits = logits.masked_fill(torch.arange(n)[None, :] > positions[:, None], float("-inf"))
    probs = torch.softmax(logits, -1)[:, q_len - observed :]
    return probs.reshape(kv_heads, -1, n).sum(1)


@pytest.mark.parametrize(
    "statistic", [Accumulated(), Accumulated(decay=0.5), LastQuery(), ObservationWindow(size=3)], ids=repr
)
def test_statistic_folds_the_dense_softmax_of_its_queries(statistic):
    kv_heads, heads, d, scale = 2, 4, 8, 0.3
    keys = torch.randn(1, kv_heads, 9, d)
    stats, expected = AttentionStats(), torch.zeros(kv_heads, 9)
    for q_len, length in ((6, 6), (1, 7), (2, 9)):  # a prefill, a decode step, a two-token step
        layer = _Layer(keys[:, :, :length])
        query = torch.randn(1, heads, q_len, d)
        stats.record(statistic, layer, None, query, None, scale, None)
        observed = statistic.observed_queries(q_len)
        if observed is not None:
            mass = _dense_mass(query[0], keys[0, :, :length], observed, scale)
            current = expected[:, :length]
            if isinstance(statistic, Accumulated):
                current.mul_(statistic.decay or 1.0).add_(mass)
            else:
                current.copy_(mass)
        torch.testing.assert_close(stats.row(0, length, kv_heads), expected[:, :length], atol=1e-5, rtol=1e-5)


def test_eviction_reorders_scores_like_tokens():
    stats = AttentionStats()
    stats.scores = torch.arange(12, dtype=torch.float32).reshape(1, 2, 6)
    stats.keep_only(0, torch.tensor([True, False, True, False, False, True]))
    assert stats.scores[0].tolist() == [[0, 2, 5, 0, 0, 0], [6, 8, 11, 0, 0, 0]]
    stats.forget_after([2])
    assert stats.scores[0].tolist() == [[0, 2, 0, 0, 0, 0], [6, 8, 0, 0, 0, 0]]
