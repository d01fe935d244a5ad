"""Generate with PagedCache under transformers' tensor parallelism, checked against one process.

    torchrun --nproc-per-node 3 eval/tp_generate.py --model smollm2       # SmolLM2-135M: 3 KV heads, 1 per rank
    torchrun --nproc-per-node 1 eval/tp_generate.py --model smollm2       # the same in one process
    torchrun --nproc-per-node 2 eval/tp_generate.py --model tiny-llama \\
        --caches dynamic paged:attn=paged paged:attn=paged,eviction=h2o,budget=24,sinks=2,window=4

Every rank loads the model with `DistributedConfig(tp_plan="auto")` (each holds 1 / world of the attention
heads, KV heads included, and of the MLP), builds each cache of `--caches` (the syntax of `common.py`)
from `model.config`, and generates greedily from the same prompt (the start of the shipped text). Rank 0
then loads the whole model and runs every configuration in one process. For each configuration the
script prints the tokens, whether they equal the one-process tokens (and, with eviction, whether every
rank kept the same tokens as one process), KV bytes per rank, summed over the ranks and in one process,
and tokens/s (new tokens / seconds of `generate()`, the prompt's prefill included). It exits with 1 on any
mismatch. On CPU the ranks talk over gloo (`--threads` each, default 1); on GPUs the same command runs
over NCCL, one GPU per rank. `--out` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache import PagedCache  # noqa: E402


def model_folder(name: str) -> tuple[Path, common.Codec | None, Path | None]:
    """(folder to load from, codec, temporary folder to delete). `from_pretrained` needs a folder on every
    rank: SmolLM2's converted one, a local path, or tiny-llama saved by this rank (its weights are seeded).
    A local folder without a tokenizer (the tests' tiny models) gets no codec: its prompt is random ids."""
    from transformers import AutoTokenizer

    if name == common.TINY_LLAMA:
        model, codec = common.load_model(name)
        folder = Path(tempfile.mkdtemp(prefix="tp_generate_"))
        model.save_pretrained(folder)
        return folder, codec, folder
    if name == "smollm2":
        from hf_paged_cache.smollm2 import model_dir

        folder = model_dir()
    else:
        folder = Path(name)
        if not any((folder / file).is_file() for file in ("tokenizer.json", "tokenizer_config.json")):
            return folder, None, None
    return folder, common.tokenizer_codec(AutoTokenizer.from_pretrained(folder)), None


def prompt_ids(codec: common.Codec | None, vocab_size: int, tokens: int) -> torch.Tensor:
    """The first `tokens` tokens of the shipped text; seeded random ids when there is no tokenizer."""
    if codec is None:
        return torch.randint(3, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    text, _ = common.load_text()
    return torch.tensor([codec(text)[:tokens]])


def load(folder: Path, tensor_parallel: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    kv_heads = AutoConfig.from_pretrained(folder).get_text_config().num_key_value_heads
    if tensor_parallel and kv_heads % world:
        raise SystemExit(f"{world} ranks cannot split the model's {kv_heads} KV heads: use a world size dividing {kv_heads}")
    extra = {"distributed_config": DistributedConfig(tp_plan="auto")} if tensor_parallel else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).eval()
    model.generation_config.eos_token_id = None  # every run generates exactly --max-new-tokens
    return model


def kept_positions(cache) -> list[list[list[int]]] | None:
    """The logical positions every row of every group stores, when the cache evicted (else None)."""
    if not isinstance(cache, PagedCache) or cache.options.eviction is None:
        return None
    groups = cache.groups.values()
    return [[group.stored_positions(row).tolist() for row in range(len(group.tables))] for group in groups]


def paged_metrics(cache) -> dict:
    """A PagedCache's own view: the tensor-parallel ranks it knows of, its bytes with tables, tokens evicted."""
    if not isinstance(cache, PagedCache):
        return {"tp_size": None, "metrics_kv_bytes": None, "metrics_total_kv_bytes": None, "evicted_tokens": 0}
    metrics = cache.metrics()
    return {"tp_size": metrics.tp_size, "metrics_kv_bytes": metrics.kv_bytes,
            "metrics_total_kv_bytes": metrics.total_kv_bytes, "evicted_tokens": metrics.evicted_tokens}  # fmt: skip


def run(model, spec: common.CacheSpec, ids: torch.Tensor, new_tokens: int) -> dict:
    """One greedy generation with a fresh cache of `spec`: tokens, bytes and speed."""
    cache = common.make_cache(spec, model)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    return {
        "tokens": out[0, ids.shape[1] :].tolist(),
        **common.cache_bytes(cache),
        "tokens_per_s": new_tokens / seconds,
        **paged_metrics(cache),
        "kept": kept_positions(cache),
    }


def run_all(model, specs: list[common.CacheSpec], ids: torch.Tensor, new_tokens: int) -> list[dict]:
    run(model, specs[0], ids[:, :8], 2)  # warm-up: first-call costs stay out of the timings
    return [run(model, spec, ids, new_tokens) for spec in specs]


PER_RANK = ("kv_bytes", "pool_bytes", "tokens_per_s", "tp_size", "metrics_kv_bytes", "metrics_total_kv_bytes")


def kept_by_all(ranks: list[dict]):
    """What the ranks keep together: with head-shared eviction every rank keeps the same positions (None if they
    differ); with per-head eviction each rank keeps its own KV heads', joined here in rank (head) order."""
    kept = [rank["kept"] for rank in ranks]
    per_head = kept[0] is not None and any(row and isinstance(row[0], list) for group in kept[0] for row in group)
    if not per_head:
        return kept[0] if all(other == kept[0] for other in kept) else None
    return [[sum((other[g][r] for other in kept), []) for r in range(len(group))] for g, group in enumerate(kept[0])]


def compare(specs, per_rank: list[list[dict]], single: list[dict]) -> list[dict]:
    """One row per configuration: the ranks' results against the one-process run."""
    rows = []
    for index, spec in enumerate(specs):
        ranks = [results[index] for results in per_rank]
        reference = single[index]
        rows.append({
            "cache": spec.label,
            "tokens_equal": all(rank["tokens"] == reference["tokens"] for rank in ranks),
            "kept_equal": kept_by_all(ranks) == reference["kept"],
            "tokens_per_s": ranks[0]["tokens_per_s"],
            "single_tokens_per_s": reference["tokens_per_s"],
            "per_rank": [{key: rank[key] for key in PER_RANK} for rank in ranks],
            "kv_bytes_total": sum(rank["kv_bytes"] for rank in ranks),
            "single_kv_bytes": reference["kv_bytes"],
            "evicted_tokens": ranks[0]["evicted_tokens"],
            "tokens": ranks[0]["tokens"],
            "single_tokens": reference["tokens"],
            "kept": ranks[0]["kept"],
        })  # fmt: skip
    return rows


def same(row: dict) -> str:
    """The table's verdict: tokens equal to one process's, and (with eviction) the same tokens kept."""
    if not row["tokens_equal"]:
        return "NO: tokens differ"
    return "yes" if row["kept_equal"] else "NO: kept tokens differ"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny-llama, or a local model folder")
    parser.add_argument("--caches", nargs="+", default=["dynamic", "paged:attn=paged"], help="cache specs (common.py)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", help="write the results as JSON here (rank 0)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = [common.parse_cache_spec(text) for text in args.caches]
    world = int(os.environ.get("WORLD_SIZE", "1"))

    folder, codec, scratch = model_folder(args.model)
    try:
        model = load(folder, tensor_parallel=world > 1)
        ids = prompt_ids(codec, model.config.vocab_size, args.prompt_tokens)
        rank = dist.get_rank() if world > 1 else 0
        results = run_all(model, specs, ids, args.max_new_tokens)
        per_rank = [None] * world if rank == 0 else None
        if world > 1:
            dist.gather_object(results, per_rank)
            dist.destroy_process_group()
        else:
            per_rank = [results]
        if rank != 0:
            return 0
        del model
        single = run_all(load(folder, tensor_parallel=False), specs, ids, args.max_new_tokens)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    rows = compare(specs, per_rank, single)
    print(f"{args.model}: {world} rank(s) x {args.threads} thread(s), prompt {ids.shape[1]} tokens, "
          f"{args.max_new_tokens} new tokens; KV bytes = blocks in use (DynamicCache: its tensors)")  # fmt: skip
    common.print_table(
        [{**row, "kv_rank": row["per_rank"][0]["kv_bytes"], "same": same(row)} for row in rows],
        [("cache", "cache", ""), ("same", "= 1 process", ""), ("tokens_per_s", "tok/s", ".2f"),
         ("single_tokens_per_s", "tok/s 1 proc", ".2f"), ("kv_rank", "KV B/rank", ","),
         ("kv_bytes_total", "KV B total", ","), ("single_kv_bytes", "KV B 1 proc", ","),
         ("evicted_tokens", "evicted", "d")],
    )  # fmt: skip
    for row in rows:
        print(f"{row['cache']}: {row['tokens']}" + (f"\n    {codec.decode(row['tokens'])!r}" if codec else ""))
    if args.out:
        common.write_json(args.out, {"model": args.model, "world_size": world, "threads": args.threads,
                                     "prompt_tokens": ids.shape[1], "new_tokens": args.max_new_tokens,
                                     "environment": common.environment(), "rows": rows})  # fmt: skip
    mismatched = [row["cache"] for row in rows if not (row["tokens_equal"] and row["kept_equal"])]
    if mismatched:
        print(f"MISMATCH with the one-process run: {', '.join(mismatched)}", file=sys.stderr)
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
