"""Types the paged store does not hold: transformers' own layers serve them."""

import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache, FalconH1Config, LlamaConfig, MistralConfig
from transformers.cache_utils import LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionLayer

from hf_paged_cache import PagedCache, StreamingLLM
from hf_paged_cache.serving.generator import BatchGenerator
from hf_paged_cache.layer_types.registry import layer_type_for


def _config(first: str, **extra) -> LlamaConfig:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, **extra)  # fmt: skip
    config.layer_types = [first, "full_attention"]
    return config


def test_delegated_types_are_transformers_layers():
    cache = PagedCache(_config("linear_attention"))
    assert isinstance(cache.layers[0], LinearAttentionLayer) and not cache.layer_types[0].stored
    # The batch generator runs such layers once per request (it used to refuse them: "not stored in blocks").
    assert cache.layer_types[0].per_request and cache.layer_types[0].packing_refusal(cache.layers[0]) is None
    assert not cache.layer_types[1].per_request
    assert not layer_type_for("compressed_sparse_attention").paged_readable
    assert layer_type_for("linear_attention").paged_readable


def test_a_recurrent_layer_with_a_sliding_window_is_refused_by_the_packed_forward():
    cache = PagedCache(_config("hybrid_sliding", sliding_window=8))
    assert isinstance(cache.layers[0], LinearAttentionAndSlidingWindowAttentionLayer)
    assert "sliding-window attention in one layer" in cache.layer_types[0].packing_refusal(cache.layers[0])


def _falcon_h1() -> FalconH1Config:
    """Falcon-H1: each layer is transformers' hybrid layer (Mamba-2 and attention K/V in one), none in blocks."""
    return FalconH1Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4,
                          mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8)  # fmt: skip


BLOCK_OPTIONS = [{"num_blocks": 12}, {"max_memory": "1MiB"}, {"initial_blocks": 4}, {"quant": "int8"},
                 {"eviction": StreamingLLM(budget=12, sinks=2, window=6)}, {"share_with": {1: 0}}]  # fmt: skip


@pytest.mark.parametrize("options", BLOCK_OPTIONS, ids=lambda options: next(iter(options)))
def test_options_that_act_on_blocks_are_refused_for_a_model_that_stores_none(options):
    """They used to be accepted and ignored (nothing evicted, `kv_bytes` 0, a 12-block pool serving any prompt)."""
    name = next(iter(options))
    config = _falcon_h1()
    assert not any(layer_type.stored for layer_type in PagedCache(config).layer_types)
    with pytest.raises(ValueError, match=rf"`{name}` cannot take effect for FalconH1 model: none of its layers "
                                         r"\(hybrid\) stores K/V in blocks.*leave `" + name):  # fmt: skip
        PagedCache(config, **options)


def test_the_batch_generator_refuses_them_too():
    from transformers import FalconH1ForCausalLM

    model = FalconH1ForCausalLM(_falcon_h1()).eval()
    for options in ({"quant": "int8"}, {"num_blocks": 12}, {"eviction": StreamingLLM(budget=12, sinks=2, window=6)}):
        with pytest.raises(ValueError, match="cannot take effect for FalconH1 model"):
            BatchGenerator(model, **options)


def test_eviction_is_refused_for_a_model_whose_stored_layers_evict_nothing():
    """Every layer of this Mistral slides: its window keeps each layer's tokens and eviction drops none."""
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)  # fmt: skip
    assert PagedCache(config, quant="int8", num_blocks=12).layer_types[0].stored  # what blocks take, it takes
    with pytest.raises(ValueError, match=r"`eviction` cannot take effect for Mistral model: none of its layers "
                                         r"\(sliding_attention\) lets eviction drop tokens"):  # fmt: skip
        PagedCache(config, eviction=StreamingLLM(budget=12, sinks=2, window=6))


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "eval"))
import zoo  # noqa: E402

# transformers 5.25 keeps the recurrent states of the tokens a crop may take back (`recurrent_states_to_keep`).
ROLLS_BACK_STATES = Version(transformers.__version__) >= Version("5.25")


@pytest.mark.parametrize("decoding", ["prompt_lookup", "assisted"])
@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "falcon_h1"])  # gated delta net, short convolutions, Mamba-2
def test_speculative_roll_back_on_a_hybrid_model_equals_dynamic_cache(name, decoding):
    """Candidates a step rejects are cropped off: the blocks by the cache, the recurrent and conv states by
    transformers' own layers, which keep the states to roll back to when `generate` asks
    (`activate_past_recording(recurrent_states_to_keep=...)`). Where transformers cannot roll a recurrent state back
    (before 5.25), it refuses the model itself, for DynamicCache alike."""
    model, implementation = zoo.build(name)
    model.set_attn_implementation(implementation)
    base = torch.randint(3, zoo.VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([base, base, base, base[:, :3]], 1)  # repeats, so prompt lookup finds candidates
    extra = {"prompt_lookup_num_tokens": 3} if decoding == "prompt_lookup" else {"assistant_model": zoo.build(name)[0]}
    outputs = []
    for cache in (DynamicCache(config=model.config), PagedCache(model.config, block_size=4)):
        try:
            with torch.no_grad():
                outputs.append(model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=12,
                                              do_sample=False, pad_token_id=zoo.PAD_ID, **extra)[0].tolist())  # fmt: skip
        except ValueError as error:
            assert not ROLLS_BACK_STATES and "not supported with stateful models" in str(error)
            outputs.append("refused")
    assert outputs[0] == outputs[1]
    assert outputs[0] != "refused" or name != "lfm2"  # a conv state alone rolls back on either release
