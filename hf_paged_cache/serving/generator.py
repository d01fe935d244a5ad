"""Continuous batching: many requests served in one memory budget by one unmodified HF model.

Every step packs prompt chunks and decode tokens of many requests into one forward (`PackedCache`): no
padding is stored or computed. Each request owns a `PagedCache` forked from one template, so all requests
share the template's pools; a step is scheduled only when the pools hold the blocks it takes, and a new
request is admitted only when its first chunk fits with a block of headroom left for each running request.
Everything `PagedCache` offers applies per request: quantized blocks (more requests fit), eviction (a fixed
per-request budget), sliding-window and hybrid models. Prefix caching (`prefix_cache.py`) lets a request
start from the blocks of an earlier one with the same leading tokens.

Under memory pressure (a running request cannot get its next block, or the pools pass `swap_threshold`) the
lowest-priority running requests are preempted: swapped to host blocks (`swap.py`) and swapped back a step
before they run again (on CUDA the copy in overlaps that step's forward, on a side stream: `copy_stream.py`),
or dropped and queued again with their generated tokens as part of the prompt (recompute; the prefix cache may
recover part of it) -- whichever `preemption` says, or the cheaper by an estimate.
Priority is the victim policy: least recently scheduled first (`"lru"`), or the seeds' weighted score.
Each request's generation settings are checked when it is added (`request_settings.py`); a step records nothing
until its forward and sampling succeed, and is rolled back (its requests recomputed) if either raises.

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

from ..attention.dispatch import ATTENTION_NAME
from ..attention.contract import check_model_features
from .packed_cache import PackedCache
from ..blocks.pool import BlockPool
from ..cache import PagedCache
from ..config import PagedCacheConfig
from ..memory.copy_stream import COPY_MODES
from ..errors import UnsupportedAttentionError
from ..layers.paged import PagedLayer, SharedKVLayer
from ..distributed import tensor_parallel_size
from ..memory.accounting import blocks_in_budget
from ..memory.defragment import Fragmentation, compact, device_pools, fragmentation
from .prefix_cache import PrefixCache
from .settings import FIELDS, RequestSettings, check_generation_config, request_settings, token_ids
from ..memory.swap import SwapSpace


PREEMPTION_MODES = ("auto", "swap", "recompute")
VICTIM_POLICIES = ("lru", "weighted")
# Host copy speed assumed before the first swap is measured (bytes/s); `auto` preemption compares it with the
# measured prefill speed.
DEFAULT_COPY_RATE = 4e9

_CACHE_FIELDS = frozenset(f.name for f in dataclasses.fields(PagedCacheConfig))
_GENERATION_FIELDS = FIELDS - _CACHE_FIELDS


@dataclass(frozen=True)
class BatchConfig:
    """The batching knobs (the cache's own options are `PagedCacheConfig`'s).

    Args:
        max_batch_tokens: tokens one forward computes at most (prompt chunks and decode tokens together).
        max_num_seqs: requests running at once at most (the seeds' `--max-num-seqs`).
        prefix_caching: reuse full blocks of earlier requests with the same leading tokens (full-precision
            caches without eviction; ignored otherwise, see `PrefixCache.supports`).
        progress: show a progress bar of finished requests.
        preemption: what happens to a preempted request: `"swap"` (its blocks go to host memory and come back
            before it runs again; recompute when the host pool is full), `"recompute"` (its blocks are dropped
            and it is queued again with its generated tokens as part of its prompt), or `"auto"`: the cheaper
            of the two by an estimate (bytes to copy both ways at the measured copy speed against tokens to
            compute again at the measured prefill speed).
        victim_policy: which running request is preempted first: `"lru"` (least recently scheduled; ties: the
            latest admitted) or `"weighted"`, the seeds' score: access frequency x time decay (steps it was
            scheduled in, each weighted `decay ** steps ago`) less `size_weight` x the share of the pool it holds
            -- cold requests and large ones (which free the most blocks per preemption) go first.
        swap_threshold: preempt before the pools run dry, as soon as more than this share of a pool is in use
            (and admit or swap in only while it stays below); None: preempt only when a request cannot get its
            next block.
        swap_blocks: host blocks per device pool (None: as many as the device pool has).
        swap_compression: a `quant` format ("fp8", "int4", ...) for host copies of full-precision blocks: fewer
            host bytes and less copy traffic, at a small quality cost (they come back close, not bit-exact).
        swap_copies: when swap copies run (`copy_stream.py`): `"auto"` (asynchronous on CUDA, synchronous
            otherwise), `"sync"`, `"async"` (a CUDA side stream: copies overlap the forwards that do not need
            them), or `"deferred"` (each copy waits until a step needs it: a check that outputs do not depend on
            when copies land).
        decay, size_weight: the weighted score's time decay per step and size weight.
        compact_threshold: compact the pools (`pool_compaction.py`) after a step that leaves more than this share
            of the ids below a pool's highest block in use free; None: only when `compact()` is called.
    """

    max_batch_tokens: int = 512
    max_num_seqs: int = 32
    prefix_caching: bool = True
    progress: bool = False
    preemption: str = "auto"
    victim_policy: str = "lru"
    swap_threshold: float | None = None
    swap_blocks: int | None = None
    swap_compression: str | None = None
    swap_copies: str = "auto"
    decay: float = 0.9
    size_weight: float = 1.0
    compact_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        for name in ("prefix_caching", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}")
        for name, allowed in (("preemption", PREEMPTION_MODES), ("victim_policy", VICTIM_POLICIES),
                              ("swap_copies", COPY_MODES)):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("swap_threshold", "compact_threshold"):
            value = getattr(self, name)
            share = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1
            if value is not None and not share:
                raise ValueError(f"`{name}` must be in (0, 1] (a share of the pool) or None, got {value!r}")
        if not 0.0 < self.decay <= 1.0 or self.size_weight < 0:
            raise ValueError(
                f"`decay` must be in (0, 1] and `size_weight` >= 0, got {self.decay!r} and {self.size_weight!r}"
            )


@dataclass
class GenerationOutput:
    """One request's result: `generated_tokens` (ids), why it stopped ("eos", "stop_string", "length", "cancelled",
    "error"),
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
    stalled: int  # requests waiting for blocks: swapped out, or running but not scheduled this step
    preempted_swap: int = 0  # preemptions so far, by kind
    preempted_recompute: int = 0
    swap_out_blocks: int = 0  # swap traffic so far, each way
    swap_out_bytes: int = 0
    swap_in_blocks: int = 0
    swap_in_bytes: int = 0
    swap_stall_seconds: float = 0.0  # time the host or the compute stream waited for swap copies so far
    swap_copy_seconds: float = 0.0  # time the swap copies took so far (overlapped with compute or not)
    swap_prefetched: int = 0  # swap-ins copied while a forward they were not part of ran (a step ahead)
    recomputed_tokens: int = 0  # tokens computed again after recompute preemptions (prefix hits excluded)
    fragmentation: float = 0.0  # the largest share of free ids below a pool's highest block in use
    compactions: int = 0  # so far

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
    settings: RequestSettings
    cache: PagedCache | None = None
    fed: int = 0  # tokens in its cache
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks
    last_step: int = -1  # the step it was last scheduled in
    hotness: float = 0.0  # steps it was scheduled in, each weighted decay ** (steps ago), as of `last_step`
    peak: int = 0  # most tokens its cache ever held (tokens fed again below it are recomputed)
    admitted: bool = False  # admitted once (later admissions follow a preemption or a rolled-back step)

    @property
    def tokens(self) -> list[int]:
        """What the model has seen or will see: the prompt, then the generated tokens (after a recompute
        preemption all of them are fed again, as a prompt)."""
        return self.output.prompt_ids + self.output.generated_tokens

    @property
    def pending(self) -> int:
        """Tokens to feed before the next sample: a prompt's remaining tokens, or the last generated one."""
        return len(self.tokens) - self.fed


class BatchGenerator:
    """Serves requests added with `add_request` (streaming use: `get_result`, `cancel_request`, or iterate)."""

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig | None = None, tokenizer=None,
                 **options):  # fmt: skip
        """`tokenizer` is needed only for `stop_strings`. Every option is checked before anything changes: a failed
        constructor leaves the model as it was (the `"paged"` attention is selected last)."""
        batch_fields = {f.name for f in dataclasses.fields(BatchConfig)}
        unknown = sorted(set(options) - batch_fields - _GENERATION_FIELDS - _CACHE_FIELDS)
        if unknown:
            raise ValueError(
                f"Unknown option(s) {unknown}. Batching options: {sorted(batch_fields)}; cache options: "
                f"{sorted(_CACHE_FIELDS)}; generation options: any `GenerationConfig` field"
            )
        if generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise ValueError(
                f"`generation_config` must be a transformers `GenerationConfig`, got "
                f"{type(generation_config).__name__}: pass `GenerationConfig(**settings)`, or the settings as "
                "keyword options"
            )
        self.config = BatchConfig(**{k: options.pop(k) for k in list(options) if k in batch_fields})
        self.model = model
        # Generation settings given as options (max_new_tokens=..., do_sample=...) override the config's.
        self.generation_config = copy.deepcopy(generation_config or model.generation_config)
        for name in [k for k in options if k in _GENERATION_FIELDS]:
            setattr(self.generation_config, name, options.pop(name))
        check_generation_config(self.generation_config, "the generation config")
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.tokenizer = tokenizer
        self._settings({}, "the generation config", 1, 0)  # its values, checked once before any request
        check_model_features(model.config)  # the packed forward always runs the "paged" attention
        self.template = PagedCache(model.config, _pools_up_front(PagedCacheConfig(**options), model))
        _check_model(self.template)
        self.growable = self.template.options.growable
        self.sliding = [layer.is_sliding for layer in self.template.layers]
        cacheable = self.config.prefix_caching and self.template.options.sharing and PrefixCache.supports(self.template)
        self.prefix_cache = PrefixCache(self.template) if cacheable else None
        if self.config.swap_copies == "async" and model.device.type != "cuda":
            raise ValueError(f"`swap_copies='async'` needs a model on CUDA, this one is on {model.device}: use 'auto'")
        self.swap = SwapSpace(self.template, self.config.swap_blocks, self.config.swap_compression,
                              self.config.swap_copies)  # fmt: skip
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:  # set_attn_implementation ignored: nothing changed
            raise UnsupportedAttentionError(
                f"{type(model).__name__} ignores `attn_implementation` (its attention is its own code, "
                f"{model.config._attn_implementation!r}), so the packed forward cannot run the \"paged\" attention it "
                "needs: use `model.generate` with a `PagedCache` for this model (the gather path, exact)"
            )
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.swapped: deque[_Request] = deque()  # preempted to host memory, oldest first
        self.preempted = {"swap": 0, "recompute": 0}
        self.prefetched = 0  # swap-ins started while a forward they were not part of ran
        self.recomputed_tokens = 0
        self.compactions = 0
        self._waited = 0  # running requests that waited for blocks at the latest step
        self._forward_seconds = 0.0  # measured prefill / decode speed, for `auto` preemption
        self._forward_tokens = 0
        self.finished: deque[GenerationOutput] = deque()
        self.history: list[BatchMetrics] = []
        self._next_id = 0
        self._started = time.perf_counter()
        self._done = 0
        self._admitted_prompt_tokens = 0
        self._progress = None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int | None = None,
                    do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, seed: int | None = None,
                    eos_token_id: int | Sequence[int] | None = None, **settings) -> int:  # fmt: skip
        """Queue a request (a list or 1-D tensor of token ids); settings not given (these, or other honoured
        `GenerationConfig` fields such as `repetition_penalty`, `min_new_tokens`, `max_length`) come from the
        generation config. Everything is checked here, so a bad value queues nothing. Returns its id."""
        where = f"request {self._next_id}"
        prompt = token_ids(prompt_ids, "prompt_ids", self.vocab_size, where)
        if not prompt:
            raise ValueError(f"{where}: `prompt_ids` is empty: a request needs at least one token")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"{where}: `seed` must be an int, got {seed!r}")
        settings.update(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                        top_p=top_p, eos_token_id=eos_token_id)  # fmt: skip
        chosen = self._settings(settings, where, len(prompt), seed if seed is not None else self._next_id)
        request = _Request(GenerationOutput(self._next_id, prompt), chosen)
        self._next_id += 1
        self.waiting.append(request)
        return request.output.request_id

    def _settings(self, overrides: dict, where: str, prompt_length: int, seed: int) -> RequestSettings:
        return request_settings(self.generation_config, overrides, where, prompt_length, self.vocab_size,
                                self.model.device, seed, self.tokenizer)  # fmt: skip

    def cancel_request(self, request_id: int) -> bool:
        """Stop a queued or running request now and free its blocks; False if it already finished."""
        for queue in (self.waiting, self.running, self.swapped):
            for request in list(queue):
                if request.output.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "cancelled")
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

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
        """Schedule (preempting under pressure), swap in the next requests to resume, run one packed forward,
        sample, retire finished requests.

        The copies follow `copy_stream.py`'s rules: the fence orders this forward after every copy so far (the
        victims' device blocks may be reused by it; the requests swapped in at the previous step run in it), and
        the swap-ins started after it are prefetches: their copies overlap this forward, they run from the next
        step. With nothing running there is no forward to overlap: swapped requests come back first and run now."""
        copies = self.swap.copies
        copies.poll()
        if self.config.swap_threshold is not None:
            self._relieve()
        if not self.running:
            self._swap_in({}, prefetch=False)
        batch, taken = self._schedule()
        copies.fence()
        self._swap_in(taken, prefetch=bool(batch))
        if self.growable:  # a pool that grows reallocates its storage: a pending copy in would write the old one
            copies.fence()
        if batch:
            started = time.perf_counter()
            self._forward(batch)
            self._forward_seconds += time.perf_counter() - started
            self._forward_tokens += sum(q for _, q in batch)
        holes = _largest_hole_share(self.template)
        if self.config.compact_threshold is not None and holes > self.config.compact_threshold:
            self.compact()
            holes = _largest_hole_share(self.template)
        self._record(sum(q for _, q in batch), holes)

    def _schedule(self) -> tuple[list[tuple[_Request, int]], dict[BlockPool, int]]:
        """Running requests by priority (decode tokens before prompt chunks), each preempting the lowest-priority
        unscheduled ones while its step does not fit; then new requests while the pools hold them. Returns the
        batch and the blocks it takes per pool."""
        budget, batch, taken = self.config.max_batch_tokens, [], {}
        self._waited = 0
        queue = deque(sorted(self.running, key=lambda r: (r.pending == 1, self._priority(r)), reverse=True))
        while queue:
            request = queue.popleft()
            q = min(request.pending, budget)
            if q == 0:
                break
            q = self._make_room(request, q, queue, taken, scheduled=bool(batch))
            if q == 0:
                self._waited += 1
            else:
                batch.append((request, q))
                budget -= q
                self._touch(request)
        while self.waiting and not self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.cache is None:
                request.cache = self.template.sibling()
                if self.prefix_cache is not None:
                    request.fed = self.prefix_cache.attach(request.cache, request.tokens)
            q = min(request.pending, budget)
            demand = request.cache.step_demand(q)
            if not (self._below_threshold(demand) and self._fits(demand, taken, headroom=len(self.running))):
                if not self.running and not batch:  # even an empty pool cannot take its first chunk
                    self.waiting.popleft()
                    self._fail(request, q)
                    continue
                # Its prefix hit took cached blocks out of the free queue that this step's requests may need.
                self._drop_waiting_cache()
                break
            self.running.append(self.waiting.popleft())
            if not request.admitted:  # its first admission (not a recompute)
                request.admitted = True
                request.output.prefix_hit_tokens = request.fed
                self._admitted_prompt_tokens += len(request.output.prompt_ids)
                if self.prefix_cache is not None:
                    self.prefix_cache.stats.record(len(request.tokens), request.fed)
            batch.append((request, q))
            budget -= q
            self._touch(request)
        return batch, taken

    def _make_room(self, request: _Request, q: int, queue: deque[_Request], taken: dict[BlockPool, int],
                   scheduled: bool) -> int:  # fmt: skip
        """Tokens of `request` this step computes: `q` once the lowest-priority requests of `queue` are preempted
        until its step fits. With none left to preempt and others running this step, a smaller prompt chunk
        that fits, or none (it waits for their blocks: preempting itself would only bring it back to the same
        shortage). A request that is short even alone fails."""
        demand = request.cache.step_demand(q)
        while not self._fits(demand, taken, headroom=0):
            if queue:
                self._preempt(queue.pop())
            elif scheduled:
                return self._largest_chunk(request, q - 1, taken)
            elif self._drop_waiting_cache():  # a queued request's prefix hit held blocks; it attaches again later
                continue
            else:
                self.running.remove(request)
                self._fail(request, q)
                return 0
        return q

    def _largest_chunk(self, request: _Request, most: int, taken: dict[BlockPool, int]) -> int:
        """The most tokens (at most `most`, 0 if not even one) whose step fits, recorded in `taken`."""
        low, high = 0, most
        while low < high:
            middle = (low + high + 1) // 2
            if self._fits(request.cache.step_demand(middle), dict(taken), headroom=0):
                low = middle
            else:
                high = middle - 1
        if low:
            self._fits(request.cache.step_demand(low), taken, headroom=0)
        return low

    def _priority(self, request: _Request) -> tuple[float, int]:
        """Higher is kept longer (the victim is the lowest): by the victim policy, ties to the earlier request."""
        if self.config.victim_policy == "lru":
            return request.last_step, -request.output.request_id
        hot = request.hotness * self.config.decay ** (len(self.history) - request.last_step)
        pools = self._pools()
        share = _held_blocks(request.cache) / max(sum(pool.num_blocks for pool in pools), 1)
        return hot - self.config.size_weight * share, -request.output.request_id

    def _touch(self, request: _Request) -> None:
        step = len(self.history)
        request.hotness = request.hotness * self.config.decay ** (step - request.last_step) + 1.0
        request.last_step = step

    # ------------------------------------------------------------------ preemption
    def _preempt(self, request: _Request) -> None:
        """Swap `request` out or drop it for recompute (by `preemption`, the host pool's room and the estimate)."""
        self.running.remove(request)
        if self._swap_is_cheaper(request):
            self.swap.swap_out(request.cache)
            self.swapped.append(request)
            self.preempted["swap"] += 1
        else:
            self._requeue(request)

    def _requeue(self, request: _Request) -> None:
        """Drop the request's blocks (device or host) and queue it first, to be computed again from its tokens."""
        self._drop_blocks(request)
        self.preempted["recompute"] += 1

    def _drop_blocks(self, request: _Request) -> None:
        request.cache.reset()  # also after a forward interrupted halfway (some layers wrote, others not)
        request.cache, request.fed, request.keys = None, 0, []
        self.waiting.appendleft(request)

    def _swap_is_cheaper(self, request: _Request) -> bool:
        mode = self.config.preemption
        if mode == "recompute" or request.fed == 0 or not self.swap.can_swap_out(request.cache):
            return False
        if mode == "swap":
            return True
        stats, seconds = self.swap.stats, self.swap.copies.stats.copy_seconds
        copy_rate = (stats.out_bytes + stats.in_bytes) / seconds if seconds else DEFAULT_COPY_RATE
        compute_rate = self._forward_tokens / max(self._forward_seconds, 1e-9)
        return 2 * self.swap.swap_bytes(request.cache) / copy_rate < request.fed / compute_rate

    def _swap_in(self, taken: dict[BlockPool, int], prefetch: bool) -> None:
        """Swapped requests come back, oldest first, while the pools hold their blocks besides this step's (`taken`)
        and a block of headroom for every running request (and themselves); they run from the next step
        (`prefetch`: a forward runs meanwhile). One that cannot come back even into an idle pool (its shared
        blocks came back as copies) is recomputed instead."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            demand = self.swap.in_demand(request.cache)
            stepped = {pool: demand.get(pool, 0) + taken.get(pool, 0) for pool in demand.keys() | taken.keys()}
            if self._below_threshold(stepped) and self._fits(demand, dict(taken), headroom=len(self.running) + 1):
                self.swap.swap_in(request.cache)
                self.prefetched += prefetch
                self.running.append(self.swapped.popleft())
                self._touch(request)  # coming back counts as an access: it is not the next victim at once
            elif not self.running:
                self._requeue(self.swapped.popleft())
            else:
                break

    def _relieve(self) -> None:
        """`swap_threshold`: preempt the lowest-priority running requests while a pool is fuller than it."""
        while len(self.running) > 1 and not self._below_threshold({}):
            self._preempt(min(self.running, key=self._priority))

    def _below_threshold(self, demand: dict[BlockPool, int]) -> bool:
        """Whether every pool stays at or below `swap_threshold` after taking `demand` (always without one, and
        when nothing runs: an idle generator takes whatever fits)."""
        limit = self.config.swap_threshold
        if limit is None or not self.running:
            return True
        return all(pool.num_used + demand.get(pool, 0) <= limit * pool.num_blocks for pool in self._pools())

    def _pools(self) -> list[BlockPool]:
        return [pool for pool, _kind in device_pools(self.template)]

    def _drop_waiting_cache(self) -> bool:
        """Let the next queued request's prefix hit go (its blocks back to the pool); False if it held none."""
        if not self.waiting or self.waiting[0].cache is None:
            return False
        request = self.waiting[0]
        request.cache.reset()
        request.cache, request.fed = None, 0
        return True

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
            f"request {request.output.request_id} ({len(request.tokens)} tokens, {request.fed} of them in its cache) "
            f"needs more blocks for its next {q} tokens than the whole pool holds ({sorted(pools)} blocks of "
            f"{self.template.options.block_size}): give a larger `num_blocks` / `max_memory`, or a smaller "
            "`max_batch_tokens` so that prompts are computed in smaller chunks"
        )
        self._finish(request, "error")

    def _forward(self, batch: list[tuple[_Request, int]]) -> None:
        """Run the packed forward and sample; nothing is recorded until both succeed for the whole batch. If either
        raises (the model, or an interrupt), the step is rolled back (`_roll_back`) and the exception propagates.
        A request whose own sampling fails finishes with `error`; the others are unaffected."""
        tokens, positions, spans, keep = [], [], [], []
        for request, q in batch:
            start = len(tokens)
            tokens += request.tokens[request.fed : request.fed + q]
            positions += range(request.fed, request.fed + q)
            spans.append((start, start + q))
            keep.append(start + q - 1)
        ids = torch.tensor([tokens], device=self.model.device)
        cache = PackedCache([request.cache for request, _ in batch], spans, self.sliding)
        states = [request.settings.snapshot() for request, _ in batch]
        try:
            logits = self.model(input_ids=ids, position_ids=torch.tensor([positions], device=ids.device),
                                cache=cache, use_cache=True,
                                logits_to_keep=torch.tensor(keep, device=ids.device)).logits[0]  # fmt: skip
            samples = [self._sample(request, q, logits[index]) for index, (request, q) in enumerate(batch)]
        except BaseException:
            self._roll_back(batch, states)
            raise
        for (request, q), token in zip(batch, samples):
            self.recomputed_tokens += max(min(request.fed + q, request.peak) - request.fed, 0)
            request.fed += q
            request.peak = max(request.peak, request.fed)
            if self.prefix_cache is not None:
                request.keys = self.prefix_cache.register(request.cache, request.tokens[: request.fed], request.keys)
            if token is None:
                continue
            if isinstance(token, Exception):
                request.output.error = f"sampling failed: {type(token).__name__}: {token}"
                self.running.remove(request)
                self._finish(request, "error")
                continue
            request.output.generated_tokens.append(token)
            reason = request.settings.finish_reason(request.tokens, len(request.output.generated_tokens))
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)

    @staticmethod
    def _sample(request: _Request, q: int, logits: torch.Tensor) -> int | Exception | None:
        """The request's next token once this step completes its pending tokens (None before), or the error its
        sampling raised (it fails alone)."""
        if request.pending > q:
            return None
        try:
            return request.settings.next_token(logits, request.tokens)
        except Exception as error:  # noqa: BLE001 -- recorded on the request's output
            return error

    def _roll_back(self, batch: list[tuple[_Request, int]], states: list) -> None:
        """Undo a step that failed: the batch's caches may hold part of it (the layers before the failure wrote),
        so each of its requests drops its blocks and is queued first again, to be computed from its tokens
        (the prefix cache may recover whole blocks); its sampling generator goes back to its state before the
        step. Nothing of the step was recorded, so every request then produces what it would have."""
        for (request, _q), state in zip(reversed(batch), reversed(states)):
            request.settings.restore(state)
            self.running.remove(request)
            self._drop_blocks(request)

    def _finish(self, request: _Request, reason: str) -> None:
        request.output.finish_reason = reason
        if request.cache is not None:
            request.cache.reset()  # its blocks go back (prefix-cached ones stay findable until reused)
            request.cache = None
        self.finished.append(request.output)
        self._done += 1
        if self._progress is not None:
            self._progress.update(1)

    def _record(self, scheduled: int, holes: float) -> None:
        metrics = self.template.metrics()
        stats = self.prefix_cache.stats if self.prefix_cache is not None else None
        swap, copies = self.swap.stats, self.swap.copies.stats
        self.history.append(BatchMetrics(
            step=len(self.history), seconds=time.perf_counter() - self._started, running=len(self.running),
            waiting=len(self.waiting), finished=self._done, tokens_scheduled=scheduled,
            token_budget=self.config.max_batch_tokens,
            blocks_used=metrics.blocks_used + metrics.quantized_blocks_used,
            blocks_total=metrics.blocks_total + metrics.quantized_blocks_total, kv_bytes=metrics.used_bytes,
            shared_blocks=metrics.shared_blocks,
            prompt_tokens=self._admitted_prompt_tokens,
            prefix_hit_tokens=stats.hit_tokens if stats else 0, stalled=len(self.swapped) + self._waited,
            preempted_swap=self.preempted["swap"], preempted_recompute=self.preempted["recompute"],
            swap_out_blocks=swap.out_blocks, swap_out_bytes=swap.out_bytes, swap_in_blocks=swap.in_blocks,
            swap_in_bytes=swap.in_bytes, swap_stall_seconds=copies.stall_seconds,
            swap_copy_seconds=copies.copy_seconds, swap_prefetched=self.prefetched,
            recomputed_tokens=self.recomputed_tokens,
            fragmentation=holes, compactions=self.compactions,
        ))  # fmt: skip

    def compact(self, keep_free: int | None = None) -> tuple[dict[str, Fragmentation], dict[str, Fragmentation]]:
        """Pack the blocks in use to the low end of every pool (`pool_compaction.compact`; with `keep_free`, shrink
        each growable pool to its blocks in use plus that many; fixed pools keep their size). Returns the
        fragmentation before and after."""
        self.swap.copies.fence()  # a pending copy in writes the ids it was given, which compaction moves
        before = fragmentation(self.template)
        compact(self.template, self.prefix_cache, keep_free)
        self.compactions += 1
        return before, fragmentation(self.template)

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
        except BaseException:  # a failed step was rolled back: the results so far stay available
            self.finished.extendleft(reversed(list(results.values())))
            raise
        finally:
            if self._progress is not None:
                self._progress.close()
                self._progress = None
        return [results[key] for key in sorted(results)]


def generate_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]],
                   generation_config: GenerationConfig | None = None, **options) -> list[GenerationOutput]:  # fmt: skip
    """Generate for every prompt (lists or 1-D tensors of token ids) with continuous batching; one output per prompt,
    in order.

    `options` are `PagedCache` options (`block_size`, `num_blocks` / `max_memory`, `quant`, `eviction`, ...), the
    batching knobs of `BatchConfig` (`max_batch_tokens`, `max_num_seqs`, `prefix_caching`, `progress`), and
    generation settings that override `generation_config` (`max_new_tokens`, `do_sample`, `eos_token_id`, ...;
    `stop_strings` with `tokenizer=`). The model is switched to the `"paged"` attention. Requests that can never
    fit finish with `error` set; the others finish normally.
    """
    generator = BatchGenerator(model, generation_config, **options)
    for prompt in prompts:
        generator.add_request(prompt)
    return generator.run()


def _pools_up_front(options: PagedCacheConfig, model: PreTrainedModel) -> PagedCacheConfig:
    """A `max_memory` budget as `num_blocks`: a cache sizes `max_memory` pools at its first step, which would give
    every request pools of its own; the requests must share the template's from the start."""
    if options.max_memory is None:
        return options
    num_blocks = blocks_in_budget(model.config, options.max_memory, options.block_size, options.dtype or model.dtype,
                                  tensor_parallel_size(model.config))  # fmt: skip
    return dataclasses.replace(options, max_memory=None, num_blocks=num_blocks)


def _check_model(template: PagedCache) -> None:
    """The packed forward needs every layer stored in blocks (no linear-attention or chunked layers)."""
    for index, layer in enumerate(template.layers):
        paged = isinstance(layer, (PagedLayer, SharedKVLayer))
        if not paged or getattr(layer, "chunked", False):
            kind = "chunked attention" if paged else f"not stored in blocks ({type(layer).__name__}: linear attention, "
            kind += "" if paged else "a recurrent or convolutional state)"
            raise ValueError(
                f"Layer {index} is {kind}: the batch generator serves models whose layers are full or sliding-window "
                "attention; use `model.generate` with a `PagedCache` for this model"
            )


def _largest_hole_share(template: PagedCache) -> float:
    return max((f.hole_share for f in fragmentation(template).values()), default=0.0)


def _held_blocks(cache: PagedCache) -> int:
    """Blocks the rows of `cache` hold (full-precision and quantized; shared ones counted once per holder)."""
    return sum(len(blocks) for group in cache.groups.values() for row in group.rows for blocks in row.block_lists())
