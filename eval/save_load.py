"""Saving and loading a long context: file size next to the cache's bytes in use, save and load time.

For each `--caches` spec (a `PagedCache` option set, see `common.py`): prefill `--context` tokens of the
text, `cache.save()` into a temporary folder and `PagedCache.load()` it back, `--repeats` times each
(median seconds). The file is then checked: the original and the loaded cache continue with
`--check-tokens` greedy tokens, which must be the same tokens with bit-identical logits.

"bytes in use" is `metrics().kv_bytes`: the blocks in use (quantized ones as codes, scales and zero points)
plus their tables; the file holds those blocks, the tables and a JSON header. Loading reads a file the
save just wrote, so it comes from the OS page cache: the time is that of reading memory, checking the
SHA-256 and filling a fresh pool, not of a disk.

    python eval/save_load.py                                        # SmolLM2-135M, 4,000 tokens: fp32, fp16, int4
    python eval/save_load.py --model tiny-llama --context 300 --repeats 1 --check-tokens 4   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache import PagedCache  # noqa: E402

DEFAULT_CACHES = ["paged", "paged:dtype=fp16", "paged:quant=int4"]


def prefill(model, ids: torch.Tensor, cache, chunk: int = 2048) -> torch.Tensor:
    """Feed `ids` `[1, n]` in chunks, the last token as a step of its own (so a quantized cache has sealed
    every block older than its residual window, as while decoding); the logits of the last position."""
    with torch.inference_mode():
        for first in range(0, ids.shape[1] - 1, chunk):
            model(input_ids=ids[:, first : min(first + chunk, ids.shape[1] - 1)], cache=cache, logits_to_keep=1)
        return model(input_ids=ids[:, -1:], cache=cache).logits


def continuation(model, cache, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Logits of `steps` greedy steps from the last `logits`."""
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache).logits
            out.append(logits)
    return out


def timed(function, repeats: int) -> tuple[float, object]:
    """(median seconds, the last result) of `repeats` calls."""
    seconds, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def measure(model, spec: common.CacheSpec, ids: torch.Tensor, folder: Path, args) -> dict:
    cache = common.make_cache(spec, model)
    logits = prefill(model, ids, cache)
    path = folder / "cache.safetensors"
    save_seconds, _ = timed(lambda: cache.save(path), args.repeats)
    load_seconds, loaded = timed(lambda: PagedCache.load(path, model.config), args.repeats)
    metrics, size = cache.metrics(), path.stat().st_size
    row = {
        "cache": spec.label,
        "tokens": cache.get_seq_length(),
        "kv_bytes": metrics.kv_bytes,
        "pool_bytes": metrics.pool_bytes,
        "loaded_pool_bytes": loaded.metrics().pool_bytes,
        "file_bytes": size,
        "file_vs_kv": size / metrics.kv_bytes,
        "save_s": save_seconds,
        "load_s": load_seconds,
        "save_mb_s": size / save_seconds / 1e6,
        "load_mb_s": size / load_seconds / 1e6,
    }
    expected = continuation(model, cache, logits, args.check_tokens)
    got = continuation(model, loaded, logits, args.check_tokens)
    return {**row, "same_logits": all(torch.equal(a, b) for a, b in zip(expected, got))}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny-llama, or a local path / hub id")
    parser.add_argument("--caches", nargs="+", default=DEFAULT_CACHES, help="PagedCache specs (see eval/README.md)")
    parser.add_argument("--context", type=int, default=4000, help="tokens prefilled and saved")
    parser.add_argument("--repeats", type=int, default=3, help="saves and loads timed per cache (median)")
    parser.add_argument("--check-tokens", type=int, default=8, help="greedy tokens the loaded cache must match")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="eval/results/save_load", help="writes <out>.json and <out>.csv")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    specs = [common.parse_cache_spec(text) for text in args.caches]
    if any(spec.kind != "paged" for spec in specs):
        raise SystemExit("save / load is a PagedCache feature: give `paged` specs only")
    model, encode = common.load_model(args.model)
    text, source = common.text_from_args(args)
    ids = torch.tensor([encode(text)[: args.context]])
    if ids.shape[1] < args.context:
        raise SystemExit(f"the text has only {ids.shape[1]} tokens; lower --context")
    print(f"{args.model}, {ids.shape[1]} tokens of {source}, {args.threads} threads, median of {args.repeats}")
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(model, spec, ids, Path(folder), args) for spec in specs]
    common.print_table(rows, [
        ("cache", "cache", "s"), ("kv_bytes", "bytes in use", ",d"), ("pool_bytes", "pool bytes", ",d"),
        ("loaded_pool_bytes", "loaded pool bytes", ",d"), ("file_bytes", "file bytes", ",d"),
        ("file_vs_kv", "file / in use", ".4f"), ("save_s", "save s", ".3f"), ("load_s", "load s", ".3f"),
        ("save_mb_s", "save MB/s", ".0f"), ("load_mb_s", "load MB/s", ".0f"), ("same_logits", "same logits", "")
    ])  # fmt: skip
    common.write_json(f"{args.out}.json", {"args": vars(args), "source": source, "environment": common.environment(),
                                           "rows": rows})  # fmt: skip
    common.write_csv(f"{args.out}.csv", rows)
    if not all(row["same_logits"] for row in rows):
        raise SystemExit("a loaded cache did not continue exactly like the saved one")
    return rows


if __name__ == "__main__":
    main()
