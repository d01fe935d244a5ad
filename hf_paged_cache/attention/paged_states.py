"""The new K/V that `update()` hands to the `"paged"` attention, guarded against any other reader.

Under the `"paged"` attention `update()` returns only the step's new states: the attention reads the
history from the blocks through the `PagedKV` handle. The cache picks that path from the config it was
built from, so a different model object (or a config switched after the cache was built) would run e.g.
SDPA over the new tokens alone: wrong outputs, or a shape error from deep inside torch. The states
therefore come wrapped: the `"paged"` attention never touches them, and any other attention fails with
the library's error at its first operation on them. They also carry the layer's handle, for models whose later
layers attend over an earlier layer's `update()` result (Gemma-3n's KV-shared layers): those layers' attention
calls get the states but not the producer's kwargs, and read the producer's blocks through that handle.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError

# Metadata that attention functions read before computing (shapes, dtypes): harmless, so allowed.
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__repr__,
}  # fmt: skip

MISREAD = (
    'PagedCache handed this layer\'s K/V to the "paged" attention (the config the cache was built from selects '
    "it), but the model calling it reads them with other code: a different model object than the one whose config "
    "built the cache, a model whose attention is its own code rather than transformers' attention interface, or one "
    "that transforms the cached states before its attention. Build the cache from this model's config "
    '(`PagedCache(model.config)`) and select "paged" on this model (`model.set_attn_implementation("paged")`); a '
    'model that cannot run it is served exactly by the gather path (attn_implementation="sdpa" or "eager"). This '
    "forward step was interrupted: call `cache.reset()` before using the cache again."
)


class PagedOnlyStates(torch.Tensor):
    """A tensor of new K/V states that only the `"paged"` attention may receive (it reads the blocks).

    `source` is the producing layer's handle, whose `reader()` (a read-only handle on its blocks, no eviction work
    attached) a layer that reuses these states instead of calling `update()` itself reads through."""

    source = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        raise UnsupportedModelError(MISREAD)


def paged_only(states: torch.Tensor, source=None) -> PagedOnlyStates:
    """`states` guarded, carrying `source`: the handle (`PagedKV` or `PackedPagedKV`) of the layer that produced them;
    its reader is made only when a later layer reuses them (most models have none)."""
    guarded = states.as_subclass(PagedOnlyStates)
    guarded.source = source
    return guarded


def reused_paged_kv(states: torch.Tensor):
    """A read-only handle on the blocks behind `states` (a new reader of the producing layer's handle) when they are
    what a paged layer's `update()` returned, else None."""
    source = states.source if isinstance(states, PagedOnlyStates) else None
    return None if source is None else source.reader()
