"""`ROWS` and `COMPACTED`: the torch paths over full-precision blocks.

`ROWS` attends row by row, over the row's own stored tokens (`KVBlocks.row_kv`: views when its blocks form one run)
with the mask's columns for them, so rows of a ragged batch neither copy their history nor attend over each other's
padding. `COMPACTED` reads rows eviction compacted: their survivors stand in front of a virtual base, so it reads
whole blocks in stored order and takes the mask at each slot's logical position.
"""

from __future__ import annotations

import torch

from ..attention.torch_path import attend, attention, causal_mask, zero_unattended
from ..blocks.plan import StepPlan
from ..kernels.layout import gather_blocks
from ..layers.paged import PagedLayer


def step_causal_mask(plan: StepPlan, q_len: int, device: torch.device) -> torch.Tensor:
    """The causal mask of the step's read range (`q_len` queries, the last of its keys), built once per step."""
    return plan.cached(("causal_mask", q_len, device),
                       lambda: causal_mask(q_len, plan.new_len - plan.kv_offset, device))  # fmt: skip


def attend_rows(layer: PagedLayer, query: torch.Tensor, plan: StepPlan, mask: torch.Tensor | None, scale: float,
                softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`ROWS`: `query` `[batch, heads, q, d]` over the layer's rows (not compacted), `[batch, heads, q, d]`."""
    q_len = query.shape[2]
    causal = mask is None and q_len > 1  # plain causality: every query sees at least its own key
    if causal:
        mask = step_causal_mask(plan, q_len, query.device)
    out = []
    for row, runs in enumerate(plan.runs()):
        if not runs:  # nothing stored in range: a fully masked row, zeroed below
            out.append(query.new_zeros(1, query.shape[1], q_len, layer.value_dim))
            continue
        keys, values = layer.storage.row_kv(plan, row)
        own = causal and keys.shape[1] == q_len  # the row reads only its queries' own keys: SDPA's causal flag
        row_mask = None if mask is None or own else mask[row if mask.shape[0] > 1 else 0, None, :, :, runs[0][0] :]
        out.append(attention(query[row : row + 1], keys[None], values[None], row_mask, scale, softcap, sinks,
                             causal=own))  # fmt: skip
    out = out[0] if len(out) == 1 else torch.cat(out)
    # The columns before a row's first run are its padding, hidden by the model's mask: the whole mask
    # tells which query rows see no key at all.
    return out if causal else zero_unattended(out, mask)


def attend_compacted(layer: PagedLayer, query: torch.Tensor, plan: StepPlan, mask: torch.Tensor | None, scale: float,
                     softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`COMPACTED`: `query` `[batch, heads, q, d]` over the layer's compacted rows, `[batch, heads, q, d]`."""
    return attend(query, *read_with_mask(layer, plan, mask, query.shape[2]), scale, softcap, sinks)


def read_with_mask(layer: PagedLayer, plan: StepPlan, mask: torch.Tensor | None,
                   q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """K/V of the step's read range as whole blocks in stored order (`StepPlan.block_read`) and the boolean mask
    `[b, 1, q, n]` that goes with them: the model's mask taken at each slot's logical position, hiding slots outside
    the row's range. A compacted row stores its survivors in front of its virtual `base` (`Row.base`), so they stand
    at positions the model's mask shows."""
    ids, positions, valid = plan.cached(("block_read", layer.device),
                                        lambda: tuple(t.to(layer.device) for t in plan.block_read()))
    keys, values = (gather_blocks(blocks, ids) for blocks in (layer.key_blocks, layer.value_blocks))
    total = plan.new_len - plan.kv_offset
    if mask is None:
        mask = causal_mask(q_len, total, keys.device)
    columns = (positions - plan.kv_offset).clamp(0, total - 1)
    mask = mask.expand(len(plan.read_start), 1, q_len, total)
    visible = mask.gather(-1, columns[:, None, None, :].expand(-1, 1, q_len, -1))
    return keys, values, visible & valid[:, None, None, :]

