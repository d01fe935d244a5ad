"""A batch-generator request's generation settings, checked when it is added and applied per request.

A request's settings are its own, else the generator's `GenerationConfig`'s, else the defaults `model.generate`
applies. They are validated at `add_request` (naming the request and the value), so a bad value cannot fail
inside a step that serves other requests. Logits processing reuses transformers' own processors on the request's
tokens, in `generate`'s order: repetition penalty, minimum lengths, then (sampling) temperature, top-k, top-p and
min-p, whose constructors reject the values `generate` rejects; stop strings use its `StopStringCriteria` (with the
tokenizer given to the generator, as `generate` needs one too). Options the generator cannot honour (beam search,
several sequences per prompt, ...) are refused, never ignored.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

DEFAULT_MAX_NEW_TOKENS = 20
NO_EOS = -1  # transformers' continuous batching's `eos_token_id` for "no EOS"
FIELDS = frozenset(GenerationConfig().to_dict())
HONOURED = frozenset({"max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature",
                      "top_k", "top_p", "min_p", "repetition_penalty", "eos_token_id", "stop_strings"})  # fmt: skip
# Fields that do not change the tokens here: the other special tokens, and `generate`'s cache and compilation
# settings (the generator brings its own cache and chunks prompts by `max_batch_tokens`).
IGNORED = frozenset({"pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation",
                     "cache_config", "max_cache_len", "compile_config", "disable_compile", "prefill_chunk_size",
                     "continuous_batching_config", "transformers_version", "_from_model_config"})  # fmt: skip
# What `generate` uses for a field left unset: the no-op value of every refused option (num_beams=1, ...) and
# the defaults of the honoured ones (top_k=50, ...).
GENERATE_DEFAULTS = GenerationConfig._get_default_generation_params()
_HINTS = {
    "num_beams": "beam search is not supported (each request decodes one sequence)",
    "num_return_sequences": "add the prompt once per sequence instead",
}


# Positions per chunk of a row whose argmax `row_argmax` finds chunk by chunk.
ARGMAX_CHUNK = 1024


def row_argmax(rows: torch.Tensor) -> torch.Tensor:
    """`rows.argmax(-1)` of `[n, vocab]`: each row's first index of its maximum (NaN above all). Found as the first
    chunk whose maximum is the row's, then the first maximum within it: torch's CPU argmax reads a long row element by
    element, while its `amax` is vectorised."""
    vocab = rows.shape[-1]
    if vocab < 4 * ARGMAX_CHUNK:
        return rows.argmax(-1)
    whole = vocab - vocab % ARGMAX_CHUNK
    maxes = rows[:, :whole].unflatten(1, (-1, ARGMAX_CHUNK)).amax(-1)
    if whole < vocab:
        maxes = torch.cat([maxes, rows[:, whole:].amax(-1, keepdim=True)], dim=1)
    first = maxes.argmax(-1) * ARGMAX_CHUNK
    # A last chunk shorter than the others repeats the row's last logit past its end: never before its first copy.
    columns = (first[:, None] + torch.arange(ARGMAX_CHUNK, device=rows.device)).clamp_(max=vocab - 1)
    return first + rows.gather(1, columns).argmax(-1)


@dataclass
class RequestSettings:
    """What one request's sampling needs: its logits processors, greedy or seeded sampling, and when it stops."""

    max_new_tokens: int
    stop_ids: frozenset[int]
    do_sample: bool
    processors: LogitsProcessorList
    generator: torch.Generator | None
    stop_strings: StopStringCriteria | None = None

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax of the logits as they come (no sampling, no processors), which a step
        takes for many requests in one op."""
        return not self.do_sample and not self.processors

    def next_token(self, logits: torch.Tensor, tokens: list[int]) -> int:
        """The next token after `tokens` (the prompt and the tokens generated so far) from its logits."""
        scores = logits.float()
        if self.processors:
            scores = self.processors(torch.tensor([tokens], device=logits.device), scores[None])[0]
        if not self.do_sample:
            return int(scores.argmax())
        # Drawn on the CPU, where the generator lives: a seed gives the same draws wherever the model runs.
        return int(torch.multinomial(scores.softmax(-1).cpu(), 1, generator=self.generator))

    def finish_reason(self, tokens: list[int], generated: int) -> str | None:
        """Why the request stops after its latest token (`tokens` end with it; `generated` so far), or None."""
        if tokens[-1] in self.stop_ids:
            return "eos"
        if self.stop_strings is not None:
            tail = torch.tensor([tokens[-self.stop_strings.maximum_token_len :]])
            if bool(self.stop_strings(tail, None)[0]):
                return "stop_string"
        return "length" if generated >= self.max_new_tokens else None

    def snapshot(self) -> torch.Tensor | None:
        """The sampling generator's state, to undo the draws of a step that is rolled back."""
        return None if self.generator is None else self.generator.get_state()

    def restore(self, state: torch.Tensor | None) -> None:
        if self.generator is not None:
            self.generator.set_state(state)


def check_generation_config(config: GenerationConfig, where: str) -> None:
    """Refuse every option of `config` that the generator would otherwise ignore."""
    for name, value in config.to_dict().items():
        if name not in HONOURED and name not in IGNORED:
            _refuse_if_set(name, value, where)


def request_settings(config: GenerationConfig, overrides: Mapping, where: str, prompt_length: int, vocab: int,
                     device: torch.device, seed: int, tokenizer=None) -> RequestSettings:  # fmt: skip
    """The settings of a request of `prompt_length` tokens: `overrides` (None: unset) over `config`'s fields over
    `generate`'s defaults, validated (`where` names the request in errors; `tokenizer` serves stop strings)."""
    unknown = sorted(set(overrides) - FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown generation option(s) {unknown}; the generator honours {sorted(HONOURED)}")
    for name, value in overrides.items():
        if name not in HONOURED:
            _refuse_if_set(name, value, where)
    values = {name: getattr(config, name) for name in HONOURED}
    values.update({name: value for name, value in overrides.items() if value is not None and name in HONOURED})
    stop_ids = frozenset(() if values["eos_token_id"] is None else
                         token_ids(_without_disabled(values["eos_token_id"]), "eos_token_id", vocab, where,
                                   single=True))  # fmt: skip
    do_sample = values["do_sample"] if values["do_sample"] is not None else GENERATE_DEFAULTS["do_sample"]
    if not isinstance(do_sample, bool):
        raise ValueError(f"{where}: `do_sample` must be a bool, got {do_sample!r}")
    for name, least in (("max_new_tokens", 1), ("max_length", 1), ("min_new_tokens", 0), ("min_length", 0),
                        ("top_k", None)):  # fmt: skip
        value = values[name]
        if value is not None and not (_is_int(value) and (least is None or value >= least)):
            bound = "" if least is None else f" >= {least}"
            raise ValueError(f"{where}: `{name}` must be an int{bound}, got {value!r}")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if values[name] is None:
            continue
        if not isinstance(values[name], numbers.Real) or isinstance(values[name], bool):
            raise ValueError(f"{where}: `{name}` must be a number, got {values[name]!r}")
        values[name] = float(values[name])
    try:
        processors = _processors(values, stop_ids, do_sample, prompt_length, device)
    except ValueError as error:  # transformers' own check, which names the parameter
        raise ValueError(f"{where}: {error}") from None
    generator = torch.Generator().manual_seed(seed) if do_sample else None
    max_new = _max_new_tokens(values["max_new_tokens"], values["max_length"], prompt_length, where)
    stop_strings = _stop_strings(values["stop_strings"], tokenizer, where)
    return RequestSettings(max_new, stop_ids, do_sample, processors, generator, stop_strings)


def token_ids(value, name: str, vocab: int, where: str, single: bool = False) -> list[int]:
    """`value` (a list or 1-D tensor of ints; one int too if `single`) as token ids in [0, vocab), else a clear
    error: strings, floats, booleans and out-of-range ids are refused, not coerced."""
    kind = "a token id or a list / 1-D tensor of them" if single else "a list or 1-D tensor of token ids"
    if isinstance(value, torch.Tensor):
        integral = not value.dtype.is_floating_point and not value.dtype.is_complex and value.dtype != torch.bool
        if not integral or value.dim() > 1 or (value.dim() == 0 and not single):
            shape = list(value.shape)
            raise ValueError(f"{where}: `{name}` must be {kind}, got a {value.dtype} tensor of shape {shape}")
        items = value.reshape(-1).tolist()
    elif single and _is_int(value):
        items = [value]
    elif isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{where}: `{name}` must be {kind}, got {type(value).__name__} {value!r}")
    else:
        items = list(value)
    for position, token in enumerate(items):
        if not _is_int(token) or not 0 <= token < vocab:
            raise ValueError(
                f"{where}: `{name}`[{position}] = {token!r} is not a token id: ids are ints in [0, {vocab}) (the "
                "model's vocabulary); tokenize text first"
            )
    return [int(token) for token in items]


def _without_disabled(eos):
    """`eos_token_id` without `NO_EOS`, transformers' "no EOS" (its `generate_batch` writes it into a generation config
    that has none, which its callers then pass on)."""
    if _is_int(eos) and eos == NO_EOS:
        return []
    if isinstance(eos, (list, tuple)):
        return [token for token in eos if not (_is_int(token) and token == NO_EOS)]
    return eos


def _processors(values: dict, stop_ids: frozenset[int], do_sample: bool, prompt_length: int,
                device: torch.device) -> LogitsProcessorList:  # fmt: skip
    """`generate`'s processors for the honoured options, in its order (`_get_logits_processor`)."""
    processors = LogitsProcessorList()
    penalty = values["repetition_penalty"]
    if penalty is not None and penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty))
    eos = sorted(stop_ids)
    if values["min_length"] and eos:
        processors.append(MinLengthLogitsProcessor(values["min_length"], eos, device=device))
    if values["min_new_tokens"] and eos:
        minimum = values["min_new_tokens"]
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, minimum, eos, device=device))
    if not do_sample:  # `generate` ignores the sampling settings when greedy (it only warns)
        return processors
    temperature, top_k, top_p = (values[name] if values[name] is not None else GENERATE_DEFAULTS[name]
                                 for name in ("temperature", "top_k", "top_p"))  # fmt: skip
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p != 1.0:
        processors.append(TopPLogitsWarper(top_p))  # raises outside [0, 1] (`generate` ignores top_p > 1)
    if values["min_p"] is not None:
        processors.append(MinPLogitsWarper(values["min_p"]))
    return processors


def _max_new_tokens(max_new: int | None, max_length: int | None, prompt_length: int, where: str) -> int:
    """`max_new_tokens` if given (it takes precedence, as in `generate`), else what `max_length` (prompt and new
    tokens) leaves after the prompt, else the default."""
    if max_new is not None:
        return max_new
    if max_length is None:
        return DEFAULT_MAX_NEW_TOKENS
    if max_length <= prompt_length:
        raise ValueError(
            f"{where}: `max_length`={max_length} (prompt and new tokens) leaves no room after its "
            f"{prompt_length}-token prompt: raise `max_length`, or give `max_new_tokens`"
        )
    return max_length - prompt_length


def _stop_strings(value, tokenizer, where: str) -> StopStringCriteria | None:
    if value is None:
        return None
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, (list, tuple)) or not strings or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"{where}: `stop_strings` must be a non-empty string or list of them, got {value!r}")
    if tokenizer is None:
        raise ValueError(
            f"{where}: `stop_strings`={value!r} needs the tokenizer (to match strings across tokens): pass "
            "`tokenizer=` to `BatchGenerator` / `generate_batch`, as `generate` needs it too"
        )
    return StopStringCriteria(tokenizer, list(strings))


def _refuse_if_set(name: str, value, where: str) -> None:
    if value is None or value is False or (name in GENERATE_DEFAULTS and value == GENERATE_DEFAULTS[name]):
        return
    hint = _HINTS.get(name, "unset it")
    raise ValueError(
        f"{where}: `{name}`={value!r} is not supported by the batch generator, which would ignore it: {hint}. It "
        f"honours {sorted(HONOURED)}"
    )


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
