"""How many concurrent N-token sequences fit in X bytes of KV blocks, for a model and a storage format.

    python -m hf_paged_cache.capacity --memory 2GiB --tokens 1000 4000 16000 --quant int4
    python -m hf_paged_cache.capacity --model path/to/hf/folder --memory 24GB --tokens 8192 --dtype bfloat16

Answered from `estimate_kv_bytes` (exact for a `PagedCache`: whole blocks, sliding windows, quantized blocks
with their scales; a hybrid model's recurrent / conv state per sequence, measured on the meta device), so no
model weights are loaded. Bytes grow linearly with the length and count only the KV heads; the seeds' capacity
formula (quadratic in the length, query heads counted on top) overstated it.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig

from .accounting import estimate_kv_bytes, max_sequences
from .sequence_state import sequence_state

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (the PyPI wheel's) or a local HF folder / hub id")
    parser.add_argument("--memory", required=True, help="bytes of KV blocks, e.g. 2GiB or 512MB")
    parser.add_argument("--tokens", type=int, nargs="+", required=True, help="stored tokens per sequence")
    parser.add_argument("--dtype", default="float16", choices=DTYPES)
    parser.add_argument("--quant", help="a quantization format (int8, int4, int2, fp8, K4V2, ...)")
    parser.add_argument("--residual-length", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--served", action="store_true",
                        help="as generate_batch holds them with prefix caching: a hybrid model's sequence also counts "
                             "one state checkpoint (the default checkpoint_memory)")
    args = parser.parse_args(argv)
    if args.model == "smollm2":
        from .smollm2 import model_dir

        config = AutoConfig.from_pretrained(model_dir())
    else:
        config = AutoConfig.from_pretrained(args.model)
    options = {"quant": args.quant, "residual_length": args.residual_length}
    rows = []
    for tokens in args.tokens:
        per_sequence = estimate_kv_bytes(config, 1, tokens, args.block_size, DTYPES[args.dtype], **options)
        fits = max_sequences(config, tokens, args.memory, args.block_size, DTYPES[args.dtype], args.served, **options)
        state = sequence_state(config, DTYPES[args.dtype]).bytes_at(tokens)
        rows.append({"tokens": tokens, "bytes_per_sequence": per_sequence, "state_bytes_per_sequence": state,
                     "sequences": fits})  # fmt: skip
        held = f" ({state:,} B of it recurrent state)" if state else ""
        print(f"{tokens:>8,} tokens: {per_sequence:>14,} B per sequence{held} -> {fits:,} sequences in "
              f"{args.memory} ({args.quant or args.dtype}, blocks of {args.block_size})")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
