"""Token eviction: policies score what survives (`policies/`, one module each) from statistics of attention
(`statistics` says which, `attention_stats` records them); wrappers add variants (`wrappers`); `selection`
turns scores into survivors within the `budget`; the evictor decides when (`evictor`), and `removal` frees
the blocks."""

from .attention_stats import AttentionStats
from .budget import TokenBudget, pyramid_budgets
from .evictor import Evictor
from .novelty import key_novelty
from .policies import (
    H2O,
    TOVA,
    EvictionPolicy,
    KeepRatio,
    KeyDiff,
    KeyNorm,
    KeyNovelty,
    RandomEviction,
    SnapKV,
    StreamingLLM,
)
from .selection import RowChoice, ScoreInputs, Selector, TakenFirst, choose_kept, choose_kept_per_head, novel_tokens
from .statistics import Accumulated, LastQuery, ObservationWindow, Statistic
from .wrappers import PerHead, ProtectNovel

__all__ = [
    "Accumulated",
    "AttentionStats",
    "EvictionPolicy",
    "Evictor",
    "H2O",
    "KeepRatio",
    "KeyDiff",
    "KeyNorm",
    "KeyNovelty",
    "LastQuery",
    "ObservationWindow",
    "PerHead",
    "ProtectNovel",
    "RandomEviction",
    "RowChoice",
    "ScoreInputs",
    "Selector",
    "SnapKV",
    "Statistic",
    "StreamingLLM",
    "TOVA",
    "TakenFirst",
    "TokenBudget",
    "choose_kept",
    "choose_kept_per_head",
    "key_novelty",
    "novel_tokens",
    "pyramid_budgets",
]
