"""Pieces shared by the paged kernels: the per-tile attention step and the launch plumbing.

Why one module: decode and prefill differ only in which query rows a program owns and which key
range it walks. Everything done per tile of keys -- gather K/V through the block table, scale,
soft-cap, causal / sliding-window masking, the online-softmax update -- is identical, so it lives
here once as ``@triton.jit`` helpers that both kernels inline.

The host side is shared too. A launcher never calls a kernel directly: it builds ``Launch`` records
(kernel, grid, runtime arguments, constexprs, warps, stages) and runs them. ``compile_check`` builds
the very same records from tiny CPU tensors and hands them to ``triton.compile`` instead, so the
variants checked for the GPU are, by construction, the ones the launchers run -- there is no second
copy of the constexpr logic to drift.

Numerics: every loaded value is converted to the *dot dtype* right after the load and every softmax
statistic is fp32. The dot dtype is the cache's own dtype for fp16/bf16 (tensor-core dots, fp32
accumulation, probabilities rounded to 16 bits before the P.V product as in FlashAttention) and fp32
with ``input_precision="ieee"`` for fp32 caches (exact, no tf32; these run on FMA units, so their
launchers pick smaller tiles to stay spill-free; the precision argument is moot for 16-bit operands).
Under the Triton interpreter bf16
arithmetic is wrong (it operates on raw bits), so there bf16 caches use fp32 dots instead; fp16 dots
are exact in the interpreter and keep the GPU code path under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Smallest M, N and K a tl.dot accepts on NVIDIA GPUs (the interpreter does not check it).
MIN_DOT = 16


@dataclass(frozen=True)
class Launch:
    """One kernel launch, described completely enough to run it or to compile it ahead of time."""

    kernel: Any  # a triton JITFunction (or InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: dict[str, Any]  # runtime arguments by name, in the kernel's parameter order
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int

    def run(self) -> None:
        self.kernel[self.grid](**self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def is_interpreted(kernel) -> bool:
    """True when ``@triton.jit`` ran with TRITON_INTERPRET=1 (decided when the kernel's module was imported)."""
    return isinstance(kernel, InterpretedFunction)


def dot_dtype(cache_dtype: torch.dtype, interpreted: bool):
    """The operand dtype of the kernels' tl.dot calls for a cache of ``cache_dtype`` (see module docstring)."""
    if cache_dtype == torch.float16:
        return tl.float16
    if cache_dtype == torch.bfloat16 and not interpreted:
        return tl.bfloat16
    if cache_dtype in (torch.bfloat16, torch.float32):
        return tl.float32
    raise TypeError(f"unsupported KV cache dtype {cache_dtype}; expected float32, float16 or bfloat16")


def block_d(head_dim: int) -> int:
    """Head dims that are not powers of two (80, 96, ...) are padded to the next one and masked."""
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def check_paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The storage layout: two ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensors with a contiguous
    head dim (any other strides; the cache allocates them head-major, see ``layout.py``)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] with one dtype, "
            f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous head_dim (stride 1)")


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take explicit strides for every dim but the last, which must have stride 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


# Reductions go through tl.reduce with combine functions defined here, not tl.max / tl.sum, and the
# kernels avoid tl.zeros / tl.cdiv: those are @jit functions of triton's standard library, created
# when triton is first imported. If that import came before TRITON_INTERPRET=1 was set (importing
# transformers imports triton), the interpreter cannot call them ("Cannot call @triton.jit'd outside
# of the scope of a kernel"); functions defined in this package are decorated late enough.
@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def row_max(x):
    return tl.reduce(x, 1, _max_combine)


@triton.jit
def row_sum(x):
    return tl.reduce(x, 1, _add_combine)


@triton.jit
def softcap_logits(x, softcap):
    """``softcap * tanh(x / softcap)``; tanh is written with exp because libdevice fails in the interpreter.

    tanh(y) = 1 - 2 / (exp(2y) + 1) saturates correctly: exp overflowing to inf gives 1, underflowing
    to 0 gives -1.
    """
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))


@triton.jit
def first_visible_key(q_pos, window):
    """Smallest stored index that query ``q_pos`` may attend to (window == 0: no sliding window)."""
    return tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)


@triton.jit
def visible(q_pos, k_pos, window):
    """[M, N] mask: key k_pos[n] is visible from query q_pos[m] (causal, and inside the sliding window).

    A query row with q_pos == -1 (padding, or a padded row of a query group) sees nothing.
    """
    causal = k_pos[None, :] <= q_pos[:, None]
    return causal & ((window <= 0) | (k_pos[None, :] > q_pos[:, None] - window))


@triton.jit
def load_kv_tile(head_ptr, tok_off, offs_d, mask, DOT_DTYPE: tl.constexpr):
    """[BLOCK_N, BLOCK_D] tile of one KV head; ``tok_off`` holds each token's offset in the cache."""
    return tl.load(head_ptr + tok_off[:, None] + offs_d[None, :], mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def attend_key_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    key_lo,
    key_hi,
    k_head_ptr,
    v_head_ptr,
    table_ptr,
    stride_kv_block,
    stride_kv_tok,
    scale,
    softcap,
    window,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Fold keys ``[key_lo, key_hi)`` of one row and one KV head into an online-softmax state.

    acc [M, BLOCK_D], m_i [M], l_i [M] (fp32): unnormalised output, running max and running sum.
    q [M, BLOCK_D] (DOT_DTYPE): the query rows sharing this KV head; q_pos [M]: their stored indices.
    key_lo must be a multiple of BLOCK_N so that every tile stays inside aligned cache blocks.
    table_ptr points at the row's block table; k/v_head_ptr at the cache plus the KV head's offset.
    Keys are gathered token by token (block id from the table, offset inside the block), so BLOCK_N
    is independent of the cache block size.
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for start in range(key_lo, key_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < key_hi
        block_id = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        tok_off = block_id.to(tl.int64) * stride_kv_block + (k_pos % BLOCK_SIZE) * stride_kv_tok
        kv_mask = k_valid[:, None] & d_mask[None, :]
        k = load_kv_tile(k_head_ptr, tok_off, offs_d, kv_mask, DOT_DTYPE)
        v = load_kv_tile(v_head_ptr, tok_off, offs_d, kv_mask, DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if USE_SOFTCAP:
            s = softcap_logits(s, softcap)
        s = tl.where(visible(q_pos, k_pos, window), s, float("-inf"))

        m_new = tl.maximum(m_i, row_max(s))
        # Rows that have seen no visible key yet keep m = -inf; shift them by 0 so exp() gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_shift)
        p = tl.exp(s - m_shift[:, None])
        l_i = l_i * alpha + row_sum(p)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def normalize(acc, l_i):
    """Final softmax normalisation; rows that saw no key (l == 0, acc == 0) come out as 0, never NaN."""
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
