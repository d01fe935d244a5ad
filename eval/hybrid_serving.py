"""Serving a hybrid model (issue 24): requests in a fixed memory and throughput, against one-by-one and padded batches.

No small trained hybrid model installs offline (the package lists hold none: the SmolLM2 wheel is a Llama), so the
model is a random-weight one built from a config with a fixed seed (say so wherever its figures are quoted):
`qwen3_next` (gated delta-net linear attention, 3 of every 4 layers, and full attention; MoE of 4 experts) or
`lfm2` (short convolutions, 3 of every 4 layers, and full attention), ~14M parameters each. Prompts are random
token ids of lengths spread evenly over [--min-len, --max-len], --new-tokens each, greedy.

- throughput: one-by-one `generate` with DynamicCache, padded batches of 8 with DynamicCache, and
  `hf_paged_cache.generate_batch` (each request's recurrent state in a slot of the state pool): generated
  tokens/s and how many outputs equal the one-by-one run's.
- memory: in --memory bytes, the requests of --capacity-len stored tokens predicted to fit (`max_sequences`:
  state + KV per token) and those that ran at once under `max_memory` (the state pool's slots served first,
  blocks in the rest), with the state and KV bytes per running request measured at the peak; against the
  bytes one DynamicCache request holds (state + KV, nothing shared, nothing reserved).

    python eval/hybrid_serving.py                                   # the default sizes (minutes on 2 cores)
    python eval/hybrid_serving.py --model lfm2 --requests 6 --min-len 20 --max-len 60 --new-tokens 4
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Lfm2Config, Qwen3NextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import serving  # noqa: E402

from hf_paged_cache import BatchGenerator  # noqa: E402
from hf_paged_cache.accounting import max_sequences  # noqa: E402

VOCAB = 4096
SHARED = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)  # fmt: skip
CONFIGS = {
    "qwen3_next": lambda: Qwen3NextConfig(**SHARED, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                                          linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=256,
                                          shared_expert_intermediate_size=256,
                                          layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2),
    "lfm2": lambda: Lfm2Config(**SHARED, block_auto_adjust_ff_dim=False,
                               layer_types=(["conv"] * 3 + ["full_attention"]) * 2),
}  # fmt: skip


def build(name: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts_for(args) -> list[list[int]]:
    rng = random.Random(0)
    lengths = [round(args.min_len + i * (args.max_len - args.min_len) / max(args.requests - 1, 1))
               for i in range(args.requests)]  # fmt: skip
    rng.shuffle(lengths)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def throughput(model, args) -> list[dict]:
    prompts = prompts_for(args)
    reference, base = serving.timed("one-by-one DynamicCache", serving.one_by_one, model, prompts, args.new_tokens)
    rows = [base]
    for label, function, options in (
        ("padded batches of 8, DynamicCache", serving.padded_batches, {}),
        ("hf_paged_cache.generate_batch", serving.ours, {"block_size": 16, "max_batch_tokens": args.max_batch_tokens,
                                                         "max_num_seqs": args.max_num_seqs}),
    ):  # fmt: skip
        outputs, row = serving.timed(label, function, model, prompts, args.new_tokens, **options)
        row["identical_to_one_by_one"] = sum(a == b for a, b in zip(outputs, reference))
        row["vs_one_by_one"] = row["tokens_per_s"] / base["tokens_per_s"]
        rows.append(row)
    return rows


def memory(model, args) -> list[dict]:
    """Requests of --capacity-len tokens (prompt + new) in --memory bytes: predicted, and run under `max_memory`."""
    new = args.new_tokens
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.capacity_len - new)] for _ in range(args.capacity_requests)]
    predicted = max_sequences(model.config, args.capacity_len, args.memory, 16, model.dtype)
    generator = BatchGenerator(model, max_new_tokens=new, do_sample=False, eos_token_id=None, block_size=16,
                               max_memory=args.memory, max_num_seqs=max(predicted, 1), prefix_caching=False,
                               max_batch_tokens=args.max_batch_tokens)  # fmt: skip
    for prompt in prompts:
        generator.add_request(prompt)
    start = time.perf_counter()
    outputs = generator.run()
    seconds = time.perf_counter() - start
    peak = max(generator.history, key=lambda m: (m.running, m.step))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts[0] + [3] * new]), cache=cache, use_cache=True)
    dynamic = sum(dynamic_bytes(layer) for layer in cache.layers)
    row = {"system": "hf_paged_cache.generate_batch under max_memory", "memory": args.memory,
           "predicted_requests": predicted, "peak_running": peak.running, "state_slots": peak.state_slots,
           "state_pool_bytes": peak.state_pool_bytes, "blocks_total": peak.blocks_total,
           "kv_bytes_per_request": peak.kv_bytes / peak.running,
           "state_bytes_per_request": peak.state_bytes / peak.running,
           "dynamic_cache_bytes_per_request": dynamic, "preempted": dict(peak.preempted),
           "tokens_per_s": sum(len(o.generated_tokens) for o in outputs) / seconds}  # fmt: skip
    print(row, flush=True)
    return [row]


def dynamic_bytes(layer) -> int:
    """Bytes a DynamicCache layer holds: K/V and any recurrent / conv state."""
    tensors = [getattr(layer, name, None) for name in ("keys", "values")]
    tensors += [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3_next", choices=CONFIGS)
    parser.add_argument("--workloads", nargs="+", default=["throughput", "memory"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--memory", default="8MiB", help="the memory budget of the memory workload")
    parser.add_argument("--capacity-requests", type=int, default=24)
    parser.add_argument("--capacity-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="eval/results/hybrid_serving")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build(args.model)
    parameters = sum(p.numel() for p in model.parameters())
    results = {"model": f"{args.model} (random weights, seed 0)", "parameters": parameters, "args": vars(args)}
    for workload in args.workloads:
        results[workload] = {"throughput": throughput, "memory": memory}[workload](model, args)
    common.write_json(f"{args.out}.json", results)
    return results


if __name__ == "__main__":
    main()
