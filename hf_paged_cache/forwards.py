"""How a packed forward swaps the forwards of a model's modules, and what it checks first: the decoder layers of a
model, whether two functions run the same code, whether hooks are set that a replaced forward would skip.

Every forward the package runs in place of a module's own (fused decoder layers, oneDNN products, compiled
modules, recurrent layers run per request) is swapped in by `swapped_forwards` for one packed forward alone, so the
user's model runs as before everywhere else.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn.modules import module as nn_module


@contextmanager
def swapped_forwards(modules: list[torch.nn.Module], forwards: list) -> Iterator[None]:
    """Within the block, `modules[i]` runs `forwards[i]`; after it, each runs what it ran before."""
    saved = [module.__dict__.get("forward") for module in modules]  # an accelerate hook sets its own
    try:
        for module, forward in zip(modules, forwards):
            module.forward = forward
        yield
    finally:
        for module, forward in zip(modules, saved):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The decoder layers of `model`, in `layer_types` order: its decoder's `layers` list (or its one list of at
    least `num_layers` modules)."""
    decoder = model.get_decoder()
    lists = {name: module for name, module in decoder.named_children()
             if isinstance(module, torch.nn.ModuleList) and len(module) >= num_layers}  # fmt: skip
    if "layers" in lists:
        return lists["layers"]
    if len(lists) == 1:
        return next(iter(lists.values()))
    raise ValueError(
        f"{type(decoder).__name__} has {'no' if not lists else 'more than one'} list of {num_layers} decoder layers, "
        "so the batch generator cannot run its recurrent layers per request: use `model.generate` with a `PagedCache`"
    )


def same_code(first, second, _compared: set | None = None) -> bool:
    """Whether two functions (or methods, their decorators unwrapped) run the same code: the same bytecode and
    defaults, and every module-level name `second` reads bound in `first`'s module to the same object or to a function
    of the same code in turn (a model's modular copy of transformers' Llama code is, unless it swaps a helper: Ernie
    4.5's attention is Llama's bytecode calling its own interleaved `apply_rotary_pos_emb`)."""
    first, second = inspect.unwrap(first), inspect.unwrap(second)
    if first is second:
        return True
    if not (inspect.isfunction(first) and inspect.isfunction(second)):
        return False
    if any(getattr(first.__code__, name) != getattr(second.__code__, name)
           for name in ("co_code", "co_names", "co_consts", "co_varnames")):  # fmt: skip
        return False
    if (first.__defaults__, first.__kwdefaults__) != (second.__defaults__, second.__kwdefaults__):
        return False
    compared = set() if _compared is None else _compared
    if (id(first), id(second)) in compared:  # under comparison further up (recursion): the rest decides
        return True
    compared.add((id(first), id(second)))
    missing = object()
    for name in second.__code__.co_names:
        if name not in second.__globals__:
            continue  # an attribute's name, or a builtin
        ours, theirs = first.__globals__.get(name, missing), second.__globals__[name]
        if ours is not theirs and not same_code(ours, theirs, compared):
            return False
    return True


def has_global_hooks() -> bool:
    """Whether forward hooks registered for every module (`register_module_forward_hook`...) are set: a fused forward
    that does not call a module would skip them."""
    # torch has no public query for them either.
    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def hooked(module: torch.nn.Module) -> bool:
    """Whether `module` has forward hooks, which a fused forward that does not call it would skip."""
    # nn.Module has no public query for its hooks.
    return bool(module._forward_hooks or module._forward_pre_hooks)
