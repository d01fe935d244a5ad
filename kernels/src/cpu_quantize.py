"""Sealing blocks on the CPU in one C++ call (built with the attention kernel: `cpu_attention.available()`).

A quantized layer seals the blocks a step completes, per layer and step; the formats' torch encode runs a dozen small
ops per call, which costs far more than the arithmetic on a block or two. `quantize_blocks_cpu` writes the same codes,
scales and zero points bit for bit (the torch encode, `QuantFormat.quantize`, is its reference) for the formats the
CPU kernel reads (`cpu_attention.reads_format`).
"""

from __future__ import annotations

import torch

from hf_paged_cache.quantization import QuantFormat

from .cpu_attention import kernel_format, reads_format


def quantize_blocks_cpu(fmt: QuantFormat, x: torch.Tensor, sources: torch.Tensor, fields: dict[str, torch.Tensor],
                        targets: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Blocks `x[sources[i]]` (`x`: float32 `[blocks, block_size, kv_heads, d]`, e.g. a layer's storage) quantized
    into blocks `targets[i]` of the pool `fields` (`fmt.allocate`'s layout), as `fmt.quantize` would write them.
    Returns the first block's reconstruction error `[block_size, kv_heads]`: per token and head, |decoded - x| over
    the head's mean |x| in the block. Call `cpu_attention.available()` first."""
    block_size, head_dim = x.shape[1], x.shape[-1]
    if not reads_format(fmt, block_size, head_dim):
        raise ValueError(f"quantize_blocks_cpu cannot encode {fmt!r} (see cpu_attention.reads_format)")
    kernel = kernel_format(fmt, block_size, head_dim)
    zero = fields["zero"] if "zero" in fields else fields["scale"].new_empty(0)
    errors = torch.zeros(block_size, x.shape[2])
    torch.ops.hf_paged_cache.quantize_blocks_cpu(x, sources, fields["codes"], fields["scale"], zero, targets,
                                                 kernel.bits, kernel.group, kernel.per_token, kernel.scale_bits,
                                                 errors)  # fmt: skip
    return errors
