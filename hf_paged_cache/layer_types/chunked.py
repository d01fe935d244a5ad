"""`chunked_attention` (Llama-4): a query at position p reads the keys of its own chunk, [floor(p / C) * C, p]
counted from the row's first real token (transformers' `chunked_overlay`). Its group keeps the chunk the next
query falls in, so blocks leave as the chunk moves on (right after a boundary a row holds no past at all). Where
the cache cannot tell a row's left padding (Llama-4's attention is given no `position_ids` under `generate()`;
the batch generator tells it), it keeps the window of the chunk size, which holds every chunk the row may be in.
Prefix caching reads a chunked group's blocks as a sliding group's; eviction never moves its tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..attention.torch_path import chunked_mask
from ..blocks.reach import Chunks
from .base import LayerSpec
from .full import FullAttention

if TYPE_CHECKING:
    from ..blocks.tables import BlockTables


class ChunkedAttention(FullAttention):
    """Not a sliding window: what it keeps shrinks to nothing at each chunk boundary. transformers serves it with
    its sliding layer of the chunk size, so `is_sliding`, `sliding_window` and `get_max_length` answer as that."""

    is_sliding = True
    evictable = False

    def window(self, kwargs: dict[str, Any]) -> int:
        return kwargs["sliding_window"]  # transformers' layer kwargs carry `attention_chunk_size` under this name

    def reach(self, kwargs: dict[str, Any]) -> Chunks:
        return Chunks(self.window(kwargs))

    def group_name(self, spec: LayerSpec) -> str:
        return f"chunked_attention[{self.window(spec.kwargs)}]"

    def read_mask(self, tables: BlockTables, q_len: int, kv_offset: int, n: int, device: torch.device) -> torch.Tensor:
        return chunked_mask(q_len, n, kv_offset, tables.sliding_window, device)

    def kernel_chunk(self, tables: BlockTables) -> int:
        return tables.sliding_window
