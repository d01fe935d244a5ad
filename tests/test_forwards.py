"""`forwards`: what a packed forward swaps a model's module forwards with, and what it checks before: swapped
forwards put back, the decoder layers found, code compared through the helpers it calls, hooks seen."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_paged_cache.forwards import decoder_layers, has_global_hooks, hooked, same_code, swapped_forwards


class _Decoder(torch.nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(count))


class _Model(torch.nn.Module):
    def __init__(self, count: int = 2):
        super().__init__()
        self.decoder = _Decoder(count)

    def get_decoder(self):
        return self.decoder


def test_swapped_forwards_are_put_back_as_they_were_also_after_an_error():
    plain, hooked_module = torch.nn.Identity(), torch.nn.Identity()
    own = hooked_module.forward = lambda x: x + 1  # an instance-level forward (an accelerate hook) stays
    with pytest.raises(RuntimeError, match="inside"), swapped_forwards([plain, hooked_module],
                                                                       [lambda x: 2 * x, lambda x: 3 * x]):  # fmt: skip
        assert plain(torch.ones(1)).item() == 2 and hooked_module(torch.ones(1)).item() == 3
        raise RuntimeError("inside")
    assert "forward" not in plain.__dict__ and hooked_module.__dict__["forward"] is own


def test_the_decoder_layers_are_the_decoders_layer_list():
    model = _Model(3)
    assert decoder_layers(model, 2) is model.decoder.layers
    with pytest.raises(ValueError, match="has no list of 4 decoder layers"):
        decoder_layers(_Model(2), 4)


def test_hooks_are_seen_on_a_module_and_globally():
    module = torch.nn.Identity()
    assert not hooked(module) and not has_global_hooks()
    handle = module.register_forward_pre_hook(lambda *args: None)
    assert hooked(module)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert has_global_hooks()
    finally:
        handle.remove()


def _doubled(x):
    return 2 * x


def _helper_user(x):
    return _doubled(x) + 1


def test_same_code_follows_the_module_level_helpers_a_function_calls():
    """The same bytecode calling a helper of another code is other code; decorators are unwrapped; defaults count."""
    copy = type(_helper_user)(_helper_user.__code__, {**_helper_user.__globals__, "_doubled": lambda x: 3 * x})
    alias = type(_helper_user)(_helper_user.__code__, {**_helper_user.__globals__,
                                                       "_doubled": type(_doubled)(_doubled.__code__, {})})  # fmt: skip
    assert same_code(alias, _helper_user) and not same_code(copy, _helper_user)
    assert same_code(functools.wraps(_helper_user)(lambda x: x), _helper_user)  # unwrapped to `_helper_user`
    with_default = type(_doubled)(_doubled.__code__, _doubled.__globals__, argdefs=(1,))
    assert not same_code(with_default, _doubled)
