"""A Llama-style decoder layer's element-wise steps in one C++ pass each (`cpu_layer_ops.cpp`), for the batch
generator's fused layers: in eager torch an RMS norm is six small ops and the rotary embedding of queries and keys
twelve, each a pass over the tokens and an allocation. Built with the CPU attention kernel
(`cpu_attention.available()` says whether it is); float32 only. `rms_norm_ref` / `rotary_ref` are transformers'
formulas, their references: the rotary op gives the same bits, the norm's mean sums in another order.
"""

from __future__ import annotations

import torch


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x**2, -1) + eps))` per token of `x` `[..., hidden]` (float32)."""
    return torch.ops.hf_paged_cache.rms_norm_cpu(x, weight, eps)


def rotary_cpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`q` `[batch, tokens, heads, d]` and `k` `[batch, tokens, kv_heads, d]` rotated by `cos` / `sin`
    `[batch, tokens, d]` (float32), as new contiguous tensors of the same shapes."""
    return torch.ops.hf_paged_cache.rotary_cpu(q, k, cos, sin)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm` in float32."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """transformers' `apply_rotary_pos_emb` on tokens-major `q` / `k` `[batch, tokens, heads, d]`."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
