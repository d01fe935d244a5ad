"""Decode speed and KV bytes: DynamicCache vs PagedCache (gather read path) vs PagedCache ("paged" read path).

One process, so every ratio compares runs on the same machine under the same load:

- batch 1 at each `--contexts` length: prefill that many tokens of the text (untimed, in chunks), then
  time `--steps` greedy decode steps; runs of the configurations are interleaved (the order rotates each
  repeat) and the median of `--repeats` runs is reported. Between runs the cache is cropped back to
  the prefilled context, so every run decodes from the same state.
- a ragged batch: `--ragged-batch` prompts whose lengths spread evenly over [`--ragged-min`,
  `--ragged-max`], left-padded, `--ragged-new` new tokens through `model.generate()`.

Targets (checked and printed): PagedCache ≥ 0.95× DynamicCache tokens/s at 512 tokens and ≥ 1.0× at
6144; PagedCache KV bytes ≤ ideal (tokens × bytes per token) + one partial block per row per layer;
PagedCache pool bytes (what the process holds) ≤ 1.25× its KV bytes in use; ragged-batch KV bytes ≤ 0.7×
DynamicCache's.

    python eval/bench_decode.py                 # the full run (several minutes on 2 cores)
    python eval/bench_decode.py --quick         # a smoke run: tiny contexts; only the byte bounds are judged
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import plots  # noqa: E402

from hf_paged_cache.demo import TokenClock  # noqa: E402

SPEED_TARGETS = {512: 0.95, 6144: 1.0}  # context -> minimum tokens/s ratio vs DynamicCache
RAGGED_BYTES_TARGET = 0.7
POOL_TARGET = 1.25  # pool bytes / bytes in use of a growable PagedCache


# ---------------------------------------------------------------------------------------------- batch 1
def prefill(model, ids: torch.Tensor, cache, chunk: int) -> float:
    """Feed `ids` `[1, n]` into `cache` in chunks; returns seconds."""
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, first : first + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start


def decode(model, cache, token: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    """`steps` greedy one-token forwards starting from `token` `[1, 1]`; returns (seconds, tokens fed)."""
    fed = []
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(steps):
            fed.append(token)
            logits = model(input_ids=token, cache=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
        seconds = time.perf_counter() - start
    return seconds, torch.cat(fed, dim=1)[0].tolist()


def rewind(spec, model, cache, ids: torch.Tensor, context: int, chunk: int):
    """Bring `cache` back to exactly the prefilled `context` tokens (crop, or rebuild when not croppable)."""
    extra = cache.get_seq_length() - context
    if extra == 0:
        return cache
    if getattr(cache, "is_croppable", False):
        cache.crop(-extra)
        return cache
    cache = common.make_cache(spec, model)
    prefill(model, ids[:, :context], cache, chunk)
    return cache


def bench_context(model, specs, ids: torch.Tensor, context: int, args, bytes_per_token: int) -> list[dict]:
    prompt, first_token = ids[:, :context], ids[:, context : context + 1]
    caches, rows = {}, {}
    for spec in specs:
        cache = common.make_cache(spec, model)
        seconds = prefill(model, prompt, cache, args.prefill_chunk)
        decode(model, cache, first_token, 2)  # warm-up of this read path at this length
        caches[spec.label] = rewind(spec, model, cache, ids, context, args.prefill_chunk)
        rows[spec.label] = {"context": context, "config": spec.label, "prefill_tokens_per_s": context / seconds,
                            "runs_tokens_per_s": []}  # fmt: skip
    tokens = {}
    for repeat in range(args.repeats):
        shift = repeat % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            common.use_attention(model, spec.attn)
            cache = caches[spec.label] = rewind(spec, model, caches[spec.label], ids, context, args.prefill_chunk)
            seconds, fed = decode(model, cache, first_token, args.steps)
            rows[spec.label]["runs_tokens_per_s"].append(args.steps / seconds)
            tokens.setdefault(spec.label, fed)
    reference = tokens[specs[0].label]
    for spec in specs:
        row, cache = rows[spec.label], caches[spec.label]
        row["tokens_per_s"] = statistics.median(row["runs_tokens_per_s"])
        row["same_tokens_as_first"] = tokens[spec.label] == reference
        row.update(_bytes(cache, stored=[context + args.steps], bytes_per_token=bytes_per_token))
    del caches
    return [rows[spec.label] for spec in specs]


def _bytes(cache, stored: list[int], bytes_per_token: int) -> dict:
    """KV bytes of `cache`, and for a PagedCache the bound: ideal + one partial block per row and layer."""
    memory = common.cache_bytes(cache)
    ideal = sum(stored) * bytes_per_token
    out = {"kv_bytes": memory["kv_bytes"], "pool_bytes": memory["pool_bytes"], "ideal_bytes": ideal,
           "pool_ratio": memory["pool_bytes"] / memory["kv_bytes"], "tokens_stored": sum(stored)}  # fmt: skip
    block_size = getattr(getattr(cache, "options", None), "block_size", None)
    if block_size is not None:
        # a row's partial block wastes at most block_size - 1 slots in each layer
        out["bound_bytes"] = ideal + len(stored) * (block_size - 1) * bytes_per_token
        out["within_bound"] = memory["kv_bytes"] <= out["bound_bytes"]
    return out


# ---------------------------------------------------------------------------------------------- ragged batch
def bench_ragged(model, specs, ids: torch.Tensor, args, bytes_per_token: int) -> list[dict]:
    batch = args.ragged_batch
    lengths = [round(args.ragged_min + i * (args.ragged_max - args.ragged_min) / max(batch - 1, 1)) for i in range(batch)]
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad
    width = max(lengths)
    input_ids = torch.full((batch, width), pad, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, length in enumerate(lengths):
        start = 1000 * row
        input_ids[row, width - length :] = ids[0, start : start + length]
        mask[row, width - length :] = 1
    new = args.ragged_new
    runs = {spec.label: [] for spec in specs}
    outputs, caches = {}, {}

    def run(spec):
        common.use_attention(model, spec.attn)
        cache, clock = common.make_cache(spec, model), TokenClock()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, cache=cache, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, streamer=clock)  # fmt: skip
        return out[:, width:], cache, clock.decode_tokens_per_s(batch)

    for spec in specs:  # warm-up, shorter
        common.use_attention(model, spec.attn)
        with torch.inference_mode():
            model.generate(input_ids=input_ids[:, -8:], attention_mask=mask[:, -8:], cache=common.make_cache(spec, model),
                           max_new_tokens=2, min_new_tokens=2, do_sample=False)  # fmt: skip
    for repeat in range(args.ragged_repeats):
        shift = repeat % len(specs)
        for spec in specs[shift:] + specs[:shift]:
            generated, cache, speed = run(spec)
            runs[spec.label].append(speed)
            outputs.setdefault(spec.label, generated)
            caches[spec.label] = cache
    reference = outputs[specs[0].label]
    rows = []
    # every row stores its prompt and all new tokens but the last (which is never fed back)
    stored = [length + new - 1 for length in lengths]
    for spec in specs:
        row = {"config": spec.label, "batch": batch, "prompt_lengths": lengths, "new_tokens": new,
               "runs_tokens_per_s": runs[spec.label], "tokens_per_s": statistics.median(runs[spec.label]),
               "same_tokens_as_first": torch.equal(outputs[spec.label], reference)}  # fmt: skip
        row.update(_bytes(caches[spec.label], stored, bytes_per_token))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny-llama | a local path or hub id")
    parser.add_argument("--caches", nargs="+", default=["dynamic", "paged", "paged:attn=paged"], metavar="SPEC",
                        help="cache specs (eval/common.py); the first is the baseline of every ratio")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 6144])
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per configuration and context")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--ragged-batch", type=int, default=8)
    parser.add_argument("--ragged-min", type=int, default=64)
    parser.add_argument("--ragged-max", type=int, default=512)
    parser.add_argument("--ragged-new", type=int, default=64)
    parser.add_argument("--ragged-repeats", type=int, default=3, help="runs of the ragged batch (0: none)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: contexts 64 160, 8 steps, 2 repeats, ragged 4 prompts of 16..64 (+8)")
    parser.add_argument("--out", default="eval/results/bench_decode.json")
    parser.add_argument("--plot", metavar="FILE", help="also draw tokens/s against context and the ragged bytes")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)  # fmt: skip
    if args.quick:
        args.contexts, args.steps, args.repeats = [64, 160], 8, 2
        args.ragged_batch, args.ragged_min, args.ragged_max, args.ragged_new, args.ragged_repeats = 4, 16, 64, 8, 1

    for name in ("ragged_batch", "ragged_repeats"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0 (0: no ragged batch), got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    specs = [common.parse_cache_spec(text) for text in args.caches]
    text, source = common.text_from_args(args)
    model, encode = common.load_model(args.model)
    from hf_paged_cache import kv_bytes_per_token

    bytes_per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    needed = max(max(args.contexts) + args.steps + 1, 1000 * (args.ragged_batch - 1) + args.ragged_max)
    ids = torch.tensor(encode(text[: 8 * needed + 10_000])[:needed])[None]
    if ids.shape[1] < needed:
        parser.error(f"the text has {ids.shape[1]} tokens; this run needs {needed}")
    print(f"{args.model}: {bytes_per_token:,} KV bytes/token, {torch.get_num_threads()} threads, text {source}")

    single = []
    for context in args.contexts:
        rows = bench_context(model, specs, ids, context, args, bytes_per_token)
        single.extend(rows)
        print(f"  context {context}: " + ", ".join(f"{r['config']} {r['tokens_per_s']:.1f} tok/s" for r in rows), flush=True)
    ragged = bench_ragged(model, specs, ids, args, bytes_per_token) if args.ragged_batch and args.ragged_repeats else []
    for rows in [single, ragged]:
        for row in rows:
            base = next(r for r in rows if r["config"] == specs[0].label and r.get("context") == row.get("context"))
            row["speed_ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["bytes_ratio"] = row["kv_bytes"] / base["kv_bytes"]

    targets = _targets(specs, single, ragged, args.quick)
    _report(single, ragged, targets)
    payload = {"model": args.model, "text": source, "bytes_per_token": bytes_per_token, "quick": args.quick,
               "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
               "environment": common.environment(), "single": single, "ragged": ragged, "targets": targets}  # fmt: skip
    print(f"\nwrote {common.write_json(args.out, payload)}")
    if args.plot:
        print(f"wrote {plots.decode(single, ragged, args.plot)}")
    return payload


def _targets(specs, single, ragged, quick: bool) -> list[dict]:
    paged = [spec.label for spec in specs if spec.kind == "paged"]
    targets = []
    for row in single:
        if row["config"] in paged and row["context"] in SPEED_TARGETS and not quick:
            need = SPEED_TARGETS[row["context"]]
            targets.append({"target": f"{row['config']} tok/s at {row['context']} >= {need}x {specs[0].label}",
                            "value": round(row["speed_ratio"], 3), "met": row["speed_ratio"] >= need})  # fmt: skip
        if row["config"] in paged:
            targets.append({"target": f"{row['config']} KV bytes at {row['context']} <= ideal + 1 partial block/row/layer",
                            "value": row["kv_bytes"], "bound": row["bound_bytes"], "met": row["within_bound"]})  # fmt: skip
            targets.append(_pool_target(row, f"at {row['context']}"))
    for row in ragged:
        if row["config"] in paged and not quick:
            targets.append({"target": f"{row['config']} ragged KV bytes <= {RAGGED_BYTES_TARGET}x {specs[0].label}",
                            "value": round(row["bytes_ratio"], 3), "met": row["bytes_ratio"] <= RAGGED_BYTES_TARGET})
        if row["config"] in paged:
            targets.append({"target": f"{row['config']} ragged KV bytes <= ideal + 1 partial block/row/layer",
                            "value": row["kv_bytes"], "bound": row["bound_bytes"], "met": row["within_bound"]})  # fmt: skip
            targets.append(_pool_target(row, "ragged"))
    return targets


def _pool_target(row: dict, where: str) -> dict:
    return {"target": f"{row['config']} pool bytes {where} <= {POOL_TARGET}x KV bytes in use",
            "value": round(row["pool_ratio"], 3), "met": row["pool_ratio"] <= POOL_TARGET}  # fmt: skip


def _report(single, ragged, targets) -> None:
    print("\nbatch 1, greedy decode (median of runs):")
    common.print_table(single, [
        ("config", "cache", ""), ("context", "context", "d"), ("tokens_per_s", "tok/s", ".2f"),
        ("speed_ratio", "× first", ".3f"), ("kv_bytes", "KV bytes", ",d"), ("ideal_bytes", "ideal", ",d"),
        ("pool_bytes", "pool bytes", ",d"), ("pool_ratio", "pool × KV", ".3f"),
        ("same_tokens_as_first", "same tokens", ""),
    ])  # fmt: skip
    if ragged:
        r = ragged[0]
        print(f"\nragged batch of {r['batch']} (prompts {r['prompt_lengths'][0]}..{r['prompt_lengths'][-1]} tokens, "
              f"left-padded, +{r['new_tokens']} new, generate()):")  # fmt: skip
        common.print_table(ragged, [
            ("config", "cache", ""), ("tokens_per_s", "tok/s", ".2f"), ("speed_ratio", "× first", ".3f"),
            ("kv_bytes", "KV bytes", ",d"), ("bytes_ratio", "bytes × first", ".3f"), ("ideal_bytes", "ideal", ",d"),
            ("pool_bytes", "pool bytes", ",d"), ("pool_ratio", "pool × KV", ".3f"),
            ("same_tokens_as_first", "same tokens", ""),
        ])  # fmt: skip
    print("\ntargets:")
    for target in targets:
        bound = f" (bound {target['bound']:,})" if "bound" in target else ""
        value = f"{target['value']:,}" if isinstance(target["value"], int) else target["value"]
        print(f"  [{'met' if target['met'] else 'MISSED'}] {target['target']}: {value}{bound}")


if __name__ == "__main__":
    main()
