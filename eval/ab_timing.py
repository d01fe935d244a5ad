"""One process of a before / after timing pair: `generate_batch` on the mixed workload, timed (issue 60).

Run it alternately from two checkouts (e.g. a git worktree of the code before, with its own venv) with nothing else
running; it prints one JSON line: each run's seconds and a digest of the generated tokens (equal digests: equal
tokens). The prompts are `eval/serving.py`'s mixed ones (24 prompts of 100–800 tokens cut from Pride and Prejudice,
shuffled), 24 new tokens each, greedy, 2 threads, after a warm-up on two prompts.

    python eval/ab_timing.py --model smollm2 --runs 3
    python eval/ab_timing.py --model smollm2 --quant int4 --runs 3
    python eval/ab_timing.py --model gemma3-random --runs 3   # Gemma-3-shaped, ~100M parameters, seed 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_TEXT  # noqa: E402

from hf_paged_cache import generate_batch  # noqa: E402
from hf_paged_cache.smollm2 import load_smollm2  # noqa: E402


def gemma3_random() -> torch.nn.Module:
    """A Gemma-3-shaped model (GELU-tanh MLP, pre / post norms, q / k norms, head_dim 256, sliding windows of 512),
    random weights of seed 0, SmolLM2's vocabulary."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=49152, hidden_size=640, intermediate_size=2048, num_hidden_layers=12,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              max_position_embeddings=4096, pad_token_id=0, eos_token_id=None, bos_token_id=None)  # fmt: skip
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "gemma3-random"], default="smollm2")
    parser.add_argument("--quant", help="a `quant` spec for the cache (with residual_length=0)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24, help="the first N of the 24 prompts (a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    if args.model == "gemma3-random":
        model = gemma3_random()
    tokens = tokenizer(DEFAULT_TEXT.read_text())["input_ids"]
    count, low, high = 24, 100, 800
    lengths = [round(low + i * (high - low) / (count - 1)) for i in range(count)]
    random.Random(0).shuffle(lengths)
    prompts = [tokens[i * 997 : i * 997 + length] for i, length in enumerate(lengths)][: args.prompts]
    options = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    if args.quant:
        options.update(quant=args.quant, residual_length=0)
    generate_batch(model, prompts[:2], **options)
    times, outputs = [], None
    for _ in range(args.runs):
        start = time.perf_counter()
        outputs = [output.generated_tokens for output in generate_batch(model, prompts, **options)]
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "digest": hashlib.sha1(str(outputs).encode()).hexdigest()[:12]}))


if __name__ == "__main__":
    main()
