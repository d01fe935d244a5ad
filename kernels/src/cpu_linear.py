"""Matrix products of few rows on a linear layer's plain weight (`cpu_linear_ops.cpp`), for the batch generator's
packed forwards on a CPU: a decode step's products read each weight whole for a few tokens, where oneDNN's kernels
(tuned for many rows) run slower than these and need a packed copy of the weight or a reorder at every product. Built with the CPU attention kernel (`cpu_attention.available()` says whether it is); float32 only.
`linear_rows_ref` / `gated_rows_ref` are their torch references.
"""

from __future__ import annotations

import torch

# Rows up to which a decode step's products run here: over SmolLM2's layer shapes the kernel is faster than oneDNN's
# product up to 64 rows but near 8 (where oneDNN's is 5-10% faster), and the two are even beyond (eval/few_rows.py).
FEW_ROWS = 64


def linear_rows_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`x @ weight.T (+ bias) (+ residual)` for `x` `[..., in]`, `weight` `[out, in]` (float32): each sum added after
    the product rounds, as separate ops would."""
    return torch.ops.hf_paged_cache.linear_rows_cpu(x, weight, bias, residual)


def gated_rows_cpu(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                   gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`silu(x @ gate_weight.T + gate_bias) * (x @ up_weight.T + up_bias)` (a gated-SiLU MLP's hidden state), float32."""
    return torch.ops.hf_paged_cache.gated_rows_cpu(x, gate_weight, gate_bias, up_weight, up_bias)


def linear_rows_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """torch's `linear`, plus `residual`."""
    out = torch.nn.functional.linear(x, weight, bias)
    return out if residual is None else out + residual


def gated_rows_ref(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                   gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """transformers' Llama MLP before its down projection."""
    gate = torch.nn.functional.linear(x, gate_weight, gate_bias)
    return torch.nn.functional.silu(gate) * torch.nn.functional.linear(x, up_weight, up_bias)
