"""Serving many prompts: the continuous batch generator against its baselines, in one process (issue 13).

Workloads (greedy, prompts cut from a public-domain text at different offsets):

- mixed: N prompts of lengths spread evenly over [--min-len, --max-len], shuffled, --new-tokens each.
  Systems: one-by-one `generate` with DynamicCache, padded batches of 8 with DynamicCache, transformers'
  `generate_batch` ("paged|sdpa", page size 16), and `hf_paged_cache.generate_batch`. Generated tokens/s
  and whether each system's tokens equal the one-by-one run.
- shared: --shared-requests requests that share a --system-len-token system prompt, each with its own
  --question-len-token question: prompt tokens computed and tokens/s with and without prefix caching.
- pressure (issue 14; not run by default): the mixed prompts with the pool sized for --pressure (a share) of
  their total demand (every request's prompt and new tokens in blocks of 16) against an unconstrained pool:
  tokens/s, identical outputs, preemptions, swap traffic each way, stall time and recomputed tokens for swap
  with LRU victims, swap with the weighted score, recompute-only, auto, and swap with fp8 host copies.
- capacity: KV bytes per running request with the model's dtype and with int4 blocks (measured at the
  last step with the most requests running), so the requests that fit in one pool compare.
- quant (issue 25; not run by default): the mixed prompts through the batch generator unquantized and with each
  --quant format (--residual-length, default the library's), alternating, --quant-repeats times: tokens/s, the ratio to the
  unquantized run of the same round, KV bytes per running request at the peak (so the requests one pool holds
  compare) and whether each round's outputs equal the first round's.

vLLM's CPU engine as a peer (issue 25) runs in its own venv, on prompts written here as token ids:
`--write-prompts FILE` writes the mixed and shared prompts and exits; eval/vllm_cpu.py generates from them;
`--vllm RESULT` then adds vLLM's row to mixed and shared and counts each system's outputs equal to vLLM's.

    python eval/serving.py                                   # the issue's sizes on SmolLM2-135M (~15 min, 2 cores)
    python eval/serving.py --model tiny-llama --requests 6 --min-len 20 --max-len 60 --new-tokens 4 --shared-requests 3
    python eval/serving.py --workloads pressure --skip-hf    # memory pressure at 25% of the demand
    python eval/serving.py --write-prompts eval/results/serving_prompts.json  # for eval/vllm_cpu.py
    python eval/serving.py --workloads quant --requests 12 --max-len 800 --new-tokens 24 --quant int4 int8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache import BatchGenerator, generate_batch  # noqa: E402


def one_by_one(model, prompts, new_tokens, make_cache=lambda model: DynamicCache(config=model.config), attn="sdpa"):
    """Each prompt alone through `generate`, with a fresh `make_cache(model)` under attention `attn`."""
    model.set_attn_implementation(attn)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=make_cache(model),
                             max_new_tokens=new_tokens, do_sample=False)  # fmt: skip
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def padded_batches(model, prompts, new_tokens, size: int = 8, pad_id: int = 0):
    model.set_attn_implementation("sdpa")
    outputs = []
    for start in range(0, len(prompts), size):
        group = prompts[start : start + size]
        width = max(map(len, group))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device)
        out = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)  # fmt: skip
        outputs += out[:, width:].tolist()
    return outputs


def transformers_generate_batch(model, prompts, new_tokens):
    from transformers import ContinuousBatchingConfig

    model.set_attn_implementation("paged|sdpa")
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    results = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=ContinuousBatchingConfig(page_size=16))  # fmt: skip
    ordered = sorted(results.values(), key=lambda r: int(str(r.request_id).split("_")[-1]))
    return [list(r.generated_tokens) for r in ordered]


def ours(model, prompts, new_tokens, **options):
    outputs = generate_batch(model, prompts, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, **options)
    return [o.generated_tokens for o in outputs]


def served(generator: BatchGenerator, prompts, new_tokens) -> list[list[int]]:
    """The prompts through a generator built before the clock started: its construction (packing weights, loading
    the extension) is start-up, as vLLM's engine construction is."""
    for prompt in prompts:
        generator.add_request(prompt, max_new_tokens=new_tokens)
    return [output.generated_tokens for output in generator.run()]


OURS = "hf_paged_cache.generate_batch"


def compile_warm_up(model, tokens) -> float:
    """Seconds of a short `compile=True` run, which compiles the modules every later compiled run reuses: the
    compile is start-up (as vLLM's, in its engine construction), kept out of the workloads' times."""
    start = time.perf_counter()
    generate_batch(model, [tokens[:40], tokens[:300]], max_new_tokens=2, do_sample=False, eos_token_id=None,
                   compile=True)  # fmt: skip
    return time.perf_counter() - start


def timed(label, function, *args, **kwargs) -> tuple[list, dict]:
    start = time.perf_counter()
    outputs = function(*args, **kwargs)
    seconds = time.perf_counter() - start
    generated = sum(map(len, outputs))
    row = {"system": label, "seconds": seconds, "generated": generated, "tokens_per_s": generated / seconds}
    print(row, flush=True)
    return outputs, row


def mixed_prompts(tokens, args) -> list[list[int]]:
    """--requests prompts of lengths spread evenly over [--min-len, --max-len], shuffled."""
    rng = random.Random(0)
    lengths = [round(args.min_len + i * (args.max_len - args.min_len) / max(args.requests - 1, 1))
               for i in range(args.requests)]  # fmt: skip
    rng.shuffle(lengths)
    return [tokens[i * 997 : i * 997 + n] for i, n in enumerate(lengths)]


def shared_prompts(tokens, args) -> list[list[int]]:
    """--shared-requests prompts: the first --system-len tokens, then a --question-len slice of their own."""
    system = tokens[: args.system_len]
    return [system + tokens[50_000 + i * args.question_len : 50_000 + (i + 1) * args.question_len]
            for i in range(args.shared_requests)]  # fmt: skip


def write_prompts(path, tokens, args) -> None:
    """The mixed and shared prompts as token ids, for a peer that cannot import this package (eval/vllm_cpu.py)."""
    workloads = {"mixed": mixed_prompts(tokens, args), "shared": shared_prompts(tokens, args)}
    common.write_json(path, {"workloads": {name: {"new_tokens": args.new_tokens, "prompts": prompts}
                                           for name, prompts in workloads.items()}})  # fmt: skip


def vllm_row(args, workload: str) -> tuple[list | None, dict | None]:
    """(vLLM's outputs, its row) for `workload` from the --vllm result file, or (None, None)."""
    if not args.vllm:
        return None, None
    result = json.loads(Path(args.vllm).read_text())
    for name, ours in (("max_batch_tokens", args.max_batch_tokens), ("max_num_seqs", args.max_num_seqs)):
        if result.get(name) != ours:  # the same step size and sequence cap on both sides, or the rows do not compare
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"{args.vllm}: vLLM ran with {name}={result.get(name)} (None: a result written before "
                             f"vllm_cpu.py recorded it; run it again), ours would run with {ours}: pass {flag} "
                             f"{result.get(name)} here, or run vllm_cpu.py with {flag} {ours}")
    run = result["workloads"][workload]
    row = {"system": f"vLLM CPU engine (separate process, prefix caching {'on' if result['prefix_caching'] else 'off'})",
           "seconds": run["seconds"], "generated": run["generated"], "tokens_per_s": run["tokens_per_s"],
           "startup_seconds": result["startup_seconds"]}  # fmt: skip
    return run["outputs"], row


def same_as(outputs, reference) -> int | None:
    return None if reference is None else sum(a == b for a, b in zip(outputs, reference))


def mixed(model, tokens, args) -> list[dict]:
    prompts = mixed_prompts(tokens, args)
    vllm_outputs, vllm = vllm_row(args, "mixed")
    reference, base = timed("one-by-one DynamicCache", one_by_one, model, prompts, args.new_tokens)
    base["identical_to_vllm"] = same_as(reference, vllm_outputs)
    rows = [base]
    systems = [("padded batches of 8, DynamicCache", padded_batches), (OURS, None)]
    if not args.skip_hf:
        systems.insert(1, ("transformers generate_batch", transformers_generate_batch))
    for label, function in systems:
        if function is None:  # ours: built first (it selects the "paged" attention the runs before it replaced)
            start = time.perf_counter()
            generator = BatchGenerator(model, do_sample=False, eos_token_id=None, block_size=16,
                                       max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
                                       compile=args.compile, prepack_weights=args.prepack_weights)  # fmt: skip
            startup = time.perf_counter() - start
            print({"system": label, "startup_seconds": startup}, flush=True)
            outputs, row = timed(label, served, generator, prompts, args.new_tokens)
            row["startup_seconds"] = startup
        else:
            outputs, row = timed(label, function, model, prompts, args.new_tokens)
        row["identical_to_one_by_one"] = sum(a == b for a, b in zip(outputs, reference))
        row["identical_to_vllm"] = same_as(outputs, vllm_outputs)
        row["vs_one_by_one"] = row["tokens_per_s"] / base["tokens_per_s"]
        rows.append(row)
    if vllm:
        vllm["identical_to_one_by_one"] = same_as(vllm_outputs, reference)
        print(vllm, flush=True)
        rows.append(vllm)
    by = {row["system"]: row["tokens_per_s"] for row in rows}
    ratios = {"vs padded batches of 8": by[OURS] / by["padded batches of 8, DynamicCache"]}
    if vllm:
        ratios["vs vLLM"] = by[OURS] / vllm["tokens_per_s"]
    if "transformers generate_batch" in by:
        ratios["vs transformers generate_batch"] = by[OURS] / by["transformers generate_batch"]
    print(ratios, flush=True)
    rows.append({"system": "ratios", **ratios})
    return rows


def shared(model, tokens, args) -> list[dict]:
    prompts = shared_prompts(tokens, args)
    vllm_outputs, vllm = vllm_row(args, "shared")
    rows = []
    for caching in (False, True):
        generator = BatchGenerator(model, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                                   block_size=16, max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
                                   prefix_caching=caching, compile=args.compile,
                                   prepack_weights=args.prepack_weights)  # fmt: skip
        for prompt in prompts:
            generator.add_request(prompt)
        start = time.perf_counter()
        outputs = generator.run()
        seconds = time.perf_counter() - start
        hit = sum(o.prefix_hit_tokens for o in outputs)
        row = {"system": f"prefix caching {'on' if caching else 'off'}", "seconds": seconds,
               "tokens_per_s": sum(len(o.generated_tokens) for o in outputs) / seconds,
               "prompt_tokens": sum(map(len, prompts)), "prompt_tokens_computed": sum(map(len, prompts)) - hit,
               "outputs": [o.generated_tokens for o in outputs]}  # fmt: skip
        row["identical_to_vllm"] = same_as(row["outputs"], vllm_outputs)
        print({k: v for k, v in row.items() if k != "outputs"}, flush=True)
        rows.append(row)
    off, on = rows
    summary = {"system": "prefix caching on / off", "computed_ratio": on["prompt_tokens_computed"] / off["prompt_tokens_computed"],
               "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
               "identical": on.pop("outputs") == off.pop("outputs")}  # fmt: skip
    if vllm:
        summary["on vs vLLM"] = on["tokens_per_s"] / vllm["tokens_per_s"]
        print(vllm, flush=True)
    print(summary, flush=True)
    return [*rows, *([vllm] if vllm else []), summary]


PRESSURE_SYSTEMS = (
    ("swap, LRU victims", {"preemption": "swap", "victim_policy": "lru"}),
    ("swap, weighted victims", {"preemption": "swap", "victim_policy": "weighted"}),
    ("recompute only", {"preemption": "recompute"}),
    ("auto (cheaper by estimate), LRU", {"preemption": "auto"}),
    ("swap, LRU, fp8 host copies", {"preemption": "swap", "swap_compression": "fp8"}),
)


def pressure_pool(prompts, new_tokens: int, share: float, block_size: int = 16) -> tuple[int, int]:
    """(pool blocks, demand): the demand is every request's prompt and new tokens in blocks; the pool `share` of it."""
    demand = sum(-(-(len(prompt) + new_tokens) // block_size) for prompt in prompts)
    return max(round(share * demand), 1), demand


def pressure(model, tokens, args) -> list[dict]:
    prompts = mixed_prompts(tokens, args)
    block_size = 16
    pool, demand = pressure_pool(prompts, args.new_tokens, args.pressure, block_size)
    rows, reference = [], None
    for label, options in (("unconstrained", {}), *PRESSURE_SYSTEMS):
        sized = {"num_blocks": pool, **options} if options else {}
        generator = BatchGenerator(model, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                                   block_size=block_size, max_batch_tokens=args.max_batch_tokens,
                                   max_num_seqs=args.max_num_seqs, prefix_caching=False, **sized)  # fmt: skip
        for prompt in prompts:
            generator.add_request(prompt)
        start = time.perf_counter()
        outputs = [o.generated_tokens for o in generator.run()]
        seconds = time.perf_counter() - start
        reference = reference or outputs
        last = generator.metrics()
        row = {"system": label, "pool_blocks": pool if options else last.blocks_total, "demand_blocks": demand,
               "seconds": seconds, "tokens_per_s": sum(map(len, outputs)) / seconds,
               "identical": sum(a == b for a, b in zip(outputs, reference)), "steps": last.step + 1,
               "preempted_swap": last.preempted_swap, "preempted_recompute": last.preempted_recompute,
               "swap_out_blocks": last.swap_out_blocks, "swap_out_bytes": last.swap_out_bytes,
               "swap_in_blocks": last.swap_in_blocks, "swap_in_bytes": last.swap_in_bytes,
               "stall_seconds": last.swap_stall_seconds, "copy_seconds": last.swap_copy_seconds,
               "prefetched": last.swap_prefetched, "recomputed_tokens": last.recomputed_tokens}  # fmt: skip
        if options:
            row["vs_unconstrained"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        print(row, flush=True)
        rows.append(row)
    return rows


def run_with_peak(model, prompts, args, **options) -> tuple[list[list[int]], dict]:
    """One batch generator run over `prompts`: (outputs, a row of seconds, tokens/s and the KV bytes per running
    request at the last step with the most requests running; quantized prompts are sealed by then, since a
    quantized prompt is held in full precision until the step after its prefill)."""
    generator = BatchGenerator(model, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                               block_size=16, prefix_caching=False, prepack_weights=args.prepack_weights,
                               **options)  # fmt: skip
    for prompt in prompts:
        generator.add_request(prompt)
    start = time.perf_counter()
    outputs = [o.generated_tokens for o in generator.run()]
    seconds = time.perf_counter() - start
    peak = max(generator.history, key=lambda m: (m.running, m.step))
    return outputs, {"seconds": seconds, "tokens_per_s": sum(map(len, outputs)) / seconds,
                     "kv_bytes_per_request": peak.kv_bytes / peak.running, "peak_running": peak.running}  # fmt: skip


def capacity(model, tokens, args) -> list[dict]:
    prompts = [tokens[i * 991 : i * 991 + args.capacity_len] for i in range(args.capacity_requests)]
    rows = []
    for label, options in (("model dtype", {}), ("int4", {"quant": "int4", "residual_length": 0})):
        _outputs, row = run_with_peak(model, prompts, args, max_num_seqs=args.capacity_requests, **options)
        rows.append({"system": label, **{key: row[key] for key in ("kv_bytes_per_request", "peak_running", "tokens_per_s")}})
        print(rows[-1], flush=True)
    rows.append({"system": "int4 requests per pool vs model dtype",
                 "ratio": rows[0]["kv_bytes_per_request"] / rows[1]["kv_bytes_per_request"]})  # fmt: skip
    print(rows[-1], flush=True)
    return rows


def quant(model, tokens, args) -> list[dict]:
    """The mixed prompts unquantized and with each --quant format, alternating round by round (so a machine's load
    drifting over the run touches every system alike)."""
    prompts = mixed_prompts(tokens, args)
    options = {"max_batch_tokens": args.max_batch_tokens, "max_num_seqs": args.max_num_seqs}
    residual = {} if args.residual_length is None else {"residual_length": args.residual_length}
    rows, first = [], {}
    for round_ in range(args.quant_repeats):
        base = None
        for spec in ("none", *args.quant):
            quantized = {} if spec == "none" else {"quant": spec, **residual}
            outputs, row = run_with_peak(model, prompts, args, **options, **quantized)
            first.setdefault(spec, outputs)
            base = base or row
            row = {"system": spec, "round": round_, **row, "identical_to_first_round": outputs == first[spec],
                   "vs_unquantized": row["tokens_per_s"] / base["tokens_per_s"],
                   "requests_per_pool_vs_unquantized": base["kv_bytes_per_request"] / row["kv_bytes_per_request"]}  # fmt: skip
            print(row, flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workloads", nargs="+", default=["mixed", "shared", "capacity"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate_batch (slow on CPU)")
    parser.add_argument("--shared-requests", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--question-len", type=int, default=50)
    parser.add_argument("--pressure", type=float, default=0.25, help="pool size as a share of the total demand")
    parser.add_argument("--capacity-requests", type=int, default=16)
    parser.add_argument("--capacity-len", type=int, default=1000)
    parser.add_argument("--quant", nargs="+", default=["int4", "int8"], help="formats of the quant workload")
    parser.add_argument("--quant-repeats", type=int, default=2, help="rounds of the quant workload")
    parser.add_argument("--residual-length", type=int, help="the quant workload's residual window (default: the library's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true",
                        help="our generator with BatchConfig(compile=True), compiled in a warm-up before the workloads")
    parser.add_argument("--prepack-weights", action="store_true",
                        help="our generator with BatchConfig(prepack_weights=True) (packed when it is built, before "
                             "the clock: start-up, as vLLM's engine construction)")
    parser.add_argument("--out", default="eval/results/serving")
    parser.add_argument("--write-prompts", metavar="FILE", help="write the mixed and shared prompts as token ids and exit")
    parser.add_argument("--vllm", metavar="RESULT", help="eval/vllm_cpu.py's result on --write-prompts' prompts")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, encode = common.load_model(args.model)
    load_seconds = time.perf_counter() - start  # our start-up, against vLLM's engine construction
    print({"load_seconds": load_seconds}, flush=True)
    model.generation_config.eos_token_id = None
    text, source = common.text_from_args(args)
    tokens = encode(text)
    if args.write_prompts:
        write_prompts(args.write_prompts, tokens, args)
        return {"prompts": args.write_prompts}
    results = {"model": args.model, "text": source, "load_seconds": load_seconds, "args": vars(args)}
    if args.compile:
        results["compile_seconds"] = compile_warm_up(model, tokens)
        print({"compile_seconds": results["compile_seconds"]}, flush=True)
    for workload in args.workloads:
        run = {"mixed": mixed, "shared": shared, "capacity": capacity, "pressure": pressure, "quant": quant}[workload]
        results[workload] = run(model, tokens, args)
    common.write_json(f"{args.out}.json", results)
    return results


if __name__ == "__main__":
    main()
