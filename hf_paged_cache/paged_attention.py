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

from collections.abc import Callable

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

ATTENTION_NAME = "paged"
# Decode tokens of a packed forward whose histories begin with a prefix of at least this many stored tokens in the
# same blocks read it once for all of them (`_attend_shared_prefix`), when reading it once per token would read at
# least SHARED_PREFIX_MIN_REREAD of its tokens again: below that, the call and merge it adds cost more than it saves.
SHARED_PREFIX_MIN_TOKENS = 64
SHARED_PREFIX_MIN_REREAD = 1536


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
    """A packed forward: each sequence's queries over its own blocks, `[1, q, heads, d]`. The one-token sequences (the
    decode tokens) whose rows the torch path reads from one storage are attended together: those whose histories
    begin with a prefix they share (`_shared_prefixes`) read it once for all of them. Where the layer can
    (`PagedLayer.reads_rows_in_place`), the other decode tokens and the prompt chunks under plain causality go to one
    call of the C++ CPU attention kernel over their blocks where they lie. Else the decode tokens are attended in a call
    per bucket of similar history lengths over their histories gathered into one padded batch, instead of one call per
    sequence; there a decode token with a long full-precision history (`PagedKV.reads_in_place`) attends alone over
    its own blocks, since copying it into the padded batch would cost more than the call."""
    plain = [(start, stop, part) for start, stop, part in packed.parts if part.reads_with_others]
    decode = [(start, part) for start, stop, part in plain if stop - start == 1]
    decode = [(start, part) for start, part in decode if part.layer.storage is decode[0][1].layer.storage]
    pieces, read = [], set()
    for members, prefix in _shared_prefixes(decode, packed.memo) if decode and sinks is None else []:
        group = [decode[index] for index in members]
        pieces += _attend_shared_prefix(query, group, prefix, packed.memo, scale, softcap)
        read.update(start for start, _part in group)
    if softcap is None and sinks is None:
        # A plain row is one the kernel reads (`kernel_reads_row` allows what `reads_plain_row` does): asked of the rest.
        plain_starts = {start for start, _stop, _part in plain}
        rows = _rows_in_place([part for part in packed.parts if part[0] not in read
                               and (part[0] in plain_starts or part[2].reads_in_kernel)], query)  # fmt: skip
        if rows:
            spans = tuple((start, stop) for start, stop, _part in rows)
            every = spans[0][0] == 0 and spans[-1][1] == query.shape[2] and all(
                stop == next_start for (_start, stop), (next_start, _stop) in zip(spans, spans[1:]))  # fmt: skip
            if every:  # every token, in order: the queries as they lie, the kernel's output as the forward's
                tokens, queries = slice(None), query[0].transpose(0, 1)  # [tokens, heads, d]
            else:
                key = ("row_tokens", spans)
                if key not in packed.memo:  # the same for every layer of the forward
                    packed.memo[key] = torch.cat([torch.arange(*span) for span in spans]).to(query.device)
                tokens = packed.memo[key]
                queries = query[0].index_select(1, tokens).transpose(0, 1)
            layer = rows[0][2].layer
            out = layer.attend_rows_in_place(queries, [part for _start, _stop, part in rows],
                                             [stop - start for start, stop in spans], packed.memo, scale)  # fmt: skip
            if every:
                return out[None]
            pieces.append((tokens, out))
            read.update(start for start, _stop in spans)
    together = [(start, part) for start, part in decode if start not in read and not part.reads_in_place]
    if len(together) < 2:
        together = []
    for bucket in _similar_lengths(together, lambda item: item[1].read_len):
        tokens = torch.tensor([start for start, _part in bucket], device=query.device)
        keys, values, mask = bucket[0][1].layer.gather_rows([part.plan for _start, part in bucket], packed.memo)
        # [rows, heads, 1, d], in the precision the rows are read in (float32 for a quantized history)
        queries = query[0].index_select(1, tokens).transpose(0, 1).unsqueeze(2).to(keys.dtype)
        pieces.append((tokens, attention(queries, keys, values, mask, scale, softcap, sinks)[:, :, 0].to(query.dtype)))
    read.update(start for start, _part in together)
    for start, stop, part in packed.parts:
        if start not in read:
            mask = part.own_mask(stop - start, query.device)
            pieces.append((slice(start, stop), _attend_blocks(query[:, :, start:stop], part, mask, scale, softcap,
                                                              sinks)[0]))  # fmt: skip
    out = query.new_empty(query.shape[2], query.shape[1], pieces[0][1].shape[-1])
    for where, piece in pieces:
        out[where] = piece
    return out[None]


def _rows_in_place(plain: list[tuple[int, int, PagedKV]], query: torch.Tensor) -> list[tuple[int, int, PagedKV]]:
    """The parts among `plain` (one-row reads the kernel can take, `PagedKV.reads_in_kernel`, not read yet) that the
    C++ CPU attention kernel attends in one call: those of the first one's storage, where its layer allows the kernel,
    whose queries are one token or attend under plain causality (no window or chunk mask)."""
    rows = [(start, stop, part) for start, stop, part in plain
            if stop - start == 1 or part.own_mask(stop - start, query.device) is None]  # fmt: skip
    if not rows or not rows[0][2].layer.reads_rows_in_place(query.dtype):
        return []
    return [row for row in rows if row[2].layer.storage is rows[0][2].layer.storage]


def _shared_prefixes(decode: list[tuple[int, PagedKV]], memo: dict) -> list[tuple[list[int], int]]:
    """The decode tokens whose stored read ranges begin in the same blocks (a cached prefix), as (their indices in
    `decode`, the prefix's tokens), for prefixes of at least `SHARED_PREFIX_MIN_TOKENS` of which reads apart would read
    at least `SHARED_PREFIX_MIN_REREAD` tokens again; each token keeps at least its own key past the prefix. Sorted by
    their blocks, the tokens of a prefix stand together, and the prefix a run of them shares is what its first and last
    share. Found once per forward (`memo`) for every layer of the tokens' group."""
    key = ("shared_prefixes", tuple(id(part.plan) for _start, part in decode))
    if key in memo:
        return memo[key]
    block_size = decode[0][1].layer.tables.block_size
    reads = sorted((part.plan.read_start[0], part.layer.read_blocks(part.plan), index)
                   for index, (_start, part) in enumerate(decode))  # fmt: skip

    def shared(one, other) -> int:  # the tokens two reads share from their first
        if one[0] != other[0] or not one[1]:
            return 0
        blocks = next((at for at, (a, b) in enumerate(zip(one[1], other[1])) if a != b), min(len(one[1]), len(other[1])))
        return blocks * block_size - one[0] % block_size

    found, run = [], reads[:1]
    for read in [*reads[1:], None]:
        if read is not None and shared(run[0], read) >= SHARED_PREFIX_MIN_TOKENS:
            run.append(read)
            continue
        if len(run) > 1:
            plans = [decode[index][1].plan for _first, _blocks, index in run]
            prefix = min(shared(run[0], run[-1]), *(plan.read_stop[0] - plan.read_start[0] - 1 for plan in plans))
            if prefix >= SHARED_PREFIX_MIN_TOKENS and (len(run) - 1) * prefix >= SHARED_PREFIX_MIN_REREAD:
                found.append(([index for _first, _blocks, index in run], prefix))
        run = [read]
    memo[key] = found
    return found


def _attend_shared_prefix(query: torch.Tensor, group: list[tuple[int, PagedKV]], prefix: int, memo: dict, scale: float,
                          softcap: float | None) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Decode tokens `group` (starts in the packed `query` `[1, heads, q, d]`) whose read ranges begin with the same
    `prefix` stored tokens: all of them over the prefix in one call (its keys read once, as views of its blocks),
    then each over the rest of its own range (gathered in buckets of similar lengths), merged by log-sum-exp
    (cascade attention); both in the C++ CPU kernel, over the blocks where they lie, where the layer allows it
    (`PagedLayer.reads_shared_prefix_in_place`). Returns (token indices, outputs `[tokens, heads, d]`) pieces."""
    layer, heads, head_dim = group[0][1].layer, query.shape[1], query.shape[-1]
    kv_heads = layer.kv_shape[0]
    tokens = torch.tensor([start for start, _part in group], device=query.device)
    if softcap is None and layer.reads_shared_prefix_in_place(query.dtype) and all(
            part.reads_in_kernel for _start, part in group):  # fmt: skip
        queries = query[0].index_select(1, tokens).transpose(0, 1)  # [rows, heads, d]
        parts = [part for _start, part in group]
        return [(tokens, layer.attend_shared_prefix_in_place(queries, parts, prefix, memo, scale))]
    queries = query[0].index_select(1, tokens).float()  # [heads, rows, d]
    keys, values = layer.row_kv(group[0][1].plan, 0, prefix)  # [kv_heads, prefix, d]
    out, lse = partial_attention(queries.reshape(1, kv_heads, -1, head_dim), keys[None].float(), values[None].float(),
                                 None, scale, softcap)  # fmt: skip
    out, lse = out.reshape(heads, len(group), -1).transpose(0, 1), lse.reshape(heads, len(group)).transpose(0, 1)
    queries = queries.transpose(0, 1)  # [rows, heads, d]
    pieces = []
    for bucket in _similar_lengths(list(range(len(group))), lambda index: group[index][1].read_len - prefix):
        rows = torch.tensor(bucket, device=query.device)
        keys, values, mask = layer.gather_rows([group[index][1].plan for index in bucket], memo, skip=prefix)
        rest, rest_lse = partial_attention(queries[rows].reshape(len(bucket), kv_heads, -1, head_dim), keys.float(),
                                           values.float(), mask, scale, softcap)  # fmt: skip
        merged, _lse = merge_partials(out[rows], lse[rows], rest.reshape(len(bucket), heads, -1),
                                      rest_lse.reshape(len(bucket), heads))  # fmt: skip
        pieces.append((tokens[rows], merged.to(query.dtype)))
    return pieces


def _similar_lengths(items: list, length: Callable, spread: float = 1.5) -> list[list]:
    """`items` in buckets of similar read `length`s (the longest at most `spread` x the shortest), so a padded batch
    copies and attends over few more keys than its rows read, in a few calls rather than one per row."""
    buckets: list[list] = []
    for item in sorted(items, key=length):
        if not buckets or length(item) > spread * length(buckets[-1][0]):
            buckets.append([])
        buckets[-1].append(item)
    return buckets


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
                   softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """Attention of `query` `[batch, heads, q, head_dim]` over the blocks `paged_kv` names: `[batch, q, heads, d]`."""
    # A step whose tokens read some quantized blocks differently (`StepPlan.transition`) takes the torch path.
    if paged_kv.uses_kernels and (mask is None or paged_kv.plan.padding_exact) and not any(paged_kv.plan.transition):
        out = _kernel_attention(query, paged_kv, scale, softcap, sinks)
    else:  # the torch path: row by row over views of the blocks (a quantized layer decodes its history too)
        out = paged_kv.layer.attend(query, paged_kv.plan, mask, scale, softcap, sinks).transpose(1, 2)
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
