"""Exceptions that are part of the public API."""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a step needs. Raised before anything changes, so the cache is
    exactly as it was before the failed call and can be used again (e.g. after `reset()`)."""

    def __init__(self, group: str, needed: int, free: int, total: int, block_size: int):
        self.group, self.needed, self.free, self.total, self.block_size = group, needed, free, total, block_size
        super().__init__(
            f"PagedCache ran out of blocks for its {group} layers: this step needs {needed} blocks but only {free} "
            f"of {total} ({block_size} tokens each) are free. Remedies: give a larger `num_blocks` or `max_memory` "
            "(or neither, to let the pool grow), generate fewer or shorter sequences, or call `cache.reset()` to "
            "return every block before a new generation."
        )


class CacheFileError(ValueError):
    """`PagedCache.load` cannot use a file: it is corrupted, truncated or of another format version, or it
    does not fit the given config (another model) or options. Raised before any cache is built."""


class UnsupportedModelError(RuntimeError):
    """The model's code cannot be served the way asked, as its first forward shows (a decoder layer the batch generator
    cannot call per request, an attention that calls `update()` without kwargs, K/V handed to the "paged" attention
    read by other code). A property of the model, not of one request: the batch generator raises it, with the step
    taken back, instead of failing the step's requests one by one."""


class UnsupportedAttentionError(ValueError):
    """The model uses an attention feature the `"paged"` attention does not implement (a T5-style position
    bias, sparse attention, KV-shared layers without a named producer, ...). Raised before the cache changes (or
    after taking the step back), so the cache is as it was and works with another attention implementation."""
