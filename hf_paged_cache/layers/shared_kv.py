"""`SharedKVLayer`: a cache layer that stores nothing and reads an earlier paged layer's blocks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from .paged import PagedLayer


class SharedKVLayer(CacheLayerMixin):
    """A layer that stores nothing and reads an earlier paged layer's K/V (`share_with`, or a model's KV-shared
    layer, which calls no `update()` and attends over its source's states): its own new K/V are dropped, so
    attention sees the source layer's history and this step's source states."""

    is_compileable = False
    is_quantized = False

    def __init__(self, source: PagedLayer):
        super().__init__()
        self.source = source
        self.is_initialized = True
        source.read_by_others = True

    def __repr__(self) -> str:
        return f"SharedKVLayer(source={self.source!r})"

    @property
    def is_sliding(self) -> bool:
        return self.source.is_sliding

    @property
    def is_croppable(self) -> bool:  # a crop of the cache crops the source's tables, which this layer reads
        return self.source.is_croppable

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the source layer stores the K/V."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, attention_kwargs: dict | None = None,
               undo: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        self.source.check_states(key_states)
        if self.source.seq_len != self.source.tables.length or self.source.tables.plan is None:
            raise RuntimeError("A `share_with` layer ran before its source layer wrote this step: the source must be "
                               "an earlier layer of the same forward")  # fmt: skip
        return self.source.hand_over(self.source.tables.plan, key_states, value_states, attention_kwargs, undo=undo)

    def get_seq_length(self) -> int:
        return self.source.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.source.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.source.get_max_length()

    # The source's tables follow every whole-cache edit; this layer holds nothing to edit.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass

    def crop(self, max_length: int) -> None:
        pass

    def reset(self) -> None:
        pass
