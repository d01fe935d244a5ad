"""`BatchConfig(compile=True)`: the packed forwards run the decoder layers' feed-forward blocks and norms compiled,
the user's model is left as it was, and the tokens stay those of each prompt run alone."""

from __future__ import annotations

import pytest
import torch
from batch_workloads import NEW, alone, random_prompts, tiny_model
from tiny_models import MODELS_BY_NAME
from transformers import DynamicCache

from hf_paged_cache.serving.batch_config import BatchConfig
from hf_paged_cache.cpu_runtime.compiled import CompiledModules, maps_one_tensor
from hf_paged_cache.serving.generator import BatchGenerator

pytestmark = pytest.mark.usefixtures("one_thread")


def test_only_one_tensor_modules_of_the_decoder_layers_are_compiled():
    model = tiny_model("llama_gqa")
    compiled = CompiledModules(model, model.config.num_hidden_layers)
    kinds = {type(module).__name__ for module in compiled.modules}
    assert kinds == {"LlamaMLP", "LlamaRMSNorm"}
    layer = model.model.layers[0]
    assert not maps_one_tensor(layer.self_attn) and maps_one_tensor(layer.mlp)
    assert len(compiled.modules) == 3 * model.config.num_hidden_layers  # the MLP and both norms of every layer


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
def test_compiled_packed_forwards_give_the_tokens_of_each_prompt_alone(name):
    model = tiny_model(name)
    prompts = random_prompts((5, 17, 9, 30), seed=3)
    generator = BatchGenerator(model, max_new_tokens=NEW, block_size=4, max_batch_tokens=16, compile=True)
    for prompt in prompts:
        generator.add_request(prompt)
    outputs = generator.run()
    for prompt, output in zip(prompts, outputs):
        assert output.generated_tokens == alone(model, prompt, DynamicCache(), MODELS_BY_NAME[name].gather_impl)
    # The compiled forwards were swapped in for the packed forwards only: the model's own modules are back.
    assert all("forward" not in module.__dict__ for module in generator.compiled.modules)


def test_compiled_modules_give_the_eager_result():
    model = tiny_model("llama_gqa")
    compiled = CompiledModules(model, model.config.num_hidden_layers)
    hidden = torch.randn(1, 7, model.config.hidden_size)
    eager = [module(hidden) for module in compiled.modules]
    with compiled.active():
        fused = [module(hidden) for module in compiled.modules]
    for expected, got in zip(eager, fused):
        torch.testing.assert_close(got, expected)


def test_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="`compile` must be a bool"):
        BatchConfig(compile="yes")
