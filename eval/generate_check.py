"""Greedy tokens through every read path against one-by-one `generate` with DynamicCache + sdpa (issue 26).

The GPU check of the paged kernels and of their fall-backs: the same prompts (mixed lengths, as
`serving.py --workloads mixed`), for each backend (`"triton"`: the kernels; `"torch"`: none), through
`generate_batch` and one by one through `generate` with a PagedCache under the "paged" attention and under
sdpa (the gather path). Per system: requests whose tokens equal the reference, the first
differing position of the others, generated tokens/s. The Triton systems run on CUDA, or on CPU under
`TRITON_INTERPRET=1` (slow: tiny sizes only); elsewhere they are listed as skipped. Exits 1 if any system that
ran differs from the reference.

    python eval/generate_check.py --model smollm2-random --device cuda            # the GPU check
    TRITON_INTERPRET=1 python eval/generate_check.py --model tiny-llama --requests 3 --min-len 20 --max-len 40 \\
        --new-tokens 4                                                            # plumbing, on CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serving import mixed_prompts, one_by_one, ours, timed  # noqa: E402

from hf_paged_cache import PagedCache  # noqa: E402

BLOCK_SIZE = 16


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where `tokens` and `reference` differ (None when equal)."""
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def systems(args, triton_runs: bool) -> list[tuple[str, object, dict]]:
    """(label, function, options) of every system, the Triton ones only where they can run.

    The backend decides who writes blocks under any attention, so the gather path (sdpa) with
    `backend="triton"` still runs the cache-write kernel; with `backend="torch"` no kernel runs at all.
    """
    batch = dict(block_size=BLOCK_SIZE, max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs)
    rows = []
    for backend in ("triton", "torch") if triton_runs else ("torch",):
        def make_cache(model, backend=backend):
            return PagedCache(model.config, block_size=BLOCK_SIZE, backend=backend)

        rows += [
            (f"generate_batch, backend={backend}", ours, dict(batch, backend=backend)),
            (f"one-by-one PagedCache, paged attention, backend={backend}", one_by_one,
             dict(make_cache=make_cache, attn="paged")),
            (f"one-by-one PagedCache, sdpa (gather path), backend={backend}", one_by_one,
             dict(make_cache=make_cache, attn="sdpa")),
        ]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-random", help="smollm2, a name of common.RANDOM_LLAMAS, or a path")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="eval/results/generate_check")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, encode = common.load_model(args.model, getattr(torch, args.dtype))
    model.to(args.device)
    model.generation_config.eos_token_id = None
    text, source = common.text_from_args(args)
    prompts = mixed_prompts(encode(text), args)
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    triton_runs = model.device.type == "cuda" or interpreted

    reference, base = timed("one-by-one DynamicCache, sdpa (reference)", one_by_one, model, prompts, args.new_tokens)
    rows = [base]
    for label, function, options in systems(args, triton_runs):
        outputs, row = timed(label, function, model, prompts, args.new_tokens, **options)
        differences = [first_difference(a, b) for a, b in zip(outputs, reference)]
        row.update(identical=differences.count(None), requests=len(prompts),
                   first_differences={i: d for i, d in enumerate(differences) if d is not None})  # fmt: skip
        rows.append(row)
    if not triton_runs:
        rows.append({"system": "backend=triton", "skipped": "needs CUDA or TRITON_INTERPRET=1"})
    ran = [row for row in rows[1:] if "identical" in row]
    all_identical = all(row["identical"] == row["requests"] for row in ran)
    summary = {"device": str(model.device), "triton": "interpreted" if interpreted else "compiled" if triton_runs
               else "skipped", "systems": len(ran), "all_identical": all_identical}  # fmt: skip
    print(summary, flush=True)
    common.write_json(f"{args.out}.json", {"model": args.model, "text": source, "args": vars(args), "rows": rows,
                                           "summary": summary})  # fmt: skip
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())
