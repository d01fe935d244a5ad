"""Peak process memory of a generation, cache by cache, beside the bytes each cache uses and holds.

Each `--caches` spec (see `common.py`) runs `--runs` times, every run in a process of its own (a process never
gives all freed memory back to the OS, so configurations measured in one process would read each other's
peaks; `--jobs` of them may run at once, which changes only the wall time). A run loads the model, builds the
cache, generates a few tokens from a short prompt (one-time setup: kernels, thread pools, imports), then
records its resident memory (`VmRSS`), resets the kernel's high-water mark (`echo 5 > /proc/self/clear_refs`)
and greedily generates `--new-tokens` tokens from a `--prompt-tokens` prompt of the text. "peak above model"
is the high-water mark `VmHWM` afterwards minus that baseline: every byte the generation needed at its worst
moment (K/V, activations, logits, allocator slack), not the cache's alone. The table shows the median over the runs (RSS peaks vary by about 15% from run to run).

Beside it, with the library's own accounting (`inspection.cache_bytes`), after every generated token: the
cache's bytes in use and the storage it holds (for `DynamicCache` / `QuantizedCache` the two are the tensors
it holds), their largest ratio over the generation, and both at the end. Linux only (`/proc/self/status`).

    python eval/peak_memory.py                        # SmolLM2-135M, 6,000-token prompt, 3 runs per cache
    python eval/peak_memory.py --model tiny-llama --prompt-tokens 300 --new-tokens 4 --runs 1 --caches dynamic paged
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from transformers import StoppingCriteria  # noqa: E402

DEFAULT_CACHES = [
    "dynamic",
    "quantized:nbits=4",
    "paged",
    "paged:attn=paged,quant=int8",
    "paged:attn=paged,quant=int4",
    "paged:attn=paged,eviction=h2o,budget=0.25",
    "paged:attn=paged,eviction=streaming,budget=0.25",
]
MIB = 2**20
WARMUP_TOKENS = 32


def status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (`VmRSS`: resident now, `VmHWM`: the resident high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field: peak memory is measured on Linux only")


def reset_peak() -> None:
    """Set `VmHWM` back to the current resident size (Linux `clear_refs`, value 5)."""
    Path("/proc/self/clear_refs").write_text("5")
    if status_kib("VmHWM") > status_kib("VmRSS") + 1024:
        raise RuntimeError("writing 5 to /proc/self/clear_refs did not reset VmHWM: this kernel cannot measure peaks")


class RecordBytes(StoppingCriteria):
    """Records the cache's bytes after every generated token; never stops the generation."""

    def __init__(self, cache):
        self.cache, self.trace = cache, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.trace.append(common.cache_bytes(self.cache))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model, spec: common.CacheSpec, ids: torch.Tensor, new_tokens: int) -> tuple[object, list[dict]]:
    cache = common.make_cache(spec, model)
    record = RecordBytes(cache)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, stopping_criteria=[record])  # fmt: skip
    return cache, record.trace


def worker(args) -> dict:
    """One run of one cache in this process (the parent starts one process per run)."""
    torch.set_num_threads(args.threads)
    model, encode = common.load_model(args.model, common.DTYPES[args.dtype])
    text, _source = common.text_from_args(args)
    tokens = encode(text)
    if len(tokens) < args.prompt_tokens:
        raise SystemExit(f"the text has only {len(tokens)} tokens; lower --prompt-tokens")
    spec = common.parse_cache_spec(args.worker)
    generate(model, spec, torch.tensor([tokens[:WARMUP_TOKENS]]), 2)
    ids = torch.tensor([tokens[: args.prompt_tokens]])
    gc.collect()
    baseline = status_kib("VmRSS")
    reset_peak()
    cache, trace = generate(model, spec, ids, args.new_tokens)
    peak = status_kib("VmHWM")
    return {
        "cache": spec.label,
        "peak_mib": (peak - baseline) / 1024,
        "model_rss_mib": baseline / 1024,
        "used_mib": trace[-1]["kv_bytes"] / MIB,
        "held_mib": trace[-1]["pool_bytes"] / MIB,
        "max_held_ratio": max(point["pool_bytes"] / point["kv_bytes"] for point in trace if point["kv_bytes"]),
        "tokens": cache.get_seq_length(),
    }


def run_once(spec: str, args) -> dict:
    command = [sys.executable, __file__, "--worker", spec, "--model", args.model, "--dtype", args.dtype,
               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
               "--threads", str(args.threads)]  # fmt: skip
    for option in ("text_file", "dataset", "dataset_config"):
        if getattr(args, option):
            command += [f"--{option.replace('_', '-')}", getattr(args, option)]
    command += ["--split", args.split, "--text-column", args.text_column]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"the run of {spec!r} failed:\n{result.stderr[-4000:]}")
    run = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"{spec}: {json.dumps(run)}", file=sys.stderr, flush=True)
    return run


def summarise(spec: str, runs: list[dict]) -> dict:
    peaks = [run["peak_mib"] for run in runs]
    return {**runs[-1], "peak_mib": statistics.median(peaks), "peak_min_mib": min(peaks), "peak_max_mib": max(peaks),
            "runs": len(runs)}  # fmt: skip


def markdown(rows: list[dict]) -> str:
    lines = [
        "| cache | peak above model, MiB (median) | min-max | in use, MiB | held, MiB | held / in use (max) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| `{row['cache']}` | {row['peak_mib']:,.0f} | {row['peak_min_mib']:,.0f}-{row['peak_max_mib']:,.0f} | "
            f"{row['used_mib']:,.1f} | {row['held_mib']:,.1f} | {row['max_held_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny-llama, tiny-gemma3, a local path / hub id")
    parser.add_argument("--caches", nargs="+", default=DEFAULT_CACHES, help="cache specs (see eval/README.md)")
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated (greedy) after the prompt")
    parser.add_argument("--runs", type=int, default=3, help="processes per cache; the peak is their median")
    parser.add_argument("--dtype", default="float32", choices=sorted(common.DTYPES))
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs (processes) at a time")
    parser.add_argument("--json", help="also write the rows (every run's peak included) to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one run of this cache spec, JSON on stdout
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    if args.runs < 1 or args.jobs < 1:
        parser.error("--runs and --jobs must be >= 1")
    if args.worker:
        print(json.dumps(worker(args)))
        return []
    for spec in args.caches:
        common.parse_cache_spec(spec)  # a typo fails before the first run
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {spec: [pool.submit(run_once, spec, args) for _ in range(args.runs)] for spec in args.caches}
        every_run = {spec: [future.result() for future in runs] for spec, runs in futures.items()}
    rows = [summarise(spec, runs) for spec, runs in every_run.items()]
    print(f"{args.model} ({args.dtype}), {args.prompt_tokens}-token prompt + {args.new_tokens} new tokens, "
          f"{args.threads} threads, median of {args.runs} process(es) per cache\n")  # fmt: skip
    print(markdown(rows))
    if args.json:
        common.write_json(args.json, {"args": vars(args), "environment": common.environment(), "rows": rows,
                                      "runs": every_run})  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
