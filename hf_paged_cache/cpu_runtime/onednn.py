"""oneDNN matrix products for the packed forward's linear layers on a CPU (`BatchConfig(onednn=True)`).

A packed forward of a small model is mostly its linear layers' matrix products. On a CPU, `nn.Linear` runs the
BLAS torch was built with (MKL), which on some processors takes a slow path (AMD's, for one); oneDNN, which torch
also ships, has its own kernels for the instruction set the CPU reports. Each plain `nn.Linear` of the model whose
weight is on the CPU runs `torch.ops.mkldnn._linear_pointwise` on its own weight (no packed copy is kept, so the
model's memory does not grow) within the packed forwards alone; the user's model runs as before everywhere else.

A gated-SiLU MLP (Llama's `down_proj(act_fn(gate_proj(x)) * up_proj(x))`) runs as two fused products: the SiLU is
the gate product's post-op and the product with it the up product's, so the two `[tokens, intermediate]`
elementwise passes, and the fresh memory their outputs take, are gone.

A product of few rows (a step of decode tokens: at most `cpu_linear.FEW_ROWS`) in float32 runs the C++ kernel of
`kernels/src/cpu_linear.py` instead, on the plain weight: it streams the weight once for all the rows, where oneDNN's
kernels (tuned for many rows) run slower, and needs no packed copy.

oneDNN reorders a plain weight into its own blocked layout at every product, a pass over the whole weight that costs
most when the product is small (a step of decode tokens). `PackedWeights` keeps every weight reordered once: a second
copy of those weights in memory, so it is the user's choice (`BatchConfig(prepack_weights=True)`). A weight that is
replaced, or changed in place where torch counts it (its version), is packed again before its next product; a change
through `.data` is not seen.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP

from ..forwards import hooked, same_code, swapped_forwards
from ..kernels import cpu_attention, cpu_linear

_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and the linear op its CPU path runs."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _runs_on_onednn(module: torch.nn.Module) -> bool:
    # Subclasses (quantized linears) have their own math; a module with a forward of its own (an accelerate hook
    # that moves offloaded weights in) must keep it.
    return (type(module) is torch.nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype in _DTYPES
            and "forward" not in module.__dict__)  # fmt: skip


def _is_gated_silu_mlp(module: torch.nn.Module) -> bool:
    """An MLP whose forward is Llama's code (the same bytecode: the modular copies, Qwen2's, Mistral's, ..., are) over
    plain linears oneDNN runs, with no hooks the fused forward would skip, and a plain SiLU."""
    if "forward" in module.__dict__ or not same_code(type(module).forward, LlamaMLP.forward):
        return False
    linears = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(module, "act_fn", None)
    return (all(isinstance(linear, torch.nn.Module) and _runs_on_onednn(linear) and not hooked(linear) for linear in linears)
            and type(act) in (torch.nn.SiLU, SiLUActivation) and "forward" not in act.__dict__ and not hooked(act)
            and len({linear.weight.dtype for linear in linears}) == 1)  # fmt: skip


class PackedWeights:
    """The weights of `linears` in oneDNN's blocked layout for products of about `batch_tokens` rows, each packed
    again when its module's weight is replaced or its version moves."""

    def __init__(self, linears: list[torch.nn.Linear], batch_tokens: int):
        self.batch_tokens = batch_tokens
        self._packed: dict[torch.nn.Linear, tuple[torch.Tensor, torch.Tensor, int]] = {}
        for module in linears:
            self.weight(module)

    def weight(self, module: torch.nn.Linear) -> torch.Tensor:
        """`module`'s weight as oneDNN's products take it: its packed copy, up to date."""
        weight = module.weight
        packed = self._packed.get(module)
        if packed is None or packed[1] is not weight or packed[2] != weight._version:
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_tokens)
            packed = (reordered, weight, weight._version)
            self._packed[module] = packed
        return packed[0]

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies hold (the memory this option adds)."""
        return sum(packed.numel() * packed.element_size() for packed, _weight, _version in self._packed.values())


def _weight(module: torch.nn.Linear, packed: PackedWeights | None) -> torch.Tensor:
    return module.weight if packed is None else packed.weight(module)


def _few_rows(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of `inputs` with `weight` runs on the few-rows kernel (`kernels/src/cpu_linear.py`)."""
    return (inputs.numel() <= cpu_linear.FEW_ROWS * inputs.shape[-1] and weight.dtype == torch.float32
            and cpu_attention.available())  # fmt: skip


def _product(module: torch.nn.Linear, packed: PackedWeights | None, inputs: torch.Tensor,
             residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """`module(inputs)` on oneDNN (`inputs` on the CPU in the weight's dtype), plus `residual` added by the product's
    post-op if given (the same bits as a separate add: the product rounds once, then the sum); few rows in float32 on
    the few-rows kernel."""
    if _few_rows(inputs, module.weight):
        return cpu_linear.linear_rows_cpu(inputs, module.weight, module.bias, residual)
    inputs, weight = inputs.contiguous(), _weight(module, packed)
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(inputs, weight, module.bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(inputs, residual.contiguous(), weight, module.bias, "add")


def _gated_mlp(module: torch.nn.Module, packed: PackedWeights | None, inputs: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """A gated-SiLU MLP (`_is_gated_silu_mlp`) as two fused products and the down product (+ `residual`)."""
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj
    if _few_rows(inputs, gate.weight):
        hidden = cpu_linear.gated_rows_cpu(inputs, gate.weight, up.weight, gate.bias, up.bias)
        return _product(down, packed, hidden, residual)
    inputs = inputs.contiguous()
    act = torch.ops.mkldnn._linear_pointwise(inputs, _weight(gate, packed), gate.bias, "swish", [], "")  # oneDNN's SiLU
    hidden = torch.ops.mkldnn._linear_pointwise.binary(inputs, act, _weight(up, packed), up.bias, "mul")
    return _product(down, packed, hidden, residual)


@torch.compiler.disable  # Inductor lowers this op only for weights frozen into the graph: a compiled module calls it
def _onednn_forward(module: torch.nn.Linear, packed: PackedWeights | None, inputs: torch.Tensor) -> torch.Tensor:
    if inputs.dtype != module.weight.dtype or inputs.device.type != "cpu":  # mixed dtypes: the module's own math
        return torch.nn.functional.linear(inputs, module.weight, module.bias)
    return _product(module, packed, inputs)


@torch.compiler.disable
def _fused_mlp_forward(module: torch.nn.Module, packed: PackedWeights | None, inputs: torch.Tensor) -> torch.Tensor:
    if inputs.dtype != module.gate_proj.weight.dtype or inputs.device.type != "cpu":
        return type(module).forward(module, inputs)
    return _gated_mlp(module, packed, inputs)


class OneDnnLinears:
    """The CPU `nn.Linear` layers of `model` and its gated-SiLU MLPs (none when oneDNN is missing or the model is
    elsewhere); with `prepack`, their weights packed once for products of about `batch_tokens` rows."""

    def __init__(self, model: torch.nn.Module, prepack: bool = False, batch_tokens: int = 512):
        available = onednn_available()
        linears = [module for module in model.modules() if available and _runs_on_onednn(module)]
        mlps = [module for module in model.modules() if available and _is_gated_silu_mlp(module)]
        self.modules = linears + mlps
        self._running = set(self.modules)
        self.packed = PackedWeights(linears, batch_tokens) if prepack and linears else None
        self.forwards = [functools.partial(_onednn_forward, module, self.packed) for module in linears]
        self.forwards += [functools.partial(_fused_mlp_forward, module, self.packed) for module in mlps]

    @property
    def packed_bytes(self) -> int:
        """Bytes the packed weights hold (0 without `prepack`)."""
        return self.packed.nbytes if self.packed is not None else 0

    def runs(self, module: torch.nn.Module) -> bool:
        """Whether `module` (a linear layer or a gated-SiLU MLP) runs on oneDNN here."""
        return module in self._running

    def linear(self, module: torch.nn.Linear, inputs: torch.Tensor,
               residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`module(inputs)` (+ `residual`, added in the product) for a linear layer that `runs` here, on inputs in its
        weight's dtype on the CPU."""
        return _product(module, self.packed, inputs, residual)

    def mlp(self, module: torch.nn.Module, inputs: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`module(inputs)` (+ `residual`) for a gated-SiLU MLP that `runs` here, on inputs as for `linear`."""
        return _gated_mlp(module, self.packed, inputs, residual)

    def active(self, skip: Collection[torch.nn.Module] = ()) -> AbstractContextManager[None]:
        """Within the block, the layers run their oneDNN forwards (but those in `skip`: modules whose forwards nothing
        calls in the block, inside layers that run fused)."""
        swaps = [(module, forward) for module, forward in zip(self.modules, self.forwards) if module not in skip]
        if not swaps:
            return nullcontext()
        modules, forwards = zip(*swaps)
        return swapped_forwards(list(modules), list(forwards))
