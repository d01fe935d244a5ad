"""`QUANTIZED`: the torch path over a quantized history, row by row.

The sealed prefix is decoded at most `CHUNK_TOKENS` tokens at a time (`QuantizedLayer.quantized_chunks`), each chunk
attended by every tile of `QUERY_TILE` queries (so a long prompt chunk's transients stay bounded), and the chunks
merged with an online softmax in float32, so no full-precision copy of the history ever exists. A row's transition
blocks (`StepPlan.transition`: read quantized by some of the step's queries, in full precision by the others) and its
full-precision suffix are attended last, in one call per tile of `TRANSITION_TILE` queries over the columns it sees.
A rotated side is read as stored: the queries (rotated keys) and the short full-precision suffix are mapped into its
code space instead (`QuantFormat.code_space`), and the output (rotated values) back once at the end, as the Triton
kernels do -- not every decoded token of a long history.
"""

from __future__ import annotations

import torch

from ..attention.torch_path import OnlineSoftmax, visible_columns
from ..blocks.plan import StepPlan
from ..layers import quantized as quantized_layers
from ..layers.quantized import QuantizedLayer
from .rows import step_causal_mask

QUERY_TILE = 512  # queries of a long step attended at a time (their logits: a tile x a chunk)
# Queries of a step with a transition attended at a time: each tile reads only the span of columns it sees each way,
# so smaller tiles skip most of what a long step's early queries cannot see.
TRANSITION_TILE = 128


def attend(layer: QuantizedLayer, query: torch.Tensor, plan: StepPlan, mask: torch.Tensor | None, scale: float,
           softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`query` `[batch, heads, q, d]` over the layer's quantized history: `[batch, heads, q, d]`, like
    `attention.attend`."""
    batch, _heads, q_len, _ = query.shape
    if mask is None and (q_len > 1 or plan.kv_offset or any(plan.transition)):
        # (one query with nothing cut and no transition sees every key, and needs no mask)
        mask = step_causal_mask(plan, q_len, query.device)
    key_format, value_format = layer.kv_format.key, layer.kv_format.value
    out = []
    for row in range(batch):
        row_query = key_format.code_space(query[row])
        transition = layer.transition_kv(plan, row) if plan.transition[row] else None
        tile = QUERY_TILE if transition is None else TRANSITION_TILE
        tiles = [(q0, None if mask is None else mask[row if mask.shape[0] > 1 else 0, 0, q0 : q0 + tile],
                  OnlineSoftmax(row_query[:, q0 : q0 + tile], scale, softcap, sinks))
                 for q0 in range(0, q_len, tile)]  # fmt: skip
        span = None if transition is None else (transition[0], transition[0] + transition[1][0].shape[1])
        suffix = None
        for keys, values, first in _read_parts(layer, plan, row, span):
            if span is not None and first >= span[1]:  # the suffix after a transition: attended with it
                suffix = keys, values, first
                continue
            for _q0, row_mask, softmax in tiles:
                visible = None if row_mask is None else visible_columns(row_mask, first - plan.kv_offset, keys.shape[1])
                softmax.update(keys, values, visible)
        if transition is not None:
            for q0, row_mask, softmax in tiles:
                for keys, values, visible in _transition_pieces(layer, plan, transition, suffix, row_mask, q_len - q0):
                    softmax.update(keys, values, visible)
        result = torch.cat([softmax.result() for _q0, _mask, softmax in tiles], dim=1)
        out.append(value_format.code_space(result))
    layer.attended()
    return (out[0][None] if batch == 1 else torch.stack(out)).to(query.dtype)


def _read_parts(layer: QuantizedLayer, plan: StepPlan, row: int, span: tuple[int, int] | None = None):
    """The row's read as float32 `(keys, values, first position)` parts in the code space, `[kv_heads, n, d]`: its
    quantized chunks decoded (at most `CHUNK_TOKENS` tokens each) from its `read_from` on and its full-precision
    suffix, but the positions `span` (a transition's blocks, read apart). A suffix that continues the last chunk is
    copied into the end of that chunk's buffer, so the two are attended in one call (the suffix is at most the residual
    window and a block)."""
    base, start, stop = plan.base[row], plan.read_start[row], plan.read_stop[row]
    span = span or (base, base)
    chunks = layer.quantized_chunks(plan, row, max(base - span[0], 0) // layer.tables.block_size)
    skip = max(min(span[1] - base, stop) - start, 0)  # suffix tokens within the span
    start += skip
    suffix_first = base + start
    for index, (blocks, first) in enumerate(chunks):
        tokens = (blocks.stop - blocks.start) * layer.tables.block_size
        joined = index == len(chunks) - 1 and stop > start and first + tokens == suffix_first
        extra = stop - start if joined else 0
        keys, values = layer.sealed.decoded_buffer(blocks, tokens, extra)
        if joined:
            suffix_keys, suffix_values = _suffix(layer, plan, row, skip)
            keys[:, tokens:], values[:, tokens:] = suffix_keys, suffix_values
            stop = start  # the suffix is read
        lead = max(plan.read_from[row] - first, 0)  # the first block's positions before the row's read
        yield keys[:, lead:], values[:, lead:], first + lead
    if stop > start:
        keys, values = _suffix(layer, plan, row, skip)
        yield keys, values, suffix_first


def _suffix(layer: QuantizedLayer, plan: StepPlan, row: int, skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's full-precision read range but its first `skip` tokens, float32 in the code space, `[kv_heads, n, d]`."""
    keys, values = (part[:, skip:].float() for part in layer.storage.row_kv(plan, row))
    return layer.kv_format.key.code_space(keys), layer.kv_format.value.code_space(values)


def _transition_pieces(layer: QuantizedLayer, plan: StepPlan, transition: tuple, suffix: tuple | None,
                       row_mask: torch.Tensor, back: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """A row's transition blocks (`QuantizedLayer.transition_kv`) as each query of the tile `back` tokens before the
    step's end (the queries are the step's last tokens: all of its tokens, or its last alone in a narrowed forward)
    would read them one token at a time: quantized when they end `window` positions or more before the query's own
    position + 1, else in full precision; then the row's `suffix` (keys, values, first position), if any. Returns
    `(keys, values, visible)` pieces of at most `CHUNK_TOKENS` columns each way (a bounded transient, as for the
    quantized prefix), of only the columns some query of the tile sees that way, the suffix joined to the last piece:
    one call each."""
    first, full, quantized = transition
    n, bs, chunk = full[0].shape[1], layer.tables.block_size, quantized_layers.CHUNK_TOKENS
    start_position = plan.new_len - back
    positions = torch.arange(start_position, start_position + row_mask.shape[0], device=row_mask.device)
    ends = first + (torch.arange(n, device=row_mask.device) // bs + 1) * bs
    reads_quantized = ends[None, :] <= positions[:, None] + 1 - layer.tables.window
    visible = visible_columns(row_mask, first - plan.kv_offset, n)
    pieces = []
    for start in range(0, n, chunk):
        columns = slice(start, start + chunk)
        parts = [(*side, visible[:, columns] & reads) for side, reads in (
            ((quantized[0][:, columns], quantized[1][:, columns]), reads_quantized[:, columns]),
            ((full[0][:, columns], full[1][:, columns]), ~reads_quantized[:, columns]))]  # fmt: skip
        if suffix is not None and start + chunk >= n:
            keys, values, suffix_first = suffix
            parts.append((keys, values, visible_columns(row_mask, suffix_first - plan.kv_offset, keys.shape[1])))
        parts = [_seen_columns(*part) for part in parts]
        pieces.append(tuple(torch.cat(side, 1) for side in zip(*parts)))
    return pieces


def _seen_columns(keys: torch.Tensor, values: torch.Tensor,
                  visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`keys` / values `[kv_heads, n, d]` and `visible` `[q, n]` cut to the span of columns some query sees (one
    column, unseen, if none is: a query that sees nothing anywhere still gets its log-sum-exp of -inf)."""
    seen = visible.any(0).nonzero()
    columns = slice(int(seen[0]), int(seen[-1]) + 1) if seen.numel() else slice(0, min(keys.shape[1], 1))
    return keys[:, columns], values[:, columns], visible[:, columns]
