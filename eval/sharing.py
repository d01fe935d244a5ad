"""Memory that sharing saves, measured against DynamicCache in the same process (issue 12).

Three workloads on one public-domain text (outputs are checked identical to the DynamicCache runs):

- samples: `num_return_sequences=N`, seeded sampling, a P-token prompt, T new tokens: KV bytes after the
  prefill and at the end, against DynamicCache's and against the ideal (the prompt once plus each sample's
  own tokens);
- beams: `num_beams=B`, T new tokens from the same prompt: peak KV bytes over the generation;
- forks: one C-token context, Q questions answered through `fork()`: time per fork, the family's KV bytes
  against the ideal (the context once plus each question's and answer's own tokens), answers against
  recomputing the context for each question.

    python eval/sharing.py                                  # the issue's sizes (SmolLM2-135M, ~10 min on 2 cores)
    python eval/sharing.py --model tiny-llama --prompt-tokens 64 --new-tokens 8 --context-tokens 96 --questions 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache import PagedCache  # noqa: E402


class _Peak(StoppingCriteria):
    """Records the cache's bytes after every step (the first record is the prefill's)."""

    def __init__(self, cache):
        self.cache, self.records = cache, []

    def __call__(self, input_ids, scores, **kwargs):
        memory = common.cache_bytes(self.cache)
        self.records.append(memory["kv_bytes"] + memory["table_bytes"])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _generate(model, ids: torch.Tensor, cache, new_tokens: int, **kwargs) -> tuple[torch.Tensor, list[int]]:
    peak = _Peak(cache)
    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, stopping_criteria=StoppingCriteriaList([peak]),
                             **kwargs)  # fmt: skip
    return out, peak.records


def bytes_per_token(model) -> int:
    probe = PagedCache(model.config, block_size=1)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), cache=probe)
    return probe.metrics().used_bytes


def samples_and_beams(model, prompt: torch.Tensor, args, per_token: int) -> list[dict]:
    rows = []
    for name, kwargs, ideal_tokens in (
        (f"{args.samples} samples", {"do_sample": True, "num_return_sequences": args.samples, "top_k": 0},
         prompt.shape[1] + args.samples * args.new_tokens),
        (f"{args.beams} beams", {"do_sample": False, "num_beams": args.beams, "early_stopping": False}, None),
    ):  # fmt: skip
        runs = {}
        paged = PagedCache(model.config, block_size=args.block_size)
        for label, cache in (("dynamic", DynamicCache()), ("paged", paged)):
            start = time.perf_counter()
            runs[label] = (*_generate(model, prompt, cache, args.new_tokens, **kwargs), time.perf_counter() - start)
        (out_d, rec_d, t_d), (out_p, rec_p, t_p) = runs["dynamic"], runs["paged"]
        row = {
            "workload": name,
            "identical": bool(torch.equal(out_d, out_p)),
            "prefill_ratio": rec_p[0] / rec_d[0],
            "peak_ratio": max(rec_p) / max(rec_d),
            "end_ratio": rec_p[-1] / rec_d[-1],
            "paged_end_bytes": rec_p[-1],
            "dynamic_end_bytes": rec_d[-1],
            "seconds_dynamic": t_d,
            "seconds_paged": t_p,
        }
        if ideal_tokens is not None:
            row["end_vs_ideal"] = rec_p[-1] / (ideal_tokens * per_token)
        rows.append(row)
        print(row, flush=True)
    return rows


def forks(model, context: torch.Tensor, questions: list[torch.Tensor], args, per_token: int) -> dict:
    cache = PagedCache(model.config, block_size=args.block_size)
    with torch.inference_mode():
        model(input_ids=context, cache=cache, logits_to_keep=1)
    family, fork_ms, own_tokens, identical = [], [], 0, True
    for question in questions:
        start = time.perf_counter()
        family.append(cache.fork())
        fork_ms.append(1000 * (time.perf_counter() - start))
        ids = torch.cat([context, question], dim=1)
        answer, _ = _generate(model, ids, family[-1], args.answer_tokens, do_sample=False)
        own_tokens += question.shape[1] + args.answer_tokens - 1  # the last answer token is not stored
        recomputed, _ = _generate(model, ids, PagedCache(model.config, block_size=args.block_size), args.answer_tokens,
                                  do_sample=False)  # fmt: skip
        identical &= bool(torch.equal(answer, recomputed))
    metrics = cache.metrics()
    ideal = (context.shape[1] + own_tokens) * per_token
    row = {
        "workload": f"{len(questions)} questions via fork()",
        "identical": identical,
        "fork_ms_mean": sum(fork_ms) / len(fork_ms),
        "fork_ms_max": max(fork_ms),
        "family_bytes": metrics.kv_bytes,
        "ideal_bytes": ideal,
        "family_vs_ideal": metrics.kv_bytes / ideal,
        "vs_copies": metrics.kv_bytes / ((len(questions) * context.shape[1] + own_tokens) * per_token),
        "shared_blocks": metrics.shared_blocks,
        "forks_alive": metrics.forks,
    }
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=4000)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--question-tokens", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["samples", "forks"])
    parser.add_argument("--out", default="eval/results/sharing")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, encode = common.load_model(args.model)
    model.generation_config.eos_token_id = None  # every run generates exactly the tokens asked for
    text, source = common.text_from_args(args)
    tokens = torch.tensor(encode(text))
    per_token = bytes_per_token(model)
    results = {"model": args.model, "text": source, "args": vars(args), "rows": []}
    if "samples" not in args.skip:
        prompt = tokens[None, : args.prompt_tokens]
        results["rows"] += samples_and_beams(model, prompt, args, per_token)
    if "forks" not in args.skip:
        context = tokens[None, : args.context_tokens]
        start = args.context_tokens
        questions = [tokens[None, start + i * args.question_tokens : start + (i + 1) * args.question_tokens]
                     for i in range(args.questions)]  # fmt: skip
        results["rows"].append(forks(model, context, questions, args, per_token))
    common.write_json(f"{args.out}.json", results)
    return results


if __name__ == "__main__":
    main()
