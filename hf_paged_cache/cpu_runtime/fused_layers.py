"""Llama decoder layers run as one fused forward in the packed forward (with `BatchConfig(onednn=True)`, on a CPU).

Outside its matrix products an eager decoder layer of a small model still costs a good share of a step: an RMS norm
is six small ops, the rotary embedding twelve, each residual add another pass over the tokens, each module call its
Python. A layer whose code is transformers' Llama code (the same bytecode for the layer, its attention, norms and
gated-SiLU MLP, with plain float32 linears on oneDNN and no hooks) runs instead as: one C++ norm, the three
projections, one C++ rotary op (`kernels/src/cpu_layer.py`), the cache's `update` and the attention exactly as the model
calls them, the output projection with the residual added in the product, one norm, and the MLP with the residual
added in its down product (`onednn.py`). Only the norm's mean sums in another order, a last-bit difference.

When what follows the last layer is the model's own per-token code (Llama's model and causal-LM forwards: a norm and
the LM head on the kept tokens), the last layer computes its output past the attention only for the tokens whose
logits the step keeps; the other tokens' rows carry its input, which nothing reads. The kept tokens are the
sequences' last, each of which sees its whole read range under plain causality: there the layer's queries and its
attention are the kept tokens' alone too (`PackedPagedKV.last_tokens`); only its keys and values are every token's.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaRMSNorm,
    eager_attention_forward,
)

from ..attention.contract import PAGED_KV_KWARG
from ..forwards import decoder_layers, has_global_hooks, hooked, same_code, swapped_forwards
from ..kernels import cpu_attention, cpu_layer
from ..layers.handle import PackedPagedKV
from ..paged_attention import paged_attention_forward
from .onednn import OneDnnLinears

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _is_llama_layer(layer: torch.nn.Module, linears: OneDnnLinears) -> bool:
    """A decoder layer running Llama's code throughout, in float32, whose linears and MLP run on oneDNN."""
    attention = getattr(layer, "self_attn", None)
    norms = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
    if attention is None or any(norm is None for norm in norms) or getattr(layer, "mlp", None) is None:
        return False
    projections = [getattr(attention, name, None) for name in _PROJECTIONS]
    return (same_code(type(layer).forward, LlamaDecoderLayer.forward)
            and same_code(type(attention).forward, LlamaAttention.forward)
            and all(same_code(type(norm).forward, LlamaRMSNorm.forward) for norm in norms)
            and all(projection is not None and linears.runs(projection) for projection in projections)
            and linears.runs(layer.mlp)
            and all(parameter.dtype == torch.float32 for parameter in layer.parameters()))  # fmt: skip


def _runs_plain(modules: list[torch.nn.Module]) -> bool:
    """Whether nothing hooks into a layer's `modules` (itself and those in it, which its fused forward does not call;
    checked at every forward: hooks can come at any time), and none of them has a forward of its own (an accelerate
    hook)."""
    return all(not hooked(module) and "forward" not in module.__dict__ for module in modules)


def _keeps_last_layer_per_token(model: torch.nn.Module) -> bool:
    """Whether what runs after the last decoder layer is Llama's own model and causal-LM code (a norm, the LM head on
    the kept tokens): per token, so tokens whose logits are not kept need no output from the last layer."""
    base = getattr(model, "model", None)
    return (base is not None and same_code(type(model).forward, LlamaForCausalLM.forward)
            and same_code(type(base).forward, LlamaModel.forward))  # fmt: skip


class FusedDecoderLayers:
    """The decoder layers of `model` that run fused in packed forwards (`of`); `active(keep)` makes them so for the
    forward it encloses (`keep`: the packed tokens whose logits the forward returns)."""

    def __init__(self, layers: list[torch.nn.Module], linears: OneDnnLinears, last: torch.nn.Module | None):
        self.layers = layers
        self.members = [list(layer.modules()) for layer in layers]  # the structure the fused forward was chosen for
        self.linears = linears
        self.last = last  # the last decoder layer, when only its kept tokens' outputs are read

    @classmethod
    def of(cls, model: torch.nn.Module, num_layers: int, linears: OneDnnLinears,
           per_request: list[torch.nn.Module] = ()) -> FusedDecoderLayers | None:  # fmt: skip
        """The fused layers of `model`: those of its `num_layers` decoder layers that run Llama's code and do not run
        per request; None when there are none or the C++ ops are not built."""
        try:
            modules = list(decoder_layers(model, num_layers))
        except (AttributeError, ValueError):  # no decoder layers to find: nothing is fused
            return None
        fused = [layer for layer in modules if layer not in per_request and _is_llama_layer(layer, linears)]
        if not fused or not cpu_attention.available():
            return None
        ends = len(modules) == num_layers and modules[-1] in fused and _keeps_last_layer_per_token(model)
        return cls(fused, linears, modules[-1] if ends else None)

    @contextmanager
    def active(self, keep: torch.Tensor) -> Iterator[set[torch.nn.Module]]:
        """Within the block, the layers run fused; the last one computes its output only for the tokens `keep`. Yields
        the modules of the layers that run fused (their own forwards are not called: `OneDnnLinears.active` need not
        swap theirs)."""
        running = [] if has_global_hooks() else [(layer, members) for layer, members in zip(self.layers, self.members)
                                                 if _runs_plain(members)]  # fmt: skip
        layers = [layer for layer, _members in running]
        forwards = [functools.partial(_fused_forward, layer, self.linears, keep if layer is self.last else None)
                    for layer in layers]  # fmt: skip
        with swapped_forwards(layers, forwards):
            yield {module for _layer, members in running for module in members}


def _fused_forward(layer: torch.nn.Module, linears: OneDnnLinears, keep: torch.Tensor | None,
                   hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                   **kwargs) -> torch.Tensor:  # fmt: skip
    """`LlamaDecoderLayer.forward` of `layer` (and `LlamaAttention.forward` of its attention), fused; the layer's own
    forward where the inputs are not what the fused ops take (training, another dtype or device, no rotary)."""
    attention = layer.self_attn
    if (layer.training or attention.training or position_embeddings is None or hidden_states.dtype != torch.float32
            or hidden_states.device.type != "cpu"):  # fmt: skip
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
                                   **kwargs)  # fmt: skip
    kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what the layer hands its attention
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(attention.config._attn_implementation, eager_attention_forward)
    hidden_shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
    normed = _norm(layer.input_layernorm, hidden_states)
    key = linears.linear(attention.k_proj, normed).view(hidden_shape)
    value = linears.linear(attention.v_proj, normed).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    if keep is None:
        query = linears.linear(attention.q_proj, normed).view(hidden_shape)
        query, key = (states.transpose(1, 2) for states in cpu_layer.rotary_cpu(query, key, cos, sin))
    else:  # the last layer: its queries wait for the cache's handle
        key = _rotated(key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
    residual, attended = hidden_states, None  # attended: the kept tokens' rows of the attention's output
    if keep is not None:  # the last layer: only the kept tokens' outputs are read
        packed = kwargs.get(PAGED_KV_KWARG)
        last = (packed.last_tokens(hidden_states.device)
                if isinstance(packed, PackedPagedKV) and interface is paged_attention_forward else None)  # fmt: skip
        if last is None:  # every token's query attends
            attended = keep
        else:  # the kept tokens are the sequences' last: their queries alone attend
            kwargs[PAGED_KV_KWARG] = last
            cos, sin, normed = cos[:, keep], sin[:, keep], normed[:, keep]
        query = linears.linear(attention.q_proj, normed).view(*normed.shape[:-1], -1, attention.head_dim)
        query, residual = _rotated(query, cos, sin), residual[:, keep]
    out, _weights = interface(attention, query, key, value, attention_mask, dropout=0.0, scaling=attention.scaling,
                              **kwargs)  # fmt: skip
    out = out.reshape(*out.shape[:2], -1)
    if attended is not None:
        out = out[:, attended]
    hidden = linears.linear(attention.o_proj, out, residual)
    hidden = linears.mlp(layer.mlp, _norm(layer.post_attention_layernorm, hidden), hidden)
    if keep is None:
        return hidden
    return hidden_states.index_copy(1, keep, hidden)


def _rotated(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`states` `[batch, tokens, heads, d]` rotated alone (the rotary op's other input without heads), as
    `[batch, heads, tokens, d]`."""
    return cpu_layer.rotary_cpu(states, states[:, :, :0], cos, sin)[0].transpose(1, 2)


def _norm(norm: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return cpu_layer.rms_norm_cpu(hidden_states, norm.weight, norm.variance_epsilon)
