"""`LayerType`: what the cache does differently for one of transformers' `layer_types`, as hooks.

Every place that used to branch on a type string (building layers, grouping their tables, masks, the kernels'
window, eviction, the batch generator, memory accounting) asks the layer's type instead, so a new kind of layer
is one module and one `register_layer_type` call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..attention.torch_path import causal_mask
from ..blocks.reach import Reach, SlidingWindow

if TYPE_CHECKING:
    from transformers.cache_utils import CacheLayerMixin

    from ..blocks.tables import BlockTables
    from ..config import PagedCacheConfig


@dataclass
class LayerSpec:
    """What building one layer may need: its index and transformers' kwargs for it, the options, its storage
    format (`quant`), the layers built before it, the model's own KV-sharing map `{consumer: producer}` and
    `group(name, reach, quant)`, which gives (creating once) the block tables of a group."""

    index: int
    kwargs: dict[str, Any]
    options: PagedCacheConfig
    quant: str | None
    built: list[CacheLayerMixin]
    reused: dict[int, int] = field(default_factory=dict)
    group: Callable[[str, Reach | None, str | None], BlockTables] | None = None


class LayerType:
    """How the cache serves the layers of one `layer_types` name (`name`, set at registration).

    Class attributes say what holds for every layer of the type; methods answer per layer or per group.
    """

    name: str = ""
    stored = True  # the paged store keeps this type's own K/V in blocks (so it can be quantized and measured)
    is_sliding = False  # transformers' `is_sliding`: masks are built for a window
    evictable = False  # eviction policies may drop its tokens
    kernels_read = True  # the Triton kernels' masking (by window or chunk) serves it
    paged_readable = True  # the "paged" attention can read it from blocks
    per_request = False  # its state runs along one sequence: a packed forward runs its layer once per request

    def window(self, kwargs: dict[str, Any]) -> int | None:
        """The window its group's tables keep (blocks that leave it are freed), None to keep everything."""
        return None

    def reach(self, kwargs: dict[str, Any]) -> Reach | None:
        """How far back its group's reads go, which decides the blocks rows drop (None: keep everything)."""
        window = self.window(kwargs)
        return None if window is None else SlidingWindow(window)

    def group_name(self, spec: LayerSpec) -> str:
        """The name of the group whose tables the layer shares (without the storage format's suffix)."""
        raise NotImplementedError(f"layer type {self.name!r} stores nothing in block tables")

    def build_layer(self, spec: LayerSpec) -> CacheLayerMixin:
        """The cache layer serving layer `spec.index`."""
        raise NotImplementedError

    def mask_sizes(self, tables: BlockTables, seq_len: int, query_length: int) -> tuple[int, int]:
        """transformers' `get_mask_sizes` (kv length, kv offset) for a layer holding `seq_len` tokens: what the
        step reads, from its group's `read_offset` on."""
        kv_offset = tables.read_offset(seq_len)
        return seq_len - kv_offset + query_length, kv_offset

    def max_length(self, tables: BlockTables) -> int:
        """transformers' `get_max_length`: the window its tables keep, -1 when the layer keeps every token."""
        return -1 if tables.sliding_window is None else tables.sliding_window

    def read_window(self, tables: BlockTables) -> int | None:
        """The window a mask made by the cache itself (a packed row's) restricts reads to, None for none."""
        return None

    def read_mask(self, tables: BlockTables, q_len: int, kv_offset: int, n: int,
                  device: torch.device) -> torch.Tensor | None:  # fmt: skip
        """The boolean `[1, 1, q_len, n]` mask of a row without a model-made mask (a packed row, no padding) whose
        queries are the last `q_len` of the `n` positions read from `kv_offset` on; None for plain causality, which
        every reader takes a missing mask for (and attends without building one where it can)."""
        window = self.read_window(tables)
        return None if window is None else causal_mask(q_len, n, device, window)

    def kernel_window(self, tables: BlockTables) -> int:
        """The window constant the Triton kernels mask by (0: none)."""
        return 0

    def kernel_chunk(self, tables: BlockTables) -> int:
        """The chunk size the Triton kernels mask by (0: none)."""
        return 0

    def packing_refusal(self, layer: CacheLayerMixin) -> str | None:
        """Why the batch generator's packed forward cannot serve `layer` (what it is), or None when it can."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
