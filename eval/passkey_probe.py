"""A fast probe of question-agnostic eviction signals: would a policy keep the pass key before the question?

eval/eviction.py's passkey task answers the question through an evicted cache (minutes per prompt on a CPU).
This probe takes one prefill per prompt instead: it reads every layer's keys of the context from the cache,
scores them with each key-based policy's own `score()` (no attention statistics: the signals a policy has
before any question) and counts the layers, and the KV heads, whose top `--ratio` of the tokens (besides
the protected sinks and recent window) holds every digit of the pass key. A policy that keeps the digits in
few layers cannot answer; keeping them everywhere is necessary, not sufficient (the answer still has to be
read back), so confirm a signal with eval/eviction.py.

    python eval/passkey_probe.py --lengths 2048 --depths 0.1 0.5 0.9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import eviction  # noqa: E402

from hf_paged_cache import KeyDiff, KeyNorm, KeyNovelty, PagedCache  # noqa: E402
from hf_paged_cache.eviction import ScoreInputs  # noqa: E402
from hf_paged_cache.layers.paged import stored_keys  # noqa: E402

SIGNALS = {  # name: the policy whose score() is probed
    "keynorm": KeyNorm(budget=64, sinks=0, window=0),
    "keydiff": KeyDiff(budget=64, sinks=0, window=0),
    "novelty, stored keys": KeyNovelty(budget=64, sinks=0, window=0, rotary="none"),
    "novelty (rotary pairs)": KeyNovelty(budget=64, sinks=0, window=0),
}


def digit_indices(encode, prompt: dict) -> list[int]:
    """Context indices of the pass key's digits (their first occurrence, in the key sentence)."""
    context, key = prompt["context"], prompt["key"]
    sentence = encode(eviction.KEY_SENTENCE.format(key=key))
    for start in range(len(context) - len(sentence) + 1):
        if context[start : start + len(sentence)] == sentence:
            return [start + i for i, token in enumerate(sentence) if encode.decode([token]).strip().isdigit()]
    raise ValueError("the key sentence is not in the context")


def probe(model, encode, prompt: dict, args) -> dict[str, tuple[int, int, int]]:
    """Per signal: (layers keeping every digit, KV heads keeping every digit, KV heads in all)."""
    cache = PagedCache(model.config, block_size=eviction.BLOCK)
    eviction.forward(model, cache, prompt["context"])
    digits, count = digit_indices(encode, prompt), len(prompt["context"])
    keep = int(args.ratio * count)
    found = {}
    for name, policy in SIGNALS.items():
        layers = heads = total = 0
        for layer in cache.paged_layers:
            keys = stored_keys(layer, 0)
            scores = policy.score(ScoreInputs(torch.arange(count), count, None, lambda: keys)).float()
            scores[:, : args.sinks] = scores[:, count - args.window :] = float("inf")  # protected anyway
            layers += set(digits) <= set(scores.mean(0).topk(keep).indices.tolist())
            for head in scores:
                heads += set(digits) <= set(head.topk(keep).indices.tolist())
                total += 1
        found[name] = (layers, heads, total)
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), tiny-llama, or a path")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.25, help="fraction of the context kept")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, encode = common.load_model(args.model)
    common.use_attention(model, "sdpa")
    rows = []
    for prompt in eviction.passkey_prompts(encode, args):
        for name, (layers, heads, total) in probe(model, encode, prompt, args).items():
            rows.append({"length": prompt["length"], "depth": prompt["depth"], "trial": prompt["trial"],
                         "signal": name, "layers": f"{layers}/{total // model.config.num_key_value_heads}",
                         "heads": f"{heads}/{total}"})  # fmt: skip
    print(f"layers (head-mean score) and KV heads whose top {args.ratio:.0%} keep every digit of the pass key")
    common.print_table(rows, [("length", "length", "d"), ("depth", "depth", ".0%"), ("trial", "trial", "d"),
                              ("signal", "signal", ""), ("layers", "layers", ""),
                              ("heads", "KV heads", "")])  # fmt: skip
    return {"results": rows}


if __name__ == "__main__":
    main()
