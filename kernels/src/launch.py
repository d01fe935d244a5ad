"""The host side the paged kernels' launchers share: launch records, the dot dtype, argument checks.

A launcher never calls a kernel directly: it builds ``Launch`` records (kernel, grid, runtime arguments,
constexprs, warps, stages) and runs them. ``compile_check`` builds the very same records from tiny CPU tensors
and hands them to ``triton.compile`` instead, so the variants checked for the GPU are, by construction, the ones
the launchers run -- there is no second copy of the constexpr logic to drift.

Numerics: every loaded value is converted to the *dot dtype* right after the load and every softmax
statistic is fp32. The dot dtype is the cache's own dtype for fp16/bf16 (tensor-core dots, fp32
accumulation, probabilities rounded to 16 bits before the P.V product as in FlashAttention) and fp32
with ``input_precision="ieee"`` for fp32 caches (exact, no tf32; these run on FMA units, so their
launchers pick smaller tiles to stay spill-free; the precision argument is moot for 16-bit operands).
Under the Triton interpreter bf16 arithmetic is wrong (it operates on raw bits), so there bf16 caches use fp32
dots instead; fp16 dots are exact in the interpreter and keep the GPU code path under test.
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
    head dim and the same strides (any strides; the cache allocates them head-major, see ``layout.py``): the kernels
    address both by ``k_cache``'s."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] with one dtype, "
            f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous head_dim (stride 1)")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must have the same strides (the kernels address both by k_cache's), got "
            f"{k_cache.stride()} and {v_cache.stride()}: lay them out alike (e.g. `.contiguous()` on both)"
        )


def sink_logits(sinks: torch.Tensor | None, num_q_heads: int, device: torch.device) -> torch.Tensor | None:
    """Learned sink logits (gpt-oss's ``s_aux``) as the kernels read them: one float32 per query head, or None."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must hold one logit per query head: shape ({num_q_heads},), got {tuple(sinks.shape)}")
    return sinks.to(device=device, dtype=torch.float32).contiguous()


def chunk_args(chunk_size: int, chunk_offsets: torch.Tensor | None, sliding_window: int,
               seq_lens: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """The kernels' chunked-attention arguments: the chunk size (0: none) and, per row, what to add to a stored
    index so that chunks start at multiples of the size (int32 ``[batch]``, zeros when None; without chunks never
    read, and ``seq_lens`` stands in)."""
    if chunk_size < 0 or (chunk_size and sliding_window):
        raise ValueError(f"chunk_size={chunk_size} must be >= 0 and comes without a sliding_window ({sliding_window})")
    if not chunk_size:
        return dict(chunk=0, chunk_offsets=seq_lens)
    chunk_offsets = torch.zeros_like(seq_lens) if chunk_offsets is None else chunk_offsets
    if chunk_offsets.shape != seq_lens.shape:
        raise ValueError(f"chunk_offsets must hold one offset per row: shape {tuple(seq_lens.shape)}, "
                         f"got {tuple(chunk_offsets.shape)}")  # fmt: skip
    return dict(chunk=int(chunk_size), chunk_offsets=chunk_offsets.to(device=seq_lens.device, dtype=torch.int32))


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take explicit strides for every dim but the last, which must have stride 1."""
    return x if x.stride(-1) == 1 else x.contiguous()
