"""The evictor: *when* rows are cut down to their budget (the policy decides *what* survives).

Triggers, all here: as each layer finishes its attention (`after_attention`: after every prompt chunk
unless `evict_between_chunks` is off; while decoding every `evict_every` steps, or else once a row holds
a whole block more than its budget, so every eviction frees at least one block); when a prompt whose
chunks were not evicted is complete (`before_step`); under pool pressure (`relieve`); by hand
(`PagedCache.evict_now`). Each eviction-enabled layer is its own group, so layers keep different tokens
and per-layer budgets work; sliding-window layers keep their window and evict nothing more.
"""

from __future__ import annotations

import copy

import torch

from ..blocks.plan import StepPlan
from ..blocks.tables import BlockTables
from ..layers.paged import PagedLayer, stored_keys
from .attention_stats import AttentionStats
from .policies.base import EvictionPolicy
from .removal import check_evict, evict_tokens, unit_sizes
from .selection import RowChoice, ScoreInputs


class Evictor:
    """Applies `policy` to the full-attention layers `layers` (`{layer index: layer}`, one group each);
    under tensor parallelism (`tp_size` ranks) scores are averaged over the ranks, so all keep the same.
    The policy's variant keywords are resolved once, into `selector` (`EvictionPolicy.composed()`)."""

    def __init__(self, policy: EvictionPolicy, layers: dict[int, PagedLayer], block_size: int,
                 evict_every: int | None, between_chunks: bool, tp_size: int = 1):  # fmt: skip
        self.policy = policy
        self.selector = policy.composed()
        self.layers = layers
        self.block_size = block_size
        self.evict_every = evict_every
        self.between_chunks = between_chunks
        self.tp_size = tp_size
        self.stats = {index: AttentionStats() for index in layers}
        self.counts: dict[str, list[int]] = {}  # group name -> [row evictions, tokens evicted]
        self.decode_steps = 0
        self.last_q_len = 0  # tokens of the previous forward: tells prefill from decode

    # ------------------------------------------------------------------ triggers
    def before_step(self, stepping: list[BlockTables], q_len: int) -> None:
        """Count decode steps, and compress a prompt whose chunks were not evicted, now that it is complete."""
        if not stepping or stepping[0].length == 0:
            return
        if q_len == 1:
            self.decode_steps += 1
            if self.last_q_len > 1 and not self.between_chunks:
                self.evict(stepping, slack=0)

    def step_planned(self, q_len: int) -> None:
        self.last_q_len = q_len

    def relieve(self, stepping: list[BlockTables]) -> None:
        """Pool pressure: cut every row above its budget down to it before the step is planned again."""
        self.evict(stepping, slack=0)

    def after_attention(self, layer_idx: int, plan: StepPlan, query: torch.Tensor, mask: torch.Tensor | None,
                        scale: float, softcap: float | None, sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """Record the statistic the policy needs from this layer's attention, then evict if it is time."""
        layer, q_len = self.layers[layer_idx], query.shape[2]
        statistic = self.policy.statistic
        if statistic is not None:
            self.stats[layer_idx].record(statistic, layer, plan, query, mask, scale, softcap, sinks)
        if q_len > 1:
            if self.between_chunks:
                self.evict([layer.tables], slack=0)
        elif self.evict_every is None:
            self.evict([layer.tables], slack=self.block_size)
        elif self.decode_steps % self.evict_every == 0:
            self.evict([layer.tables], slack=0)

    # ------------------------------------------------------------------ eviction
    def evict(self, groups: list[BlockTables], slack: int) -> int:
        """Cut every row of `groups` that stores more than its budget + `slack` tokens down to the
        budget; returns the tokens evicted. All decisions are made (and the fresh blocks copy-on-write
        needs are checked) before any row changes, so running out of blocks leaves the cache as it was."""
        by_group = {layer.tables.name: index for index, layer in self.layers.items()}
        decisions = []
        for group in groups:
            index = by_group.get(group.name)
            if index is None or not self.layers[index].is_initialized:
                continue
            keeps = {}
            for row in range(len(group.rows)):
                budget = self.policy.budget_for(group.length - group.rows[row].pads, index)
                if group.stored_count(row) > budget + slack:
                    keeps[row] = self._choose_kept(index, row, budget)
            if keeps:
                check_evict(group, keeps)
                decisions.append((group, index, keeps))
        evicted = 0
        for group, index, keeps in decisions:
            counts = self.counts.setdefault(group.name, [0, 0])
            for row, keep in keeps.items():
                tokens = evict_tokens(group, row, keep, self.layers[index].storage.move_tokens)
                self.stats[index].keep_only(row, keep)
                counts[0] += 1
                counts[1] += tokens
                evicted += tokens
        return evicted

    def _choose_kept(self, index: int, row: int, budget: int) -> torch.Tensor:
        """The row's survivors: `[n]` for all heads, or `[kv_heads, n]` when each head chooses its own."""
        layer = self.layers[index]
        group = layer.tables
        positions = group.stored_positions(row)  # [kv_heads, n] once a per-head choice evicted the row
        kv_heads, count = layer.kv_shape[0], positions.shape[-1]
        attention = None
        if self.policy.statistic is not None:
            attention = self.stats[index].row(row, count, kv_heads)
        inputs = ScoreInputs(positions, group.length, attention, lambda: stored_keys(layer, row).cpu())
        choice = RowChoice(inputs, first_real=group.rows[row].pads, budget=budget, sinks=self.policy.sinks,
                           window=self.policy.window, kv_heads=kv_heads, unit_sizes=unit_sizes(group, row),
                           split=group.quantized_tokens(row), tp_size=self.tp_size)  # fmt: skip
        return self.selector.choose(choice)

    # ------------------------------------------------------------------ following whole-cache edits
    def reorder(self, order: list[int]) -> None:
        """Beam search: the statistics follow their rows."""
        for stats in self.stats.values():
            stats.reorder(order)

    def cropped(self) -> None:
        """After a crop: tokens stored next start with no statistics."""
        for index, stats in self.stats.items():
            group = self.layers[index].tables
            stats.forget_after([group.stored_count(row) for row in range(len(group.rows))])

    def fork(self, layers: dict[int, PagedLayer]) -> Evictor:
        """This evictor for a fork of the cache whose layers are `layers`: statistics and counters copied."""
        twin = copy.copy(self)
        twin.layers = layers
        twin.stats = copy.deepcopy(self.stats)
        twin.counts = copy.deepcopy(self.counts)
        return twin

    def reset(self) -> None:
        self.stats = {index: AttentionStats() for index in self.layers}
        self.counts.clear()
        self.decode_steps = self.last_q_len = 0

    @property
    def totals(self) -> tuple[int, int]:
        """(row evictions, tokens evicted) over every group."""
        return sum(c[0] for c in self.counts.values()), sum(c[1] for c in self.counts.values())

