"""One process of a before / after timing pair: `generate_batch` on the mixed or shared workload, timed (issues 60, 61).

Run it alternately from two checkouts (e.g. a git worktree of the code before, with its own venv) with nothing else
running; it prints one JSON line: each run's seconds and a digest of the generated tokens (equal digests: equal
tokens). The prompts are `eval/serving.py`'s mixed ones (24 prompts of 100–800 tokens cut from Pride and Prejudice,
shuffled), or with `--workload shared` 16 prompts of the text's first 600 tokens and 30–80 of their own; 24 new
tokens each, greedy, 2 threads, after a warm-up on two prompts (of the other workload: no prefix hits carried over).

    python eval/ab_timing.py --model smollm2 --runs 3
    python eval/ab_timing.py --model smollm2 --quant int4 --runs 3
    python eval/ab_timing.py --model gemma3-random --runs 3   # Gemma-3-shaped, ~100M parameters, seed 0
    python eval/ab_timing.py --model lfm2-random --runs 3     # LFM2-shaped (conv 2 : 1 attention), 66M, seed 0
    python eval/ab_timing.py --model lfm2-random --system padded --runs 1   # padded batches of 8, DynamicCache
    python eval/ab_timing.py --model lfm2-random --workload shared --prefix-caching off   # hits off (on: default)
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
import serving  # noqa: E402
from common import DEFAULT_TEXT  # noqa: E402
from random_models import MODELS  # noqa: E402

from hf_paged_cache import generate_batch  # noqa: E402
from hf_paged_cache.smollm2 import load_smollm2  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", *MODELS], default="smollm2")
    parser.add_argument("--system", choices=["generate_batch", "padded"], default="generate_batch",
                        help="what is timed: ours, or padded batches of 8 with DynamicCache (eval/serving.py's)")
    parser.add_argument("--quant", help="a `quant` spec for the cache (with residual_length=0)")
    parser.add_argument("--workload", choices=["mixed", "shared"], default="mixed")
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--prepack-weights", action="store_true", help="BatchConfig(prepack_weights=True)")
    parser.add_argument("--keep-host-memory", action="store_true", help="BatchConfig(keep_host_memory=True)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24, help="the first N of the 24 prompts (a smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_smollm2()
    if args.model != "smollm2":
        model = MODELS[args.model]()
    tokens = tokenizer(DEFAULT_TEXT.read_text())["input_ids"]
    count, low, high = 24, 100, 800
    lengths = [round(low + i * (high - low) / (count - 1)) for i in range(count)]
    random.Random(0).shuffle(lengths)
    mixed = [tokens[i * 997 : i * 997 + length] for i, length in enumerate(lengths)]
    own = [30 + round(i * 50 / 15) for i in range(16)]
    shared = [tokens[:600] + tokens[50_000 + i * 100 : 50_000 + i * 100 + n] for i, n in enumerate(own)]
    prompts, warm_up = (mixed, shared) if args.workload == "mixed" else (shared, mixed)
    prompts = prompts[: args.prompts]
    options = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, prefix_caching=args.prefix_caching == "on",
                   max_batch_tokens=args.max_batch_tokens, prepack_weights=args.prepack_weights,
                   keep_host_memory=args.keep_host_memory)  # fmt: skip
    if args.quant:
        options.update(quant=args.quant, residual_length=0)
    if args.system == "padded" and (args.quant or args.prefix_caching == "off" or args.prepack_weights
                                    or args.keep_host_memory or args.max_batch_tokens != 512):  # fmt: skip
        parser.error("--quant, --prefix-caching, --max-batch-tokens, --prepack-weights and --keep-host-memory apply "
                     "to generate_batch only")
    if args.system == "padded":
        def run(texts):
            return serving.padded_batches(model, texts, options["max_new_tokens"])
    else:
        def run(texts):
            return [output.generated_tokens for output in generate_batch(model, texts, **options)]
    run(warm_up[:2])
    times, outputs = [], None
    for _ in range(args.runs):
        start = time.perf_counter()
        with torch.no_grad():
            outputs = run(prompts)
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times, "digest": hashlib.sha1(str(outputs).encode()).hexdigest()[:12]}))


if __name__ == "__main__":
    main()
