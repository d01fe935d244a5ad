"""oneDNN matrix products for the packed forward's linear layers on a CPU (`BatchConfig(onednn=True)`).

A packed forward of a small model is mostly its linear layers' matrix products. On a CPU, `nn.Linear` runs the
BLAS torch was built with (MKL), which on some processors takes a slow path (AMD's, for one); oneDNN, which torch
also ships, has its own kernels for the instruction set the CPU reports. Each plain `nn.Linear` of the model whose
weight is on the CPU runs `torch.ops.mkldnn._linear_pointwise` on its own weight (no packed copy is kept, so the
model's memory does not grow) within the packed forwards alone; the user's model runs as before everywhere else.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, nullcontext

import torch

from .recurrent import swapped_forwards

_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and the linear op its CPU path runs."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _runs_on_onednn(module: torch.nn.Module) -> bool:
    # Subclasses (quantized linears) have their own math; a module with a forward of its own (an accelerate hook
    # that moves offloaded weights in) must keep it.
    return (type(module) is torch.nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in _DTYPES
            and "forward" not in module.__dict__)  # fmt: skip


@torch.compiler.disable  # Inductor lowers this op only for weights frozen into the graph: a compiled module calls it
def _onednn_forward(module: torch.nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    if inputs.dtype != module.weight.dtype or inputs.device.type != "cpu":  # mixed dtypes: the module's own math
        return torch.nn.functional.linear(inputs, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(inputs.contiguous(), module.weight, module.bias, "none", [], "")


class OneDnnLinears:
    """The CPU `nn.Linear` layers of `model` (none when oneDNN is missing or the model is elsewhere)."""

    def __init__(self, model: torch.nn.Module):
        available = onednn_available()
        self.modules = [module for module in model.modules() if available and _runs_on_onednn(module)]
        self.forwards = [functools.partial(_onednn_forward, module) for module in self.modules]

    def active(self) -> AbstractContextManager[None]:
        """Within the block, the layers run their oneDNN forwards."""
        return swapped_forwards(self.modules, self.forwards) if self.modules else nullcontext()
