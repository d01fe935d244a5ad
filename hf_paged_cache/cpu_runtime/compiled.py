"""Compiled pieces of the packed forward (`BatchConfig(compile=True)`).

A packed forward is mostly the model's own compute, and on a CPU much of what is not a matrix product is a chain
of small element-wise ops (norms, gated activations) that `torch.compile` fuses. Only the modules of a decoder layer
that map one tensor to one tensor are compiled (feed-forward blocks, norms): they hold no cache and take no mask,
so the paged attention, the per-request layers and the caches run as they are. The compiled forwards are swapped
in for the packed forwards alone, so the user's model runs as before everywhere else.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager

import torch

from ..forwards import decoder_layers, swapped_forwards


def maps_one_tensor(module: torch.nn.Module) -> bool:
    """Whether `module.forward` takes exactly one argument (a tensor, by every transformers block of this kind)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward inspect cannot read (a C extension): not compiled
        return False
    return len(parameters) == 1 and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )


class CompiledModules:
    """The one-tensor modules of `model`'s decoder layers, compiled with dynamic shapes (one graph serves every token
    count: the layers of a model share their classes' code, so the first layer's compile serves the others)."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        layers = decoder_layers(model, num_layers)
        self.modules = [child for layer in layers for child in layer.children() if maps_one_tensor(child)]
        if not self.modules:
            raise ValueError(
                f"`compile=True`: the decoder layers of {type(model).__name__} have no module that maps one tensor to "
                "one tensor (a feed-forward block or a norm) to compile; leave `compile` off for this model"
            )
        self.compiled = [torch.compile(module.forward, dynamic=True) for module in self.modules]

    def active(self) -> AbstractContextManager[None]:
        """Within the block, the modules run their compiled forwards."""
        return swapped_forwards(self.modules, self.compiled)
