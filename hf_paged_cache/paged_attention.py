"""The `"paged"` attention implementation: attention that reads K/V straight from a `PagedCache`'s blocks.

`register_paged_attention()` registers it (and its mask function) with transformers; then
`from_pretrained(..., attn_implementation="paged")` or `model.set_attn_implementation("paged")`
selects it. Which path reads each token (the Triton kernels, the C++ CPU kernel, the torch paths) is the
selector's decision (`read_paths/selector.py`); this module hands each read to its path's module and assembles the
output. `check_model_features` refuses, before the cache changes, models whose config shows a feature this
attention cannot read from blocks. It sits above `layers/`, `read_paths/` and `layer_types/`; the attention math and
the keyword contract it applies live below them, in `attention/`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention.contract import (
    ATTENTION_NAME,
    PAGED_KV_KWARG,
    check_attention_kwargs,
    kv_sharing_sources,
    model_name,
    refuse,
    sink_logits,
)
from .attention.paged_states import reused_paged_kv
from .attention.torch_path import attend
from .errors import UnsupportedAttentionError
from .layer_types.registry import is_known, layer_type_for
from .layers.handle import PackedPagedKV, PagedKV
from .read_paths import batched_decode, cascade, kernel_rows, quantized, rows, triton
from .read_paths.selector import (
    BATCHED_DECODE,
    CASCADE,
    CASCADE_KERNEL,
    COMPACTED,
    KERNEL_ROWS,
    QUANTIZED,
    ROWS,
    TRITON,
    Read,
    choose_one,
    choose_packed,
)


def register_paged_attention() -> None:
    """Register the `"paged"` attention function and its mask function with transformers (idempotent).

    The mask function is transformers' `sdpa_mask` (a boolean `[batch, 1, q, kv]` mask, or None when
    plain causality suffices): without a mask function registered under the same name, transformers
    would hand the attention no mask at all and left-padded batches would silently go wrong.
    """
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def check_model_features(config: PretrainedConfig) -> None:
    """Refuse, from the config alone, models whose attention the paged attention cannot read from blocks."""
    model = model_name(config)
    # Layer types whose attention also reads K/V entries made after `update()` (DeepSeek-V4's compressors).
    compressed = sorted(name for name in set(getattr(config, "layer_types", None) or [])
                        if is_known(name) and not layer_type_for(name).paged_readable)  # fmt: skip
    if compressed:
        refuse(model, f"compressed attention layers ({', '.join(compressed)})",
               "the model appends its compressor's K/V entries (and their mask) to what `update()` returns, but the "
               "paged attention reads the history from the blocks and would never see them")  # fmt: skip
    sources = kv_sharing_sources(config)
    unread = [index for index, mode in enumerate(getattr(config, "kv_sharing_modes", None) or [])
              if mode not in (None, "store") and index not in sources]  # fmt: skip
    if unread:
        refuse(model, "KV-shared layers",
               f"layers {unread} reuse K/V without an earlier \"store\" layer of their own layer type to read them "
               "from, so the paged attention cannot tell which layer's blocks hold their history")  # fmt: skip


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query` is `[batch, heads, q, head_dim]`, the result `[batch, q, heads, head_dim]`.

    When `update()` left a `PagedKV` in the kwargs, `key`/`value` are only this step's new states and
    the history is read from the blocks; otherwise (a model that calls `update()` without kwargs, or no
    `PagedCache`), or when the handle says `gathered` (a model that caches latents and expands them into
    K/V after `update()`), `key`/`value` are complete and are used as given. A keyword (or dropout) it cannot honour
    is refused (`attention_contract`) and the cache takes back the step under way, so it is as it was.
    """
    # A KV-shared layer (Gemma-3n) calls no `update()`: it reuses an earlier layer's states, which name its blocks.
    paged_kv: PagedKV | PackedPagedKV | None = kwargs.get(PAGED_KV_KWARG) or reused_paged_kv(key)
    try:
        check_attention_kwargs(type(module).__name__, kwargs, dropout)
        sinks = sink_logits(type(module).__name__, kwargs, query.shape[1])
    except UnsupportedAttentionError:
        if paged_kv is not None:
            paged_kv.undo()
        raise
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    if isinstance(paged_kv, PackedPagedKV) and paged_kv.gathered:  # a packed forward of a model caching latents
        return _attend_gathered(query, key, value, paged_kv, scale, softcap, sinks), None
    if paged_kv is None or paged_kv.gathered:
        return attend(query, key, value, attention_mask, scale, softcap, sinks).transpose(1, 2).contiguous(), None
    if isinstance(paged_kv, PackedPagedKV):  # each sequence of a packed batch attends over its own blocks
        return _attend_packed(query, paged_kv, scale, softcap, sinks), None
    return _attend_blocks(query, paged_kv, attention_mask, scale, softcap, sinks).contiguous(), None


def _attend_packed(query: torch.Tensor, packed: PackedPagedKV, scale: float, softcap: float | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """A packed forward: each sequence's queries over its own blocks, `[1, q, heads, d]`, by the reads the selector
    chose (`read_paths.selector.choose_packed`); each read gives (token indices, outputs `[tokens, heads, d]`)."""
    reads = choose_packed(packed, query.dtype, softcap, sinks)
    pieces = []
    for read in reads:
        pieces += _READERS.get(read.path, _alone)(query, packed, read, scale, softcap, sinks)
    if len(pieces) == 1 and isinstance(pieces[0][0], slice) and pieces[0][0] == slice(None):
        return pieces[0][1][None]  # one read of every token, in order (the kernel rows)
    out = query.new_empty(query.shape[2], query.shape[1], pieces[0][1].shape[-1])
    for where, piece in pieces:
        out[where] = piece
    return out[None]


def _alone(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, softcap: float | None,
           sinks: torch.Tensor | None) -> list:  # fmt: skip
    """A part read alone, as a step of `generate()` (`TRITON`, `QUANTIZED`, `COMPACTED`, `ROWS`), with its own mask."""
    start, stop, part = packed.parts[read.parts[0]]
    mask = part.own_mask(stop - start, query.device)
    return [(slice(start, stop), _attend_blocks(query[:, :, start:stop], part, mask, scale, softcap, sinks, read.path)[0])]


# The reads of several parts in one call; any other read is of one part alone.
_READERS = {KERNEL_ROWS: kernel_rows.attend, BATCHED_DECODE: batched_decode.attend,
            CASCADE_KERNEL: cascade.attend_in_kernel, CASCADE: cascade.attend}  # fmt: skip


def _attend_gathered(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: PackedPagedKV, scale: float,
                     softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """A packed forward whose `key`/`value` are the sequences' gathered histories, concatenated in the parts' order:
    each sequence's queries attend over its own span with its own mask. Returns `[1, q, heads, d]`."""
    outs, kv_start = [], 0
    for start, stop, part in packed.parts:
        kv_stop = kv_start + part.read_len
        mask = part.own_mask(stop - start, query.device)
        outs.append(attend(query[:, :, start:stop], key[:, :, kv_start:kv_stop], value[:, :, kv_start:kv_stop], mask,
                           scale, softcap, sinks))  # fmt: skip
        kv_start = kv_stop
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _attend_blocks(query: torch.Tensor, paged_kv: PagedKV, mask: torch.Tensor | None, scale: float,
                   softcap: float | None, sinks: torch.Tensor | None, path: str | None = None) -> torch.Tensor:  # fmt: skip
    """Attention of `query` `[batch, heads, q, head_dim]` over the blocks `paged_kv` names, by `path` (chosen here
    when not given: `selector.choose_one`): `[batch, q, heads, d]`."""
    path = path or choose_one(paged_kv, mask)
    if path == TRITON:
        out = triton.attend(query, paged_kv, scale, softcap, sinks)
    else:
        read = _TORCH_PATHS[path]
        out = read(paged_kv.layer, query, paged_kv.plan, mask, scale, softcap, sinks).transpose(1, 2)
    paged_kv.finish(query, mask, scale, softcap, sinks)  # eviction statistics and triggers, if any
    return out


_TORCH_PATHS = {QUANTIZED: quantized.attend, COMPACTED: rows.attend_compacted, ROWS: rows.attend_rows}
