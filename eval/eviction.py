"""Token eviction on a real model: what compressing the KV cache costs in quality, and what it saves.

Four parts (`--tasks`, default all; each writes `<--out-dir>/eviction_<task>.json` and `.csv`):

  compress (a)  prefill a `--context`-token text in one forward; the cache compresses it to each ratio of
                `--ratios` right after the prompt (and never while decoding); then the next `--score-tokens`
                tokens are scored teacher-forced, one forward each. Perplexity vs the full cache.
                Target: at 25% the best policy within +1.0% of the full cache.
  passkey (b)   a random 5-digit pass key hidden at `--depths` of `--lengths` tokens of filler; greedy
                completion of "... What is the pass key? The pass key is". Budget `--passkey-ratio` of the
                context. Question-agnostic: the context is compressed before the question is read;
                question-aware: context + question are prefilled together, then compressed.
                Targets: best policy >= full - 1 trial (agnostic) and >= full (aware).
  decode (c)    teacher-forced perplexity over `--decode-length` tokens (`--decode-prefill` prefilled, the rest
                one forward each) with a fixed `--decode-budget`, evicting while decoding; KV bytes recorded
                every `--record-every` tokens. Targets: Δppl <= 5%; bytes flat once the budget is reached
                (max / min <= 1 + block / budget).
  peak (d)      peak KV bytes during a `--peak-prompt`-token prefill in chunks of `--peak-chunk`, budget
                `--peak-budget`, evicting between chunks or only after the prompt, vs no eviction.
                Target (between chunks): peak <= (budget + chunk + block) tokens' bytes.

    python eval/eviction.py                                    # everything, SmolLM2-135M (long: see eval/README.md)
    python eval/eviction.py --tasks compress --policies streaming snapkv
    python eval/eviction.py --tasks passkey --trials 2 --lengths 2048
    python eval/eviction.py --quick                            # smoke run: tiny-llama, tiny sizes

Policies are `NAME[:KEY=VALUE,...]` (e.g. `h2o:decay=0.9`, `snapkv:observation_window=16`); "full" is the
PagedCache without eviction. Every cache runs the "paged" attention (the only one that reads an evicted cache).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import plots  # noqa: E402

from common import POLICIES  # noqa: E402
from hf_paged_cache import PagedCache, kv_bytes_per_token  # noqa: E402

FULL = "full"
NEVER = 10**9  # evict_every: compress after the prompt, never while decoding
BLOCK = 16  # tokens per block of every cache
TASKS = {"a": "compress", "b": "passkey", "c": "decode", "d": "peak"}
DEFAULT_POLICIES = {"compress": list(POLICIES), "passkey": list(POLICIES),
                    "decode": ["streaming", "h2o", "h2o:decay=0.99", "tova"], "peak": ["snapkv", "h2o"]}  # fmt: skip
SIZES = {  # option: (full run, --quick)
    "context": (2048, 256), "score_tokens": (256, 16), "ratios": ([0.5, 0.25, 0.125], [0.5, 0.25, 0.125]),
    "lengths": ([2048, 4096], [256, 512]), "depths": ([0.1, 0.5, 0.9], [0.1, 0.5, 0.9]), "trials": (6, 1),
    "passkey_ratio": (0.25, 0.25), "decode_length": (4000, 96), "decode_prefill": (1024, 32),
    "decode_budget": (1024, 32), "record_every": (100, 16), "peak_prompt": (4096, 256), "peak_chunk": (512, 32),
    "peak_budget": (1024, 64), "window": (32, 8),
}  # fmt: skip

FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it."
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


# ---------------------------------------------------------------------------------------------- caches
def make_policy(text: str, budget: int, args):
    """A policy from its spec, with `budget` tokens and the run's sinks / window; None for "full"."""
    kind, options = common.parse_spec(text, [FULL, *POLICIES], what="policy")
    if kind == FULL:
        return None
    options = {"sinks": args.sinks, "window": args.window, **options}
    try:
        return POLICIES[kind](budget=budget, **options)
    except TypeError as error:
        raise ValueError(f"policy {text!r}: {error}") from None


def new_cache(model, policy, **options) -> PagedCache:
    """A PagedCache evicting with `policy` (None: no eviction), read by the "paged" attention."""
    common.use_attention(model, "paged")
    return PagedCache(model.config, block_size=BLOCK, eviction=policy, **options)


def forward(model, cache, ids, **kwargs) -> torch.Tensor:
    """One forward of `ids` (a list or 1-D tensor) through `cache`; the last position's logits."""
    with torch.inference_mode():
        ids = torch.as_tensor(ids)[None]
        return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **kwargs).logits[0, -1]


def tokens_per_layer(metrics) -> float:
    """Tokens a layer holds (on average). `tokens_stored` counts each layer group once: without
    eviction all full-attention layers share one group, with eviction every layer is its own."""
    return metrics.tokens_stored / len(metrics.groups)


def judge(name: str, met: bool, detail: str) -> dict:
    return {"target": name, "met": bool(met), "detail": detail}


def print_targets(targets: list[dict]) -> None:
    print("targets:")
    for target in targets:
        print(f"  [{'met' if target['met'] else 'MISSED'}] {target['target']}: {target['detail']}")


# ---------------------------------------------------------------------------------------------- (a) compress
def task_compress(model, encode, ids: torch.Tensor, args) -> dict:
    rows = []
    for ratio in [None, *args.ratios]:  # None: the full cache, once
        budget = None if ratio is None else int(ratio * args.context)
        for name in [FULL] if ratio is None else args.policies["compress"]:
            start = time.perf_counter()
            cache = new_cache(model, make_policy(name, budget or 1, args), evict_every=NEVER)
            forward(model, cache, ids[: args.context])  # evicts down to the budget right after the prompt
            kept = cache.metrics()
            nll = common.next_token_nll(model, ids, cache, args.context, args.score_tokens, args.progress, name)
            rows.append({
                "ratio": ratio, "policy": name, "budget": budget, "perplexity": math.exp(nll / args.score_tokens),
                "tokens_kept": tokens_per_layer(kept), "kv_bytes": kept.used_bytes,
                "seconds": time.perf_counter() - start,
            })  # fmt: skip
            print(f"  {name} @ {ratio or 1:g}: ppl {rows[-1]['perplexity']:.4f}", flush=True)
    full = rows[0]["perplexity"]
    for row in rows:
        row["delta_pct"] = 100.0 * (row["perplexity"] / full - 1.0)
    print(f"\n(a) context compression: {args.context}-token context compressed once after the prompt, "
          f"then {args.score_tokens} tokens scored one per forward")  # fmt: skip
    common.print_table(rows, [
        ("ratio", "ratio", ".3f"), ("policy", "policy", ""), ("budget", "budget", "d"), ("perplexity", "ppl", ".4f"),
        ("delta_pct", "Δ% vs full", "+.2f"), ("tokens_kept", "tokens kept/layer", ".0f"),
        ("kv_bytes", "KV bytes", ",d"), ("seconds", "s", ".1f"),
    ])  # fmt: skip
    at_quarter = [row for row in rows if row["ratio"] == 0.25]
    targets = []
    if at_quarter:
        best = min(at_quarter, key=lambda row: row["perplexity"])
        targets.append(judge("at 25% the best policy within +1.0% of the full cache", best["delta_pct"] <= 1.0,
                             f"{best['policy']} {best['delta_pct']:+.2f}%"))  # fmt: skip
    return {"results": rows, "targets": targets}


# ---------------------------------------------------------------------------------------------- (b) passkey
def passkey_prompts(encode, args) -> list[dict]:
    """One prompt per (length, depth, trial): context token ids (intro, filler, key sentence at `depth`,
    filler) of about `length` tokens, and the question's ids. Keys come from a seeded generator."""
    rng = random.Random(args.seed)
    filler, intro = encode(FILLER), encode(INTRO)
    prompts = []
    for length in args.lengths:
        for depth in args.depths:
            for trial in range(args.trials):
                key = str(rng.randint(10000, 99999))
                sentence = encode(KEY_SENTENCE.format(key=key))
                units = max(1, round((length - len(intro) - len(sentence)) / len(filler)))
                before = round(depth * units)
                context = intro + filler * before + sentence + filler * (units - before)
                prompts.append({"length": length, "depth": depth, "trial": trial, "key": key, "context": context,
                                "question": encode(QUESTION)})  # fmt: skip
    return prompts


def greedy(model, cache, logits: torch.Tensor, steps: int) -> list[int]:
    """`steps` greedy tokens, the first from `logits`."""
    tokens = [int(logits.argmax())]
    for _ in range(steps - 1):
        tokens.append(int(forward(model, cache, tokens[-1:]).argmax()))
    return tokens


def answer(model, policy, prompt: dict, aware: bool, new_tokens: int, quant: str | None) -> tuple[list[int], int]:
    """Greedy answer tokens and the tokens per layer the cache held when the answer started.

    Question-aware: context + question in one forward, compressed right after it. Question-agnostic:
    the context alone is prefilled and compressed, then the question is fed one token per forward,
    as decode steps that never evict (a multi-token forward would be compressed again after it, with
    scores that have seen the question). `quant`: the cache's format (None: full precision)."""
    cache = new_cache(model, policy, evict_every=NEVER, quant=quant)
    if aware:
        logits = forward(model, cache, prompt["context"] + prompt["question"])
    else:
        forward(model, cache, prompt["context"])
        for token in prompt["question"]:
            logits = forward(model, cache, [token])
    held = tokens_per_layer(cache.metrics())
    return greedy(model, cache, logits, new_tokens), held


def task_passkey(model, encode, ids: torch.Tensor, args) -> dict:
    prompts = passkey_prompts(encode, args)
    cells = sorted({(p["length"], p["depth"]) for p in prompts})
    runs = [(FULL, None)] + [(name, framing) for name in args.policies["passkey"] for framing in args.framings]
    rows, trials = [], []
    for name, framing in runs:
        start = time.perf_counter()
        results = []
        for prompt in prompts:
            policy = make_policy(name, int(args.passkey_ratio * len(prompt["context"])), args)
            tokens, held = answer(model, policy, prompt, framing != "agnostic", args.new_tokens, args.quant)
            reply = encode.decode(tokens)
            results.append({"policy": name, "framing": framing or "-", "length": prompt["length"],
                            "context_tokens": len(prompt["context"]), "depth": prompt["depth"],
                            "trial": prompt["trial"], "key": prompt["key"], "reply": reply,
                            "correct": prompt["key"] in reply,
                            "tokens_held_per_layer": held})  # fmt: skip
        trials += results
        row = {"policy": name, "framing": framing or "-", "correct": sum(r["correct"] for r in results),
               "trials": len(results), "seconds": time.perf_counter() - start}  # fmt: skip
        row["accuracy"] = row["correct"] / row["trials"]
        for length, depth in cells:
            cell = [r["correct"] for r in results if (r["length"], r["depth"]) == (length, depth)]
            row[f"{length}@{depth:.0%}"] = f"{sum(cell)}/{len(cell)}"
        rows.append(row)
        print(f"  {name} {framing or ''}: {row['correct']}/{row['trials']} in {row['seconds']:.1f} s", flush=True)
    print(f"\n(b) passkey retrieval: budget {args.passkey_ratio:.0%} of the context, {args.trials} trial(s) per cell, "
          f"greedy {args.new_tokens} tokens, KV {args.quant or 'full precision'}")  # fmt: skip
    common.print_table(rows, [("policy", "policy", ""), ("framing", "framing", "")]
                       + [(f"{l}@{d:.0%}", f"{l}@{d:.0%}", "") for l, d in cells]
                       + [("correct", "correct", "d"), ("accuracy", "acc", ".2f"), ("seconds", "s", ".1f")])  # fmt: skip
    full = rows[0]["correct"]
    targets = []
    for framing, slack, wording in (("agnostic", 1, "full - 1 trial"), ("aware", 0, "full")):
        candidates = [row for row in rows if row["framing"] == framing]
        if candidates:
            best = max(candidates, key=lambda row: row["correct"])
            targets.append(judge(f"question-{framing}: best policy >= {wording}", best["correct"] >= full - slack,
                                 f"{best['policy']} {best['correct']} vs full {full} of {best['trials']}"))  # fmt: skip
    return {"results": rows, "trials": trials, "targets": targets}


# ---------------------------------------------------------------------------------------------- (c) decode
def task_decode(model, encode, ids: torch.Tensor, args) -> dict:
    scored = args.decode_length - args.decode_prefill
    rows = []
    for name in [FULL, *args.policies["decode"]]:
        start = time.perf_counter()
        cache = new_cache(model, make_policy(name, args.decode_budget, args))  # evicts a block past the budget
        forward(model, cache, ids[: args.decode_prefill])
        trace = []

        def record(fed: int) -> None:
            if fed % args.record_every == 0 or fed == args.decode_prefill:
                metrics = cache.metrics()
                trace.append({"tokens_fed": fed, "used_bytes": metrics.used_bytes,
                              "tokens_per_layer": tokens_per_layer(metrics)})  # fmt: skip

        record(args.decode_prefill)
        nll = common.next_token_nll(model, ids, cache, args.decode_prefill, scored, args.progress, name, record)
        reached = [i for i, point in enumerate(trace) if point["tokens_per_layer"] >= args.decode_budget]
        at_budget = [point["used_bytes"] for point in trace[reached[0] :]] if reached and name != FULL else None
        flat_ratio = max(at_budget) / min(at_budget) if at_budget else None
        metrics = cache.metrics()
        rows.append({
            "policy": name, "budget": None if name == FULL else args.decode_budget,
            "perplexity": math.exp(nll / scored), "tokens_scored": scored,
            "final_tokens_per_layer": tokens_per_layer(metrics), "final_kv_bytes": metrics.used_bytes,
            "max_over_min_bytes": flat_ratio, "evictions": metrics.evictions, "seconds": time.perf_counter() - start,
            "trace": trace,
        })  # fmt: skip
        print(f"  {name}: ppl {rows[-1]['perplexity']:.4f} in {rows[-1]['seconds']:.1f} s", flush=True)
    full, flat_bound = rows[0]["perplexity"], 1 + BLOCK / args.decode_budget
    for row in rows:
        row["delta_pct"] = 100.0 * (row["perplexity"] / full - 1.0)
        row["flat"] = None if row["max_over_min_bytes"] is None else row["max_over_min_bytes"] <= flat_bound + 1e-9
    print(f"\n(c) decode-time eviction: {args.decode_length} tokens, {args.decode_prefill} prefilled, {scored} scored "
          f"one per forward, budget {args.decode_budget}")  # fmt: skip
    common.print_table(rows, [
        ("policy", "policy", ""), ("perplexity", "ppl", ".4f"), ("delta_pct", "Δ% vs full", "+.2f"),
        ("final_tokens_per_layer", "tokens/layer at end", ".0f"), ("final_kv_bytes", "KV bytes at end", ",d"),
        ("max_over_min_bytes", "bytes max/min", ".4f"), ("flat", "flat", ""), ("seconds", "s", ".1f"),
    ])  # fmt: skip
    targets = []
    for row in rows[1:]:
        targets.append(judge(f"{row['policy']}: Δppl <= 5%", row["delta_pct"] <= 5.0, f"{row['delta_pct']:+.2f}%"))
        targets.append(judge(f"{row['policy']}: bytes flat once at budget (max/min <= {flat_bound:.4f})",
                             bool(row["flat"]), f"{row['max_over_min_bytes']}"))  # fmt: skip
    csv_rows = [{key: value for key, value in row.items() if key != "trace"} for row in rows]
    return {"results": rows, "csv": csv_rows, "targets": targets}


# ---------------------------------------------------------------------------------------------- (d) peak
def prefill_peak(model, cache, ids: torch.Tensor, chunk: int) -> int:
    """Feed `ids` in chunks; the peak of `metrics().used_bytes`, also inside each forward: the cache
    allocates every layer's blocks for a chunk when the first layer writes, and each layer evicts right
    after its attention, so the peak is seen just before the evictor's `after_attention` for a layer."""
    peak = 0

    def record() -> None:
        nonlocal peak
        peak = max(peak, cache.metrics().used_bytes)

    if cache.evictor is not None:
        evict = cache.evictor.after_attention

        def after_attention(*args) -> None:
            record()
            evict(*args)

        cache.evictor.after_attention = after_attention  # an instance attribute: this cache's evictor only
    for first in range(0, len(ids), chunk):
        forward(model, cache, ids[first : first + chunk])
        record()
    return peak


def task_peak(model, encode, ids: torch.Tensor, args) -> dict:
    per_token = kv_bytes_per_token(model.config, model.dtype)
    bound = (args.peak_budget + args.peak_chunk + BLOCK) * per_token
    runs = [(FULL, None)] + [(name, between) for name in args.policies["peak"] for between in (True, False)]
    rows = []
    for name, between in runs:
        start = time.perf_counter()
        options = {} if between is None else {"evict_between_chunks": between}
        cache = new_cache(model, make_policy(name, args.peak_budget, args), **options)
        peak = prefill_peak(model, cache, ids[: args.peak_prompt], args.peak_chunk)
        after_prompt = cache.metrics().used_bytes
        forward(model, cache, ids[args.peak_prompt : args.peak_prompt + 1])  # the first decode step
        metrics = cache.metrics()
        rows.append({
            "policy": name, "evict": {None: "never", True: "between chunks", False: "after prompt"}[between],
            "peak_kv_bytes": peak, "peak_tokens_per_layer": peak / per_token, "kv_bytes_after_prompt": after_prompt,
            "kv_bytes_after_first_decode": metrics.used_bytes, "pool_bytes": metrics.pool_bytes,
            "bound_bytes": bound if between else None, "within_bound": peak <= bound if between else None,
            "seconds": time.perf_counter() - start,
        })  # fmt: skip
        print(f"  {name} ({rows[-1]['evict']}): peak {peak:,} B in {rows[-1]['seconds']:.1f} s", flush=True)
    print(f"\n(d) peak KV bytes: {args.peak_prompt}-token prompt in chunks of {args.peak_chunk}, budget "
          f"{args.peak_budget}; bound (budget + chunk + block) x {per_token:,} B/token = {bound:,} B")  # fmt: skip
    common.print_table(rows, [
        ("policy", "policy", ""), ("evict", "evicts", ""), ("peak_kv_bytes", "peak KV bytes", ",d"),
        ("peak_tokens_per_layer", "peak tokens/layer", ".0f"), ("kv_bytes_after_prompt", "after prompt", ",d"),
        ("kv_bytes_after_first_decode", "after 1st decode", ",d"), ("pool_bytes", "pool bytes", ",d"),
        ("within_bound", "<= bound", ""), ("seconds", "s", ".1f"),
    ])  # fmt: skip
    targets = [judge(f"{row['policy']} between chunks: peak <= budget + chunk + block", row["within_bound"],
                     f"{row['peak_kv_bytes']:,} <= {bound:,}") for row in rows if row["within_bound"] is not None]
    return {"results": rows, "targets": targets}


RUNNERS = {"compress": task_compress, "passkey": task_passkey, "decode": task_decode, "peak": task_peak}


def text_needed(task: str, args) -> int:
    """Tokens of the text a task reads (from --offset)."""
    return {"compress": args.context + args.score_tokens + 1, "passkey": 0, "decode": args.decode_length + 1,
            "peak": args.peak_prompt + 1}[task]  # fmt: skip


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("--tasks", nargs="+", default=list(RUNNERS), metavar="TASK",
                        help="compress passkey decode peak (or a b c d); default: all")
    parser.add_argument("--policies", nargs="+", metavar="SPEC",
                        help=f"policies for every task ({', '.join(POLICIES)}, with :KEY=VALUE options); "
                             "default per task: compress/passkey all, decode streaming h2o h2o:decay=0.99 tova, peak snapkv h2o")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny-llama and tiny sizes")
    parser.add_argument("--model", help="smollm2 (default) | tiny-llama (default with --quick) | a path or hub id")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--sinks", type=int, default=4, help="tokens at the start never evicted")
    parser.add_argument("--window", type=int, help="recent tokens never evicted (32; 8 with --quick)")
    parser.add_argument("--offset", type=int, default=0, help="first token of the text for compress/decode/peak")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out-dir", default="eval/results", help="where eviction_<task>.json/.csv go")
    parser.add_argument("--progress", action="store_true", help="progress bars while scoring")
    parser.add_argument("--plot", metavar="FILE", help="also draw every task's results to FILE (.png, .svg, .pdf)")
    sizes = parser.add_argument_group("sizes (defaults: full run / --quick)")
    for name, (full, quick) in SIZES.items():
        if name == "window":
            continue
        many = isinstance(full, list)
        sizes.add_argument(f"--{name.replace('_', '-')}", type=type(full[0] if many else full),
                           nargs="+" if many else None, help=f"{full} / {quick}")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=6, help="greedy tokens of a passkey answer")
    parser.add_argument("--quant", metavar="SPEC", help="passkey: quantize every cache (e.g. int2; default: none)")
    parser.add_argument("--framings", nargs="+", choices=["agnostic", "aware"], default=["agnostic", "aware"],
                        help="passkey: which framings to run (default both)")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)

    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.model = args.model or (common.TINY_LLAMA if args.quick else "smollm2")
    tasks = list(dict.fromkeys(TASKS.get(task, task) for task in args.tasks))
    unknown = [task for task in tasks if task not in RUNNERS]
    if unknown:
        parser.error(f"unknown task(s) {unknown}: use {', '.join(RUNNERS)} (or a b c d)")
    args.policies = {task: args.policies or DEFAULT_POLICIES[task] for task in RUNNERS}
    for names in args.policies.values():  # fail on a bad spec before any model runs
        for name in names:
            make_policy(name, 64, args)
    if args.threads:
        torch.set_num_threads(args.threads)

    text, source = common.text_from_args(args)
    model, encode = common.load_model(args.model, common.DTYPES[args.dtype])
    needed = max(text_needed(task, args) for task in tasks)
    ids = torch.tensor(encode(text)[args.offset : args.offset + needed])
    if len(ids) < needed:
        parser.error(f"the text has only {len(ids)} tokens after --offset; these tasks need {needed}")
    warm_up = make_policy("snapkv", args.sinks + args.window, args)  # the smallest budget a policy accepts
    forward(model, new_cache(model, warm_up), torch.arange(16) % 200)
    settings = {key: value for key, value in vars(args).items() if key not in ("policies", "tasks")}
    payloads = {}
    for task in tasks:
        print(f"\n=== {task} ({args.model}, {', '.join(args.policies[task])}) ===", flush=True)
        start = time.perf_counter()
        payload = RUNNERS[task](model, encode, ids, args)
        seconds = time.perf_counter() - start
        print_targets(payload["targets"])
        print(f"[{task}: {seconds:.1f} s wall]")
        payload = {"task": task, "model": args.model, "text": source, "policies": args.policies[task],
                   "settings": settings, "seconds": seconds, "environment": common.environment(), **payload}
        csv_rows = payload.pop("csv", payload["results"])
        json_path = common.write_json(Path(args.out_dir) / f"eviction_{task}.json", payload)
        csv_path = common.write_csv(Path(args.out_dir) / f"eviction_{task}.csv", csv_rows)
        print(f"wrote {json_path} and {csv_path}")
        payloads[task] = payload
    if args.plot:
        print(f"wrote {plots.eviction(payloads, args.plot)}")
    return payloads


if __name__ == "__main__":
    main()
