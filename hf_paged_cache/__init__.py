"""hf-paged-cache: a paged KV cache for HuggingFace transformers' `generate()`.

Importing the package registers the `"paged"` attention with transformers (`register_paged_attention`).
"""

from .paged_attention import ATTENTION_NAME, register_paged_attention
from .serving.generator import BatchConfig, BatchGenerator, BatchMetrics, GenerationOutput, generate_batch
from .blocks.pool import BlockPool
from .cache import PagedCache
from .config import PagedCacheConfig, parse_bytes
from .errors import CacheFileError, OutOfBlocksError, UnsupportedAttentionError, UnsupportedModelError
from .eviction import (
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
    pyramid_budgets,
)
from .inspection import GroupLayout, block_layout, cache_bytes, kept_positions
from .accounting import CacheMetrics, estimate_kv_bytes, kv_bytes_per_token
from .memory.defragment import Fragmentation
from .scoring import perplexity
from .memory.swap import SwapSpace, SwapStats

# `attn_implementation="paged"` works as soon as the package is imported (registering is idempotent).
register_paged_attention()

__all__ = [
    "ATTENTION_NAME",
    "BatchConfig",
    "BatchGenerator",
    "BatchMetrics",
    "BlockPool",
    "CacheFileError",
    "CacheMetrics",
    "EvictionPolicy",
    "Fragmentation",
    "GenerationOutput",
    "GroupLayout",
    "H2O",
    "KeepRatio",
    "KeyDiff",
    "KeyNorm",
    "KeyNovelty",
    "OutOfBlocksError",
    "UnsupportedAttentionError",
    "UnsupportedModelError",
    "PagedCache",
    "PagedCacheConfig",
    "RandomEviction",
    "SnapKV",
    "StreamingLLM",
    "SwapSpace",
    "SwapStats",
    "TOVA",
    "block_layout",
    "cache_bytes",
    "estimate_kv_bytes",
    "generate_batch",
    "kept_positions",
    "kv_bytes_per_token",
    "parse_bytes",
    "perplexity",
    "pyramid_budgets",
    "register_paged_attention",
]

__version__ = "0.1.0"
