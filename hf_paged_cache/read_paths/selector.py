"""Which path reads each token of a step: the one place that decides.

The `"paged"` attention reads a layer's K/V from its blocks by one of these paths, each implemented in a module of
this package (`triton`, `cascade`, `kernel_rows`, `batched_decode`, `rows`, `quantized`):

| path | reads | when |
|---|---|---|
| `TRITON` | Triton kernels over the blocks (quantized ones dequantized in registers) | the cache's backend runs them (CUDA, or the interpreter) |
| `CASCADE_KERNEL` | the C++ CPU kernel: decode tokens over a prefix they share read once, then each over its rest | a packed forward's decode tokens whose stored ranges begin in the same blocks, long enough to pay |
| `CASCADE` | the same in torch | as above, where the C++ kernel cannot take them (softcap, or not every row plain) |
| `KERNEL_ROWS` | the C++ CPU kernel over the blocks where they lie, every row in one call | a packed forward's one-row reads under plain causality, float32, no softcap, no sinks |
| `BATCHED_DECODE` | decode histories copied into padded buckets of similar lengths, one torch call per bucket | a packed forward's other decode tokens whose histories are cheaper to copy than to read alone |
| `COMPACTED` | torch over whole blocks by each slot's logical position | rows eviction compacted |
| `QUANTIZED` | torch over sealed blocks decoded a chunk at a time, transition blocks both ways | quantized histories |
| `ROWS` | torch row by row over views of the rows' runs of blocks | everything else |

A packed forward (the batch generator's) is decided once per forward and group (`choose_packed`): the cascade,
the kernel rows and the batched decode take what they can, in that order, and every part left is read alone by
`choose_one`, as a step of `generate()` is. The facts the decisions rest on are the layers' (`PagedLayer.uses_kernels`,
`cpu_kernel_reads`, `is_quantized`, `storage.block_bytes`) and the plans' (rows, ranges, `stored_blocks`,
compaction, transition blocks); what each path does with its parts is its module's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..layers import quantized as quantized_layers

if TYPE_CHECKING:
    from ..layers.handle import PackedPagedKV, PagedKV

TRITON, CASCADE_KERNEL, CASCADE, KERNEL_ROWS, BATCHED_DECODE = "triton", "cascade_kernel", "cascade", "kernel_rows", \
    "batched_decode"  # fmt: skip
COMPACTED, QUANTIZED, ROWS = "compacted", "quantized", "rows"

# A decode row's history of at least this many bytes (keys and values) is read in place rather than copied into a
# batch with others': past it the copy costs more than the attention call the batch saves.
IN_PLACE_BYTES = 256 * 1024
# Decode tokens whose histories begin with a prefix of at least this many stored tokens in the same blocks read it
# once for all of them (a cascade), when reading it once per token would read at least SHARED_PREFIX_MIN_REREAD of its
# tokens again: below that, the call and merge it adds cost more than it saves.
SHARED_PREFIX_MIN_TOKENS = 64
SHARED_PREFIX_MIN_REREAD = 1536
# Histories read in one padded bucket: the longest at most this many times the shortest.
BUCKET_SPREAD = 1.5


@dataclass(frozen=True)
class Read:
    """One call of one path: the indices (into the handle's parts) of the parts it reads, and for a cascade the
    stored tokens they share."""

    path: str
    parts: tuple[int, ...]
    prefix: int = 0


def choose_one(paged_kv: PagedKV, mask: torch.Tensor | None) -> str:
    """The path that reads one handle's queries (a step of `generate()`, or a part of a packed forward read alone)."""
    plan, layer = paged_kv.plan, paged_kv.layer
    # A step whose tokens read some quantized blocks both ways (`StepPlan.transition`) takes the torch path.
    if layer.uses_kernels() and (mask is None or plan.padding_exact) and not any(plan.transition):
        return TRITON
    if layer.is_quantized and (layer.reads_quantized(plan) or any(plan.transition)):
        return QUANTIZED
    return COMPACTED if plan.tables.compacted else ROWS


def choose_packed(packed: PackedPagedKV, query_dtype: torch.dtype, softcap: float | None,
                  sinks: torch.Tensor | None) -> list[Read]:  # fmt: skip
    """The reads of a packed forward's parts (each part once), decided once per forward and group: every layer of a
    group has the same plans and storage, so its parts go the same ways."""
    layer = packed.parts[0][2].layer
    key = ("reads", layer.tables.name, layer.device, query_dtype, softcap is None, sinks is None)
    return packed.cached(key, lambda: _choose_packed(packed, query_dtype, softcap, sinks))


def _choose_packed(packed: PackedPagedKV, query_dtype: torch.dtype, softcap: float | None,
                   sinks: torch.Tensor | None) -> list[Read]:  # fmt: skip
    parts, reads, taken = packed.parts, [], set()
    own = [not part.gathered and part.after_attention is None for _start, _stop, part in parts]  # read by a path
    plain = [index for index, (_start, _stop, part) in enumerate(parts) if own[index] and _plain_row(part)]
    decode = [index for index in plain if parts[index][1] - parts[index][0] == 1]
    storage = parts[decode[0]][2].layer.storage if decode else None
    decode = [index for index in decode if parts[index][2].layer.storage is storage]
    if decode and sinks is None:
        for members, prefix in _shared_prefixes(packed, decode):
            in_kernel = softcap is None and _cpu_kernel_cascade(parts[members[0]][2], query_dtype) and all(
                _kernel_row(parts[index][2]) for index in members)  # fmt: skip
            reads.append(Read(CASCADE_KERNEL if in_kernel else CASCADE, tuple(members), prefix))
            taken.update(members)
    if softcap is None and sinks is None:
        rows = _kernel_rows(packed, [index for index in range(len(parts)) if index not in taken and own[index]
                                     and (index in plain or _kernel_row(parts[index][2]))], query_dtype)  # fmt: skip
        if rows:
            reads.append(Read(KERNEL_ROWS, tuple(rows)))
            taken.update(rows)
    together = [index for index in decode if index not in taken and not _reads_alone(parts[index][2])]
    if len(together) >= 2:
        for bucket in similar_lengths(together, lambda index: parts[index][2].read_len):
            reads.append(Read(BATCHED_DECODE, tuple(bucket)))
        taken.update(together)
    for index, (start, stop, part) in enumerate(parts):  # read alone, as a step of `generate()`
        if index not in taken:
            reads.append(Read(choose_one(part, part.own_mask(stop - start, part.layer.device)), (index,)))
    return reads


def _plain_row(part: PagedKV) -> bool:
    """Whether the torch path reads the handle's one row as its stored blocks in order (no Triton kernels, no
    compaction) and reads something, so its decode token can be read together with others'; a quantized row reads no
    block both ways and at most a chunk of positions (so a batch's decoded copy stays within a chunk per row)."""
    layer, plan = part.layer, part.plan
    if len(plan.read_start) != 1 or plan.tables.compacted or layer.uses_kernels():
        return False
    if layer.is_quantized:
        return plan.read_stop[0] > plan.read_start[0] and not any(plan.transition) and (
            plan.new_len - plan.kv_offset <= quantized_layers.CHUNK_TOKENS)  # fmt: skip
    return plan.read_stop[0] > plan.read_start[0]


def _kernel_row(part: PagedKV) -> bool:
    """Whether the C++ kernel can read the handle's one row as its blocks lie: no Triton kernels, no compaction, and
    something to read (a quantized row may read only sealed blocks, transition blocks and long histories too)."""
    layer, plan = part.layer, part.plan
    if len(plan.read_start) != 1 or plan.tables.compacted or layer.uses_kernels():
        return False
    return plan.new_len > plan.kv_offset if layer.is_quantized else plan.read_stop[0] > plan.read_start[0]


def _cpu_kernel_cascade(part: PagedKV, query_dtype: torch.dtype) -> bool:
    """Whether the C++ kernel reads a shared prefix of this layer's rows once (full precision only: a quantized
    layer's prefix is read decoded, by the torch path)."""
    return not part.layer.is_quantized and part.layer.cpu_kernel_reads(query_dtype)


def _reads_alone(part: PagedKV) -> bool:
    """Whether a decode token is read on its own over its blocks as they lie rather than copied into a padded batch:
    a full-precision history long enough that the copy costs more than the call the batch saves."""
    layer = part.layer
    return not layer.is_quantized and part.read_len * layer.storage.block_bytes >= IN_PLACE_BYTES * layer.tables.block_size


def _kernel_rows(packed: PackedPagedKV, candidates: list[int], query_dtype: torch.dtype) -> list[int]:
    """The `candidates` the C++ kernel attends in one call: those of the first one's storage, where its layer allows
    the kernel, whose queries are one token or attend under plain causality (no window or chunk mask)."""
    parts = packed.parts
    rows = [index for index in candidates if parts[index][1] - parts[index][0] == 1
            or parts[index][2].own_mask(parts[index][1] - parts[index][0], parts[index][2].layer.device) is None]
    if not rows or not parts[rows[0]][2].layer.cpu_kernel_reads(query_dtype):
        return []
    storage = parts[rows[0]][2].layer.storage
    return [index for index in rows if parts[index][2].layer.storage is storage]


def _shared_prefixes(packed: PackedPagedKV, decode: list[int]) -> list[tuple[list[int], int]]:
    """The decode tokens whose stored read ranges begin in the same blocks (a cached prefix), as (their part indices,
    the prefix's tokens), for prefixes of at least `SHARED_PREFIX_MIN_TOKENS` of which reads apart would read at least
    `SHARED_PREFIX_MIN_REREAD` tokens again; each token keeps at least its own key past the prefix. Sorted by their
    blocks, the tokens of a prefix stand together, and the prefix a run of them shares is what its first and last
    share. A quantized history is decoded as it is read: its rows share no prefix."""
    parts = packed.parts
    first = parts[decode[0]][2].layer
    if first.is_quantized:
        return []
    block_size = first.tables.block_size
    reads = sorted((parts[index][2].plan.read_start[0], parts[index][2].plan.stored_blocks(),
                    index) for index in decode)  # fmt: skip

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
            plans = [parts[index][2].plan for _first, _blocks, index in run]
            prefix = min(shared(run[0], run[-1]), *(plan.read_stop[0] - plan.read_start[0] - 1 for plan in plans))
            if prefix >= SHARED_PREFIX_MIN_TOKENS and (len(run) - 1) * prefix >= SHARED_PREFIX_MIN_REREAD:
                found.append(([index for _first, _blocks, index in run], prefix))
        run = [read]
    return found


def similar_lengths(items: list, length: Callable) -> list[list]:
    """`items` in buckets of similar read `length`s (the longest at most `BUCKET_SPREAD` x the shortest), so a padded
    batch copies and attends over few more keys than its rows read, in a few calls rather than one per row."""
    buckets: list[list] = []
    for item in sorted(items, key=length):
        if not buckets or length(item) > BUCKET_SPREAD * length(buckets[-1][0]):
            buckets.append([])
        buckets[-1].append(item)
    return buckets
