"""Memory accounting of models whose stored keys and values differ in shape (latents, narrower values)."""

import functools
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import MODELS_BY_NAME, VOCAB, tiny_config, make_model

from hf_paged_cache import BatchGenerator, PagedCache, estimate_kv_bytes, kv_bytes_per_token
from hf_paged_cache.accounting import blocks_in_budget
from hf_paged_cache.serving.recurrent import state_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
import zoo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _prefill(model, cache, batch: int, length: int) -> None:
    tokens = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=tokens, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("name, length", [("deepseek_v3", 21), ("deepseek_v2", 21), ("mimo_v2_flash", 8)])
def test_estimate_matches_what_a_cache_of_uneven_keys_and_values_holds(name, length, quant):
    """Latent models store one latent head and its positional key, MiMo values narrower than its keys (and twice
    the KV heads in its sliding layer): the estimate counts what the blocks really hold. MiMo's length stays within
    its window (8): past it the sliding layer's figure is the documented upper bound, not an equality."""
    model = _model(name)
    cache = PagedCache(model.config, block_size=BLOCK, quant=quant, residual_length=BLOCK)
    _prefill(model, cache, 2, length)
    metrics = cache.metrics()
    estimate = estimate_kv_bytes(model.config, 2, length, BLOCK, torch.float32, quant=quant, residual_length=BLOCK)
    assert metrics.used_bytes == estimate
    if quant is None:
        assert metrics.ideal_bytes == 2 * length * kv_bytes_per_token(model.config, torch.float32)
    else:
        assert metrics.quantized_bytes > 0  # the int8 side of the estimate was exercised


@pytest.mark.parametrize("quant", [None, "int8"])
def test_estimate_reads_each_layers_config(quant):
    """Gemma-4's full-attention layers have wider heads (`global_head_dim`) than its sliding ones (`head_dim`)."""
    config = transformers.Gemma4TextConfig(**tiny_config(), head_dim=16, global_head_dim=32, sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    model, _config = make_model(transformers.Gemma4ForCausalLM, config)
    cache = PagedCache(model.config, block_size=BLOCK, quant=quant, residual_length=BLOCK)
    _prefill(model, cache, 2, 8)
    estimate = estimate_kv_bytes(model.config, 2, 8, BLOCK, torch.float32, quant=quant, residual_length=BLOCK)
    assert cache.metrics().used_bytes == estimate


@pytest.mark.parametrize("name", ["deepseek_v3", "mimo_v2_flash"])
def test_a_max_memory_generator_gets_the_blocks_the_budget_holds(name):
    """`BatchGenerator` sizes its shared pools up front, as many blocks as a `max_memory` cache's pools get."""
    model = _model(name)
    budget = 20_000
    cache = PagedCache(model.config, block_size=BLOCK, max_memory=budget)
    _prefill(model, cache, 1, 5)
    generator = BatchGenerator(model, max_new_tokens=2, block_size=BLOCK, max_memory=budget)
    metrics = generator.template.metrics()
    assert metrics.blocks_total == cache.metrics().blocks_total
    per_pool = metrics.blocks_total // len(metrics.groups)
    per_block = BLOCK * kv_bytes_per_token(model.config, torch.float32)  # one block of every layer
    assert (per_pool + 1) * per_block <= budget < (per_pool + 2) * per_block  # its null block included


def test_tensor_parallelism_splits_per_head_layers_and_refuses_uneven_splits():
    config = _model("mimo_v2_flash").config  # 2 KV heads in its full layer, 4 in its sliding layer
    whole = estimate_kv_bytes(config, 2, 30, BLOCK, torch.float32)
    assert estimate_kv_bytes(config, 2, 30, BLOCK, torch.float32, tp_size=2) * 2 == whole
    with pytest.raises(ValueError, match="`tp_size`=4 must divide the 2 KV heads of layer 1"):
        estimate_kv_bytes(config, 2, 30, BLOCK, torch.float32, tp_size=4)


def test_a_cache_with_no_stored_layer_measures_zero_and_has_no_block_budget():
    config = transformers.LlamaConfig(**tiny_config())
    config.layer_types = ["linear_attention", "linear_attention"]
    metrics = PagedCache(config).metrics()
    assert metrics.groups == {} and metrics.blocks_total == metrics.used_bytes == 0
    with pytest.raises(ValueError, match="no layer of this model stores K/V in blocks"):
        blocks_in_budget(config, 2**20, BLOCK, torch.float32)


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "falcon_h1"])
def test_a_hybrids_estimate_is_its_blocks_plus_each_rows_state(name):
    """Recurrent and conv states (fixed per row), and falcon_h1's attention K/V its hybrid layers keep themselves."""
    model = zoo.build(name)[0]
    cache = PagedCache(model.config, block_size=BLOCK)
    tokens = torch.arange(3, 24)[None]
    with torch.no_grad():
        model(input_ids=tokens, cache=cache, use_cache=True)
    held = cache.metrics().used_bytes + state_bytes(cache)
    assert estimate_kv_bytes(model.config, 1, 21, BLOCK, torch.float32) == held
    with pytest.raises(ValueError, match="recurrent state of a hybrid model is estimated for one rank only"):
        estimate_kv_bytes(model.config, 1, 21, BLOCK, torch.float32, tp_size=2)
