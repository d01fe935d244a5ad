"""How many tokens a row keeps at a layer: a count or a ratio of the row's tokens, optionally scaled per
layer (PyramidKV-like schedules, `pyramid_budgets`), and never fewer than the tokens that are never evicted."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def pyramid_budgets(num_layers: int, ratio: float = 4.0) -> list[float]:
    """PyramidKV-style per-layer budget multipliers: falling linearly from the first layer to the last,
    first / last = `ratio`, mean 1 (so the total budget is unchanged)."""
    if num_layers < 1 or ratio < 1:
        raise ValueError(f"pyramid_budgets needs num_layers >= 1 and ratio >= 1, got {num_layers}, {ratio}")
    if num_layers == 1:
        return [1.0]
    raw = [ratio - (ratio - 1) * index / (num_layers - 1) for index in range(num_layers)]
    mean = sum(raw) / num_layers
    return [value / mean for value in raw]


@dataclass(frozen=True)
class TokenBudget:
    """`amount` tokens (an int) or that ratio of a row's real tokens (a float), times the layer's multiplier
    in `layers` (if given), rounded down and raised to the `sinks` + `window` tokens that always stay.
    `owner` names the policy in error messages."""

    amount: int | float
    sinks: int
    window: int
    layers: Sequence[float] | None = None
    owner: str = "EvictionPolicy"

    @property
    def floor(self) -> int:
        return self.sinks + self.window

    def check(self) -> None:
        """Raise for a budget that is not a count or ratio, bad `sinks` / `window`, bad multipliers, or a count
        below `floor`."""
        name, amount = self.owner, self.amount
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"{name}: `budget` must be a token count (int >= 1) or a ratio in (0, 1], got {amount!r}")
        if isinstance(amount, int) and amount < 1:
            raise ValueError(f"{name}: `budget` in tokens must be >= 1, got {amount}")
        if isinstance(amount, float) and not 0.0 < amount <= 1.0:
            raise ValueError(f"{name}: a float `budget` is a ratio in (0, 1]; give tokens as an int, got {amount}")
        for attr in ("sinks", "window"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: `{attr}` must be an int >= 0, got {value!r}")
        if self.layers is not None:
            if not self.layers or any(not isinstance(m, (int, float)) or m <= 0 for m in self.layers):
                raise ValueError(f"{name}: `layer_budgets` must be positive multipliers, one per layer")
        if isinstance(amount, int):  # a ratio's budget depends on the row (and is floored at sinks + window)
            smallest = min(math.floor(amount * m) for m in self.layers or [1])
            if smallest < self.floor:
                where = "" if self.layers is None else " at the layer of the smallest `layer_budgets` multiplier"
                raise ValueError(
                    f"{name}: the budget{where} is {smallest} tokens, fewer than the {self.sinks} `sinks` + "
                    f"{self.window} `window` tokens that are never evicted: raise `budget` or lower `sinks` / `window`"
                )

    def tokens(self, real_tokens: int, layer_idx: int) -> int:
        """Tokens to keep in a row of `real_tokens` tokens (padding excluded) at layer `layer_idx`."""
        base = self.amount * real_tokens if isinstance(self.amount, float) else self.amount
        if self.layers is not None:
            if layer_idx >= len(self.layers):
                raise ValueError(
                    f"{self.owner}: `layer_budgets` has {len(self.layers)} entries but layer "
                    f"{layer_idx} exists: give one multiplier per layer"
                )
            base *= self.layers[layer_idx]
        return max(math.floor(base), self.floor, 1)
