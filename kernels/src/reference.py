"""Torch references for the paged kernels: same signatures, written to be obviously right.

Each reference gathers a row's K/V through its block table into contiguous tensors and runs plain
attention in fp32 with an explicit boolean mask and softmax. They are slow (a Python loop over rows)
and exist to define the semantics the Triton kernels are tested against; they are themselves checked
against ``torch.nn.functional.scaled_dot_product_attention`` on dense K/V in the tests.

With a ``QuantizedKV``, a row's quantized prefix is decoded by ``hf_paged_cache.quantization`` (float32)
and put before its full-precision tokens; ``quantize_blocks_ref`` is the formats' own ``quantize``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_paged_cache.quantization import QuantFormat

from .quantized import QuantizedKV


def write_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token i of ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping[i]``.

    slot = block_id * block_size + offset; a negative slot (padding) is skipped. Writes in place.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = key[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Stored tokens 0..length-1 of one row as a contiguous ``[length, num_kv_heads, head_dim]`` tensor."""
    block_size = cache.shape[1]
    s = torch.arange(length, device=cache.device)
    return cache[block_table_row[s // block_size].long(), s % block_size]


def attention_probs_ref(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    chunk_offset: int = 0,
) -> torch.Tensor:
    """Softmax probabilities ``[Hq, Lq, Lk]`` (fp32) of queries ``q [Lq, Hq, D]`` at stored indices ``q_pos [Lq]``
    over keys ``k [Lk, Hkv, D]``.

    Key s is visible from query position p iff s <= p and (sliding_window == 0 or s > p - sliding_window), and
    with ``chunk_size`` > 0 iff s and p lie in one chunk: ``(s + chunk_offset) // chunk_size`` equal.
    GQA: query head h uses KV head h // (Hq // Hkv). Queries that see no key get all-zero probabilities.
    ``sinks [Hq]``: one more logit per head, always visible, appended to each row's softmax and then dropped
    (gpt-oss's ``eager_attention_forward``), so the probabilities of a row sum to less than 1.
    """
    k = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window > 0:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    if chunk_size > 0:
        mask &= (k_pos[None, :] + chunk_offset) // chunk_size == (q_pos[:, None] + chunk_offset) // chunk_size
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.float()[:, None, None].expand(-1, logits.shape[1], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., : k.shape[0]]
    return torch.where(mask.any(dim=-1, keepdim=True), probs, 0.0)  # all-masked rows: NaN -> 0


def row_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    row: int,
    length: int,
    quantized: QuantizedKV | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored tokens 0..length-1 of one row as K, V ``[length, num_kv_heads, head_dim]``: the quantized prefix
    (if any) decoded to float32, then the full-precision tokens from the paged cache."""
    quantized_len = 0 if quantized is None else int(quantized.lens[row])
    k = gather_kv(k_cache, block_tables[row], length - quantized_len)
    v = gather_kv(v_cache, block_tables[row], length - quantized_len)
    if not quantized_len:
        return k, v
    blocks = quantized.block_tables[row, : quantized_len // k_cache.shape[1]]
    prefix_k = quantized.key_format.dequantize(quantized.key_fields, blocks).flatten(0, 1)
    prefix_v = quantized.value_format.dequantize(quantized.value_fields, blocks).flatten(0, 1)
    return torch.cat([prefix_k, k.float()]), torch.cat([prefix_v, v.float()])


def attention_ref(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    chunk_offset: int = 0,
) -> torch.Tensor:
    """Masked attention (see ``attention_probs_ref``) of ``q [Lq, Hq, D]`` over ``k, v [Lk, Hkv, D]``; fp32."""
    v = v.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    probs = attention_probs_ref(q, q_pos, k, scale, sliding_window, softcap, sinks, chunk_size, chunk_offset)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    num_splits: int | None = None,
    quantized: QuantizedKV | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for ``paged_decode_attention``; ``num_splits`` is accepted for signature parity and ignored."""
    out = torch.zeros_like(query)
    offsets = chunk_offsets.tolist() if chunk_offsets is not None else [0] * len(seq_lens)
    for b, (n, offset) in enumerate(zip(seq_lens.tolist(), offsets)):
        k, v = row_kv(k_cache, v_cache, block_tables, b, n, quantized)
        q_pos = torch.tensor([n - 1], device=query.device)
        out[b] = attention_ref(query[b, None], q_pos, k, v, scale, sliding_window, softcap, sinks, chunk_size,
                               offset)[0].to(query.dtype)  # fmt: skip
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    quantized: QuantizedKV | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    chunk_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for ``paged_prefill_attention``: the last ``query_lens[b]`` positions of row b are its
    last stored tokens (causal); the leading positions are padding and come out as 0."""
    q_len = query.shape[1]
    out = torch.zeros_like(query)
    offsets = chunk_offsets.tolist() if chunk_offsets is not None else [0] * len(seq_lens)
    for b, (n, ql, offset) in enumerate(zip(seq_lens.tolist(), query_lens.tolist(), offsets)):
        k, v = row_kv(k_cache, v_cache, block_tables, b, n, quantized)
        q_pos = torch.arange(n - ql, n, device=query.device)
        out[b, q_len - ql :] = attention_ref(
            query[b, q_len - ql :], q_pos, k, v, scale, sliding_window, softcap, sinks, chunk_size, offset
        ).to(query.dtype)
    return out


def paged_attention_mass_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    last_queries: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for ``paged_attention_mass``: each row's dense probabilities of its selected queries (the
    last ``min(query_lens[b], last_queries)`` positions), summed over queries and over each KV head's group."""
    _, q_len, num_q_heads, _ = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.zeros(len(seq_lens), num_kv_heads, block_tables.shape[1] * block_size, device=query.device)
    for b, (n, ql) in enumerate(zip(seq_lens.tolist(), query_lens.tolist())):
        w = ql if last_queries is None else min(ql, last_queries)
        q_pos = torch.arange(n - w, n, device=query.device)
        probs = attention_probs_ref(query[b, q_len - w :], q_pos, gather_kv(k_cache, block_tables[b], n), scale,
                                    sliding_window, softcap, sinks)  # fmt: skip
        out[b, :, :n] = probs.sum(dim=1).view(num_kv_heads, num_q_heads // num_kv_heads, n).sum(dim=1)
    return out


def quantize_blocks_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_blocks: torch.Tensor | Sequence[int],
    key_fields: dict[str, torch.Tensor],
    value_fields: dict[str, torch.Tensor],
    dst_blocks: torch.Tensor | Sequence[int],
    key_format: QuantFormat,
    value_format: QuantFormat,
) -> None:
    """Reference for ``quantize_blocks``: full-precision blocks ``src_blocks[i]`` of k/v_cache quantized into
    blocks ``dst_blocks[i]`` of the pools ``key_fields`` / ``value_fields`` (in place)."""
    src = torch.as_tensor(src_blocks, device=k_cache.device).long()
    key_format.quantize(k_cache[src], key_fields, dst_blocks)
    value_format.quantize(v_cache[src], value_fields, dst_blocks)
