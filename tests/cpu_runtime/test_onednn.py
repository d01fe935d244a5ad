"""`BatchConfig(onednn=True)`: the packed forwards run the model's CPU `nn.Linear` layers (and gated-SiLU MLPs, fused) on oneDNN,
the user's model is left as it was, and the tokens stay those of each prompt run alone."""

from __future__ import annotations

import functools

import pytest
import torch
from batch_workloads import NEW, alone, random_prompts, tiny_model
from tiny_models import MODELS_BY_NAME
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from hf_paged_cache.kernels import cpu_attention, cpu_linear
from hf_paged_cache.serving.batch_config import BatchConfig
from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.cpu_runtime.onednn import OneDnnLinears, onednn_available

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN"),
]


class _Scaled(torch.nn.Linear):
    """A linear subclass with math of its own (as a quantized linear has): it must keep its forward."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(inputs)


class _Doubled(LlamaMLP):
    """An MLP with Llama's layers and a forward of its own: it is not the Llama MLP's code, so it is not fused."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_every_plain_cpu_linear_and_gated_silu_mlp_of_the_model_runs_on_onednn():
    model = tiny_model("llama_gqa")
    linears = OneDnnLinears(model)
    plain = [module for module in model.modules() if type(module) is torch.nn.Linear]
    mlps = [layer.mlp for layer in model.model.layers]
    assert linears.modules == plain + mlps and len(plain) == 7 * model.config.num_hidden_layers + 1  # + the LM head


def _mlp(bias: bool = False, act: str = "silu", cls=LlamaMLP) -> LlamaMLP:
    torch.manual_seed(0)
    return cls(LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4, hidden_act=act, mlp_bias=bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_mlp_forward_is_the_mlp_up_to_rounding(dtype, bias):
    mlp = _mlp(bias).to(dtype)
    linears = OneDnnLinears(mlp)
    assert mlp in linears.modules
    inputs = torch.randn(2, 37, 48, dtype=dtype)[:, ::2]
    expected = mlp(inputs)
    with linears.active():
        got = mlp(inputs)
        assert "forward" in mlp.__dict__
    assert "forward" not in mlp.__dict__
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, expected, **tolerance)


def test_mlps_the_fused_forward_would_change_keep_their_own():
    other_act, own_forward, hooked = _mlp(act="gelu"), _mlp(cls=_Doubled), _mlp()
    hooked.up_proj.register_forward_hook(lambda module, args, output: output * 0)  # a hook only the module's forward runs
    for mlp in (other_act, own_forward, hooked):
        assert mlp not in OneDnnLinears(mlp).modules
    inputs = torch.randn(3, 48)
    expected = hooked(inputs)
    with OneDnnLinears(hooked).active():
        torch.testing.assert_close(hooked(inputs), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_forward_is_the_linear_layer_up_to_rounding(dtype, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    linears = OneDnnLinears(layer)
    inputs = torch.randn(3, 37, 48, dtype=dtype)[:, ::2]  # a strided view, as the model's slices are
    expected = layer(inputs)
    with linears.active():
        assert "forward" in layer.__dict__
        got = layer(inputs)
        if dtype == torch.bfloat16:  # another input dtype takes the module's own math, and its error
            with pytest.raises(RuntimeError, match="dtype"):
                layer(inputs.float())
    assert "forward" not in layer.__dict__  # the model's own forward is back
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU kernels could not be built here")
@pytest.mark.parametrize("rows", [1, cpu_linear.FEW_ROWS, cpu_linear.FEW_ROWS + 1])
def test_products_of_few_float32_rows_run_the_few_rows_kernel_and_more_run_onednn(rows, monkeypatch):
    """A linear layer and a gated-SiLU MLP over at most `FEW_ROWS` rows (a decode step) take the few-rows kernel on
    their plain weights, with or without packed copies; more rows take oneDNN. Both give the modules' outputs."""
    calls = []
    for name in ("linear_rows_cpu", "gated_rows_cpu"):
        kernel = getattr(cpu_linear, name)
        monkeypatch.setattr(cpu_linear, name, lambda *args, _kernel=kernel, _name=name: calls.append(_name) or _kernel(*args))
    mlp, inputs = _mlp(bias=True), torch.randn(1, rows, 48)
    layer, expected = mlp.down_proj, mlp(inputs)
    layer_inputs = torch.randn(1, rows, 80)
    for prepack in (False, True):
        linears = OneDnnLinears(mlp, prepack=prepack)
        with linears.active():
            got, got_layer = mlp(inputs), layer(layer_inputs)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_layer, torch.nn.functional.linear(layer_inputs, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
    few = ["gated_rows_cpu", "linear_rows_cpu", "linear_rows_cpu"] * 2  # the MLP's gated and down products, the layer
    assert calls == (few if rows <= cpu_linear.FEW_ROWS else [])


def test_subclasses_and_hooked_linears_keep_their_own_forward():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Scaled(4, 4), torch.nn.Linear(4, 4))
    hook = model[2].forward
    model[2].forward = hook  # an accelerate hook sets an instance forward of its own
    linears = OneDnnLinears(model)
    assert linears.modules == [model[0]]
    with linears.active():
        assert model[2].forward is hook and "forward" not in model[1].__dict__


def test_a_model_elsewhere_than_the_cpu_has_nothing_to_swap():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, device="meta"), torch.nn.Linear(4, 4, dtype=torch.float16))
    assert OneDnnLinears(model).modules == []  # not on the CPU; a dtype oneDNN's CPU linear does not take


@pytest.mark.parametrize("onednn, prepack", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
def test_packed_forwards_on_onednn_give_the_tokens_of_each_prompt_alone(name, onednn, prepack):
    """With or without oneDNN, and with its weights prepacked (whose copies the metrics count)."""
    model = tiny_model(name)
    prompts = random_prompts((5, 17, 9, 30), seed=3)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=16, onednn=onednn,
                               prepack_weights=prepack)  # fmt: skip
    assert (generator.onednn is not None) == onednn
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    for prompt, output in zip(prompts, outputs):
        assert output.generated_tokens == alone(model, prompt, DynamicCache(), MODELS_BY_NAME[name].gather_impl)
    assert all("forward" not in module.__dict__ for module in model.modules())
    linear_weights = [module.weight for module in model.modules() if type(module) is torch.nn.Linear]
    packed = sum(weight.numel() * weight.element_size() for weight in linear_weights) if prepack else 0
    assert generator.metrics().packed_weight_bytes == packed


def test_onednn_must_be_a_bool():
    with pytest.raises(ValueError, match="`onednn` must be a bool"):
        BatchConfig(onednn=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_weights_give_the_products_of_the_plain_ones(dtype):
    """A packed weight is the same weight in oneDNN's layout: the products are those of the plain weight up to the last
    bits (a one-token product may take another kernel) at every token count (packed for 16 tokens, used for 1, 5, 40)."""
    mlp = _mlp(bias=True).to(dtype)
    plain, packed = OneDnnLinears(mlp), OneDnnLinears(mlp, prepack=True, batch_tokens=16)
    assert plain.packed_bytes == 0
    assert packed.packed_bytes == sum(p.numel() * p.element_size() for n, p in mlp.named_parameters() if "weight" in n)
    for tokens in (1, 5, 40):
        inputs = torch.randn(tokens, 48, dtype=dtype)
        with plain.active():
            expected = mlp(inputs), mlp.down_proj(mlp.up_proj(inputs))
        with packed.active():
            got = mlp(inputs), mlp.down_proj(mlp.up_proj(inputs))
        tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, **tolerance)


def test_a_prepacked_weight_changed_or_replaced_is_packed_again():
    """An in-place change torch counts (its version) or a new weight is seen at the next product; the packed copy of a
    weight that did not change is kept."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    linears, inputs = OneDnnLinears(layer, prepack=True), torch.randn(3, 48)
    first = linears.packed.weight(layer)
    assert linears.packed.weight(layer) is first
    with torch.no_grad():
        layer.weight.mul_(2)
    with linears.active():
        torch.testing.assert_close(layer(inputs), torch.nn.functional.linear(inputs, layer.weight, layer.bias))
    layer.weight = torch.nn.Parameter(torch.randn(80, 48))
    with linears.active():
        torch.testing.assert_close(layer(inputs), torch.nn.functional.linear(inputs, layer.weight, layer.bias))


def test_prepack_weights_needs_onednn_and_must_be_a_bool():
    with pytest.raises(ValueError, match="`prepack_weights=True` .* needs `onednn=True`"):
        BatchConfig(prepack_weights=True, onednn=False)
    with pytest.raises(ValueError, match="`prepack_weights` must be a bool"):
        BatchConfig(prepack_weights="yes")
