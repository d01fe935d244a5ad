"""What every policy shares (`EvictionPolicy`): the budget, the protected tokens, and the keywords that
compose it with its variants.

A policy is one small dataclass with a `score()` (higher = keep), in the spirit of kvpress's presses. The
cache applies it after the prompt's prefill, between chunks of a chunked prefill, during decoding and under
pool pressure (`PagedCacheConfig.evict_every` / `evict_between_chunks`), and removes each row's evicted
tokens so that whole blocks return to the pool (`PagedCache.evict_now()` triggers it by hand): see
`evictor.py`. A policy that needs attention statistics names a `Statistic` (`statistics.py`) in `statistic`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..budget import TokenBudget
from ..novelty import check_novelty_options
from ..selection import RowChoice, ScoreInputs, Selector, choose_kept
from ..statistics import Statistic
from ..wrappers import PerHead, ProtectNovel


@dataclass
class EvictionPolicy(Selector):
    """Budget and protection shared by every policy; subclasses implement `score`.

    Args:
        budget: tokens kept per row and layer (an int >= 1), or a fraction in (0, 1] of the row's
            tokens (padding excluded) at the time of eviction.
        sinks: the first `sinks` tokens of each row are never evicted (attention sinks).
        window: the most recent `window` tokens are never evicted.
        layer_budgets: optional per-layer multipliers of `budget`, one per layer of the model (index =
            layer index; e.g. `pyramid_budgets(num_layers)`); a layer's budget is rounded down.
        per_head: sugar for wrapping the policy in `PerHead` (each KV head keeps its own best tokens).
            Default: True for H2O, SnapKV and KeepRatio, False for the others (chosen by measurement,
            docs/BENCHMARKS.md).
        protect_novel: sugar for wrapping it in `ProtectNovel(..., protect_novel, rotary)`: that fraction of
            the budget first goes to the most novel tokens (0 disables).
        rotary: how the model's rotary embedding pairs key channels, for `key_novelty`: "half" (channel i
            with i + head_dim/2, transformers' `rotate_half`: Llama, Qwen, Mistral, Gemma, GPT-NeoX),
            "interleaved" (2i with 2i+1, GPT-J), or "none" (no rotary embedding, e.g. GPT-2).

    The three variant keywords are resolved once, by `composed()`, into the selector the evictor runs; they
    stay fields so that a saved cache names its policy by its fields alone. A budget in tokens below
    `sinks + window` (at any layer) is refused here; a ratio's budget of a short row is raised to
    `sinks + window`, since those tokens are never evicted.
    """

    budget: int | float = 1024
    sinks: int = 4
    window: int = 32
    layer_budgets: Sequence[float] | None = None
    per_head: bool = False
    protect_novel: float = 0.0
    rotary: str = "half"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.per_head, bool):
            raise ValueError(f"{name}: `per_head` must be True or False, got {self.per_head!r}")
        check_novelty_options(name, self.protect_novel, self.rotary)
        if self.layer_budgets is not None:
            self.layer_budgets = list(self.layer_budgets)
        self.token_budget.check()

    @property
    def token_budget(self) -> TokenBudget:
        return TokenBudget(self.budget, self.sinks, self.window, self.layer_budgets, type(self).__name__)

    def budget_for(self, tokens: int, layer_idx: int) -> int:
        """Tokens to keep in a row of `tokens` real tokens at layer `layer_idx`."""
        return self.token_budget.tokens(tokens, layer_idx)

    def composed(self) -> Selector:
        """The selector this policy's keywords describe: itself, within `PerHead` if `per_head`, within
        `ProtectNovel` if `protect_novel`."""
        selector: Selector = PerHead(self) if self.per_head else self
        return ProtectNovel(selector, self.protect_novel, self.rotary) if self.protect_novel else selector

    def choose(self, row: RowChoice) -> torch.Tensor:
        """The head-shared choice by this policy's scores alone (`composed()` adds the variants)."""
        return choose_kept(row, row.reduce(self.score(row.inputs)))

    @property
    def statistic(self) -> Statistic | None:
        """The attention statistic `score` reads as `inputs.attention` (None: it needs none)."""
        return None

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """`[n]` or `[kv_heads, n]` scores (higher = keep); per-head scores are averaged over heads."""
        raise NotImplementedError
