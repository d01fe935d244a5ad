"""The fixed Hadamard rotation of head vectors that rotating formats apply before quantizing.

It spreads an outlier channel's energy over all channels and stores nothing; being symmetric and orthogonal it
is its own inverse, so one function rotates and rotates back.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["hadamard", "rotate_heads"]


def hadamard(x: Tensor) -> Tensor:
    """`x` times the normalized Hadamard matrix (Sylvester's, divided by sqrt(d)) along its last dim d, a power
    of two: symmetric and orthogonal, so it is its own inverse and `hadamard(q) . hadamard(k) == q . k`.

    A butterfly of log2(d) rounds of neighbour sums and differences (then one multiply), the same float32
    operations in the same order as the seal kernel's (`kernels.dequantize.hadamard`), so both rotate a
    block bit-identically before quantizing it.
    """
    d = x.shape[-1]
    for _ in range(d.bit_length() - 1):  # after log2(d) rounds of (a + b, a - b), Sylvester's ordering
        a, b = x.unflatten(-1, (d // 2, 2)).unbind(-1)
        x = torch.cat([a + b, a - b], -1)
    return x * d**-0.5  # the float32 of the same double as the kernel's constant


@functools.lru_cache(maxsize=None)
def _hadamard_matrix(d: int, device: torch.device) -> Tensor:
    """The float32 `[d, d]` matrix of `hadamard`: one matmul rotates many vectors."""
    return hadamard(torch.eye(d, device=device))


def rotate_heads(x: Tensor) -> Tensor:
    """`hadamard` of float32 `x [..., head_dim]` as one matmul (rotating, or rotating back: the same), keeping
    a head-major layout head-major (`[n, block, heads, d]` viewed from a contiguous `[heads, n, block, d]`)."""
    matrix = _hadamard_matrix(x.shape[-1], x.device)
    if x.dim() == 4 and x.permute(2, 0, 1, 3).is_contiguous():
        return (x.permute(2, 0, 1, 3) @ matrix).permute(1, 2, 0, 3)
    return x @ matrix
