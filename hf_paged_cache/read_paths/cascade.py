"""`CASCADE_KERNEL` and `CASCADE`: decode tokens whose stored ranges begin with the same prefix (a cached prefix, the
selector's `Read.prefix` tokens) attend over it once for all of them, then each over the rest of its own range, the two
merged by log-sum-exp (cascade attention). In the C++ kernel: the queries over the prefix as rows that are not causal
(every query sees every key of its row; as many rows as threads, so each has a share), then each over its rest, the
kernel returning each query's log-sum-exp for the merge. In torch: the prefix's keys as views of its blocks, the rest
gathered in buckets of similar lengths."""

from __future__ import annotations

import torch

from ..attention.torch_path import merge_partials, partial_attention
from ..kernels import cpu_attention
from ..layers.handle import PackedPagedKV
from . import batched_decode
from .kernel_rows import kernel_tables
from .selector import Read, similar_lengths


def attend_in_kernel(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float,
                     *_unused) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """`CASCADE_KERNEL`: (token indices, outputs `[tokens, heads, d]`) of the read's decode tokens."""
    group = [packed.parts[index] for index in read.parts]
    tokens = torch.tensor([start for start, _stop, _part in group], device=query.device)
    queries = query[0].index_select(1, tokens).transpose(0, 1)  # [rows, heads, d]
    layer, plans = group[0][2].layer, [part.plan for _start, _stop, part in group]
    # The queries over the prefix in as many rows as threads (each row's query tiles are one task per KV head).
    split = min(torch.get_num_threads(), len(plans))
    counts = [len(plans) // split + (row < len(plans) % split) for row in range(split)]
    shared_tables = kernel_tables(layer, plans[:1] * split, counts, packed, read.parts[:1] * split, length=read.prefix)
    shared = cpu_attention.paged_partial_attention_cpu(queries, layer.key_blocks, layer.value_blocks, *shared_tables,
                                                       scale, causal=False)  # fmt: skip
    own_tables = kernel_tables(layer, plans, [1] * len(plans), packed, read.parts, offset=read.prefix)
    own = cpu_attention.paged_partial_attention_cpu(queries, layer.key_blocks, layer.value_blocks, *own_tables, scale)
    return [(tokens, merge_partials(*shared, *own)[0])]


def attend(query: torch.Tensor, packed: PackedPagedKV, read: Read, scale: float, softcap: float | None,
           *_unused) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """`CASCADE`: (token indices, outputs `[tokens, heads, d]`) of the read's decode tokens, in torch."""
    group = [packed.parts[index] for index in read.parts]
    layer, heads, head_dim, prefix = group[0][2].layer, query.shape[1], query.shape[-1], read.prefix
    kv_heads = layer.kv_shape[0]
    tokens = torch.tensor([start for start, _stop, _part in group], device=query.device)
    queries = query[0].index_select(1, tokens).float()  # [heads, rows, d]
    keys, values = layer.storage.row_kv(group[0][2].plan, 0, prefix)  # [kv_heads, prefix, d]
    out, lse = partial_attention(queries.reshape(1, kv_heads, -1, head_dim), keys[None].float(), values[None].float(),
                                 None, scale, softcap)  # fmt: skip
    out, lse = out.reshape(heads, len(group), -1).transpose(0, 1), lse.reshape(heads, len(group)).transpose(0, 1)
    queries = queries.transpose(0, 1)  # [rows, heads, d]
    pieces = []
    for bucket in similar_lengths(list(range(len(group))), lambda index: group[index][2].read_len - prefix):
        rows = torch.tensor(bucket, device=query.device)
        plans = [group[index][2].plan for index in bucket]
        keys, values, mask = batched_decode.gather_rows(layer, plans, packed, tuple(read.parts[index] for index in bucket), prefix)
        rest, rest_lse = partial_attention(queries[rows].reshape(len(bucket), kv_heads, -1, head_dim), keys.float(),
                                           values.float(), mask, scale, softcap)  # fmt: skip
        merged, _lse = merge_partials(out[rows], lse[rows], rest.reshape(len(bucket), heads, -1),
                                      rest_lse.reshape(len(bucket), heads))  # fmt: skip
        pieces.append((tokens[rows], merged.to(query.dtype)))
    return pieces
