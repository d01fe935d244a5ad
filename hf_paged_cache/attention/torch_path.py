"""The torch attention every read path shares: causal masks, soft-capping, learned sink logits, grouped (GQA)
heads, an online softmax over K/V chunks, and the attention mass eviction scores are made of.

A sink (gpt-oss's `s_aux`: one learned logit per query head) joins every softmax's denominator and has no value:
it takes probability from the keys, adds nothing to the output, and is never a key (never windowed or evicted).

Kernels have their own Triton versions (`hf_paged_cache.kernels`); this module is what runs everywhere
else, so the plain, quantized and statistics paths agree by construction.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F


def causal_mask(q_len: int, n: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Boolean `[1, 1, q_len, n]`: the queries are the last `q_len` of the `n` keys, each seeing at most the
    `window` most recent of them (itself included) when a sliding window is given."""
    visible = torch.ones(q_len, n, dtype=torch.bool, device=device).tril(n - q_len)
    if window is not None:
        visible = visible.triu(n - q_len - window + 1)
    return visible[None, None]


def chunked_mask(q_len: int, n: int, first: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Boolean `[1, 1, q_len, n]` of chunked attention for keys at positions `first, ..., first + n - 1` and the
    last `q_len` of them as queries: causal, and a query sees only the keys of its own `chunk`-sized chunk
    (chunks counted from position 0, a row without padding, as transformers' `chunked_overlay`)."""
    positions = torch.arange(first, first + n, device=device)
    queries = positions[n - q_len :, None]
    return ((positions[None, :] <= queries) & (positions[None, :] // chunk == queries // chunk))[None, None]


def grouped_logits(queries: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """Scaled (and soft-capped) logits of grouped queries `[kv_heads, g * q, d]` against `[kv_heads, n, d]`."""
    logits = torch.matmul(queries, keys.to(queries.dtype).transpose(-1, -2)).mul_(scale)
    if softcap is not None:  # Gemma-2: softcap * tanh(logits / softcap)
        logits = logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def grouped_sinks(sinks: torch.Tensor, kv_heads: int, q_len: int) -> torch.Tensor:
    """Per-head sink logits `[heads]` laid out like the grouped logits' rows: `[kv_heads, g * q, 1]` (float32)."""
    return sinks.float()[:, None].expand(-1, q_len).reshape(kv_heads, -1, 1)


def group_visibility(visible: torch.Tensor, group: int) -> torch.Tensor:
    """A `[q, n]` mask repeated for each query head of a KV head's group: `[1, group * q, n]`."""
    return visible[None].expand(group, -1, -1).reshape(1, group * visible.shape[0], visible.shape[1])


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` `[b, heads, q, d]` over `key`/`value` `[b, kv_heads, n, d]` (grouped heads).

    `mask` is boolean `[b, 1, q, n]` (True = attend) or None, meaning causal with the queries aligned to
    the last `q` keys; `sinks` `[heads]` are learned sink logits. Query rows with nothing to attend to
    return 0, never NaN.
    """
    q_len, n = query.shape[2], key.shape[2]
    if mask is None and q_len > 1:
        mask = causal_mask(q_len, n, query.device)
    return zero_unattended(attention(query, key, value, mask, scale, softcap, sinks), mask)


def attention(query, key, value, mask: torch.Tensor | None, scale: float, softcap: float | None,
              sinks: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:  # fmt: skip
    """`attend` without its last step: query rows that see no key are left as SDPA makes them (NaN), so a
    caller attending in parts fixes them once (`zero_unattended`). `mask` None means no masking; `causal` (with no
    `mask`) that the queries are the keys themselves, in order: SDPA masks that square without a mask tensor and
    skips the tiles above the diagonal."""
    key, value = key.to(query.dtype), value.to(query.dtype)
    if causal and (softcap is not None or sinks is not None):
        mask = causal_mask(query.shape[2], key.shape[2], query.device)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
        )
    else:  # SDPA can neither soft-cap nor take a sink logit (a virtual sink key would need a per-head float mask as
        # large as the logits themselves): one row at a time through the shared grouped logits
        out = torch.stack([
            _manual_row(query[b], key[b], value[b], None if mask is None else mask[b if mask.shape[0] > 1 else 0, 0],
                        scale, softcap, sinks)
            for b in range(query.shape[0])
        ])  # fmt: skip
    return out


def zero_unattended(out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`out` `[b, heads, q, d]` with the query rows that `mask` `[b, 1, q, n]` lets see no key set to 0."""
    return out if mask is None else out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def _manual_row(query, key, value, visible, scale: float, softcap: float | None, sinks: torch.Tensor | None):
    heads, q_len, head_dim = query.shape
    kv_heads = key.shape[0]
    group = heads // kv_heads
    logits = grouped_logits(query.reshape(kv_heads, group * q_len, head_dim), key, scale, softcap)
    if visible is not None:
        logits = logits.masked_fill(~group_visibility(visible, group), float("-inf"))
    if sinks is None:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:  # the sink is one more softmax column, dropped after: it only adds to the denominator
        with_sinks = torch.cat([logits.float(), grouped_sinks(sinks, kv_heads, q_len)], dim=-1)
        weights = torch.softmax(with_sinks, dim=-1)[..., :-1]
    return torch.matmul(weights.to(query.dtype), value).reshape(heads, q_len, value.shape[-1])


def visible_columns(row_mask: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Columns [first, first + count) of a `[q, width]` mask; columns before 0 (left of the read) are hidden."""
    if first >= 0:
        return row_mask[:, first : first + count]
    hidden = torch.zeros(row_mask.shape[0], -first, dtype=torch.bool, device=row_mask.device)
    return torch.cat([hidden, row_mask[:, : first + count]], dim=1)


class OnlineSoftmax:
    """Attention of one row's queries `[heads, q, d]` over K/V chunks `[kv_heads, n, d]` (grouped heads),
    merged by their log-sum-exp (float32), so no chunk outlives its `update`; the sinks (if any) join the
    sum once, in `result`. Fully masked queries give 0. Each chunk is a `partial_attention`."""

    def __init__(self, query: torch.Tensor, scale: float, softcap: float | None, sinks: torch.Tensor | None = None):
        self.heads, self.q_len, _ = query.shape
        self.query, self.scale, self.softcap, self.sinks = query.float(), scale, softcap, sinks
        self.lse = self.out = None  # [kv_heads, g * q] and [kv_heads, g * q, d]: normalised over the chunks so far

    def update(self, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None) -> None:
        if keys.shape[1] == 0:
            return
        kv_heads = keys.shape[0]
        group = self.heads // kv_heads
        query = self.query.reshape(kv_heads, group * self.q_len, -1)
        keys, values = keys.to(query.device, torch.float32), values.to(query.device, torch.float32)
        if visible is not None:  # None: every key of the chunk is visible
            visible = visible.to(query.device)
            visible = None if bool(visible.all()) else group_visibility(visible, group)[None]
        out, lse = partial_attention(query[None], keys[None], values[None], visible, self.scale, self.softcap)
        if self.out is None:
            self.out, self.lse = out[0], lse[0]
            return
        self.out, self.lse = merge_partials(self.out, self.lse, out[0], lse[0])

    def result(self) -> torch.Tensor:
        out = self.out
        if self.sinks is not None:  # a logit with no value: it only adds to the denominator
            sink = grouped_sinks(self.sinks.to(out.device), out.shape[0], self.q_len)[..., 0]
            out = out * torch.exp(self.lse - torch.logaddexp(self.lse, sink))[..., None]
        return out.reshape(self.heads, self.q_len, -1)


def partial_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
                      scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Grouped float32 `query` `[b, kv_heads, gq, d]` over a part of the keys `[b, kv_heads, n, d]`, `visible` a
    boolean mask broadcastable to `[b, 1, gq, n]` (None: every key): (the softmax-weighted values
    `[b, kv_heads, gq, dv]`, the log-sum-exp of the visible logits `[b, kv_heads, gq]`, -inf where none is), so
    parts attended apart merge exactly (`merge_partials`).

    Attended by the CPU flash kernel, which returns its log-sum-exp, where it can (CPU, no softcap, keys and values
    of one width): one fused call instead of materialising the logits; elsewhere through the shared grouped logits."""
    if keys.shape[-2] == 0:  # no key at all (the CPU kernel would divide by zero): nothing seen
        out = query.new_zeros(*query.shape[:-1], values.shape[-1])
        return out, query.new_full(query.shape[:-1], float("-inf"))
    if softcap is None and query.device.type == "cpu" and keys.shape[-1] == values.shape[-1]:
        mask = None if visible is None else torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        out, lse = _FLASH_CPU(query, keys, values, attn_mask=mask, scale=scale)
        if visible is not None:  # the kernel gives a query that sees nothing a log-sum-exp of 0
            lse = lse.masked_fill(~visible.any(-1), float("-inf"))
        return out, lse
    logits = grouped_logits(query, keys, scale, softcap)
    if visible is not None:
        logits = logits.masked_fill_(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.matmul(weights, values), lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor, other_out: torch.Tensor,
                   other_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Two `partial_attention` results of the same queries over disjoint keys, as one over both: each weighted by
    its share of the joint softmax denominator (queries that saw nothing in either keep 0)."""
    total = torch.logaddexp(lse, other_lse)
    safe = total.masked_fill(torch.isinf(total), 0.0)
    return out * torch.exp(lse - safe)[..., None] + other_out * torch.exp(other_lse - safe)[..., None], total


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, log-sum-exp): chunks merge exactly


def attention_mass(
    queries: torch.Tensor,
    chunks: Callable[[], Iterator[torch.Tensor]],
    visible: torch.Tensor,
    group: int,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per key, the softmax probability summed over `queries` `[kv_heads, group * s, d]` (float32) over
    the key chunks `[kv_heads, n_i, d]` that `chunks()` yields in order (called twice: once for the
    log-sum-exp, once for the probabilities; a single chunk without sinks takes one softmax); `visible`
    `[s, sum n_i]`. Sinks `[heads]` join each log-sum-exp, as in the model's attention, so the keys' mass
    is what the model gave them. Returns `[kv_heads, sum n_i]`."""
    visible = group_visibility(visible, group)

    def logits(chunk: torch.Tensor, start: int) -> torch.Tensor:
        out = grouped_logits(queries, chunk.float(), scale, softcap)
        return out.masked_fill_(~visible[..., start : start + chunk.shape[1]], float("-inf"))

    stream = chunks()
    head = list(itertools.islice(stream, 2))
    if not head:
        return queries.new_zeros(queries.shape[0], 0)
    if len(head) == 1 and sinks is None:  # one chunk (full precision): one fused softmax, a query seeing no key adds 0
        return torch.softmax(logits(head[0], 0), dim=-1).nan_to_num_(0.0).sum(dim=1)
    lse, start = None, 0
    if sinks is not None:  # each query row's log-sum-exp starts from its head's sink logit
        lse = grouped_sinks(sinks.to(queries.device), queries.shape[0], queries.shape[1] // group)[..., 0]
    for chunk in itertools.chain(head, stream):
        part = torch.logsumexp(logits(chunk, start), dim=-1)
        lse = part if lse is None else torch.logaddexp(lse, part)
        start += chunk.shape[1]
    masses, start = [], 0
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    for chunk in chunks():
        masses.append(torch.exp(logits(chunk, start) - safe[..., None]).sum(dim=1))
        start += chunk.shape[1]
    return torch.cat(masses, dim=-1)
