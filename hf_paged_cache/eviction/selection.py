"""Choosing a row's survivors from scores: what a choice looks at (`ScoreInputs`, `RowChoice`), the rules
every choice keeps (padding goes, sinks and the recent window stay, units are kept whole, every head keeps
as many tokens), and the `Selector` interface that policies and their wrappers (`wrappers.py`) implement.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ..distributed import reduce_scores


@dataclass
class ScoreInputs:
    """What a policy may look at for one row of one layer: `n` stored tokens, in stored order.

    keys: float32 `[kv_heads, n, head_dim]` (quantized tokens decoded), computed only when asked for.
    attention: float32 `[kv_heads, n]`, the policy's `statistic` (None when it needs none).
    positions: int64 `[n]`, the logical position of each stored token (after earlier evictions these
    are no longer contiguous), or `[kv_heads, n]` once a per-head choice evicted the row (each KV
    head then stores its own survivors); `length` is the row's logical length.
    """

    positions: torch.Tensor
    length: int
    attention: torch.Tensor | None
    _keys: object = field(repr=False, default=None)  # a callable returning the keys

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        return self._keys()


@dataclass(frozen=True)
class TakenFirst:
    """Tokens a choice takes before the policy's scores rank the rest (`ProtectNovel`: the most novel).

    shared: bool `[n]`, those the head-shared choice takes first; priority: `[kv_heads, n]`, how each head
    ranks them when it chooses its own (as many after the sealed units as `shared` holds there).
    """

    shared: torch.Tensor
    priority: torch.Tensor

    def per_head(self, row: RowChoice) -> torch.Tensor:
        """Bool `[kv_heads, n - split]`: each head's own tokens taken first among the full-precision ones."""
        split = row.split
        return novel_tokens(row, self.priority[:, split:], int(self.shared[split:].sum()), start=split)


@dataclass(frozen=True)
class RowChoice:
    """One row of one layer to be cut down to `budget` tokens: the policy's inputs and the constraints.

    first_real: positions before it are padding; sinks / window: the first real and the most recent tokens
    never evicted; unit_sizes: the units kept or evicted whole, in stored order (None: one token each);
    split: the stored index where full-precision tokens start (sealed quantized units come before);
    tp_size: tensor-parallel ranks that must agree on head-shared scores; first: tokens taken first.
    """

    inputs: ScoreInputs
    first_real: int
    budget: int
    sinks: int
    window: int
    kv_heads: int = 1
    unit_sizes: list[int] | None = None
    split: int = 0
    tp_size: int = 1
    first: TakenFirst | None = None

    @property
    def positions(self) -> torch.Tensor:
        """`[n]` positions of the head-shared choice (sinks and window stand at the same index in every head)."""
        positions = self.inputs.positions
        return positions if positions.dim() == 1 else positions[0]

    def reduce(self, scores: torch.Tensor) -> torch.Tensor:
        """`[n]` scores, the same on every tensor-parallel rank, from a policy's `[n]` or `[kv_heads, n]`."""
        return reduce_scores(scores, self.tp_size).cpu()

    def taking_first(self, first: TakenFirst) -> RowChoice:
        """This row with `first` taken before the scores rank the rest (a wrapper hands it to the inner choice)."""
        return dataclasses.replace(self, first=first)

    def protection(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(real, protected) for stored tokens at `positions`: which are not padding, and which are never
        evicted (the first `sinks` real tokens and the most recent `window`)."""
        real = positions >= self.first_real
        recent = positions >= self.inputs.length - self.window
        return real, real & ((positions < self.first_real + self.sinks) | recent)


class Selector(ABC):
    """Chooses which stored tokens of a row survive: a policy does it by its own scores, for all heads at
    once; wrappers (`PerHead`, `ProtectNovel`) change how."""

    @abstractmethod
    def choose(self, row: RowChoice) -> torch.Tensor:
        """Bool `[n]` (the same tokens in every head) or `[kv_heads, n]` (each head its own, as many)."""


def novel_tokens(row: RowChoice, novelty: torch.Tensor, count: int, start: int = 0) -> torch.Tensor:
    """Bool, shaped like `novelty` (`[n - start]`, or `[kv_heads, n - start]` for each head's own): the `count`
    highest-ranked real tokens from stored index `start` on, besides those protected anyway."""
    positions = (row.inputs.positions if novelty.dim() == 2 else row.positions)[..., start:]
    real, protected = row.protection(positions.expand_as(novelty))
    candidates = real & ~protected
    count = min(count, int(candidates.sum(dim=-1).min()))
    top = novelty.float().masked_fill(~candidates, float("-inf")).topk(count, dim=-1).indices
    return torch.zeros_like(candidates).scatter_(-1, top, True)


def choose_kept(row: RowChoice, scores: torch.Tensor) -> torch.Tensor:
    """Bool `[n]`: which stored tokens of the row survive, by `scores` `[n]` (or `[kv_heads, n]`, averaged).

    Tokens come in units that are kept or evicted whole (a quantized block: its tokens share scales and
    are never re-quantized; a full-precision token: itself). Padding always goes; sinks and the recent
    window always stay; the other units are taken by descending mean score while they fit the budget,
    the `row.first` ones first.
    """
    scores = scores.float()
    if scores.dim() == 2:
        scores = scores.mean(0)
    if row.first is not None:  # taken first, while they fit (a sealed unit with such a token counts as one)
        scores = scores.masked_fill(row.first.shared, float("inf"))
    real, protected = row.protection(row.positions)
    unit_sizes = row.unit_sizes if row.unit_sizes is not None else [1] * len(scores)
    sizes = torch.tensor(unit_sizes)
    unit = torch.repeat_interleave(torch.arange(len(unit_sizes)), sizes)

    def per_unit(values: torch.Tensor) -> torch.Tensor:  # sum over each unit's tokens
        return torch.zeros(len(unit_sizes)).index_add_(0, unit, values.float())

    unit_real, unit_protected = per_unit(real) > 0, per_unit(protected) > 0
    unit_score = per_unit(scores) / sizes
    room = row.budget - int(sizes[unit_protected].sum())
    candidates = (unit_real & ~unit_protected).nonzero().flatten()
    order = candidates[torch.argsort(unit_score[candidates], descending=True, stable=True)]
    fits = torch.cumsum(sizes[order], 0) <= room
    keep_units = unit_protected.clone()
    keep_units[order[fits]] = True
    return keep_units[unit]


def choose_kept_per_head(row: RowChoice, scores: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Bool `[kv_heads, n]`: which stored tokens each KV head keeps, by its own `scores` `[kv_heads, n]`.

    `shared` is the head-shared choice (`choose_kept`): it decides the sealed quantized units before stored
    index `row.split` for every head, and how many full-precision tokens stay. After the split each head
    keeps its sinks and recent window plus its own best-scored tokens (its `row.first` ones first), up to
    that count, so every head stores as many tokens as the others and the row's blocks hold a rectangle.
    """
    heads, n = scores.shape
    split = row.split
    real, protected = row.protection(row.inputs.positions.expand(heads, n)[:, split:])
    room = int(shared[split:].sum()) - protected.sum(dim=1)  # per head (the protected counts are the same)
    ranked = scores[:, split:].float()
    if row.first is not None:
        ranked = ranked.masked_fill(row.first.per_head(row), float("inf"))
    ranked = ranked.masked_fill(~(real & ~protected), float("-inf"))
    order = torch.argsort(ranked, dim=1, descending=True, stable=True)
    taken = torch.arange(order.shape[1])[None, :] < room[:, None]
    keep = protected | torch.zeros_like(protected).scatter_(1, order, taken)
    return torch.cat([shared[:split].expand(heads, -1), keep], dim=1)
