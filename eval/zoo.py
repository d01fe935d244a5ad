"""The model zoo: every causal-LM model type of the installed transformers, tiny and random, against DynamicCache.

For each model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` a tiny random config is built automatically (hidden size,
layers, heads, vocabulary, experts shrunk; the layer-type pattern kept so hybrids still have one layer of each kind;
`OVERRIDES` holds the few values a config needs by hand). Each (read path, mode) cell is run with a `PagedCache` and
with `DynamicCache` (the reference) and ends as one of:

    exact       same tokens, logits within 1e-4 (relative to the largest logit, when above 1)
    n/a         the model ignores attn_implementation, so it has no "paged" read path (it runs the gather path)
    refused     the cache refused the model with a clear error (message recorded)
    differs     SILENT difference: other tokens or logits, no error -- a defect
    ref-fails   DynamicCache itself cannot run this mode (its error is recorded)
    error       our cache raised something that is not a clean refusal -- a defect
    timeout     the model's time limit ran out

Read paths: "gather" (the model's own attention, "sdpa" or "eager", on K/V gathered from the blocks) and "paged"
(`attn_implementation="paged"`). Modes: greedy over a left-padded batch, beam search (2 beams), seeded sampling,
chunked prefill (`prefill_chunk_size`), and `generate_batch` against each prompt generated alone with DynamicCache.

    python eval/zoo.py                                   # the whole sweep (tens of minutes on 2 cores)
    python eval/zoo.py --models llama,gemma2 --modes greedy,beam
    python eval/zoo.py --fast --write docs/MODELS.md     # one mode (greedy, both paths) per model
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import transformers  # noqa: E402
from transformers import CONFIG_MAPPING, DynamicCache  # noqa: E402
from transformers.cache_utils import get_layer_types_and_kwargs  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

import hf_paged_cache  # noqa: E402
from hf_paged_cache import PagedCache, UnsupportedAttentionError, generate_batch  # noqa: E402
from hf_paged_cache.attention.contract import REMEDY  # noqa: E402
from hf_paged_cache.layer_types.registry import is_known, layer_type_for  # noqa: E402

VOCAB, PAD_ID, BOS_ID, EOS_ID = 128, 0, 1, 2
ATOL = 1e-4
# Block sizes every PagedCache cell runs with, against the windows and chunks of 8 (`OPTIONAL_SIZES`): one that divides
# them, one that does not (a block straddles a window's or chunk's start), one larger than them.
BLOCK_SIZES = (4, 3, 16)
NEW_TOKENS = 6
PROMPT_LEN = 8
PADS = (0, 3)  # left padding of the rows of the batch
BATCH_PROMPTS = (5, 9, 3)  # prompt lengths given to generate_batch
PATHS = ("gather", "paged")
MODES = ("greedy", "beam", "sample", "chunked", "batch")  # "batch" has one path: the generator's "paged" attention
FAST_MODES = ("greedy",)
PACKAGE_DIR = str(Path(hf_paged_cache.__file__).resolve().parent)

# The tiny sizes, applied to every config field of that name the model type has (never above the default).
SIZES: dict[str, object] = dict(
    hidden_size=64, n_embd=64, d_model=64, emb_dim=64, num_attention_heads=4, n_head=4, n_heads=4, num_heads=4,
    num_key_value_heads=2, head_dim=16, rotary_dim=8, intermediate_size=128, n_inner=128, ffn_dim=128,
    ffn_hidden_size=128, vocab_size=VOCAB, max_position_embeddings=256, n_positions=256, max_seq_len=256,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_group=1, topk_group=1, num_expert_group=1,
    first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_heads=4, linear_head_dim=16, state_size=16, time_step_rank=8, mamba_dt_rank=8,
)  # fmt: skip
# Values set exactly, whatever the default.
FIXED: dict[str, object] = dict(initializer_range=0.1, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                tie_word_embeddings=False)  # fmt: skip
# Sizes set only where the default is not None (None switches the feature off).
OPTIONAL_SIZES: dict[str, object] = dict(sliding_window=8, attention_chunk_size=8, q_lora_rank=32)
LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Per-model values the automatic shrinking cannot guess (kept in this one table).
OVERRIDES: dict[str, dict] = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  use_mamba_kernels=False),
    "dots1": dict(n_shared_experts=1),
    # Defaults that cannot build a model: rope settings per layer type, and dbrx's sub-configs (clip_qkv=None breaks).
    "cohere_compass_text": dict(rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for kind in ("full_attention", "sliding_attention")}),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"hidden_size": 64, "ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 1}),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=8),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # its default layer_types are all attention
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # its default layer_types is None
    "mamba2": dict(num_heads=8, n_groups=1),  # num_heads * head_dim must be expand * hidden_size
    "gemma3n_text": dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                         num_kv_shared_layers=2, intermediate_size=[128] * 4, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=VOCAB, laurel_rank=4, altup_num_inputs=2,
                         activation_sparsity_pattern=[0.0] * 4),
}  # fmt: skip
# Model types this sweep does not drive, with the reason.
UNSWEPT: dict[str, str] = {
    "xlm": "not a text decoder: a masked-LM encoder (`causal=False`)",
    "reformer": "LSH / local chunked attention with a cache of its own format (buckets), not a KV cache of past tokens",
    "xmod": "a language-adapter encoder: needs `set_default_language()` before any forward",
}


@dataclass
class Cell:
    status: str  # exact | n/a | refused | differs | ref-fails | error | timeout
    detail: str = ""


@dataclass
class ModelResult:
    model_type: str
    model_class: str = ""
    gather_impl: str = ""
    skipped: str = ""  # why the model type is not swept (not a text decoder, no tiny config)
    cells: dict[str, Cell] = field(default_factory=dict)  # "path/mode" -> Cell
    seconds: float = 0.0


class ZooTimeout(Exception):
    pass


# ---------------------------------------------------------------------------------------------- tiny configs
def _smaller(size, default):
    """A tiny size never grows a field (a model with 1 expert per token or 1 KV head keeps it)."""
    if isinstance(default, int) and not isinstance(default, bool) and isinstance(size, int) and 0 < default < size:
        return default
    return size


def _pattern_length(values) -> int:
    """The shortest prefix (at least 2) that holds one of each distinct value of a per-layer pattern."""
    first = {}
    for index, value in enumerate(values):
        first.setdefault(value, index)
    return max(2, max(first.values(), default=0) + 1)


def tiny_config(model_type: str):
    """A small random-weight config of `model_type`: `SIZES` where the config has the field, per-layer patterns
    (`layer_types`, `layers_block_type`, `hybrid_override_pattern`, ...) cut to their shortest prefix holding one
    layer of each type, then `OVERRIDES`."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    kwargs = {key: _smaller(value, defaults[key]) for key, value in SIZES.items() if key in defaults}
    kwargs.update({key: value for key, value in FIXED.items() if key in defaults})
    kwargs.update({key: value for key, value in OPTIONAL_SIZES.items() if defaults.get(key) is not None})
    if "kv_lora_rank" in kwargs:  # latent attention: keys expand to every head; head_dim is the rotary part
        kwargs.update(num_key_value_heads=kwargs.get("num_attention_heads", 4))
        if "head_dim" in kwargs:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    if {"is_decoder", "add_cross_attention"} <= defaults.keys():  # an encoder family: causal only as a decoder
        kwargs["is_decoder"] = True
    depth_field = next((name for name in LAYER_COUNT_FIELDS if isinstance(defaults.get(name), int)), None)
    depth = defaults.get(depth_field) if depth_field else None
    per_layer = {key: value for key, value in defaults.items()
                 if depth and isinstance(value, (list, str)) and len(value) == depth and key != "model_type"}
    patterns = [value for value in per_layer.values() if all(isinstance(item, str) for item in value)]
    # Shorter string lists are cyclic layer patterns (recurrent_gemma's block_types): keep one full cycle.
    patterns += [value for key, value in defaults.items()
                 if depth and key.endswith("types") and isinstance(value, list) and 1 < len(value) < depth
                 and all(isinstance(item, str) for item in value)]
    layers = max([2] + [_pattern_length(value) for value in patterns])
    if depth_field:
        kwargs[depth_field] = layers
    for key, value in per_layer.items():
        if key in SIZES and isinstance(value, list):  # a per-layer size, e.g. intermediate_size
            kwargs[key] = [SIZES[key]] * layers
        else:
            kwargs[key] = value[:layers]
    kwargs.update(OVERRIDES.get(model_type, {}))
    return config_class(**kwargs)


def stores_blocks(model_type: str) -> bool:
    """Whether some layer of `model_type`'s tiny config (which keeps every layer kind of its default config, `build`)
    is one the paged store holds in blocks."""
    kinds = layer_kinds(tiny_config(model_type))
    return not kinds or any(is_known(kind) and layer_type_for(kind).stored for kind in kinds)


def layer_kinds(config) -> set[str]:
    try:
        return set(get_layer_types_and_kwargs(config)[0])
    except Exception:  # noqa: BLE001  (configs that predate per-layer types)
        return set()


def build(model_type: str):
    """(model, gather attention implementation) for a tiny random `model_type`; `ValueError` if it is not a text
    decoder."""
    if model_type in UNSWEPT:
        raise ValueError(UNSWEPT[model_type])
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    base = CONFIG_MAPPING[model_type]()
    if getattr(base, "is_encoder_decoder", False):
        raise ValueError("not a text decoder: an encoder-decoder family (its causal LM is the decoder half)")
    parts = ("vision", "audio", "vq", "patcher", "encoder", "decoder", "text")
    modalities = [name for name in (getattr(base, "sub_configs", None) or {}) if any(part in name for part in parts)]
    if modalities:
        text = getattr(model_class, "config_class", None)
        own = getattr(text, "model_type", model_type)
        swept = own != model_type and own in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        also = f"; its text model is swept as `{own}`" if swept else ""
        raise ValueError(f"not a text decoder: a composite model ({', '.join(modalities)}){also}")
    config = tiny_config(model_type)
    lost = layer_kinds(CONFIG_MAPPING[model_type]()) - layer_kinds(config)
    if lost:
        raise ValueError(f"the tiny config lost layer types {sorted(lost)}: add an entry to OVERRIDES")
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.generation_config.eos_token_id = None  # every row runs to max_new_tokens
    model.generation_config.pad_token_id = PAD_ID
    try:
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError):
        model.set_attn_implementation("eager")
    gather_impl = model.config._attn_implementation  # a model without the attention interface keeps its own
    ids = torch.arange(3, 3 + PROMPT_LEN)[None]
    try:  # a forward without any cache: if this fails the tiny config is wrong, not a cache
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the tiny model cannot run a forward without a cache ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]}): add an entry to OVERRIDES") from exc
    return model, gather_impl


# ---------------------------------------------------------------------------------------------- the modes
def padded_batch(pads=PADS, length: int = PROMPT_LEN, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (len(pads), length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate(pads):
        input_ids[row, :pad] = PAD_ID
        attention_mask[row, :pad] = 0
    return input_ids, attention_mask


MODE_OPTIONS = {
    "greedy": dict(do_sample=False),
    "beam": dict(do_sample=False, num_beams=2, num_return_sequences=2),
    "sample": dict(do_sample=True, seed=1234),
    "chunked": dict(do_sample=False, prefill_chunk_size=3),
}


def run_mode(model, attn_impl: str, make_cache, mode: str, block_size: int = BLOCK_SIZES[0]):
    """One generation of `mode`; `make_cache()` gives the cache (a fresh one for each generate call; None for
    `generate_batch` in blocks of `block_size`)."""
    model.set_attn_implementation(attn_impl)
    if mode == "batch":
        return batch_reference(model, make_cache) if make_cache is not None else run_batch(model, block_size)
    options = dict(MODE_OPTIONS[mode])
    seed = options.pop("seed", None)
    input_ids, attention_mask = padded_batch(seed=MODES.index(mode))
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=make_cache(),
                              max_new_tokens=NEW_TOKENS, pad_token_id=PAD_ID, return_dict_in_generate=True,
                              output_logits=True, **options)  # fmt: skip


def batch_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in BATCH_PROMPTS]


def batch_reference(model, make_cache) -> list[list[int]]:
    """Each prompt generated alone (greedy) with `make_cache()`."""
    outputs = []
    for prompt in batch_prompts():
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=make_cache(), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, pad_token_id=PAD_ID)  # fmt: skip
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def run_batch(model, block_size: int) -> list[list[int]]:
    outputs = generate_batch(model, batch_prompts(), max_new_tokens=NEW_TOKENS, do_sample=False,
                             block_size=block_size, max_batch_tokens=8)  # fmt: skip
    errors = [output.error for output in outputs if output.error]
    if errors:
        raise RuntimeError(f"generate_batch finished a request with an error: {errors[0]}")
    return [output.generated_tokens for output in outputs]


def compare(expected, actual) -> str | None:
    """None when `actual` reproduces `expected` (tokens equal, logits and beam scores within `ATOL`), else what
    differs first."""
    if isinstance(expected, list):
        for index, (want, got) in enumerate(zip(expected, actual)):
            if want != got:
                return f"prompt {index}: tokens {got} instead of {want}"
        return None
    if expected.sequences.shape != actual.sequences.shape or not torch.equal(expected.sequences, actual.sequences):
        if expected.sequences.shape != actual.sequences.shape:
            return f"sequences of shape {tuple(actual.sequences.shape)} instead of {tuple(expected.sequences.shape)}"
        row, position = (expected.sequences != actual.sequences).nonzero()[0].tolist()
        return f"tokens differ first at row {row}, position {position}"
    for step, (want, got) in enumerate(zip(expected.logits, actual.logits)):
        gap, scale = (want - got).abs().max().item(), want.abs().max().item()
        if not gap <= ATOL * max(1.0, scale):  # fp32 rounding of other summation orders grows with the logits
            return f"logits of step {step} differ by {gap:.2e} (largest logit {scale:.1f})"
    scores = getattr(expected, "sequences_scores", None)
    if scores is not None and not torch.allclose(actual.sequences_scores, scores, rtol=0, atol=ATOL):
        return "beam scores differ"
    return None


def _where(exc: BaseException) -> tuple[bool, str]:
    """Whether the exception was raised in this package, and where (the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [frame for frame in frames if frame.filename.startswith(PACKAGE_DIR)]
    last = frames[-1] if frames else None
    inner_is_ours = bool(last and last.filename.startswith(PACKAGE_DIR))
    frame = ours[-1] if ours else last
    return inner_is_ours, f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"


def classify_failure(exc: BaseException) -> Cell:
    """refused: `UnsupportedAttentionError`, or an exception our package raised itself (a `raise` in
    hf_paged_cache: its refusals, such as the batch generator's of models that pass no attention kwargs); anything
    else our run raised while the reference ran (from transformers or torch, on our cache) is an error."""
    message = " ".join(str(exc).split())
    ours, where = _where(exc)
    deliberate = ours and isinstance(exc, (ValueError, NotImplementedError, RuntimeError))
    if isinstance(exc, UnsupportedAttentionError) or deliberate:
        return Cell("refused", message)
    return Cell("error", f"{type(exc).__name__} at {where}: {message[:300]}")


def _honours_paged(model) -> bool:
    previous = model.config._attn_implementation
    model.set_attn_implementation("paged")
    honoured = model.config._attn_implementation == "paged"
    model.set_attn_implementation(previous)
    return honoured


def sweep_model(model_type: str, modes, time_limit: float) -> ModelResult:
    result = ModelResult(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    start = time.perf_counter()

    def on_alarm(signum, frame):
        raise ZooTimeout(f"over the {time_limit:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    cells = [(path, mode) for mode in modes for path in (("paged",) if mode == "batch" else PATHS)]
    try:
        try:
            model, result.gather_impl = build(model_type)
        except ZooTimeout:
            raise
        except Exception as exc:  # noqa: BLE001  (any config / model construction failure is recorded)
            result.skipped = " ".join(str(exc).split())[:300] if isinstance(exc, ValueError) else (
                f"the tiny model could not be built: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            return result
        references = {}
        for path, mode in cells:
            key = f"{path}/{mode}"
            if mode not in references:
                try:
                    dynamic = lambda: DynamicCache(config=model.config)  # noqa: E731
                    references[mode] = ("ok", run_mode(model, result.gather_impl, dynamic, mode))
                except ZooTimeout:
                    raise
                except Exception as exc:  # noqa: BLE001
                    references[mode] = ("fail", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            state, expected = references[mode]
            if state == "fail":
                result.cells[key] = Cell("ref-fails", expected)
                continue
            impl = result.gather_impl if path == "gather" else "paged"
            if impl == "paged" and mode != "batch" and not _honours_paged(model):
                result.cells[key] = Cell("n/a", f"the model ignores attn_implementation (its attention is its own, "
                                         f"{result.gather_impl}): a PagedCache serves it through the gather path")
                continue
            result.cells[key] = run_cell(model, impl, mode, expected)
    except ZooTimeout as exc:
        for path, mode in cells:
            result.cells.setdefault(f"{path}/{mode}", Cell("timeout", str(exc)))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        result.seconds = time.perf_counter() - start
    return result


def run_cell(model, impl: str, mode: str, expected) -> Cell:
    """A PagedCache cell at every block size of `BLOCK_SIZES`: exact only if every one is; a difference or raw error
    names the block size it came at."""
    for block_size in BLOCK_SIZES:
        paged = (lambda: PagedCache(model.config, block_size=block_size)) if mode != "batch" else None  # noqa: B023
        try:
            difference = compare(expected, run_mode(model, impl, paged, mode, block_size))
        except ZooTimeout:
            raise
        except Exception as exc:  # noqa: BLE001
            cell = classify_failure(exc)
            if cell.status == "error":
                cell.detail = f"block_size {block_size}: {cell.detail}"
            return cell
        if difference:
            return Cell("differs", f"block_size {block_size}: {difference}")
    return Cell("exact")


def model_types(selected: str | None) -> list[str]:
    names = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not selected:
        return names
    wanted = [name.strip() for name in selected.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        raise SystemExit(f"--models: unknown model types {unknown} (see MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)")
    return wanted


# ---------------------------------------------------------------------------------------------- the report
SYMBOLS = {"exact": "✓", "n/a": "n/a", "refused": "refused", "ref-fails": "ref-fails", "differs": "**✗ differs**",
           "error": "**✗ error**", "timeout": "timeout"}  # fmt: skip
DEFECTS = ("differs", "error")
OUTCOMES = {
    "exact": "every cell exact (n/a where the model has no paged read path)",
    "refused": "every cell exact or refused with a reason (most: the paged read path or the batch generator)",
    "ref-fails": "DynamicCache itself cannot run it: nothing to compare",
    "defect": "at least one silent difference or raw error",
    "timeout": "over the time limit",
    "skipped": "not swept: not a text decoder, or no tiny config (reason below)",
}


def outcome(result: ModelResult) -> str:
    """One word for a model: skipped, defect, timeout, ref-fails (nothing could be compared), refused (some cells
    refused, the rest exact) or exact."""
    statuses = {cell.status for cell in result.cells.values()}
    if result.skipped:
        return "skipped"
    for status in ("differs", "error", "timeout"):
        if status in statuses:
            return "defect" if status in DEFECTS else status
    if statuses <= {"ref-fails"}:
        return "ref-fails"
    return "refused" if "refused" in statuses else "exact"


def markdown(results: list[ModelResult], modes, command: str) -> str:
    columns = [f"{path}/{mode}" for mode in modes for path in (("paged",) if mode == "batch" else PATHS)]
    counts: dict[str, int] = {}
    for result in results:
        counts[outcome(result)] = counts.get(outcome(result), 0) + 1
    cell_counts: dict[str, int] = {}
    for result in results:
        for cell in result.cells.values():
            cell_counts[cell.status] = cell_counts.get(cell.status, 0) + 1
    swept = [r for r in results if not r.skipped]
    lines = [
        "| outcome | model types | meaning |", "|---|---|---|",
        *(f"| {name} | {counts[name]} | {OUTCOMES[name]} |" for name in OUTCOMES if name in counts),
        "", "Cells (model × read path × mode): " + ", ".join(f"{n} {s}" for s, n in sorted(cell_counts.items()))
        + ".",
        "", "## The matrix", "",
        "✓ exact · refused: a clear error before anything changed (reason below) · ref-fails: DynamicCache itself "
        "cannot run it · n/a: the model ignores `attn_implementation` (its own attention code), so there is no "
        "\"paged\" read path; a PagedCache serves it through the gather path · **✗**: a silent difference or a raw "
        "error (a defect).", "",
        "| model type | class | gather attn | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]  # fmt: skip
    for result in swept:
        row = [SYMBOLS[result.cells[c].status] if c in result.cells else "–" for c in columns]
        lines.append(f"| {result.model_type} | {result.model_class} | {result.gather_impl} | " + " | ".join(row) + " |")
    reasons: dict[tuple[str, str], dict[str, list[str]]] = {}
    for result in swept:
        for column, cell in result.cells.items():
            if cell.status != "exact":
                detail = cell.detail.replace(REMEDY, "").strip()  # said once, below
                reasons.setdefault((cell.status, detail), {}).setdefault(result.model_type, []).append(column)
    for status, title in (("differs", "Silent differences (defects)"), ("error", "Raw errors (defects)"),
                          ("refused", "Refusals"), ("n/a", "No paged read path"),
                          ("ref-fails", "Where DynamicCache itself fails"), ("timeout", "Timeouts")):  # fmt: skip
        entries = [(detail, models) for (s, detail), models in reasons.items() if s == status]
        if not entries:
            continue
        lines += ["", f"## {title}", ""]
        if status == "refused":
            lines += [f"Each refusal by the \"paged\" attention ends with the remedy: {REMEDY}", ""]
        for detail, models in sorted(entries, key=lambda entry: sorted(entry[1])):
            where = "; ".join(f"{model} ({', '.join(columns)})" for model, columns in models.items())
            lines.append(f"- {where}: {detail}")
    blockless = [r.model_type for r in swept if not stores_blocks(r.model_type)]
    if blockless:
        lines += ["", "## Models that store no blocks", "",
                  "Every layer of these keeps its own state in transformers' layer classes (recurrent, convolutional, or "
                  "hybrid layers holding their attention K/V themselves, as Falcon-H1's), so a `PagedCache` holds "
                  "nothing in blocks for them: options that act on blocks (`num_blocks`, `max_memory`, "
                  "`initial_blocks`, `quant`, `eviction`, `share_with`) are refused, and the cache serves them as "
                  "`DynamicCache` would: "
                  + ", ".join(f"`{name}`" for name in blockless) + "."]  # fmt: skip
    skipped = [r for r in results if r.skipped]
    if skipped:
        lines += ["", "## Not swept", "", "| model type | class | why |", "|---|---|---|"]
        lines += [f"| {r.model_type} | {r.model_class} | {r.skipped.replace('|', '/')} |" for r in skipped]
    header = [
        "# Supported models", "",
        f"Generated by `{command}` with transformers {transformers.__version__} and torch {torch.__version__}: every "
        "model type with a causal-LM class, built tiny with random weights (eval/zoo.py), generating with a "
        "`PagedCache` and with `DynamicCache`. *gather*: the model's own attention (\"sdpa\", or \"eager\" where it "
        "has no SDPA) on K/V gathered from the blocks; *paged*: `attn_implementation=\"paged\"`; *batch*: "
        "`generate_batch` against each prompt generated alone with DynamicCache. Modes: greedy on a left-padded batch, "
        "beam search (2 beams), seeded sampling, chunked prefill (`prefill_chunk_size=3`). Every PagedCache cell runs "
        f"with blocks of {', '.join(map(str, BLOCK_SIZES))} tokens against windows and chunks of 8 (dividing them, not "
        "dividing them, larger); exact means the same tokens and logits within 1e-4 (relative to the largest logit "
        "when it is above 1) at every block size.", "",
    ]  # fmt: skip
    return "\n".join(header + lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated model types (default: all)")
    parser.add_argument("--modes", help=f"comma-separated modes of {', '.join(MODES)} (default: all)")
    parser.add_argument("--fast", action="store_true", help=f"only {', '.join(FAST_MODES)} (both read paths)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per model (default 120)")
    parser.add_argument("--results", type=Path, help="JSON-lines file: one line per model, appended as it finishes")
    parser.add_argument("--resume", action="store_true", help="skip the models already in --results")
    parser.add_argument("--write", type=Path, help="write the support matrix (markdown) to this file")
    args = parser.parse_args(argv)
    modes = FAST_MODES if args.fast else tuple(args.modes.split(",")) if args.modes else MODES
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown modes {unknown}; choose from {', '.join(MODES)}")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    done: dict[str, ModelResult] = {}
    if args.resume and args.results and args.results.exists():
        for line in args.results.read_text().splitlines():
            data = json.loads(line)
            data["cells"] = {key: Cell(**cell) for key, cell in data["cells"].items()}
            done[data["model_type"]] = ModelResult(**data)
    results = []
    for model_type in model_types(args.models):
        result = done.get(model_type) or sweep_model(model_type, modes, args.time_limit)
        results.append(result)
        if model_type not in done and args.results:
            with args.results.open("a") as handle:
                handle.write(json.dumps(asdict(result)) + "\n")
        marks = " ".join(f"{key}={cell.status}" for key, cell in result.cells.items())
        print(f"{model_type:28s} {outcome(result):9s} {result.seconds:6.1f}s {result.skipped or marks}", flush=True)
    defects = [(r.model_type, k, c) for r in results for k, c in r.cells.items() if c.status in DEFECTS]
    for model_type, key, cell in defects:
        print(f"DEFECT {model_type} {key}: {cell.status}: {cell.detail}", flush=True)
    if args.write:
        shown = [f"--models {args.models}" if args.models else "", "--fast" if args.fast else "",
                 f"--modes {args.modes}" if args.modes and not args.fast else "", f"--write {args.write}"]  # fmt: skip
        args.write.write_text(markdown(results, modes, " ".join(["python eval/zoo.py", *filter(None, shown)])))
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
