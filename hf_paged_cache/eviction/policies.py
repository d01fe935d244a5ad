"""Token-eviction policies: each scores a row's stored tokens; the evictor decides when to free them.

A policy is one small dataclass with a `score()` (higher = keep), in the spirit of kvpress's presses.
What every policy shares lives in `EvictionPolicy`: the budget (tokens, or a ratio of the row's
tokens), per-layer budget schedules, and the protected tokens -- the first `sinks` tokens (attention
sinks, StreamingLLM) and the most recent `window` tokens are never evicted. The cache applies a policy
after the prompt's prefill, between chunks of a chunked prefill, during decoding and under pool
pressure (`PagedCacheConfig.evict_every` / `evict_between_chunks`), and compacts each row's survivors so
that whole blocks return to the pool (`PagedCache.evict_now()` triggers it by hand): see `evictor.py`.

A policy that needs attention statistics names a `Statistic` object (`statistics.py`) in `statistic`:
which queries it observes and how it folds their attention into a running score per stored key.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
import torch
import torch.nn.functional as F

from .statistics import Accumulated, LastQuery, ObservationWindow, Statistic

ROTARY_PAIRINGS = ("half", "interleaved", "none")
NOVELTY_CHUNK = 512  # keys compared at a time by `key_novelty` (bounds the `[heads, chunk, n]` similarities)

@dataclass
class ScoreInputs:
    """What a policy may look at for one row of one layer: `n` stored tokens, in stored order.

    keys: float32 `[kv_heads, n, head_dim]` (quantized tokens decoded), computed only when asked for.
    attention: float32 `[kv_heads, n]`, the policy's `statistic` (None when it needs none).
    positions: int64 `[n]`, the logical position of each stored token (after earlier evictions these
    are no longer contiguous), or `[kv_heads, n]` once a `per_head` policy compacted the row (each KV
    head then stores its own survivors); `length` is the row's logical length.
    """

    positions: torch.Tensor
    length: int
    attention: torch.Tensor | None
    _keys: object = field(repr=False, default=None)  # a callable returning the keys

    @functools.cached_property
    def keys(self) -> torch.Tensor:
        return self._keys()


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


@dataclass
class EvictionPolicy:
    """Budget and protection shared by every policy; subclasses implement `score`.

    Args:
        budget: tokens kept per row and layer (an int >= 1), or a fraction in (0, 1] of the row's
            tokens (padding excluded) at the time of eviction.
        sinks: the first `sinks` tokens of each row are never evicted (attention sinks).
        window: the most recent `window` tokens are never evicted.
        layer_budgets: optional per-layer multipliers of `budget`, one per layer of the model (index =
            layer index; e.g. `pyramid_budgets(num_layers)`); a layer's budget is rounded down.
        per_head: each KV head keeps its own best tokens (scored by its own attention or keys) instead of
            the tokens whose scores, averaged over the layer's heads, are best. Every head keeps the same
            number, so memory is the same; sealed quantized blocks are still chosen for all heads at once.
            Default: True for H2O, SnapKV and KeepRatio, False for the others (chosen by measurement).
        protect_novel: the fraction of the budget that first goes to the most novel tokens -- those whose
            keys have no near copy anywhere in the row (`key_novelty`) -- before the policy's own scores
            choose the rest. A one-off fact in repetitive text survives a compression
            made before the question asking for it is read (0 disables).
        rotary: how the model's rotary embedding pairs key channels, for `key_novelty`: "half" (channel i
            with i + head_dim/2, transformers' `rotate_half`: Llama, Qwen, Mistral, Gemma, GPT-NeoX),
            "interleaved" (2i with 2i+1, GPT-J), or "none" (no rotary embedding, e.g. GPT-2).

    A budget in tokens below `sinks + window` (at any layer) is refused here; a ratio's budget of a short
    row is raised to `sinks + window`, since those tokens are never evicted.
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
        budget = self.budget
        if not isinstance(self.per_head, bool):
            raise ValueError(f"{name}: `per_head` must be True or False, got {self.per_head!r}")
        novel = self.protect_novel
        if isinstance(novel, bool) or not isinstance(novel, (int, float)) or not 0.0 <= novel < 1.0:
            raise ValueError(f"{name}: `protect_novel` is a fraction of the budget in [0, 1), got {novel!r}")
        if self.rotary not in ROTARY_PAIRINGS:
            raise ValueError(f"{name}: `rotary` must be one of {ROTARY_PAIRINGS}, got {self.rotary!r}")
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise ValueError(f"{name}: `budget` must be a token count (int >= 1) or a ratio in (0, 1], got {budget!r}")
        if isinstance(budget, int) and budget < 1:
            raise ValueError(f"{name}: `budget` in tokens must be >= 1, got {budget}")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(f"{name}: a float `budget` is a ratio in (0, 1]; give tokens as an int, got {budget}")
        for attr in ("sinks", "window"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: `{attr}` must be an int >= 0, got {value!r}")
        if self.layer_budgets is not None:
            multipliers = list(self.layer_budgets)
            if not multipliers or any(not isinstance(m, (int, float)) or m <= 0 for m in multipliers):
                raise ValueError(f"{name}: `layer_budgets` must be positive multipliers, one per layer")
            self.layer_budgets = multipliers
        if isinstance(budget, int):  # a ratio's budget depends on the row (and is floored at sinks + window)
            smallest = min(math.floor(budget * m) for m in self.layer_budgets or [1])
            if smallest < self.sinks + self.window:
                where = "" if self.layer_budgets is None else " at the layer of the smallest `layer_budgets` multiplier"
                raise ValueError(
                    f"{name}: the budget{where} is {smallest} tokens, fewer than the {self.sinks} `sinks` + "
                    f"{self.window} `window` tokens that are never evicted: raise `budget` or lower `sinks` / `window`"
                )

    def budget_for(self, tokens: int, layer_idx: int) -> int:
        """Tokens to keep in a row of `tokens` real tokens at layer `layer_idx`."""
        base = self.budget * tokens if isinstance(self.budget, float) else self.budget
        if self.layer_budgets is not None:
            if layer_idx >= len(self.layer_budgets):
                raise ValueError(
                    f"{type(self).__name__}: `layer_budgets` has {len(self.layer_budgets)} entries but layer "
                    f"{layer_idx} exists: give one multiplier per layer"
                )
            base *= self.layer_budgets[layer_idx]
        return max(math.floor(base), self.sinks + self.window, 1)

    @property
    def statistic(self) -> Statistic | None:
        """The attention statistic `score` reads as `inputs.attention` (None: it needs none)."""
        return None

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """`[n]` or `[kv_heads, n]` scores (higher = keep); per-head scores are averaged over heads."""
        raise NotImplementedError


@dataclass
class StreamingLLM(EvictionPolicy):
    """Attention sinks + the most recent tokens (Xiao et al. 2023): needs no scores, keeps the newest."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.positions.float()


@dataclass
class H2O(EvictionPolicy):
    """Heavy hitters (Zhang et al. 2023): the accumulated attention each token received, plus the
    recent window. `decay` < 1 weights recent attention more (the running sum is multiplied by `decay`
    before each step adds its mass); evicting while decoding long texts, prefer it (e.g. 0.99): pure
    sums favour the oldest tokens (docs/BENCHMARKS.md, decode-time eviction)."""

    decay: float | None = None
    per_head: bool = True  # measured better per head (docs/BENCHMARKS.md); so are SnapKV and KeepRatio

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decay is not None and not 0.0 < self.decay <= 1.0:
            raise ValueError(f"H2O: `decay` must be in (0, 1] or None, got {self.decay!r}")

    @property
    def statistic(self) -> Statistic:
        return Accumulated(self.decay)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.attention


@dataclass
class SnapKV(EvictionPolicy):
    """SnapKV (Li et al. 2024): the attention of the last `observation_window` prompt queries, average
    pooled over `kernel_size` neighbouring tokens, per KV head."""

    observation_window: int = 32
    per_head: bool = True
    kernel_size: int = 5

    @property
    def statistic(self) -> Statistic:
        return ObservationWindow(self.observation_window)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        pad = self.kernel_size // 2
        pooled = F.avg_pool1d(inputs.attention[:, None], self.kernel_size, stride=1, padding=pad, count_include_pad=False)
        return pooled[:, 0, : inputs.attention.shape[-1]]


@dataclass
class TOVA(EvictionPolicy):
    """TOVA (Oren et al. 2024): keep the tokens the latest query attends to most."""

    @property
    def statistic(self) -> Statistic:
        return LastQuery()

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.attention


@dataclass
class KeyNorm(EvictionPolicy):
    """Keep the keys of smallest L2 norm (Devoto et al. 2024: low-norm keys draw high attention);
    needs no attention at all."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return -inputs.keys.norm(dim=-1)


@dataclass
class KeyDiff(EvictionPolicy):
    """KeyDiff (Park et al. 2025): keep the keys least similar (cosine) to their KV head's mean key. Needs no
    attention and no question: in repetitive text a distinctive token -- a name, a number -- stands apart
    from the mean direction, so it survives before the question that will ask for it has been read."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        keys = F.normalize(inputs.keys, dim=-1)
        anchor = F.normalize(keys.mean(dim=1, keepdim=True), dim=-1)
        return -(keys * anchor).sum(dim=-1)


@dataclass
class KeyNovelty(EvictionPolicy):
    """Keep the tokens least like any other stored token of their KV head (`key_novelty`): redundancy
    scoring, as in R-KV, made blind to position. Text that repeats (filler, boilerplate) finds a near copy
    and goes first; a one-off fact -- a number, a name -- has none and stays, before any question has asked
    for it (docs/BENCHMARKS.md: question-agnostic pass keys). Set `rotary` to the model's pairing."""

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return key_novelty(inputs.keys, self.rotary)


def key_novelty(keys: torch.Tensor, rotary: str) -> torch.Tensor:
    """Per KV head and token, minus the largest cosine similarity of its key to any other token's: `[kv_heads, n]`
    from `keys` `[kv_heads, n, head_dim]` (higher = more novel). Keys are stored after the rotary embedding,
    which turns a repeated word's key by an angle that depends on where it stands; the magnitude of each
    rotated channel pair does not change, so tokens are compared by those magnitudes (`rotary_magnitudes`).
    O(n^2) per head, `NOVELTY_CHUNK` keys at a time."""
    signature = F.normalize(rotary_magnitudes(keys, rotary), dim=-1)  # [kv_heads, n, m]
    heads, count, _ = signature.shape
    scores = torch.empty(heads, count)
    for start in range(0, count, NOVELTY_CHUNK):
        stop = min(start + NOVELTY_CHUNK, count)
        similarity = signature[:, start:stop] @ signature.transpose(1, 2)  # [kv_heads, chunk, n]
        rows = torch.arange(stop - start)
        similarity[:, rows, rows + start] = float("-inf")  # a token is not its own copy
        scores[:, start:stop] = -similarity.amax(dim=-1)
    return scores


def rotary_magnitudes(keys: torch.Tensor, rotary: str) -> torch.Tensor:
    """`keys` `[..., head_dim]` as the magnitudes of their rotary channel pairs `[..., head_dim / 2]` (raw keys
    for `rotary="none"`): the same for a key wherever the rotary embedding placed it."""
    if rotary == "none":
        return keys
    if rotary == "half":
        first, second = keys.chunk(2, dim=-1)
    else:
        first, second = keys[..., 0::2], keys[..., 1::2]
    return torch.sqrt(first.square() + second.square())


@dataclass
class KeepRatio(EvictionPolicy):
    """Keep the fraction `budget` of tokens with the highest mean attention: the attention a token
    received, summed over the queries that saw it, divided by how many did."""

    budget: int | float = 0.5
    per_head: bool = True

    @property
    def statistic(self) -> Statistic:
        return Accumulated()

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        observed = (inputs.length - inputs.positions).clamp(min=1).float()
        return inputs.attention / observed


@dataclass
class RandomEviction(EvictionPolicy):
    """A baseline: random scores (seeded, so runs repeat)."""

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._generator = torch.Generator().manual_seed(self.seed)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return torch.rand(inputs.positions.shape[-1], generator=self._generator)


def protection(positions: torch.Tensor, first_real: int, length: int, policy: EvictionPolicy):
    """(real, protected) for stored tokens at `positions`: which are not padding, and which are never evicted
    (the first `sinks` real tokens and the most recent `window`)."""
    real = positions >= first_real
    return real, real & ((positions < first_real + policy.sinks) | (positions >= length - policy.window))


def novel_tokens(novelty: torch.Tensor, positions: torch.Tensor, first_real: int, length: int,
                 policy: EvictionPolicy, count: int) -> torch.Tensor:  # fmt: skip
    """Boolean, shaped like `novelty` (`[n]`, or `[kv_heads, n]` for each head's own): the `count` most novel
    real tokens besides the ones protected anyway (`protection`), which the choice takes first (`protect_novel`)."""
    real, protected = protection(positions.expand_as(novelty), first_real, length, policy)
    candidates = real & ~protected
    count = min(count, int(candidates.sum(dim=-1).min()))
    top = novelty.float().masked_fill(~candidates, float("-inf")).topk(count, dim=-1).indices
    return torch.zeros_like(candidates).scatter_(-1, top, True)


def choose_kept(
    scores: torch.Tensor,
    positions: torch.Tensor,
    first_real: int,
    length: int,
    budget: int,
    policy: EvictionPolicy,
    unit_sizes: list[int],
    novel: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean `[n]`: which stored tokens of a row survive.

    Tokens come in units that are kept or evicted whole (a quantized block: its tokens share scales and
    are never re-quantized; a full-precision token: itself); `unit_sizes` lists them in stored order.
    Padding (positions before `first_real`) always goes; sinks and the recent window always stay; the other
    units are taken by descending mean score while they fit the budget, the `novel` ones (`novel_tokens`, if
    given) first.
    """
    scores = scores.float()
    if scores.dim() == 2:
        scores = scores.mean(0)
    if novel is not None:  # taken first, while they fit (a sealed unit with a novel token counts as novel)
        scores = scores.masked_fill(novel, float("inf"))
    real, protected = protection(positions, first_real, length, policy)
    sizes = torch.tensor(unit_sizes)
    unit = torch.repeat_interleave(torch.arange(len(unit_sizes)), sizes)
    def per_unit(values: torch.Tensor) -> torch.Tensor:  # sum over each unit's tokens
        return torch.zeros(len(unit_sizes)).index_add_(0, unit, values.float())

    unit_real, unit_protected = per_unit(real) > 0, per_unit(protected) > 0
    unit_score = per_unit(scores) / sizes
    room = budget - int(sizes[unit_protected].sum())
    candidates = (unit_real & ~unit_protected).nonzero().flatten()
    order = candidates[torch.argsort(unit_score[candidates], descending=True, stable=True)]
    fits = torch.cumsum(sizes[order], 0) <= room
    keep_units = unit_protected.clone()
    keep_units[order[fits]] = True
    return keep_units[unit]


def choose_kept_per_head(
    scores: torch.Tensor,
    positions: torch.Tensor,
    first_real: int,
    length: int,
    policy: EvictionPolicy,
    shared: torch.Tensor,
    split: int,
    novel: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean `[kv_heads, n]`: which stored tokens each KV head keeps (`per_head` policies).

    `shared` is the head-shared choice (`choose_kept` on the heads' mean scores): it decides the sealed
    quantized units before stored index `split` for every head, and how many full-precision tokens stay.
    After `split` each head keeps its sinks and recent window plus its own best-scored tokens (`scores`
    `[kv_heads, n]`; its `novel` ones, `[kv_heads, n - split]` if given, first), up to that count, so every
    head stores as many tokens as the others and the row's blocks hold a rectangle of survivors.
    """
    heads, n = scores.shape
    real, protected = protection(positions.expand(heads, n)[:, split:], first_real, length, policy)
    room = int(shared[split:].sum()) - protected.sum(dim=1)  # per head (the protected counts are the same)
    ranked = scores[:, split:].float()
    if novel is not None:
        ranked = ranked.masked_fill(novel, float("inf"))
    ranked = ranked.masked_fill(~(real & ~protected), float("-inf"))
    order = torch.argsort(ranked, dim=1, descending=True, stable=True)
    taken = torch.arange(order.shape[1])[None, :] < room[:, None]
    keep = protected | torch.zeros_like(protected).scatter_(1, order, taken)
    return torch.cat([shared[:split].expand(heads, -1), keep], dim=1)
