"""What a layer reads of the objects it is built with that live above `layers/`: its type (a
`layer_types.LayerType`) and the cache's options (a `PagedCacheConfig`). Naming only the hooks it calls keeps
`layers/` below both packages, which build layers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..blocks.tables import BlockTables


class ReadRules(Protocol):
    """How a layer of one type is read: the part of `LayerType` a layer and its handles ask."""

    name: str
    is_sliding: bool
    kernels_read: bool

    def mask_sizes(self, tables: BlockTables, seq_len: int, query_length: int) -> tuple[int, int]: ...

    def max_length(self, tables: BlockTables) -> int: ...

    def read_window(self, tables: BlockTables) -> int | None: ...

    def read_mask(self, tables: BlockTables, q_len: int, kv_offset: int, n: int,
                  device: torch.device) -> torch.Tensor | None: ...  # fmt: skip  (None: plain causality)

    def kernel_window(self, tables: BlockTables) -> int: ...


class StorageOptions(Protocol):
    """Where and in what dtype a layer stores its blocks, and whether the kernels write them."""

    dtype: torch.dtype | None
    device: torch.device | None

    def uses_kernels(self, device: torch.device) -> bool: ...
