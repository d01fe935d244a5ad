"""Seconds per decode step of the batch generator: the packed forward's own overhead, apart from prefill (issue 25).

`--requests` prompts of lengths spread over [--min-len, --max-len] are prefilled, then `--steps` steps in which every
request decodes one token are timed (median of `--repeats` windows). `--model smollm2` times the real model;
`--model tiny` a random-weight 30-layer Llama of hidden size 72 with SmolLM2's head layout, whose compute is next to
nothing, so its step time is what the library does around the model's compute (per-request planning, writes, reads,
masks, attention calls). Uses only the public API, so the same script times an older checkout (run it with that
checkout's interpreter) for an A/B.

    python eval/packed_step.py --model tiny
    python eval/packed_step.py --model smollm2 --requests 24
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache import BatchGenerator  # noqa: E402


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=72, intermediate_size=128, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=8)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny (overhead only) or smollm2")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=800)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="eval/results/packed_step")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        model = tiny_model()
    else:
        model, _encode = common.load_model(args.model)
    vocab = model.get_input_embeddings().num_embeddings
    lengths = [round(args.min_len + i * (args.max_len - args.min_len) / max(args.requests - 1, 1))
               for i in range(args.requests)]  # fmt: skip
    generator = BatchGenerator(model, max_new_tokens=args.steps * args.repeats + 2, do_sample=False, eos_token_id=None,
                               block_size=16, max_batch_tokens=sum(lengths) + args.requests, max_num_seqs=args.requests)
    for index, length in enumerate(lengths):
        generator.add_request([(index * 7919 + j * 31) % (vocab - 1) + 1 for j in range(length)])
    generator.step()  # every prompt in one forward (the token budget holds them all)
    windows = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            generator.step()
        windows.append((time.perf_counter() - start) / args.steps)
    assert all(len(request.output.generated_tokens) > 1 for request in generator.requests.running), "not every request decoded"
    result = {"model": args.model, "requests": args.requests, "lengths": [args.min_len, args.max_len],
              "step_seconds": statistics.median(windows), "windows": windows}  # fmt: skip
    print({k: v for k, v in result.items() if k != "windows"}, flush=True)
    common.write_json(f"{args.out}.json", result)
    return result


if __name__ == "__main__":
    main()
