"""`sliding_attention`: a group per window size keeps the last `window - 1` tokens plus the step's, and blocks
that leave the window go back to the pool; lengths and masks match transformers' `DynamicSlidingWindowLayer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .full import FullAttention
from .base import LayerSpec

if TYPE_CHECKING:
    from ..blocks.tables import BlockTables


class SlidingAttention(FullAttention):
    is_sliding = True
    evictable = False

    def window(self, kwargs: dict[str, Any]) -> int:
        return kwargs["sliding_window"]

    def group_name(self, spec: LayerSpec) -> str:
        return f"sliding_attention[{self.window(spec.kwargs)}]"

    def read_window(self, tables: BlockTables) -> int:
        return tables.sliding_window

    def kernel_window(self, tables: BlockTables) -> int:
        return tables.sliding_window
