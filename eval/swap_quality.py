"""The quality cost of compressed host copies (issue 14): perplexity after a request's cache went to host memory
and back, for plain and compressed copies.

Prefill `--prefill` tokens of the text into a paged cache, swap its blocks out to host memory and back in
(`SwapSpace`, with each `--compressions` format; "none" copies exactly), then score the next `--tokens` tokens
teacher-forced in one forward that reads the swapped blocks. Reports perplexity, Δ% against no swap at all,
and host bytes per block against exact copies.

    python eval/swap_quality.py                                        # SmolLM2-135M, 512 + 256 tokens
    python eval/swap_quality.py --model tiny-llama --prefill 64 --tokens 32
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache import PagedCache  # noqa: E402
from hf_paged_cache.memory.swap import SwapSpace  # noqa: E402


@torch.no_grad()
def perplexity_after_swap(model, tokens: list[int], prefill: int, compression: str | None, swap: bool) -> dict:
    template = PagedCache(model.config, block_size=16, num_blocks=-(-len(tokens) // 16) + 1)
    cache = template.fork()
    model(input_ids=torch.tensor([tokens[: prefill - 1]]), cache=cache)  # the scoring forward feeds the last one
    space = SwapSpace(template, compression=compression)
    if swap:
        space.swap_out(cache)
        space.swap_in(cache)
    logits = model(input_ids=torch.tensor([tokens[prefill - 1 : -1]]), cache=cache).logits[0]
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(tokens[prefill:]))
    return {"perplexity": math.exp(nll.item()), "host_bytes": space.stats.out_bytes, "blocks": space.stats.out_blocks}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--compressions", nargs="+", default=["none", "fp8", "int8", "int4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="eval/results/swap_quality")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, encode = common.load_model(args.model)
    model.set_attn_implementation("paged")
    text, source = common.text_from_args(args)
    tokens = encode(text)[: args.prefill + args.tokens]
    base = perplexity_after_swap(model, tokens, args.prefill, None, swap=False)
    rows = [{"copies": "no swap", **base}]
    for name in args.compressions:
        row = perplexity_after_swap(model, tokens, args.prefill, None if name == "none" else name, swap=True)
        rows.append({"copies": name, **row})
    exact = next((row["host_bytes"] for row in rows if row["copies"] == "none"), None)
    for row in rows:
        row["delta_pct"] = 100 * (row["perplexity"] / base["perplexity"] - 1)
        row["host_bytes_vs_exact"] = row["host_bytes"] / exact if exact and row["host_bytes"] else None
        print(row, flush=True)
    results = {"model": args.model, "text": source, "args": vars(args), "rows": rows}
    common.write_json(f"{args.out}.json", results)
    return results


if __name__ == "__main__":
    main()
