"""Continuous batching: many requests served in one memory budget by one unmodified HF model.

Every step packs prompt chunks and decode tokens of many requests into one forward (`PackedCache`): no
padding is stored or computed. Each request owns a `PagedCache` forked from one template, so all requests
share the template's pools; a step is scheduled only when the pools hold the blocks it takes, and a new
request is admitted only when its first chunk fits with a block of headroom left for each running request.
Everything `PagedCache` offers applies per request: quantized blocks (more requests fit), eviction (a fixed
per-request budget), sliding-window and hybrid models. Prefix caching (`prefix_cache.py`) lets a request
start from the blocks of an earlier one with the same leading tokens.

    outputs = generate_batch(model, [ids_a, ids_b], max_new_tokens=64, num_blocks=2048)
    outputs[0].generated_tokens
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedModel

from .attention import ATTENTION_NAME
from .batch_cache import PackedCache
from .block_pool import BlockPool
from .cache import PagedCache
from .config import PagedCacheConfig
from .layers import PagedLayer, SharedKVLayer
from .prefix_cache import PrefixCache


_GENERATION_FIELDS = frozenset(GenerationConfig().to_dict()) - {f.name for f in dataclasses.fields(PagedCacheConfig)}


@dataclass(frozen=True)
class BatchConfig:
    """The batching knobs (the cache's own options are `PagedCacheConfig`'s).

    Args:
        max_batch_tokens: tokens one forward computes at most (prompt chunks and decode tokens together).
        max_num_seqs: requests running at once at most (the seeds' `--max-num-seqs`).
        prefix_caching: reuse full blocks of earlier requests with the same leading tokens (full-precision
            caches without eviction; ignored otherwise, see `PrefixCache.supports`).
        progress: show a progress bar of finished requests.
    """

    max_batch_tokens: int = 512
    max_num_seqs: int = 32
    prefix_caching: bool = True
    progress: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        for name in ("prefix_caching", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}")


@dataclass
class GenerationOutput:
    """One request's result: `generated_tokens` (ids), why it stopped ("eos", "length", "cancelled", "error"),
    the error message if any, and how many prompt tokens came from the prefix cache."""

    request_id: int
    prompt_ids: list[int]
    generated_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    prefix_hit_tokens: int = 0


@dataclass(frozen=True)
class BatchMetrics:
    """A snapshot of the generator after a step; `BatchGenerator.history` keeps one per step (a time series)."""

    step: int
    seconds: float
    running: int
    waiting: int
    finished: int
    tokens_scheduled: int  # tokens this step computed
    token_budget: int
    blocks_used: int  # over every pool of the family
    blocks_total: int
    kv_bytes: int  # bytes of the blocks in use (every pool of the family)
    shared_blocks: int
    prompt_tokens: int  # of the requests admitted so far (cached or computed)
    prefix_hit_tokens: int
    stalled: int  # running requests that waited this step for blocks

    @property
    def usage_ratio(self) -> float:
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0

    @property
    def batch_efficiency(self) -> float:
        """Tokens computed per token of budget."""
        return self.tokens_scheduled / self.token_budget

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Request:
    output: GenerationOutput
    max_new_tokens: int
    sampling: dict  # do_sample, temperature, top_k, top_p
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    cache: PagedCache | None = None
    fed: int = 0  # tokens in its cache
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks

    @property
    def tokens(self) -> list[int]:
        return self.output.prompt_ids + self.output.generated_tokens

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.output.prompt_ids)


class BatchGenerator:
    """Serves requests added with `add_request` (streaming use: `get_result`, `cancel_request`, or iterate)."""

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig | None = None, **options):
        batch_fields = {f.name for f in dataclasses.fields(BatchConfig)}
        self.config = BatchConfig(**{k: options.pop(k) for k in list(options) if k in batch_fields})
        self.model = model
        # Generation settings given as options (max_new_tokens=..., do_sample=...) override the config's.
        generation = {k: options.pop(k) for k in list(options) if k in _GENERATION_FIELDS}
        self.generation_config = copy.deepcopy(generation_config or model.generation_config)
        self.generation_config.update(**generation)
        model.set_attn_implementation(ATTENTION_NAME)
        self.template = PagedCache(model.config, PagedCacheConfig(**options))
        _check_model(self.template)
        self.growable = self.template.options.growable
        self.sliding = [layer.is_sliding for layer in self.template.layers]
        cacheable = self.config.prefix_caching and self.template.options.sharing and PrefixCache.supports(self.template)
        self.prefix_cache = PrefixCache(self.template) if cacheable else None
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: deque[GenerationOutput] = deque()
        self.history: list[BatchMetrics] = []
        self._next_id = 0
        self._started = time.perf_counter()
        self._done = 0
        self._admitted_prompt_tokens = 0
        self._progress = None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None, do_sample: bool | None = None,
                    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                    seed: int | None = None, eos_token_id: int | Sequence[int] | None = None) -> int:  # fmt: skip
        """Queue a request (token ids); settings not given come from the generation config. Returns its id."""
        prompt = [int(token) for token in prompt_ids]
        if not prompt:
            raise ValueError("`prompt_ids` is empty: a request needs at least one token")
        config = self.generation_config
        max_new = max_new_tokens if max_new_tokens is not None else (config.max_new_tokens or 20)
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"`max_new_tokens` must be a positive int, got {max_new!r}")
        eos = eos_token_id if eos_token_id is not None else config.eos_token_id
        stop_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        sampling = {
            "do_sample": config.do_sample if do_sample is None else do_sample,
            "temperature": temperature if temperature is not None else (config.temperature or 1.0),
            "top_k": top_k if top_k is not None else config.top_k,
            "top_p": top_p if top_p is not None else config.top_p,
        }
        generator = None
        if sampling["do_sample"]:
            generator = torch.Generator().manual_seed(seed if seed is not None else self._next_id)
        request = _Request(GenerationOutput(self._next_id, prompt), max_new, sampling, stop_ids, generator)
        self._next_id += 1
        self.waiting.append(request)
        return request.output.request_id

    def cancel_request(self, request_id: int) -> bool:
        """Stop a queued or running request now and free its blocks; False if it already finished."""
        for queue in (self.waiting, self.running):
            for request in list(queue):
                if request.output.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "cancelled")
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def get_result(self) -> GenerationOutput | None:
        """The next finished request (running steps until one finishes); None when nothing is left."""
        while not self.finished and self.has_work():
            self.step()
        return self.finished.popleft() if self.finished else None

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Results as requests finish."""
        while (result := self.get_result()) is not None:
            yield result

    # ------------------------------------------------------------------ one step
    @torch.no_grad()  # not inference_mode: the storage it allocates outlives the step
    def step(self) -> None:
        """Schedule, run one packed forward, sample, retire finished requests."""
        batch, stalled = self._schedule()
        if batch:
            self._forward(batch)
        elif self.running:
            raise RuntimeError(
                f"The pool is too small to continue any of the {len(self.running)} running requests (each needs a free "
                "block for its next token): give a larger `num_blocks` / `max_memory`, or lower `max_num_seqs`"
            )
        self._record(sum(q for _, q in batch), stalled)

    def _schedule(self) -> tuple[list[tuple[_Request, int]], int]:
        budget, batch, taken, stalled = self.config.max_batch_tokens, [], {}, 0
        for request in self.running:  # decode tokens first, then prompt chunks of admitted requests
            q = 1 if not request.prefilling else min(len(request.output.prompt_ids) - request.fed, budget)
            if q == 0:
                break
            if self._fits(request.cache.step_demand(q), taken, headroom=0):
                batch.append((request, q))
                budget -= q
            else:
                stalled += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.cache is None:
                request.cache = self.template.sibling()
                if self.prefix_cache is not None:
                    request.fed = request.output.prefix_hit_tokens = self.prefix_cache.attach(
                        request.cache, request.output.prompt_ids)  # fmt: skip
            q = min(len(request.output.prompt_ids) - request.fed, budget)
            if not self._fits(request.cache.step_demand(q), taken, headroom=len(self.running)):
                if not self.running and not batch:  # even an empty pool cannot take its first chunk
                    self.waiting.popleft()
                    self._fail(request, q)
                    continue
                break
            self.running.append(self.waiting.popleft())
            self._admitted_prompt_tokens += len(request.output.prompt_ids)
            batch.append((request, q))
            budget -= q
        return batch, stalled

    def _fits(self, demand: dict[BlockPool, int], taken: dict[BlockPool, int], headroom: int) -> bool:
        """Whether the pools hold `demand` besides what this step already took (and `headroom` blocks more:
        one per running request, so admitting a request cannot starve those already running)."""
        if self.growable:
            return True
        if any(pool.num_free - taken.get(pool, 0) - headroom < need for pool, need in demand.items() if need):
            return False
        for pool, need in demand.items():
            taken[pool] = taken.get(pool, 0) + need
        return True

    def _fail(self, request: _Request, q: int) -> None:
        pools = {pool.num_blocks for pool in request.cache.step_demand(q)}
        request.output.error = (
            f"request {request.output.request_id} ({len(request.output.prompt_ids)} prompt tokens) needs more blocks "
            f"for its first {q} tokens than the whole pool holds ({sorted(pools)} blocks of "
            f"{self.template.options.block_size}): give a larger `num_blocks` / `max_memory`, or a smaller "
            "`max_batch_tokens` so that prompts are computed in smaller chunks"
        )
        self._finish(request, "error")

    def _forward(self, batch: list[tuple[_Request, int]]) -> None:
        tokens, positions, spans, keep = [], [], [], []
        for request, q in batch:
            start = len(tokens)
            tokens += request.tokens[request.fed : request.fed + q]
            positions += range(request.fed, request.fed + q)
            spans.append((start, start + q))
            keep.append(start + q - 1)
        ids = torch.tensor([tokens], device=self.model.device)
        cache = PackedCache([request.cache for request, _ in batch], spans, self.sliding)
        logits = self.model(input_ids=ids, position_ids=torch.tensor([positions], device=ids.device), cache=cache,
                            use_cache=True, logits_to_keep=torch.tensor(keep, device=ids.device)).logits[0]  # fmt: skip
        for index, (request, q) in enumerate(batch):
            request.fed += q
            if self.prefix_cache is not None:
                request.keys = self.prefix_cache.register(request.cache, request.tokens[: request.fed], request.keys)
            if request.prefilling:
                continue
            token = _sample(logits[index].float(), request.sampling, request.generator)
            request.output.generated_tokens.append(token)
            if token in request.stop_ids or len(request.output.generated_tokens) >= request.max_new_tokens:
                self.running.remove(request)
                self._finish(request, "eos" if token in request.stop_ids else "length")

    def _finish(self, request: _Request, reason: str) -> None:
        request.output.finish_reason = reason
        if request.cache is not None:
            request.cache.reset()  # its blocks go back (prefix-cached ones stay findable until reused)
            request.cache = None
        self.finished.append(request.output)
        self._done += 1
        if self._progress is not None:
            self._progress.update(1)

    def _record(self, scheduled: int, stalled: int) -> None:
        metrics = self.template.metrics()
        stats = self.prefix_cache.stats if self.prefix_cache is not None else None
        self.history.append(BatchMetrics(
            step=len(self.history), seconds=time.perf_counter() - self._started, running=len(self.running),
            waiting=len(self.waiting), finished=self._done, tokens_scheduled=scheduled,
            token_budget=self.config.max_batch_tokens,
            blocks_used=metrics.blocks_used + metrics.quantized_blocks_used,
            blocks_total=metrics.blocks_total + metrics.quantized_blocks_total, kv_bytes=metrics.used_bytes,
            shared_blocks=metrics.shared_blocks,
            prompt_tokens=self._admitted_prompt_tokens,
            prefix_hit_tokens=stats.hit_tokens if stats else 0, stalled=stalled,
        ))  # fmt: skip

    def metrics(self) -> BatchMetrics | None:
        """The latest snapshot (None before the first step)."""
        return self.history[-1] if self.history else None

    def run(self) -> list[GenerationOutput]:
        """Serve every queued request; results in request order."""
        results = {}
        if self.config.progress:
            from tqdm.auto import tqdm

            self._progress = tqdm(total=len(self.waiting) + len(self.running), desc="requests")
        try:
            for output in self:
                results[output.request_id] = output
        finally:
            if self._progress is not None:
                self._progress.close()
                self._progress = None
        return [results[key] for key in sorted(results)]


def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]],
                   generation_config: GenerationConfig | None = None, **options) -> list[GenerationOutput]:  # fmt: skip
    """Generate for every prompt (lists of token ids) with continuous batching; one output per prompt, in order.

    `options` are `PagedCache` options (`block_size`, `num_blocks` / `max_memory`, `quant`, `eviction`, ...), the
    batching knobs of `BatchConfig` (`max_batch_tokens`, `max_num_seqs`, `prefix_caching`, `progress`), and
    generation settings that override `generation_config` (`max_new_tokens`, `do_sample`, `eos_token_id`, ...).
    The model is switched to the `"paged"` attention. Requests that can never fit finish with `error` set;
    the others finish normally.
    """
    generator = BatchGenerator(model, generation_config, **options)
    for prompt in prompts:
        generator.add_request(prompt)
    return generator.run()


def _check_model(template: PagedCache) -> None:
    """The packed forward needs every layer stored in blocks (no linear-attention or chunked layers)."""
    for index, layer in enumerate(template.layers):
        paged = isinstance(layer, (PagedLayer, SharedKVLayer))
        if not paged or getattr(layer, "chunked", False):
            raise ValueError(
                f"Layer {index} ({type(layer).__name__}) is not a plain paged attention layer: the batch generator "
                "serves models whose layers are full or sliding-window attention; use `model.generate` with a "
                "`PagedCache` for this model"
            )


def _sample(logits: torch.Tensor, sampling: dict, generator: torch.Generator | None) -> int:
    """Greedy, or sampling with temperature / top-k / top-p from the request's own seeded generator."""
    if not sampling["do_sample"]:
        return int(logits.argmax())
    logits = logits / max(sampling["temperature"], 1e-5)
    top_k = sampling["top_k"]
    if top_k:
        threshold = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    top_p = sampling["top_p"]
    if top_p is not None and top_p < 1.0:
        ordered, indices = torch.sort(logits, descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) > top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, indices, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
