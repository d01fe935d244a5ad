"""Writing a step's K/V into the paged cache: one launch for every token of the step.

One program per token copies all of that token's KV heads (a ``[num_kv_heads, head_dim]`` tile) for
both K and V to its slot (``slot = block_id * block_size + offset``); a negative slot marks a padding
token and is skipped.

The storage format is a compile-time variant (``FORMAT`` constexpr) of the same kernel, so a quantized
layout can later quantize in this same pass: add its name to ``FORMATS``, a branch to ``_store_token``
and its extra outputs (codes, scales) to the kernel. Today only ``"plain"`` exists: a copy into a cache
of the same dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, block_d, check_paged_kv, last_dim_contiguous

FORMATS = ("plain",)


@triton.jit
def _store_token(dst_ptrs, x, mask, FORMAT: tl.constexpr):
    """Store one token's ``[heads, head_dim]`` tile in the cache's storage format."""
    tl.static_assert(FORMAT == "plain", "unknown KV storage format")
    tl.store(dst_ptrs, x, mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache,
    v_cache,
    slot_mapping,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FORMAT: tl.constexpr,
):
    """Grid (num_tokens,)."""
    tok = tl.program_id(0).to(tl.int64)  # num_tokens x heads x head_dim may exceed 2**31 elements
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < num_kv_heads) & (offs_d < HEAD_DIM)
        dst = (slot // BLOCK_SIZE) * stride_kv_block + (slot % BLOCK_SIZE) * stride_kv_tok
        dst += offs_h * stride_kv_head + offs_d
        key = tl.load(key_ptr + tok * stride_key_tok + offs_h * stride_key_head + offs_d, mask=mask)
        value = tl.load(value_ptr + tok * stride_value_tok + offs_h * stride_value_head + offs_d, mask=mask)
        _store_token(k_cache + dst, key, mask, FORMAT)
        _store_token(v_cache + dst, value, mask, FORMAT)


def write_kv_meta(head_dim: int, block_size: int, num_kv_heads: int, storage_format: str) -> tuple[dict, int, int]:
    """Constexprs, num_warps and num_stages of the write kernel (shared by the launcher and compile_check)."""
    if storage_format not in FORMATS:
        raise ValueError(f"unknown KV storage format {storage_format!r}; known: {FORMATS}")
    constexprs = dict(
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d(head_dim),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        FORMAT=storage_format,
    )
    return constexprs, 4, 1


def plan_write_kv(k_cache, v_cache, key, value, slot_mapping) -> list[Launch]:
    """Validate inputs and describe the launch."""
    check_paged_kv(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim) or key.shape[0] != slot_mapping.shape[0]:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} / slot_mapping {tuple(slot_mapping.shape)} do not "
            f"match a cache with {num_kv_heads} KV heads of dim {head_dim}"
        )
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise TypeError(
            f"the plain format stores K/V unchanged: got {key.dtype}/{value.dtype} for a {k_cache.dtype} cache"
        )
    if key.shape[0] == 0:
        return []
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)
    constexprs, num_warps, num_stages = write_kv_meta(head_dim, block_size, num_kv_heads, "plain")
    return [
        Launch(
            _write_kv_kernel,
            grid=(key.shape[0],),
            args=dict(
                key_ptr=key, value_ptr=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                stride_key_tok=key.stride(0), stride_key_head=key.stride(1),
                stride_value_tok=value.stride(0), stride_value_head=value.stride(1),
                stride_kv_block=k_cache.stride(0), stride_kv_tok=k_cache.stride(1), stride_kv_head=k_cache.stride(2),
                num_kv_heads=num_kv_heads,
            ),
            constexprs=constexprs,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    ]  # fmt: skip


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token i of ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping[i]``.

    ``slot_mapping`` int32/int64 ``[num_tokens]``: block_id * block_size + offset, negative = skip.
    Writes ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` in place.
    """
    for launch in plan_write_kv(k_cache, v_cache, key, value, slot_mapping):
        launch.run()
