"""The `"paged"` attention implementation: attention that reads K/V straight from a `PagedCache`'s blocks.

`register_paged_attention()` registers it (and its mask function) with transformers; then
`from_pretrained(..., attn_implementation="paged")` or `model.set_attn_implementation("paged")`
selects it. CUDA tensors go to the Triton kernels of `hf_paged_cache.kernels` (the cache's `backend`
option decides); everything else runs the layer's torch path (`PagedLayer.attend`), which attends row by
row over views of each row's runs of blocks (no copy of the history per step when a row's blocks form
one run). `check_model_features` refuses, before the cache changes, models whose config shows a feature this
attention cannot read from blocks. It sits above `layers/` and `layer_types/`, whose handles and types it reads;
the attention math and the keyword contract it applies live below them, in `attention/`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention.contract import (
    PAGED_KV_KWARG,
    check_attention_kwargs,
    kv_sharing_sources,
    model_name,
    refuse,
    sink_logits,
)
from .attention.paged_states import reused_paged_kv
from .attention.torch_path import attend, attention, merge_partials, partial_attention
from .errors import UnsupportedAttentionError
from .layer_types.registry import is_known, layer_type_for
from .layers.handle import PackedPagedKV, PagedKV
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
    similar_lengths,
)

ATTENTION_NAME = "paged"


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
    if len(reads) == 1 and reads[0].path == KERNEL_ROWS and len(reads[0].parts) == len(packed.parts):
        return _kernel_rows(query, packed, reads[0], scale)[0][1][None]  # every token, in order
    pieces = []
    for read in reads:
        pieces += _READERS[read.path](query, packed, read, scale, softcap, sinks)
    out = query.new_empty(query.shape[2], query.shape[1], pieces[0][1].shape[-1])
    for where, piece in pieces:
        out[where] = piece
    return out[None]


def _kernel_rows(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, *_unused) -> list:
    """`KERNEL_ROWS`: the parts' queries in one call of the C++ CPU attention kernel over their blocks where they lie
    (`PagedLayer.attend_rows_in_place`). Every token of the forward in order takes the queries as they lie."""
    rows = [packed.parts[index] for index in read.parts]
    spans = tuple((start, stop) for start, stop, _part in rows)
    every = spans[0][0] == 0 and spans[-1][1] == query.shape[2] and all(
        stop == next_start for (_start, stop), (next_start, _stop) in zip(spans, spans[1:]))  # fmt: skip
    if every:  # the queries as they lie, the kernel's output as the forward's
        tokens, queries = slice(None), query[0].transpose(0, 1)  # [tokens, heads, d]
    else:
        tokens = packed.cached(("row_tokens", spans),  # the same for every layer of the forward
                               lambda: torch.cat([torch.arange(*span) for span in spans]).to(query.device))
        queries = query[0].index_select(1, tokens).transpose(0, 1)
    layer = rows[0][2].layer
    out = layer.attend_rows_in_place(queries, [part for _start, _stop, part in rows],
                                     [stop - start for start, stop in spans], packed.memo, scale)  # fmt: skip
    return [(tokens, out)]


def _batched_decode(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, softcap: float | None,
                    sinks: torch.Tensor | None) -> list:  # fmt: skip
    """`BATCHED_DECODE`: decode tokens over their histories gathered into one padded batch, in one call."""
    bucket = [packed.parts[index] for index in read.parts]
    tokens = torch.tensor([start for start, _stop, _part in bucket], device=query.device)
    keys, values, mask = bucket[0][2].layer.gather_rows([part.plan for _start, _stop, part in bucket], packed.memo)
    # [rows, heads, 1, d], in the precision the rows are read in (float32 for a quantized history)
    queries = query[0].index_select(1, tokens).transpose(0, 1).unsqueeze(2).to(keys.dtype)
    return [(tokens, attention(queries, keys, values, mask, scale, softcap, sinks)[:, :, 0].to(query.dtype))]


def _cascade_kernel(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, *_unused) -> list:
    """`CASCADE_KERNEL`: decode tokens whose read ranges begin with the same `read.prefix` stored tokens, in the C++
    CPU kernel: all of them over the prefix in one call (its keys read once), then each over the rest of its own range,
    merged by log-sum-exp (`PagedLayer.attend_shared_prefix_in_place`)."""
    group = [packed.parts[index] for index in read.parts]
    tokens = torch.tensor([start for start, _stop, _part in group], device=query.device)
    queries = query[0].index_select(1, tokens).transpose(0, 1)  # [rows, heads, d]
    parts = [part for _start, _stop, part in group]
    return [(tokens, group[0][2].layer.attend_shared_prefix_in_place(queries, parts, read.prefix, packed.memo, scale))]


def _cascade(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, softcap: float | None,
             *_unused) -> list:  # fmt: skip
    """`CASCADE`: the same in torch: the prefix's keys as views of its blocks, the rest of each range gathered in
    buckets of similar lengths (`selector.similar_lengths`), merged by log-sum-exp (cascade attention)."""
    group = [packed.parts[index] for index in read.parts]
    layer, heads, head_dim, prefix = group[0][2].layer, query.shape[1], query.shape[-1], read.prefix
    kv_heads = layer.kv_shape[0]
    tokens = torch.tensor([start for start, _stop, _part in group], device=query.device)
    queries = query[0].index_select(1, tokens).float()  # [heads, rows, d]
    keys, values = layer.row_kv(group[0][2].plan, 0, prefix)  # [kv_heads, prefix, d]
    out, lse = partial_attention(queries.reshape(1, kv_heads, -1, head_dim), keys[None].float(), values[None].float(),
                                 None, scale, softcap)  # fmt: skip
    out, lse = out.reshape(heads, len(group), -1).transpose(0, 1), lse.reshape(heads, len(group)).transpose(0, 1)
    queries = queries.transpose(0, 1)  # [rows, heads, d]
    pieces = []
    for bucket in similar_lengths(list(range(len(group))), lambda index: group[index][2].read_len - prefix):
        rows = torch.tensor(bucket, device=query.device)
        keys, values, mask = layer.gather_rows([group[index][2].plan for index in bucket], packed.memo, skip=prefix)
        rest, rest_lse = partial_attention(queries[rows].reshape(len(bucket), kv_heads, -1, head_dim), keys.float(),
                                           values.float(), mask, scale, softcap)  # fmt: skip
        merged, _lse = merge_partials(out[rows], lse[rows], rest.reshape(len(bucket), heads, -1),
                                      rest_lse.reshape(len(bucket), heads))  # fmt: skip
        pieces.append((tokens[rows], merged.to(query.dtype)))
    return pieces


def _alone(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, softcap: float | None,
           sinks: torch.Tensor | None) -> list:  # fmt: skip
    """A part read alone, as a step of `generate()` (`TRITON`, `QUANTIZED`, `COMPACTED`, `ROWS`), with its own mask."""
    start, stop, part = packed.parts[read.parts[0]]
    mask = part.own_mask(stop - start, query.device)
    return [(slice(start, stop), _attend_blocks(query[:, :, start:stop], part, mask, scale, softcap, sinks, read.path)[0])]


_READERS = {KERNEL_ROWS: _kernel_rows, BATCHED_DECODE: _batched_decode, CASCADE_KERNEL: _cascade_kernel,
            CASCADE: _cascade, TRITON: _alone, QUANTIZED: _alone, COMPACTED: _alone, ROWS: _alone}  # fmt: skip


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
    layer, plan = paged_kv.layer, paged_kv.plan
    if path == TRITON:
        out = _kernel_attention(query, paged_kv, scale, softcap, sinks)
    elif path == QUANTIZED:  # torch over the quantized history, decoded a chunk at a time
        out = layer.attend_quantized(query, plan, mask, scale, softcap, sinks).transpose(1, 2)
    elif path == COMPACTED:
        out = attend(query, *layer.read_with_mask(plan, mask, query.shape[2]), scale, softcap, sinks).transpose(1, 2)
    else:  # row by row over views of the blocks
        out = layer.attend_rows(query, plan, mask, scale, softcap, sinks).transpose(1, 2)
    paged_kv.finish(query, mask, scale, softcap, sinks)  # eviction statistics and triggers, if any
    return out


def _kernel_attention(query: torch.Tensor, paged_kv: PagedKV, scale: float, softcap: float | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """Triton kernels over the blocks; returns `[batch, q, heads, head_dim]`."""
    from .kernels import paged_decode_attention, paged_prefill_attention

    plan, layer, device = paged_kv.plan, paged_kv.layer, query.device
    tables, seq_lens = plan.tensor("block_tables", device), plan.tensor("seq_lens", device)
    window, softcap = paged_kv.kernel_window, softcap or 0.0
    quantized = layer.quantized_kv(plan, device) if layer.is_quantized else None
    chunk = paged_kv.kernel_chunk  # chunks start where a stored index plus the row's origin is a multiple of it
    chunking = dict(chunk_size=chunk, chunk_offsets=plan.tensor("stored_origins", device) if chunk else None)
    if query.shape[2] == 1:
        out = paged_decode_attention(
            query[:, :, 0], layer.key_blocks, layer.value_blocks, tables, seq_lens, scale, window, softcap,
            quantized=quantized, sinks=sinks, **chunking,
        )  # fmt: skip
        return out.unsqueeze(1)
    return paged_prefill_attention(
        query.transpose(1, 2), layer.key_blocks, layer.value_blocks, tables, seq_lens,
        plan.tensor("query_lens", device), scale, window, softcap, quantized=quantized, sinks=sinks, **chunking,
    )  # fmt: skip
