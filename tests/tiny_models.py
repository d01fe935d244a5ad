"""Tiny random-weight causal LMs (fp32, eval mode) covering the attention variants a paged cache must handle.

Every builder returns `(model, config)`; `MODELS` lists them with the attention implementation the
"gather" read path uses for that architecture (Gemma-2's logit soft-capping needs "eager"). Weights
are drawn with a fixed seed and a wide `initializer_range`, so logits are peaked enough that greedy
choices are not near-ties.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

VOCAB = 128
HIDDEN = 64
PAD_ID = 0
BOS_ID = 1
INIT_RANGE = 0.1


@dataclass(frozen=True)
class TinyModel:
    name: str
    build: Callable[[], tuple[PreTrainedModel, PretrainedConfig]]
    gather_impl: str = "sdpa"  # attention implementation of the "gather" read path (and of the reference)
    sliding_window: int | None = None  # smallest sliding window of the model, if any
    passes_position_ids: bool = True  # attention layers receive `position_ids` (left padding is not stored)
    passes_attention_kwargs: bool = True  # calls `cache.update(..., kwargs=...)`; if not, "paged" falls back to gather
    reuses_kv: bool = False  # some layers reuse an earlier layer's K/V (KV sharing): no eviction for it
    caches_latents: bool = False  # multi-head latent attention: "paged" is handed the gathered history; no eviction


def make_model(model_class, config: PretrainedConfig, seed: int = 0) -> tuple[PreTrainedModel, PretrainedConfig]:
    torch.manual_seed(seed)
    model = model_class(config).eval()
    # Generation is not stopped at EOS, so every row has the same length and second generate() calls
    # continue from rows of equal shape.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    return model, config


def tiny_config(**overrides) -> dict:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=2,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return base


def llama_gqa():
    return make_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**tiny_config()))


def llama_mqa():
    return make_model(transformers.LlamaForCausalLM, transformers.LlamaConfig(**tiny_config(num_key_value_heads=1)))


def qwen2_sliding():
    config = transformers.Qwen2Config(
        **tiny_config(num_hidden_layers=3),
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    return make_model(transformers.Qwen2ForCausalLM, config)


def qwen3():
    return make_model(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**tiny_config(), head_dim=16))


def mistral_sliding():
    return make_model(transformers.MistralForCausalLM, transformers.MistralConfig(**tiny_config(), sliding_window=8))


def gemma2():
    config = transformers.Gemma2Config(
        **tiny_config(num_hidden_layers=4),
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
    return make_model(transformers.Gemma2ForCausalLM, config)


def gemma3():
    config = transformers.Gemma3TextConfig(
        **tiny_config(num_hidden_layers=4),
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )
    return make_model(transformers.Gemma3ForCausalLM, config)


def phi3():
    return make_model(transformers.Phi3ForCausalLM, transformers.Phi3Config(**tiny_config()))


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=4,
        n_positions=256,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=2,
        initializer_range=INIT_RANGE,
    )
    return make_model(transformers.GPT2LMHeadModel, config)


def gpt_neox():
    shared = {key: value for key, value in tiny_config().items() if key != "num_key_value_heads"}  # MHA only
    config = transformers.GPTNeoXConfig(**shared)
    return make_model(transformers.GPTNeoXForCausalLM, config)


def _spread_sinks(built: tuple[PreTrainedModel, PretrainedConfig]) -> tuple[PreTrainedModel, PretrainedConfig]:
    """Sink logits of the order of the tiny models' attention logits (they initialise near 0, or at 0), so each
    sink takes a share of every softmax that the tokens show."""
    model, _config = built
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.Tensor):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=generator))
    return built


def gpt_oss():
    """Learned attention sinks (`s_aux`), sliding and full layers; no SDPA support in transformers."""
    config = transformers.GptOssConfig(
        **tiny_config(num_local_experts=2, num_experts_per_tok=1, head_dim=16),
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return _spread_sinks(make_model(transformers.GptOssForCausalLM, config))


def granitemoe_swa():
    """Granite-MoE with sliding-window layers: learned attention sinks (`s_aux`) too."""
    config = transformers.GraniteMoeSWAConfig(**tiny_config(num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                                                        layer_types=["sliding_attention", "full_attention"]))
    return _spread_sinks(make_model(transformers.GraniteMoeSWAForCausalLM, config))


def gemma3n():
    """KV-shared layers: the last two layers reuse the K/V of the last earlier layer of their type."""
    config = transformers.Gemma3nTextConfig(
        **tiny_config(num_hidden_layers=4, head_dim=16, intermediate_size=[2 * HIDDEN] * 4),
        sliding_window=8,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        laurel_rank=4,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4,
    )
    return make_model(transformers.Gemma3nForCausalLM, config)


class ProducerlessGemma3nConfig(transformers.Gemma3nTextConfig):
    """A Gemma-3n config whose KV-shared layers name no "store" layer to read from (refused by the paged attention)."""

    @property
    def kv_sharing_modes(self) -> list[str | None]:
        return [None if mode == "store" else mode for mode in super().kv_sharing_modes]


def deepseek_v3():
    """Multi-head latent attention: compressed latents are cached; values (8) narrower than keys (16 + 8)."""
    config = transformers.DeepseekV3Config(**tiny_config(num_key_value_heads=4), **_latent_attention(),
                                           n_group=1, topk_group=1)  # fmt: skip
    return make_model(transformers.DeepseekV3ForCausalLM, config)


def deepseek_v2():
    """DeepSeek-V2's latent attention (complex-number RoPE, its own MoE), with a low-rank query projection."""
    config = transformers.DeepseekV2Config(**tiny_config(num_key_value_heads=4), **_latent_attention(q_lora_rank=12),
                                           n_shared_experts=1)  # fmt: skip
    return make_model(transformers.DeepseekV2ForCausalLM, config)


def mimo_v2_flash():
    """Per-head keys (24) wider than values (8), cached as they are (no latents); a sliding and a full layer."""
    config = transformers.MiMoV2FlashConfig(
        **tiny_config(), head_dim=24, v_head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"],
    )  # fmt: skip
    return make_model(transformers.MiMoV2FlashForCausalLM, config)


def llama4_chunked():
    """Llama-4 text: chunked attention (chunks of 8) between full-attention layers; dense MLPs, RoPE on the
    chunked layers only, as Llama-4 has it."""
    config = transformers.Llama4TextConfig(
        **tiny_config(num_hidden_layers=3), head_dim=16, intermediate_size_mlp=2 * HIDDEN, attention_chunk_size=8,
        layer_types=["chunked_attention", "full_attention", "chunked_attention"], no_rope_layers=[1, 0, 1],
        interleave_moe_layer_step=0, moe_layers=[],
    )  # fmt: skip
    return make_model(transformers.Llama4ForCausalLM, config)


def _latent_attention(q_lora_rank: int | None = None) -> dict:
    return dict(
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=2,
        num_experts_per_tok=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


MODELS: list[TinyModel] = [
    TinyModel("llama_gqa", llama_gqa),
    TinyModel("llama_mqa", llama_mqa),
    TinyModel("qwen2_sliding", qwen2_sliding, sliding_window=8),
    TinyModel("qwen3", qwen3),
    TinyModel("mistral_sliding", mistral_sliding, sliding_window=8),
    TinyModel("gemma2", gemma2, gather_impl="eager", sliding_window=8),
    TinyModel("gemma3", gemma3, sliding_window=8),
    TinyModel("phi3", phi3),
    TinyModel("gpt2", gpt2, gather_impl="eager"),
    TinyModel("gpt_neox", gpt_neox, passes_position_ids=False, passes_attention_kwargs=False),
    TinyModel("gemma3n", gemma3n, sliding_window=8, reuses_kv=True),
    TinyModel("gpt_oss", gpt_oss, gather_impl="eager", sliding_window=8),
    TinyModel("granitemoe_swa", granitemoe_swa, gather_impl="eager", sliding_window=8),
    TinyModel("deepseek_v3", deepseek_v3, caches_latents=True),
    TinyModel("deepseek_v2", deepseek_v2, caches_latents=True),
    TinyModel("mimo_v2_flash", mimo_v2_flash, gather_impl="eager", sliding_window=8),
    TinyModel("llama4_chunked", llama4_chunked, sliding_window=8),
]
MODELS_BY_NAME = {entry.name: entry for entry in MODELS}


def feed_chunks(model, cache, tokens, chunks):
    """Feed `tokens` [1, n] in chunks of the given sizes; the logits of every position."""
    logits, start = [], 0
    with torch.no_grad():
        for size in chunks:
            chunk = tokens[:, start : start + size]
            logits.append(model(input_ids=chunk, past_key_values=cache, use_cache=True).logits)
            start += size
    return torch.cat(logits, dim=1)


def token_by_token(model, cache, input_ids, attention_mask) -> torch.Tensor:
    """The logits of a (padded) batch fed one position at a time with its attention mask."""
    with torch.no_grad():
        return torch.cat([
            model(input_ids=input_ids[:, i : i + 1], attention_mask=attention_mask[:, : i + 1], past_key_values=cache,
                  use_cache=True).logits
            for i in range(input_ids.shape[1])
        ], dim=1)  # fmt: skip


def padded_batch(pads: tuple[int, ...], length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of `length` tokens, row `i` left-padded with `pads[i]` pad tokens, and their mask."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (len(pads), length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate(pads):
        input_ids[row, :pad] = PAD_ID
        attention_mask[row, :pad] = 0
    return input_ids, attention_mask


@functools.lru_cache(maxsize=None)
def shared_model(name: str) -> PreTrainedModel:
    """The model of `MODELS_BY_NAME[name]`, built once per test process, for tests that only run it."""
    return MODELS_BY_NAME[name].build()[0]
