"""`KERNEL_ROWS`: a packed forward's one-row reads in one call of the C++ CPU attention kernel (`kernels.cpu_attention`)
over the blocks where they lie: each row's queries, the last of its stored range, attend causally over its blocks read
through a block table, so a history cut into several runs is not copied and no row is a call of its own.

A quantized layer's rows read their sealed blocks first (decoded in the kernel), then the blocks a multi-token step
reads both ways (`StepPlan.transition`: those sealed as they arrived decoded in the kernel next to their
full-precision copy, those not sealed yet decoded here), each query choosing as it would one token at a time, then
their full-precision blocks.
"""

from __future__ import annotations

import torch

from ..blocks.plan import StepPlan
from ..kernels import cpu_attention
from ..layers.handle import PackedPagedKV, PagedKV
from ..layers.paged import PagedLayer
from .selector import Read


def attend(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float,
           *_unused) -> list[tuple[torch.Tensor | slice, torch.Tensor]]:  # fmt: skip
    """The read's parts' queries (their spans of the packed `query` `[1, heads, q, d]`) in one kernel call: (token
    indices, outputs `[tokens, heads, d]`). Every token of the forward, in order, takes the queries as they lie."""
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
    parts, counts = [part for _start, _stop, part in rows], [stop - start for start, stop in spans]
    layer = parts[0].layer
    if layer.is_quantized:
        return [(tokens, _attend_quantized(layer, queries, parts, counts, packed, read.parts, scale))]
    tables = kernel_tables(layer, [part.plan for part in parts], counts, packed, read.parts)
    return [(tokens, cpu_attention.paged_attention_cpu(queries, layer.key_blocks, layer.value_blocks, *tables, scale))]


def kernel_tables(layer: PagedLayer, plans: list[StepPlan], counts: list[int], packed: PackedPagedKV,
                  parts: tuple[int, ...], skips: list[int] | None = None, offset: int = 0,
                  length: int | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The kernel's (block tables, query starts, stops, first tokens) of the plans' full-precision read ranges (the
    packed forward's `parts`) but their first `skips[i]` blocks (or `length` tokens from `offset` tokens into each
    range, if given), built once per forward for the plans' group."""

    def build() -> tuple[torch.Tensor, ...]:
        bs, skipped = layer.tables.block_size, skips or [0] * len(plans)
        starts = [max(plan.read_start[0] + offset, skip * bs) for plan, skip in zip(plans, skipped)]
        ends = [plan.read_stop[0] if length is None else min(plan.read_stop[0], start + length)
                for plan, start in zip(plans, starts)]  # fmt: skip
        ids = [plan.stored_blocks(start, end) for plan, start, end in zip(plans, starts, ends)]
        table = torch.zeros(len(plans), max(max(map(len, ids)), 1), dtype=torch.long)  # padded with the null block
        for row, blocks in enumerate(ids):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        firsts = torch.tensor([start % bs for start in starts])
        stops = firsts + torch.tensor([max(end - start, 0) for start, end in zip(starts, ends)])
        return table, torch.tensor([0, *counts]).cumsum(0), stops, firsts

    key = ("row_tables", layer.tables.name, parts, tuple(counts), tuple(skips or ()), offset, length)
    return packed.cached(key, build)


def _attend_quantized(layer, queries: torch.Tensor, parts: list[PagedKV], counts: list[int], packed: PackedPagedKV,
                      indices: tuple[int, ...], scale: float) -> torch.Tensor:  # fmt: skip
    """The quantized rows' queries in one kernel call. Blocks sealed as they arrived are decoded in the kernel next to
    their full-precision copy (`QuantizedLayer.arrival_kv`); a transition not sealed yet is decoded here
    (`QuantizedLayer.transition_kv`)."""
    plans, bs = [part.plan for part in parts], layer.tables.block_size
    arrivals = [part.layer.arrival_kv(0) if part.plan.transition[0] else None for part in parts]
    unsealed = any(plan.transition[0] and arrival is None for plan, arrival in zip(plans, arrivals))
    transitions = [part.layer.transition_kv(part.plan, 0) if part.plan.transition[0] else None
                   for part in parts] if unsealed else [None] * len(parts)  # fmt: skip

    def build() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        # The quantized read ends with the blocks sealed as they arrived, unless they are decoded here.
        quantized = [plan.quantized_tables[0][: len(plan.quantized_tables[0]) - (plan.transition[0] if unsealed
                                                                                 and arrival is not None else 0)]
                     for plan, arrival in zip(plans, arrivals)]  # fmt: skip
        table = torch.zeros(len(plans), max(max(map(len, quantized)), 1), dtype=torch.long)
        reads = torch.zeros(len(plans), 2, dtype=torch.long)
        for row, (plan, ids) in enumerate(zip(plans, quantized)):
            first, start = layer.first_readable(plan, 0)
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            reads[row] = torch.tensor([min(max(plan.read_from[0] - start, first * bs), len(ids) * bs), len(ids) * bs])
        # A transition not sealed yet is the first of the stored blocks.
        skips = [plan.transition[0] if plan.transition[0] and arrival is None else 0
                 for plan, arrival in zip(plans, arrivals)]  # fmt: skip
        return table, reads, skips

    table, reads, skips = packed.cached(("quantized_row_tables", layer.tables.name, indices), build)
    fmt = layer.kv_format
    quantized = cpu_attention.QuantizedRows(fmt.key, fmt.value, layer.qkey, layer.qvalue, table, reads)
    transition, window = None, layer.tables.window
    if unsealed:  # every transition decoded here
        (exact, starts), (decoded, _starts) = (_joined([t and t[pair] for t in transitions]) for pair in (1, 2))
        transition = cpu_attention.TransitionRows(exact, decoded, starts, window)
    elif any(arrival is not None for arrival in arrivals):  # decoded in the kernel from the quantized read's end
        exact, starts = _joined(arrivals)
        transition = cpu_attention.TransitionRows(exact, None, starts, window)
    tables = kernel_tables(layer, plans, counts, packed, indices, skips)
    out = cpu_attention.paged_attention_cpu(queries, layer.key_blocks, layer.value_blocks, *tables, scale, quantized,
                                            transition)  # fmt: skip
    for part in parts:
        part.layer.attended()
    return out


def _joined(pairs: list[tuple[torch.Tensor, torch.Tensor] | None],
            ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:  # fmt: skip
    """Rows' (keys, values) `[kv_heads, n_i, d]` (None: a row without) joined along the tokens (a lone pair as it is),
    and where each row's begin, `[rows + 1]`."""
    present = [pair for pair in pairs if pair is not None]
    keys, values = (present[0][side] if len(present) == 1 else torch.cat([pair[side] for pair in present], 1)
                    for side in (0, 1))  # fmt: skip
    starts = torch.tensor([0, *(0 if pair is None else pair[0].shape[1] for pair in pairs)]).cumsum(0)
    return (keys, values), starts
