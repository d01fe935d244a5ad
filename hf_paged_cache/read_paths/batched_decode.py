"""`BATCHED_DECODE`: decode tokens of a packed forward over their histories copied into one padded batch, a torch
call per bucket of similar lengths (the selector's buckets), instead of a call per sequence. A quantized history is
decoded straight into the batch: its sealed blocks in one call per K / V for every row (the rows' block tables
null-padded), then its full-precision range, in float32 (the precision the quantized path reads in)."""

from __future__ import annotations

import torch

from ..attention.torch_path import attention
from ..blocks.plan import StepPlan
from ..kernels.layout import heads_first
from ..layers.handle import PackedPagedKV
from ..layers.paged import PagedLayer
from .selector import Read


def attend(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, softcap: float | None,
           sinks: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The read's decode tokens (their starts in the packed `query` `[1, heads, q, d]`), in one call: (token
    indices, outputs `[tokens, heads, d]`)."""
    bucket = [packed.parts[index] for index in read.parts]
    tokens = torch.tensor([start for start, _stop, _part in bucket], device=query.device)
    keys, values, mask = gather_rows(bucket[0][2].layer, [part.plan for _start, _stop, part in bucket], packed,
                                     read.parts)  # fmt: skip
    # [rows, heads, 1, d], in the precision the rows are read in (float32 for a quantized history)
    queries = query[0].index_select(1, tokens).transpose(0, 1).unsqueeze(2).to(keys.dtype)
    return [(tokens, attention(queries, keys, values, mask, scale, softcap, sinks)[:, :, 0].to(query.dtype))]


def gather_rows(layer: PagedLayer, plans: list[StepPlan], packed: PackedPagedKV, parts: tuple[int, ...],
                skip: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The stored ranges of the one-row `plans` (the packed forward's `parts`, whose caches share the layer's storage)
    copied once into one batch: K/V `[len(plans), kv_heads, longest, d]` and the boolean mask `[len(plans), 1, 1,
    longest]` of their stored tokens (the rest read the null block). `skip` leaves out the first tokens of every range
    (a prefix they share, read once: full precision only). The slot indices are found once per forward for the
    group's layers."""
    key = ("gather_rows", layer.tables.name, parts, skip, layer.device)
    if layer.is_quantized:
        return _gather_quantized(layer, packed.cached(key, lambda: _quantized_indices(layer, plans)))
    slots, mask = packed.cached(key, lambda: _plain_indices(layer, plans, skip))
    rows, longest = mask.shape[0], mask.shape[-1]
    keys, values = (heads_first(blocks).index_select(1, slots).unflatten(1, (rows, longest)).transpose(0, 1)
                    for blocks in (layer.key_blocks, layer.value_blocks))  # fmt: skip
    return keys, values, mask


def _plain_indices(layer: PagedLayer, plans: list[StepPlan], skip: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = [plan.read_stop[0] - plan.read_start[0] - skip for plan in plans]
    longest = max(lengths)
    slots = torch.zeros(len(plans), longest, dtype=torch.long)  # slot 0: the null block's first
    for index, (plan, length) in enumerate(zip(plans, lengths)):
        slots[index, :length] = plan.slots(0, plan.read_start[0] + skip, length)
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    return slots.flatten().to(layer.device), mask[:, None, None, :].to(layer.device)


def _quantized_indices(layer, plans: list[StepPlan]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's readable sealed blocks (null-padded to the longest such table), its full-precision slots, and the
    mask of what it reads (columns before its `read_from` hidden)."""
    bs, reads = layer.tables.block_size, []
    for plan in plans:
        first, start = layer.first_readable(plan, 0)
        hidden = max(plan.read_from[0] - start - first * bs, 0)  # positions of the first block not read
        reads.append((plan.quantized_tables[0][first:], hidden, plan.read_stop[0] - plan.read_start[0]))
    width = max(len(ids) for ids, _hidden, _stored in reads)
    stored_width = max(stored for _ids, _hidden, stored in reads)
    blocks = torch.zeros(len(plans), width, dtype=torch.long)  # block 0: the null block, decoded as zeros
    slots = torch.zeros(len(plans), stored_width, dtype=torch.long)  # slot 0: the null block's first
    mask = torch.zeros(len(plans), width * bs + stored_width, dtype=torch.bool)
    for index, (plan, (ids, hidden, stored)) in enumerate(zip(plans, reads)):
        blocks[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        slots[index, :stored] = plan.slots(0, plan.read_start[0], stored)
        mask[index, hidden : len(ids) * bs] = True
        mask[index, width * bs : width * bs + stored] = True
    return blocks.to(layer.device), slots.flatten().to(layer.device), mask[:, None, None, :].to(layer.device)


def _gather_quantized(layer, indices: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks, slots, mask = indices
    rows, quantized = blocks.shape[0], blocks.shape[1] * layer.tables.block_size
    out = []
    for fmt, fields, storage in ((layer.kv_format.key, layer.qkey, layer.key_blocks),
                                 (layer.kv_format.value, layer.qvalue, layer.value_blocks)):  # fmt: skip
        batch = torch.empty(rows, mask.shape[-1], *storage.shape[2:], device=layer.device)  # [rows, n, kv_heads, d]
        if quantized:
            target = batch[:, :quantized].unflatten(1, blocks.shape[1:] + (-1,))
            if fmt.rotate:  # rotated back, then copied
                target.copy_(fmt.dequantize(fields, blocks, torch.float32))
            else:
                fmt.dequantize(fields, blocks, torch.float32, out=target)
        flat = storage.view(-1, *storage.shape[2:])
        batch[:, quantized:] = flat.index_select(0, slots).view(rows, -1, *flat.shape[1:])
        out.append(batch.transpose(1, 2))
    return out[0], out[1], mask

