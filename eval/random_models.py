"""Random-weight models of real architectures at a compute-bound size, for serving benchmarks against peers.

Each is built from a config with seed 0 and SmolLM2's vocabulary, so prompts cut from the shipped text with SmolLM2's
tokenizer are valid for all of them, and `--save DIR` writes one with that tokenizer for an engine that loads a
folder (vLLM's CPU build: `eval/vllm_cpu.py --model DIR`, `eval/vllm_paired.py --model DIR --vllm-model DIR`).
Greedy tokens of random weights are often near ties, so two engines' agreement is reported, not required.

    python eval/random_models.py --save /tmp/lfm2-random lfm2-random
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def gemma3_random() -> torch.nn.Module:
    """Gemma-3-shaped (GELU-tanh MLP, pre / post norms, q / k norms, head_dim 256, sliding windows of 512), ~100M."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=12,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None)  # fmt: skip
    return _ready(Gemma3ForCausalLM(config))


def lfm2_random() -> torch.nn.Module:
    """LFM2-shaped (short convolutions in 2 of every 3 layers, full attention in the 3rd; 12 layers, width 512), 66M."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    config = Lfm2Config(vocab_size=49152, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=8, num_key_value_heads=8, layer_types=["conv", "conv", "full_attention"] * 4,
                        max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None)  # fmt: skip
    return _ready(Lfm2ForCausalLM(config))


def qwen3_next_random() -> torch.nn.Module:
    """Qwen3-Next-shaped (gated delta-net in 3 of every 4 layers, gated full attention in the 4th; a mixture of 8
    experts, 2 per token, and a shared expert in every layer, as vLLM's class requires; 12 layers, width 512)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
                             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512, max_position_embeddings=4096,
                             layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 3, pad_token_id=0,
                             eos_token_id=None, bos_token_id=None)  # fmt: skip
    return _ready(Qwen3NextForCausalLM(config))


# Transformers of the main families at ~100–130M parameters (12 layers, width 768, 12 query heads of 64), for speed on
# every architecture (issue 62): each with what sets its decoder layer apart from Llama's.
_WIDTH = dict(vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None)  # fmt: skip


def qwen3_random() -> torch.nn.Module:
    """Qwen3-shaped: q / k RMSNorms per head, 4 KV heads, tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return _ready(Qwen3ForCausalLM(Qwen3Config(**_WIDTH, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)))


def mistral_random() -> torch.nn.Module:
    """Mistral-shaped: a sliding window of 512 tokens in every layer, 4 KV heads."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return _ready(MistralForCausalLM(MistralConfig(**_WIDTH, num_key_value_heads=4, sliding_window=512)))


def phi3_random() -> torch.nn.Module:
    """Phi-3 / Phi-4-mini-shaped: fused QKV and gate-up products, rotary on 3/4 of each head, 4 KV heads."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return _ready(Phi3ForCausalLM(Phi3Config(**_WIDTH, num_key_value_heads=4, partial_rotary_factor=0.75)))


def olmo2_random() -> torch.nn.Module:
    """OLMo-2-shaped: norms after attention and MLP (not before), q / k RMSNorms over all heads."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    return _ready(Olmo2ForCausalLM(Olmo2Config(**_WIDTH, num_key_value_heads=12)))


MODELS = {"gemma3-random": gemma3_random, "lfm2-random": lfm2_random, "qwen3-next-random": qwen3_next_random,
          "qwen3-random": qwen3_random, "mistral-random": mistral_random, "phi3-random": phi3_random,
          "olmo2-random": olmo2_random}  # fmt: skip
# Config fields released checkpoints carry that transformers' config class does not write, but vLLM's loader reads.
_EXTRA_FIELDS = {"lfm2": lambda config: {"conv_dim": config.hidden_size, "conv_dim_out": config.hidden_size,
                                         "block_dim": config.hidden_size}}  # fmt: skip


def _ready(model: torch.nn.Module) -> torch.nn.Module:
    model.generation_config.eos_token_id = None
    return model.eval()


def save(name: str, folder: str | Path) -> Path:
    """Write model `name` (float32) with SmolLM2's tokenizer to `folder`, loadable by `from_pretrained` and vLLM."""
    from hf_paged_cache.smollm2 import load_smollm2

    model, folder = MODELS[name](), Path(folder)
    model.save_pretrained(folder)
    load_smollm2()[1].save_pretrained(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.update(_EXTRA_FIELDS.get(model.config.model_type, lambda _config: {})(model.config))
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--save", required=True, metavar="DIR")
    args = parser.parse_args(argv)
    print(save(args.model, args.save))


if __name__ == "__main__":
    main()
