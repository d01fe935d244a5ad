"""Continuous batching: many requests served in one memory budget by one unmodified HF model.

Every step packs prompt chunks and decode tokens of many requests into one forward (`PackedCache`): no
padding is stored or computed. Each request owns a `PagedCache` forked from one template, so all requests
share the template's pools; a step is scheduled only when the pools hold the blocks it takes, and a new
request is admitted only when its first chunk fits with a block of headroom left for each running request.
Everything `PagedCache` offers applies per request: quantized blocks (more requests fit), eviction (a fixed
per-request budget), sliding-window and hybrid models. Prefix caching (`prefix_cache.py`) lets a request
start from the blocks of an earlier one with the same leading tokens; a request whose next block a running one is
still computing is admitted once it has.

The strategies are objects of their own: the `Scheduler` orders a step's running requests (`scheduler.py`);
under memory pressure (a running request cannot get its next block, or the pools pass `swap_threshold`) the
victim policy's lowest-priority requests are preempted, and the `Preemption` strategy (`preemption.py`) says
whether each is swapped to host blocks (`swap.py`, swapped back a step before it runs again; on CUDA the copy
in overlaps that step's forward: `copy_stream.py`) or dropped and queued again with its generated tokens as
part of its prompt (recompute; the prefix cache may recover part of it).
Each request's generation settings are checked when it is added (`settings.py`); a step records nothing
until its forward and sampling succeed, and is rolled back (its requests recomputed) if either raises; a request
whose forward keeps failing fails alone (`_isolate`).

    outputs = generate_batch(model, [ids_a, ids_b], max_new_tokens=64, num_blocks=2048)
    outputs[0].generated_tokens
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..blocks.pool import BlockPool
from ..cache import PagedCache
from ..config import PagedCacheConfig
from ..cpu_runtime.compiled import CompiledModules
from ..cpu_runtime.fused_layers import FusedDecoderLayers
from ..cpu_runtime.onednn import OneDnnLinears
from ..errors import UnsupportedAttentionError, UnsupportedModelError
from ..memory.defragment import Fragmentation, defragment, fragmentation, largest_hole_share
from ..memory.host_heap import keep_freed_host_memory
from ..paged_attention import ATTENTION_NAME, check_model_features
from .batch_config import BatchConfig, pools_up_front, split_options
from .metrics import BatchMetrics, ServingCounters
from .packed_cache import check_packable, layer_sliding, packed_logits
from .preemption import RECOMPUTE, SWAP
from .prefix_cache import PrefixCache
from .recurrent import PerRequestLayers
from .requests import GenerationOutput, Request
from .scheduler import BlockRoom
from .state_pool import StatePool
from .settings import RequestSettings, request_settings, row_argmax, token_ids

__all__ = ["BatchConfig", "BatchGenerator", "BatchMetrics", "GenerationOutput", "generate_batch"]

Batch = list[tuple[Request, int]]  # the requests of a step and the tokens each computes
_log = logging.getLogger(__name__)
# What a failed forward raises when the model's code, not a request, is at fault: raised, never charged to a request.
MODEL_REFUSALS = (UnsupportedAttentionError, UnsupportedModelError)


class BatchGenerator:
    """Serves requests added with `add_request` (streaming use: `get_result`, `cancel_request`, or iterate)."""

    def __init__(self, model: PreTrainedModel, generation_config: GenerationConfig | None = None, tokenizer=None,
                 **options):  # fmt: skip
        """`tokenizer` is needed only for `stop_strings`. Every option is checked before anything changes: a failed
        constructor leaves the model as it was (the `"paged"` attention is selected last)."""
        self.config, self.generation_config, cache_options = split_options(model, generation_config, options)
        if self.config.keep_host_memory and not keep_freed_host_memory():  # process-wide: nothing of ours to undo
            raise ValueError("`keep_host_memory=True` sets glibc's malloc thresholds, which this process's C library "
                             "does not take (it is not glibc, or refuses them): leave it False")  # fmt: skip
        self.scheduler = self.config.make_scheduler()
        self.victims = self.config.make_victims()
        self.preemption = self.config.make_preemption()
        self.model = model
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.tokenizer = tokenizer
        self._settings({}, "the generation config", 1, 0)  # its values, checked once before any request
        check_model_features(model.config)  # the packed forward always runs the "paged" attention
        self.template = PagedCache(model.config, pools_up_front(PagedCacheConfig(**cache_options), model,
                                                                self.config.max_num_seqs))  # fmt: skip
        check_packable(self.template)
        self.room = BlockRoom(self.template, self.config.swap_threshold)
        self.sliding = layer_sliding(self.template)
        self.per_request = PerRequestLayers.of(model, self.template)  # recurrent layers: one call per request
        self.states = StatePool.of(model, self.template, self.config.max_num_seqs)  # their state: a slot per request
        self.compiled = CompiledModules(model, len(self.template.layers)) if self.config.compile else None
        self.onednn = (OneDnnLinears(model, self.config.prepack_weights, self.config.max_batch_tokens)
                       if self.config.onednn else None)  # fmt: skip
        self.fused = (FusedDecoderLayers.of(model, len(self.template.layers), self.onednn,
                                            self.per_request.layers if self.per_request is not None else [])
                      if self.onednn is not None and self.compiled is None else None)  # fmt: skip
        cacheable = self.config.prefix_caching and self.template.options.sharing and PrefixCache.supports(self.template)
        self.prefix_cache = PrefixCache(self.template) if cacheable else None
        self.swap = self.preemption.swap_space(self.template, model.device)
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:  # set_attn_implementation ignored: nothing changed
            raise UnsupportedAttentionError(
                f"{type(model).__name__} ignores `attn_implementation` (its attention is its own code, "
                f"{model.config._attn_implementation!r}), so the packed forward cannot run the \"paged\" attention it "
                "needs: use `model.generate` with a `PagedCache` for this model (the gather path, exact)"
            )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # preempted to host memory, oldest first
        self.counters = ServingCounters()
        # Called with the batch before every packed forward (checks of the copy ordering rules, tracing).
        self.before_forward: list[Callable[[Batch], None]] = []
        self._waited = 0  # running requests that waited for blocks at the latest step
        self.finished: deque[GenerationOutput] = deque()
        self.history: list[BatchMetrics] = []
        self._next_id = 0
        self._started = time.perf_counter()
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
        request = Request(GenerationOutput(self._next_id, prompt), chosen)
        self._next_id += 1
        self.waiting.append(request)
        return request.request_id

    def _settings(self, overrides: dict, where: str, prompt_length: int, seed: int) -> RequestSettings:
        return request_settings(self.generation_config, overrides, where, prompt_length, self.vocab_size,
                                self.model.device, seed, self.tokenizer)  # fmt: skip

    def cancel_request(self, request_id: int) -> bool:
        """Stop a queued or running request now and free its blocks; False if it already finished."""
        for queue in (self.waiting, self.running, self.swapped):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "cancelled")
                    return True
        return False

    def reset_prefix_cache(self) -> None:
        """Forget the prefixes cached so far (vLLM's `LLM.reset_prefix_cache`): later requests compute their prompts
        again, while what runs keeps its blocks and its results. A warm generator then serves a workload as a fresh one
        would, with the memory it already holds. Nothing to do without prefix caching."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

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
        if self.room.growable:  # a pool that grows reallocates its storage: a pending copy in would write the old one
            copies.fence()
        if batch:
            started = time.perf_counter()
            # Requests isolated after a shared forward failed run in forwards of their own, so one that keeps
            # failing fails alone.
            together = [item for item in batch if not item[0].isolated]
            for forward in [together] * bool(together) + [[item] for item in batch if item[0].isolated]:
                self._forward(forward)
            self.counters.forward_seconds += time.perf_counter() - started
            self.counters.forward_tokens += sum(q for _, q in batch)
        holes = largest_hole_share(self.template)
        if self.config.compact_threshold is not None and holes > self.config.compact_threshold:
            self.compact()
            holes = largest_hole_share(self.template)
        self._record(sum(q for _, q in batch), holes)

    def _schedule(self) -> tuple[Batch, dict[BlockPool, int]]:
        """Running requests in the scheduler's order, each preempting the last unscheduled ones while its step does
        not fit; then new requests while the pools hold them. Returns the batch and the blocks it takes per pool."""
        budget, batch, taken = self.config.max_batch_tokens, [], {}
        self._waited = 0
        queue = deque(self.scheduler.order(list(self.running), self._priority))
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
                self.victims.touch(request, len(self.history))
        deferred = []  # requests that wait for a running request's blocks, in their order
        while self.waiting and not self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.cache is None:
                request.cache = self.template.sibling()
                if self.prefix_cache is not None:
                    request.fed = self.prefix_cache.attach(request.cache, request.tokens)
            if self.prefix_cache is not None and self.prefix_cache.computed_by_others(
                    request.tokens, request.fed, [(other.tokens, other.fed) for other in self.running
                                                  if other.pending > 1]):  # fmt: skip
                self._drop_waiting_cache()  # it attaches again once the running request's blocks are cached
                deferred.append(self.waiting.popleft())  # the requests behind it are admitted meanwhile
                continue
            q = min(request.pending, budget)
            demand = request.cache.step_demand(q)
            idle = not self.running
            if not (self.room.below_threshold(demand, idle) and self.room.fits(demand, taken, len(self.running))):
                if idle and not batch:  # even an empty pool cannot take its first chunk
                    self.waiting.popleft()
                    self._fail(request, q)
                    continue
                # Its prefix hit took cached blocks out of the free queue that this step's requests may need.
                self._drop_waiting_cache()
                break
            self.running.append(self.waiting.popleft())
            self.states.attach(request.cache)  # a slot is free: at most `max_num_seqs` run
            if not request.admitted:  # its first admission (not a recompute)
                self._admit(request)
            batch.append((request, q))
            budget -= q
            self.victims.touch(request, len(self.history))
        self.waiting.extendleft(reversed(deferred))
        return batch, taken

    def _admit(self, request: Request) -> None:
        request.admitted = True
        request.output.prefix_hit_tokens = request.fed
        self.counters.admitted_prompt_tokens += len(request.output.prompt_ids)
        if self.prefix_cache is not None:
            self.prefix_cache.stats.record(len(request.tokens), request.fed)

    def _make_room(self, request: Request, q: int, queue: deque[Request], taken: dict[BlockPool, int],
                   scheduled: bool) -> int:  # fmt: skip
        """Tokens of `request` this step computes: `q` once the last requests of `queue` are preempted until its
        step fits. With none left to preempt and others running this step, a smaller prompt chunk that fits, or
        none (it waits for their blocks: preempting itself would only bring it back to the same shortage). A
        request that is short even alone fails."""
        demand = request.cache.step_demand(q)
        while not self.room.fits(demand, taken, headroom=0):
            if queue:
                self._preempt(queue.pop())
            elif scheduled:
                return self.room.largest_chunk(request.cache, q - 1, taken)
            elif self._drop_waiting_cache():  # a queued request's prefix hit held blocks; it attaches again later
                continue
            else:
                self.running.remove(request)
                self._fail(request, q)
                return 0
        return q

    def _priority(self, request: Request) -> tuple[float, int]:
        """Higher is kept longer (the victim is the lowest), by the victim policy."""
        return self.victims.priority(request, len(self.history), self.room.total_blocks())

    # ------------------------------------------------------------------ preemption
    def _preempt(self, request: Request) -> None:
        """Swap `request` out or drop it for recompute, as the preemption strategy chooses."""
        mechanism = self.preemption.choose(request, self.swap, self.counters.compute_rate)
        if mechanism not in (SWAP, RECOMPUTE):
            raise ValueError(f"{type(self.preemption).__name__}.choose returned {mechanism!r}, not SWAP or RECOMPUTE")
        self.running.remove(request)
        if mechanism == SWAP:
            self.swap.swap_out(request.cache)
            self.states.swap_out(request.cache)
            self.swapped.append(request)
            self.counters.preempted[mechanism] += 1
        else:
            self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """Drop the request's blocks (device or host) and queue it first, to be computed again from its tokens."""
        self._drop_blocks(request)
        self.counters.preempted[RECOMPUTE] += 1

    def _drop_blocks(self, request: Request) -> None:
        self.states.detach(request.cache)
        request.cache.reset()  # also after a forward interrupted halfway (some layers wrote, others not)
        request.cache, request.fed, request.keys = None, 0, []
        self.waiting.appendleft(request)

    def _swap_in(self, taken: dict[BlockPool, int], prefetch: bool) -> None:
        """Swapped requests come back, oldest first, while the pools hold their blocks besides this step's (`taken`)
        and a block of headroom for every running request (and themselves); they run from the next step
        (`prefetch`: a forward runs meanwhile). One that cannot come back even into an idle pool (its shared
        blocks came back as copies) is recomputed instead."""
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            demand = self.swap.in_demand(request.cache)
            stepped = {pool: demand.get(pool, 0) + taken.get(pool, 0) for pool in demand.keys() | taken.keys()}
            fits = self.room.fits(demand, dict(taken), headroom=len(self.running) + 1)
            if self.room.below_threshold(stepped, idle=not self.running) and fits:
                self.swap.swap_in(request.cache)
                self.states.swap_in(request.cache)
                self.counters.prefetched += prefetch
                self.running.append(self.swapped.popleft())
                self.victims.touch(request, len(self.history))  # coming back is an access: not the next victim
            elif not self.running:
                self._requeue(self.swapped.popleft())
            else:
                break

    def _relieve(self) -> None:
        """`swap_threshold`: preempt the lowest-priority running requests while a pool is fuller than it."""
        while len(self.running) > 1 and not self.room.below_threshold({}, idle=False):
            self._preempt(self.victims.victims(self.running, len(self.history), self.room.total_blocks())[0])

    def _drop_waiting_cache(self) -> bool:
        """Let the next queued request's prefix hit go (its blocks back to the pool); False if it held none."""
        if not self.waiting or self.waiting[0].cache is None:
            return False
        request = self.waiting[0]
        request.cache.reset()
        request.cache, request.fed = None, 0
        return True

    def _fail(self, request: Request, q: int) -> None:
        pools = {pool.num_blocks for pool in request.cache.step_demand(q)}
        request.output.error = (
            f"request {request.request_id} ({len(request.tokens)} tokens, {request.fed} of them in its cache) "
            f"needs more blocks for its next {q} tokens than the whole pool holds ({sorted(pools)} blocks of "
            f"{self.template.options.block_size}): give a larger `num_blocks` / `max_memory`, or a smaller "
            "`max_batch_tokens` so that prompts are computed in smaller chunks"
        )
        self._finish(request, "error")

    # ------------------------------------------------------------------ forward
    def _forward(self, batch: Batch) -> None:
        """Run the packed forward and sample; nothing is recorded until both succeed for the whole batch. If either
        raises, the step is rolled back (`_roll_back`). An interrupt, or a refusal of the model's code (`MODEL_REFUSALS`),
        propagates; any other error is the requests' own: a request alone in its forward finishes with `error`, and
        those of a shared forward are isolated (each runs alone from then on), so the others go on. A request whose
        own sampling fails finishes with `error`; the others are unaffected."""
        for hook in self.before_forward:
            hook(batch)
        chunks = [(request.cache, request.tokens[request.fed : request.fed + q], request.fed) for request, q in batch]
        states = [request.settings.snapshot() for request, _ in batch]
        try:
            logits = packed_logits(self.model, chunks, self.sliding, self.per_request, self.compiled, self.onednn,
                                   self.fused)  # fmt: skip
            samples = self._next_tokens(batch, logits)
        except BaseException as error:
            self._roll_back(batch, states)
            if not isinstance(error, Exception) or isinstance(error, MODEL_REFUSALS):
                raise
            self._isolate(batch, error)
            return
        for (request, q), token in zip(batch, samples):
            self.counters.recomputed_tokens += max(min(request.fed + q, request.peak) - request.fed, 0)
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
    def _next_tokens(batch: Batch, logits: torch.Tensor) -> list[int | Exception | None]:
        """`Request.next_token` of each request of `batch` from its row of `logits`; the argmaxes of the greedy ones
        that produce a token (`RequestSettings.greedy`) in one op."""
        greedy = [index for index, (request, q) in enumerate(batch)
                  if request.samples_after(q) and request.settings.greedy]  # fmt: skip
        rows = logits if len(greedy) == len(batch) else logits[greedy]
        picked = dict(zip(greedy, row_argmax(rows.float()).tolist())) if greedy else {}
        return [picked[index] if index in picked else request.next_token(q, logits[index])
                for index, (request, q) in enumerate(batch)]  # fmt: skip

    def _roll_back(self, batch: Batch, states: list) -> None:
        """Undo a step that failed: the batch's caches may hold part of it (the layers before the failure wrote),
        so each of its requests drops its blocks and is queued first again, to be computed from its tokens
        (the prefix cache may recover whole blocks); its sampling generator goes back to its state before the
        step. Nothing of the step was recorded, so every request then produces what it would have."""
        for (request, _q), state in zip(reversed(batch), reversed(states)):
            request.settings.restore(state)
            self.running.remove(request)
            self._drop_blocks(request)

    def _isolate(self, batch: Batch, error: Exception) -> None:
        """After the rolled-back forward of `batch` raised `error`: its request fails if it ran alone; else each of
        its requests runs alone from then on."""
        if len(batch) > 1:
            for request, _q in batch:
                request.isolated = True
            _log.warning("a packed forward of requests %s failed (%s: %s); each runs alone from now on",
                         [request.request_id for request, _q in batch], type(error).__name__, error)  # fmt: skip
            return
        request = batch[0][0]
        self.waiting.remove(request)  # queued again by the roll-back
        request.output.error = f"its forward failed: {type(error).__name__}: {error}"
        self._finish(request, "error")

    def _finish(self, request: Request, reason: str) -> None:
        request.output.finish_reason = reason
        if request.cache is not None:
            self.states.detach(request.cache)
            request.cache.reset()  # its blocks go back (prefix-cached ones stay findable until reused)
            request.cache = None
        self.finished.append(request.output)
        self.counters.finished += 1
        if self._progress is not None:
            self._progress.update(1)

    def _record(self, scheduled: int, holes: float) -> None:
        prefix = self.prefix_cache.stats if self.prefix_cache is not None else None
        queues = (len(self.running), len(self.waiting), len(self.swapped) + self._waited)
        state = self.states.usage([request.cache for request in self.running])
        self.history.append(self.counters.snapshot(
            len(self.history), time.perf_counter() - self._started, queues, scheduled, self.config.max_batch_tokens,
            self.template.metrics(), prefix, self.swap.stats, self.swap.copies.stats, holes, state,
            self.onednn.packed_bytes if self.onednn is not None else 0,
        ))  # fmt: skip

    def compact(self, keep_free: int | None = None) -> tuple[dict[str, Fragmentation], dict[str, Fragmentation]]:
        """Pack the blocks in use to the low end of every pool (`memory/defragment.py`; with `keep_free`, shrink
        each growable pool to its blocks in use plus that many; fixed pools keep their size). Returns the
        fragmentation before and after."""
        self.swap.copies.fence()  # a pending copy in writes the ids it was given, which compaction moves
        before = fragmentation(self.template)
        prefix = self.prefix_cache  # its entries hold block ids too
        held = [] if prefix is None else [functools.partial(prefix.remap, groups=self.template.groups)]
        defragment(self.template, held, keep_free)
        self.counters.compactions += 1
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

