"""Token eviction: policies decide what survives (`policies`) from scores fed by attention statistics
(`statistics` says which, `attention_stats` records them), the evictor decides when (`evictor`), and
compaction frees the blocks (`compaction`)."""

from .evictor import Evictor
from .policies import (
    H2O,
    TOVA,
    EvictionPolicy,
    KeepRatio,
    KeyDiff,
    KeyNorm,
    KeyNovelty,
    RandomEviction,
    ScoreInputs,
    SnapKV,
    StreamingLLM,
    choose_kept,
    choose_kept_per_head,
    key_novelty,
    novel_tokens,
    pyramid_budgets,
)
from .attention_stats import AttentionStats
from .statistics import Accumulated, LastQuery, ObservationWindow, Statistic

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
    "RandomEviction",
    "ScoreInputs",
    "SnapKV",
    "Statistic",
    "StreamingLLM",
    "TOVA",
    "choose_kept",
    "choose_kept_per_head",
    "key_novelty",
    "novel_tokens",
    "pyramid_budgets",
]
