"""A fast probe of KV formats: one forward over a text, every full block of keys / values quantized and decoded.

eval/perplexity.py measures a format as the cache applies it (a full-precision residual window, one forward
per scored token), which takes minutes per format. This probe takes seconds: each attention layer's K/V of
the whole sequence is cut into blocks of `block_size` tokens, every full block goes through the format's own
`quantize` / `dequantize`, and perplexity is taken over the sequence in one forward. Without a residual
window it overstates the damage (int2 at block 64: +145% here, +16.7% in eval/perplexity.py), so use it to
rank formats and transforms, not to judge a target. Two transforms can be tried around a format: `rot` (the
Hadamard rotation of the head dimension before quantizing, undone after: what `IntN(rotate=True)` ships)
and `clip` (per scale group, the range shrunk by the ratio of `CLIP_RATIOS` with the least squared error;
not shipped).

    python eval/quant_probe.py --tokens 1024 --probes "K2c4" "K2c1" "V2t64" "V2t64+rot" "K2c1s8,V2t64"

A probe is `SIDE,SIDE` with SIDE = `K|V` + bits + `c<channels>` (per channel group over a block) or
`t<channels>` (per token), `s8` for 8-bit scales, `+rot`, `+clip`, `@<block size>` at the end (default 16);
a side not named stays full precision.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hf_paged_cache.quantization import IntN, hadamard  # noqa: E402

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
SIDE = re.compile(r"([KV])([24])([ct])(\d+)(s8)?((?:\+rot|\+clip)*)")


def roundtrip(fmt: IntN, blocks: torch.Tensor) -> torch.Tensor:
    """`blocks [n, block, heads, dim]` through the format's own quantize / dequantize."""
    pool = fmt.allocate(blocks.shape[0], *blocks.shape[1:])
    fmt.quantize(blocks, pool, range(blocks.shape[0]))
    return fmt.dequantize(pool, range(blocks.shape[0]))


def clipped_roundtrip(fmt: IntN, blocks: torch.Tensor) -> torch.Tensor:
    """Per scale group, the round trip of the group clamped to its range shrunk by each of CLIP_RATIOS
    (around its midpoint), keeping the one with the least squared error against the unclamped group."""
    n, block, heads, dim = blocks.shape
    group = fmt.group(dim, block)
    dims = (-1,) if fmt.axis == "token" else (1, -1)
    grouped = blocks.unflatten(-1, (-1, group))
    low, high = grouped.amin(dims, keepdim=True), grouped.amax(dims, keepdim=True)
    best = best_error = None
    for ratio in CLIP_RATIOS:
        mid, half = (low + high) / 2, (high - low) / 2 * ratio
        clamped = grouped.clamp(mid - half, mid + half).flatten(-2)
        decoded = roundtrip(fmt, clamped).unflatten(-1, (-1, group))
        error = (decoded - grouped).square().sum(dims, keepdim=True)
        if best is None:
            best, best_error = decoded, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, decoded, best), torch.where(better, error, best_error)
    return best.flatten(-2)


def parse_probe(text: str) -> tuple[dict, int]:
    """{"K" / "V": (format, rotate, clip)} and the block size of a probe spec (see the module docstring)."""
    body, _, block = text.partition("@")
    sides = {}
    for part in filter(None, body.split(",")):
        match = SIDE.fullmatch(part)
        if match is None:
            raise ValueError(f"bad probe side {part!r}: e.g. K2c1s8, V2t64+rot, K4c4+clip")
        side, bits, axis, channels, scale8, extras = match.groups()
        fmt = IntN(int(bits), "channel" if axis == "c" else "token", int(channels), 8 if scale8 else 16)
        sides[side] = (fmt, "+rot" in extras, "+clip" in extras)
    return sides, int(block or 16)


class Probe:
    """The attention function "quant_probe": SDPA over K/V whose full blocks went through a probe's formats."""

    def __init__(self):
        self.sides, self.block_size = {}, 16

    def transform(self, x: torch.Tensor, side: str) -> torch.Tensor:
        if side not in self.sides:
            return x
        fmt, rotate, clip = self.sides[side]
        batch, heads, length, dim = x.shape
        full = length // self.block_size * self.block_size
        blocks = x[:, :, :full].float().transpose(1, 2).reshape(-1, self.block_size, heads, dim)
        blocks = hadamard(blocks) if rotate else blocks
        decoded = (clipped_roundtrip if clip else roundtrip)(fmt, blocks)
        decoded = hadamard(decoded) if rotate else decoded
        decoded = decoded.reshape(batch, full, heads, dim).transpose(1, 2).to(x.dtype)
        return torch.cat([decoded, x[:, :, full:]], 2)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        key, value = self.transform(key, "K"), self.transform(value, "V")
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", nargs="+", required=True, metavar="SPEC", help="see the module docstring")
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny-llama | a local path or hub id")
    parser.add_argument("--tokens", type=int, default=1024, help="length of the scored sequence")
    parser.add_argument("--offset", type=int, default=50000, help="first token of the text")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    common.add_text_arguments(parser)
    args = parser.parse_args(argv)
    probes = [(text, *parse_probe(text)) for text in args.probes]  # fail on a bad spec before loading
    if args.threads:
        torch.set_num_threads(args.threads)
    probe = Probe()
    AttentionInterface.register("quant_probe", probe)
    AttentionMaskInterface.register("quant_probe", sdpa_mask)
    text, _ = common.text_from_args(args)
    model, encode = common.load_model(args.model, torch.float32)
    model.set_attn_implementation("quant_probe")
    ids = torch.tensor(encode(text)[args.offset : args.offset + args.tokens])[None]

    def perplexity() -> float:
        with torch.inference_mode():
            return math.exp(model(input_ids=ids, labels=ids).loss.item())

    base = perplexity()
    print(f"{'full precision':40s} ppl {base:9.3f}", flush=True)
    rows = []
    for text, sides, block_size in probes:
        probe.sides, probe.block_size = sides, block_size
        ppl = perplexity()
        rows.append({"probe": text, "perplexity": ppl, "delta_pct": 100 * (ppl / base - 1)})
        print(f"{text:40s} ppl {ppl:9.3f}  {rows[-1]['delta_pct']:+8.2f}%", flush=True)
    return rows


if __name__ == "__main__":
    main()
