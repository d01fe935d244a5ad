"""Per-layer attention scores for eviction (`AttentionStats`), and the attention mass they are made of.

The `"paged"` attention hands each layer's queries here after its attention; the mass a key receives is
the softmax probability (learned sink logits in its denominator, as in the model's attention) summed over its
KV head's query group and the observed queries -- from the Triton
kernel `paged_attention_mass` on the kernel path, else from `torch_attention.attention_mass` over the
layer's stored key chunks (never a `[queries, keys]` matrix of a whole row).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..attention.torch_path import attention_mass
from .statistics import Statistic

if TYPE_CHECKING:
    from ..blocks.plan import StepPlan
    from ..layers.paged import PagedLayer

QUERY_CHUNK = 256  # queries per pass when the torch path computes attention statistics


class AttentionStats:
    """One layer's scores, `[rows, kv_heads, capacity]` in each row's stored order; grown geometrically."""

    def __init__(self) -> None:
        self.scores: torch.Tensor | None = None

    @torch.no_grad()
    def record(self, statistic: Statistic, layer: PagedLayer, plan: StepPlan, query: torch.Tensor,
               mask: torch.Tensor | None, scale: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """Fold this step's attention of `query` `[batch, heads, q, d]` into the scores."""
        batch, _heads, q_len, _ = query.shape
        observed = statistic.observed_queries(q_len)
        if observed is None:
            return
        counts = [layer.tables.stored_count(row) for row in range(batch)]
        self._fit(batch, max(counts), layer.kv_shape[0], layer.device)
        kernel = layer.uses_kernels() and not layer.is_quantized  # the mass kernel reads full precision only
        mass = _kernel_mass(layer, plan, query, scale, softcap, sinks, observed) if kernel else None
        for row, n in enumerate(counts):
            row_mass = mass[row, :, :n] if mass is not None else _torch_mass(layer, query, mask, scale, softcap, sinks,
                                                                              row, n, observed)  # fmt: skip
            statistic.fold(self.scores[row, :, :n], row_mass)

    def row(self, row: int, count: int, kv_heads: int) -> torch.Tensor:
        """The row's scores for its `count` stored tokens, on the CPU (zeros if nothing was observed)."""
        if self.scores is None or self.scores.shape[0] <= row:
            return torch.zeros(kv_heads, count)
        return self.scores[row, :, :count].cpu()

    def _fit(self, rows: int, count: int, kv_heads: int, device: torch.device) -> None:
        scores = self.scores
        if scores is None or scores.shape[0] != rows or scores.shape[2] < count:
            capacity = max(count, 2 * (scores.shape[2] if scores is not None else 0), 64)
            grown = torch.zeros(rows, kv_heads, capacity, device=device)
            if scores is not None and scores.shape[0] == rows:
                grown[..., : scores.shape[2]] = scores
            self.scores = grown

    def keep_only(self, row: int, keep: torch.Tensor) -> None:
        """Reorder the row's scores like its tokens after an eviction (`keep`: `[n]`, or `[kv_heads, n]` per head)."""
        if self.scores is None:
            return
        scores = self.scores[row]
        heads, count = scores.shape[0], keep.shape[-1]
        kept = scores[:, :count][keep.to(scores.device).expand(heads, count)].view(heads, -1)
        scores.zero_()
        scores[:, : kept.shape[1]] = kept

    def forget_after(self, counts: list[int]) -> None:
        """Zero the scores past each row's stored count (after a crop; a row not listed stores nothing), so
        tokens stored next start from nothing."""
        if self.scores is not None:
            for row in range(self.scores.shape[0]):
                self.scores[row, :, counts[row] if row < len(counts) else 0 :] = 0

    def reorder(self, order: list[int]) -> None:
        """Row i takes the scores of row `order[i]` (beam search)."""
        if self.scores is not None:
            self.scores = self.scores[torch.tensor(order, device=self.scores.device)]


def _kernel_mass(layer: PagedLayer, plan: StepPlan, query: torch.Tensor, scale: float, softcap: float | None,
                 sinks: torch.Tensor | None, observed: int) -> torch.Tensor:  # fmt: skip
    from ..kernels import paged_attention_mass

    device = query.device
    return paged_attention_mass(
        query.transpose(1, 2), layer.key_blocks, plan.tensor("block_tables", device), plan.tensor("seq_lens", device),
        plan.tensor("query_lens", device), scale, 0, softcap or 0.0, observed, sinks=sinks,
    )  # fmt: skip


def _torch_mass(layer: PagedLayer, query: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap, sinks,
                row: int, n: int, observed: int) -> torch.Tensor:  # fmt: skip
    """The mass of row `row`'s `n` stored keys, `QUERY_CHUNK` observed queries at a time."""
    kv_heads, (_, heads, q_len, head_dim) = layer.kv_shape[0], query.shape
    length = layer.tables.length
    columns = length - n + torch.arange(n, device=query.device)  # virtual position of each stored token
    chunks = functools.partial(layer.stored_key_chunks, row)
    total = torch.zeros(kv_heads, n, device=query.device)
    for lo in range(q_len - observed, q_len, QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, q_len)
        queries = query[row, :, lo:hi].float().reshape(kv_heads, -1, head_dim)  # [kv_heads, group * s, d]
        if mask is not None:
            visible = mask[row if mask.shape[0] > 1 else 0, 0, lo:hi].to(query.device)[:, columns]
        else:  # plain causality: query i sits at position length - q_len + i
            visible = columns[None, :] <= (length - q_len + torch.arange(lo, hi, device=query.device))[:, None]
        total += attention_mass(queries, chunks, visible, heads // kv_heads, scale, softcap, sinks)
    return total
