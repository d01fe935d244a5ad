"""The handles `update()` leaves in the attention kwargs in place of gathered K/V (`PAGED_KV_KWARG`): where a
step's history lives and what is due once attention ran, so the attention function needs no reference to the
cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers.cache_utils import CacheLayerMixin

    from ..blocks.plan import StepPlan

# (plan, query, mask, scale, softcap, sinks): what runs after a layer's attention (eviction), bound by the cache.
AfterAttention = Callable[["StepPlan", torch.Tensor, "torch.Tensor | None", float, "float | None",
                           "torch.Tensor | None"], None]  # fmt: skip


class PagedKV:
    """The handle `update()` leaves in the attention kwargs in place of gathered K/V: where the step's
    history lives, and the work due once attention ran (`finish`: eviction statistics and triggers), so
    neither the attention function nor the layer needs a reference to the cache.

    `gathered`: `update()` returned the gathered history instead (a model that caches latents expands it into the
    K/V its attention receives); the handle then only takes the step back on a refusal and masks a packed row."""

    def __init__(self, layer: CacheLayerMixin, plan: StepPlan, after_attention: AfterAttention | None = None,
                 undo: Callable[[], None] | None = None, gathered: bool = False):  # fmt: skip
        self.layer = layer
        self.plan = plan
        self.after_attention = after_attention
        self.undo_step = undo  # takes the cache's step back when the attention refuses the model
        self.gathered = gathered

    @property
    def kernel_window(self) -> int:
        """The window constant the kernels mask this layer's reads by (0: none)."""
        return self.layer.layer_type.kernel_window(self.layer.tables)

    @property
    def kernel_chunk(self) -> int:
        """The chunk size the kernels mask this layer's reads by (0: none)."""
        return self.layer.layer_type.kernel_chunk(self.layer.tables)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of logical positions [kv_offset, new_len) of every row, `[batch, kv_heads, n, head_dim]`."""
        return self.layer.gather(self.plan)

    def undo(self) -> None:
        """Called by the attention when it refuses the model: the cache takes back the step under way."""
        if self.undo_step is not None:
            self.undo_step()

    def finish(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None,
               sinks: torch.Tensor | None = None) -> None:  # fmt: skip
        """Called by the attention once this layer's output is computed."""
        if self.after_attention is not None:
            self.after_attention(self.plan, query, mask, scale, softcap, sinks)

    def reader(self) -> PagedKV:
        """The handle for another layer that attends over this layer's K/V (a KV-shared layer): the same blocks and
        plan without the work due after attention, so eviction statistics are recorded once per stored layer."""
        return PagedKV(self.layer, self.plan, None, self.undo_step, self.gathered)

    @property
    def read_len(self) -> int:
        """Positions the step reads (the gathered history's length)."""
        return self.plan.new_len - self.plan.kv_offset

    def own_mask(self, q_len: int, device: torch.device) -> torch.Tensor | None:
        """The mask of a sequence that has no model-made mask (a packed batch), as its layer type reads (causal over
        the read range, within a window or a chunk); None for plain causality (`ReadRules.read_mask`) and for one
        query, which sees the whole read range."""
        if q_len == 1:
            return None
        return self.plan.cached(("own_mask", q_len, device), lambda: self.layer.layer_type.read_mask(
            self.layer.tables, q_len, self.plan.kv_offset, self.read_len, device))  # the group's layers share it


class PackedPagedKV:
    """The handle a packed forward (the batch generator's) leaves instead of one `PagedKV`: for each sequence,
    its slice `[start, stop)` of the packed tokens and its own `PagedKV`."""

    def __init__(self, parts: list[tuple[int, int, PagedKV]], memo: dict | None = None):
        self.parts = parts
        self.memo = {} if memo is None else memo  # built once per forward, shared by its layers (reads, indices)

    def cached(self, key, build):
        """`build()`, computed once per forward and shared by its layers (the reads of a group, their indices)."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    @property
    def gathered(self) -> bool:
        """Whether the forward's K/V are the sequences' gathered histories, concatenated in the parts' order."""
        return all(part.gathered for _start, _stop, part in self.parts)

    def undo(self) -> None:
        """Every sequence's cache takes back the step under way (the attention refused the model)."""
        for _start, _stop, part in self.parts:
            part.undo()

    def last_tokens(self, device: torch.device) -> PackedPagedKV | None:
        """The handle of a forward whose queries are each sequence's last token alone (query i is sequence i's), which
        sees the whole read range: for a layer whose output is read only at those tokens (a causal LM's last decoder
        layer). None where it would read otherwise: a sequence's tokens see less than plain causality gives them (a
        window, a chunk), work is due after the attention (it reads every query), or the history is gathered."""
        parts = []
        for index, (start, stop, part) in enumerate(self.parts):
            if part.after_attention is not None or part.gathered or part.own_mask(stop - start, device) is not None:
                return None
            parts.append((index, index + 1, part))
        return PackedPagedKV(parts, self.memo)

    def reader(self) -> PackedPagedKV:
        """`PagedKV.reader` for every sequence."""
        return PackedPagedKV([(start, stop, part.reader()) for start, stop, part in self.parts], self.memo)
