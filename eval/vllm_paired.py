"""vLLM's CPU engine and the batch generator run in turn on the same prompts, both warm (issue 25).

Separate processes run back to back minutes apart see this machine at different speeds (a run of ours can take
15.3 s or 17.4 s within the hour). Here one vLLM engine (`eval/vllm_cpu.py --serve`, in vLLM's own venv) and one
generator of ours stay up, and each pair of runs is seconds apart; which side goes first alternates. Both empty their
prefix cache before every run (`LLM.reset_prefix_cache`, `BatchGenerator.reset_prefix_cache`), so each run computes
what the first did, with the memory its engine already holds; `--warm-up` runs of each workload on both sides come
first, untimed. vLLM's engine is this script's child, so both sides run under the same environment (the
`GLIBC_TUNABLES` the results record, for one).

    python eval/vllm_paired.py --vllm-python /work/vllm-venv/bin/python --prompts eval/results/serving_prompts.json \\
        --pairs 8 --prepack-weights --keep-host-memory --out eval/results/vllm_paired.json

`--keep-host-memory` sets glibc's malloc in our process alone (`BatchConfig(keep_host_memory=True)`); vLLM's runs as
its defaults (or the environment) have it.

Prints every pair (seconds, vLLM's over ours, outputs equal to vLLM's) and per workload the summed ratio: ours in
× vLLM's speed, the same tokens generated on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serving import same_as, served  # noqa: E402
from vllm_cpu import DEFAULT_MODEL, SERVE_MARK  # noqa: E402  (it imports vLLM only inside main)

from hf_paged_cache import BatchGenerator  # noqa: E402


class VllmEngine:
    """`eval/vllm_cpu.py --serve` run by vLLM's Python: one workload at a time."""

    def __init__(self, python: str, args: argparse.Namespace):
        script = Path(__file__).resolve().with_name("vllm_cpu.py")
        command = [python, str(script), "--serve", "--prompts", args.prompts, "--model", args.vllm_model,
                   "--max-num-seqs", str(args.max_num_seqs), "--max-batch-tokens", str(args.max_batch_tokens),
                   "--dtype", args.dtype]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started = self._reply()

    def _reply(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(SERVE_MARK):
                return json.loads(line[len(SERVE_MARK) :])
        raise SystemExit(f"vLLM's engine exited ({self.process.wait()}) before it answered: see its output above")

    def run(self, workload: str) -> dict:
        self.process.stdin.write(workload + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        """Stop the engine (an empty line), unless it has stopped already."""
        if self.process.poll() is None:
            self.process.stdin.write("\n")
            self.process.stdin.flush()
        self.process.wait(timeout=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the Python of vLLM's venv (see eval/README.md)")
    parser.add_argument("--vllm-model", default=DEFAULT_MODEL,
                        help="the model directory vLLM loads (eval/README.md: the same weights as --model)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", required=True, help="JSON from eval/serving.py --write-prompts")
    parser.add_argument("--workloads", nargs="+", default=["mixed", "shared"])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--warm-up", type=int, default=1, help="untimed runs of each workload on both sides first")
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--prepack-weights", action="store_true", help="ours with its weights prepacked for oneDNN")
    parser.add_argument("--keep-host-memory", action="store_true",
                        help="ours with BatchConfig(keep_host_memory=True): its process keeps the memory it frees")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both engines' (vLLM's CPU gated delta-net runs only in bfloat16)")
    parser.add_argument("--out", default="eval/results/vllm_paired.json")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.warm_up < 0:
        parser.error("--warm-up must be at least 0")
    torch.set_num_threads(2)
    saved = json.loads(Path(args.prompts).read_text())
    missing = [name for name in args.workloads if name not in saved["workloads"]]
    if missing:
        parser.error(f"--workloads {missing} are not in {args.prompts} (it has {list(saved['workloads'])})")
    model, _ = common.load_model(args.model, dtype=getattr(torch, args.dtype))
    model.generation_config.eos_token_id = None

    generator = BatchGenerator(model, do_sample=False, eos_token_id=None, block_size=16,
                               max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
                               prepack_weights=args.prepack_weights,
                               keep_host_memory=args.keep_host_memory)  # fmt: skip

    def ours(name: str) -> dict:
        workload = saved["workloads"][name]
        generator.reset_prefix_cache()
        start = time.perf_counter()
        outputs = served(generator, workload["prompts"], workload["new_tokens"])
        return {"seconds": time.perf_counter() - start, "outputs": outputs}

    env = {"GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES"), "keep_host_memory": args.keep_host_memory}
    print({"env": env}, flush=True)
    vllm = VllmEngine(args.vllm_python, args)
    rows = []
    try:
        for _ in range(args.warm_up):
            for name in args.workloads:
                vllm.run(name)
                ours(name)
        for pair in range(args.pairs):
            for name in args.workloads:
                first, second = ("vllm", "ours") if pair % 2 == 0 else ("ours", "vllm")
                runs = {}
                for side in (first, second):
                    runs[side] = vllm.run(name) if side == "vllm" else ours(name)
                row = {"pair": pair, "workload": name, "first": first, "vllm_seconds": runs["vllm"]["seconds"],
                       "ours_seconds": runs["ours"]["seconds"],
                       "x_vllm": runs["vllm"]["seconds"] / runs["ours"]["seconds"],
                       "identical_to_vllm": same_as(runs["ours"]["outputs"], runs["vllm"]["outputs"]),
                       "requests": len(runs["ours"]["outputs"])}  # fmt: skip
                print(row, flush=True)
                rows.append(row)
    finally:
        vllm.close()
    summary = {}
    for name in args.workloads:
        own = [row for row in rows if row["workload"] == name]
        summary[name] = {"x_vllm_summed": sum(row["vllm_seconds"] for row in own) / sum(row["ours_seconds"] for row in own),
                         "x_vllm_median": statistics.median(row["x_vllm"] for row in own),
                         "identical_to_vllm": min(row["identical_to_vllm"] for row in own)}  # fmt: skip
        print({"workload": name, **summary[name]}, flush=True)
    result = {"settings": vars(args), "env": env, "vllm_startup_seconds": vllm.started.get("startup_seconds"),
              "pairs": rows, "summary": summary}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
