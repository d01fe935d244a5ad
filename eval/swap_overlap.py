"""Overlap of swap copies with compute under memory pressure (issue 14): the serving pressure workload with
synchronous swap copies against overlapping ones, in one process.

The pool holds --pressure of the demand (as `serving.py --workloads pressure`) and every preemption swaps. The
same requests run with `swap_copies="sync"`, then with the overlapping mode: "async" on CUDA (a side stream;
swap-ins start a step ahead of running), "deferred" elsewhere (the same scheduling, each copy at the latest
moment the ordering rules allow; there is nothing to overlap with off CUDA, so there the ratio is about 1 and
only shows that the comparison runs). Per run: generated tokens/s, seconds stalled on copies (the host or the
compute stream waiting for them), seconds the copies took, swap-ins prefetched, outputs identical to the
synchronous run; then the throughput ratio and the share of the copy time that did not stall.

    python eval/swap_overlap.py                    # SmolLM2-135M, 16 requests of 100-1,000 tokens, 64 new each
    python eval/swap_overlap.py --model tiny-llama --requests 8 --min-len 20 --max-len 120 --new-tokens 8 \\
        --max-batch-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serving import mixed_prompts, pressure_pool  # noqa: E402

from hf_paged_cache import BatchGenerator  # noqa: E402

BLOCK_SIZE = 16


def run(model, prompts, args, pool: int, copies: str) -> tuple[list[list[int]], dict]:
    generator = BatchGenerator(model, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                               block_size=BLOCK_SIZE, max_batch_tokens=args.max_batch_tokens,
                               max_num_seqs=args.max_num_seqs, prefix_caching=False, num_blocks=pool,
                               preemption="swap", swap_copies=copies)  # fmt: skip
    for prompt in prompts:
        generator.add_request(prompt)
    start = time.perf_counter()
    outputs = [o.generated_tokens for o in generator.run()]
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generator.swap.copies.synchronize()
    generator.swap.copies.poll()  # the last fences' stalls are counted once their events have passed
    last = generator.metrics()
    copies_stats = generator.swap.copies.stats
    return outputs, {
        "copies": generator.swap.copies.mode, "seconds": seconds, "tokens_per_s": sum(map(len, outputs)) / seconds,
        "steps": last.step + 1, "preempted_swap": last.preempted_swap, "swap_out_bytes": last.swap_out_bytes,
        "swap_in_bytes": last.swap_in_bytes, "stall_seconds": copies_stats.stall_seconds,
        "copy_seconds": copies_stats.copy_seconds, "prefetched": last.swap_prefetched,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--pressure", type=float, default=0.25, help="pool size as a share of the total demand")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="eval/results/swap_overlap")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, encode = common.load_model(args.model, getattr(torch, args.dtype))
    model.to(args.device)
    model.generation_config.eos_token_id = None
    text, source = common.text_from_args(args)
    prompts = mixed_prompts(encode(text), args)
    pool, demand = pressure_pool(prompts, args.new_tokens, args.pressure, BLOCK_SIZE)
    overlapping = "async" if model.device.type == "cuda" else "deferred"
    run(model, prompts[:2], args, pool, "sync")  # warm-up (CUDA context, kernels), not timed
    rows, reference = [], None
    for copies in ("sync", overlapping):
        outputs, row = run(model, prompts, args, pool, copies)
        reference = reference or outputs
        row.update(pool_blocks=pool, demand_blocks=demand, identical=sum(a == b for a, b in zip(outputs, reference)))
        print(row, flush=True)
        rows.append(row)
    sync, overlapped = rows
    summary = {
        "device": str(model.device), "overlapping_mode": overlapping,
        "throughput_ratio": overlapped["tokens_per_s"] / sync["tokens_per_s"],
        "stall_seconds_saved": sync["stall_seconds"] - overlapped["stall_seconds"],
        "copy_time_hidden": 1 - overlapped["stall_seconds"] / overlapped["copy_seconds"]
        if overlapped["copy_seconds"] else 0.0,
    }  # fmt: skip
    print(summary, flush=True)
    results = {"model": args.model, "text": source, "args": vars(args), "rows": rows, "summary": summary}
    common.write_json(f"{args.out}.json", results)
    return results


if __name__ == "__main__":
    main()
