"""Teacher-forced perplexity in which every scored token is predicted through the cache.

For each cache configuration: prefill `--prefill` tokens of the text into a fresh cache, then feed the
following `--tokens` tokens one at a time (one forward per token, reading the cache), adding up the
negative log-likelihood of each next token. Lossless caches (dynamic, paged) give the same perplexity
up to float rounding; lossy ones (quantized, later evicting) show their cost as Δ% against the first
configuration.

    python eval/perplexity.py --caches dynamic paged paged:block_size=32 paged:attn=paged quantized:nbits=4
    python eval/perplexity.py --tokens 200 --prefill 128 --caches dynamic paged    # a quick look

Cache specs: see eval/common.py (`KIND[:KEY=VALUE,...]`). Results: a table on stdout, and
`<--out>.json` / `<--out>.csv`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import plots  # noqa: E402


def score(model, ids: torch.Tensor, cache, prefill: int, tokens: int, progress: bool, label: str) -> dict:
    """Prefill ids[:prefill], then feed ids[prefill + i] and score ids[prefill + i + 1] for i < tokens."""
    with torch.inference_mode():
        model(input_ids=ids[None, :prefill], cache=cache, use_cache=True, logits_to_keep=1)
    start = time.perf_counter()
    nll = common.next_token_nll(model, ids, cache, prefill, tokens, progress, label)
    seconds = time.perf_counter() - start
    stored = cache.get_seq_length()
    memory = common.cache_bytes(cache)
    return {
        "nll": nll / tokens,
        "perplexity": math.exp(nll / tokens),
        "tokens_scored": tokens,
        "tokens_in_cache": stored,
        "kv_bytes": memory["kv_bytes"],
        "kv_bytes_per_token": memory["kv_bytes"] / stored,
        "pool_bytes": memory["pool_bytes"],
        "tokens_per_s": tokens / seconds,
        "decode_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", nargs="+", default=["dynamic", "paged"], metavar="SPEC",
                        help="cache configurations; the first is the reference for Δ%% (see eval/common.py)")
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny-llama | a local path or hub id")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--prefill", type=int, default=512, help="tokens prefilled before scoring starts")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens scored, each after a one-token forward")
    parser.add_argument("--offset", type=int, default=0, help="first token of the text to use")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", default="eval/results/ppl", help="prefix of the .json and .csv result files")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--plot", metavar="FILE", help="also draw perplexity against KV bytes/token (.png, .svg)")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)  # fmt: skip

    if args.prefill < 1 or args.tokens < 1:
        parser.error("--prefill and --tokens must be positive")
    specs = [common.parse_cache_spec(text) for text in args.caches]
    if args.threads:
        torch.set_num_threads(args.threads)
    text, source = common.text_from_args(args)
    model, encode = common.load_model(args.model, common.DTYPES[args.dtype])
    needed = args.prefill + args.tokens + 1
    ids = torch.tensor(encode(text)[args.offset : args.offset + needed])
    if len(ids) < needed:
        parser.error(f"the text has only {len(ids)} tokens after --offset; --prefill + --tokens + 1 = {needed}")

    for spec in specs:  # warm-up: first forwards of each attention path pay one-time costs
        score(model, ids[:20], common.make_cache(spec, model), 16, 3, False, spec.label)
    rows = []
    for spec in specs:
        cache = common.make_cache(spec, model)
        result = score(model, ids, cache, args.prefill, args.tokens, not args.no_progress, spec.label)
        rows.append({"config": spec.label, "kind": spec.kind, "attn": spec.attn, **result})
        del cache
    reference = rows[0]["perplexity"]
    for row in rows:
        row["delta_pct"] = 100.0 * (row["perplexity"] / reference - 1.0)

    print(f"\nperplexity of {args.model} on {source}: prefill {args.prefill}, {args.tokens} tokens scored one at a time")
    common.print_table(rows, [
        ("config", "cache", ""), ("perplexity", "ppl", ".4f"), ("delta_pct", "Δ% vs first", "+.3f"),
        ("kv_bytes_per_token", "KV B/token", ",.0f"), ("kv_bytes", "KV bytes", ",d"),
        ("tokens_per_s", "tok/s", ".1f"),
    ])  # fmt: skip
    payload = {
        "model": args.model, "dtype": args.dtype, "text": source, "offset": args.offset,
        "prefill": args.prefill, "tokens": args.tokens, "environment": common.environment(), "results": rows,
    }  # fmt: skip
    json_path = common.write_json(f"{args.out}.json", payload)
    csv_path = common.write_csv(f"{args.out}.csv", rows)
    print(f"\nwrote {json_path} and {csv_path}")
    if args.plot:
        title = f"{args.model}: prefill {args.prefill}, {args.tokens} tokens scored through the cache"
        print(f"wrote {plots.perplexity(rows, title, args.plot)}")
    return payload


if __name__ == "__main__":
    main()
