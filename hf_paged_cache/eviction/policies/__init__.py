"""Token-eviction policies, one module per method; `base` holds what they share."""

from .base import EvictionPolicy
from .h2o import H2O
from .keep_ratio import KeepRatio
from .key_diff import KeyDiff
from .key_norm import KeyNorm
from .key_novelty import KeyNovelty
from .random import RandomEviction
from .snapkv import SnapKV
from .streaming import StreamingLLM
from .tova import TOVA

__all__ = ["EvictionPolicy", "H2O", "KeepRatio", "KeyDiff", "KeyNorm", "KeyNovelty", "RandomEviction", "SnapKV",
           "StreamingLLM", "TOVA"]
