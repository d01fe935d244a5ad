"""Continuous batching: many requests served in one memory budget by one unmodified HF model.

The engine: every step takes its batch from the `RequestScheduler` (`request_scheduler.py`: the queues, admission,
preemption, swap-in), runs one packed forward of its prompt chunks and decode tokens (`runner.py`: no padding
stored or computed), samples, and retires finished requests. Each request owns a `PagedCache` forked from one
template, so all requests share the template's pools, and everything `PagedCache` offers applies per request:
quantized blocks (more requests fit), eviction (a fixed per-request budget), sliding-window and hybrid models. Prefix
caching (`prefix_cache.py`) lets a request start from the blocks of an earlier one with the same leading tokens.

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
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

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
from .runner import check_packable, layer_sliding, packed_logits
from .prefix_cache import PrefixCache
from .recurrent import PerRequestLayers, StateCuts, restarts_state
from .request_scheduler import Batch, RequestScheduler
from .requests import GenerationOutput, Request
from .state_checkpoints import Saved, StateCheckpoints
from .state_pool import StatePool
from .settings import RequestSettings, request_settings, row_argmax, token_ids

__all__ = ["BatchConfig", "BatchGenerator", "BatchMetrics", "GenerationOutput", "generate_batch"]

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
        self.model = model
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.tokenizer = tokenizer
        self._settings({}, "the generation config", 1, 0)  # its values, checked once before any request
        check_model_features(model.config)  # the packed forward always runs the "paged" attention
        self.template = PagedCache(model.config, pools_up_front(PagedCacheConfig(**cache_options), model,
                                                                self.config))  # fmt: skip
        check_packable(self.template)
        self.sliding = layer_sliding(self.template)
        self.states = StatePool.of(model, self.template, self.config.max_num_seqs)  # recurrent state: a slot per request
        gather = self.states.gathered if self.states.batches_steps else None  # their single-token steps as one batch
        self.per_request = PerRequestLayers.of(model, self.template, gather,  # recurrent layers: by request
                                               self.states.state.tensors)  # fmt: skip
        self.compiled = CompiledModules(model, len(self.template.layers)) if self.config.compile else None
        self.onednn = (OneDnnLinears(model, self.config.prepack_weights, self.config.max_batch_tokens)
                       if self.config.onednn else None)  # fmt: skip
        self.fused = (FusedDecoderLayers.of(model, len(self.template.layers), self.onednn,
                                            self.per_request.layers if self.per_request is not None else [])
                      if self.onednn is not None and self.compiled is None else None)  # fmt: skip
        self.prefix_cache = self._prefix_cache()
        self.swap = self.config.make_preemption().swap_space(self.template, model.device)
        self.counters = ServingCounters()
        self.requests = RequestScheduler(self.config, self.template, self.states, self.swap, self.prefix_cache,
                                         self.counters, self._finish, restarts_state(self.template))  # fmt: skip
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:  # set_attn_implementation ignored: nothing changed
            raise UnsupportedAttentionError(
                f"{type(model).__name__} ignores `attn_implementation` (its attention is its own code, "
                f"{model.config._attn_implementation!r}), so the packed forward cannot run the \"paged\" attention it "
                "needs: use `model.generate` with a `PagedCache` for this model (the gather path, exact)"
            )
        # Called with the batch before every packed forward (checks of the copy ordering rules, tracing).
        self.before_forward: list[Callable[[Batch], None]] = []
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
        self.requests.waiting.append(request)
        return request.request_id

    def _settings(self, overrides: dict, where: str, prompt_length: int, seed: int) -> RequestSettings:
        return request_settings(self.generation_config, overrides, where, prompt_length, self.vocab_size,
                                self.model.device, seed, self.tokenizer)  # fmt: skip

    def cancel_request(self, request_id: int) -> bool:
        """Stop a queued or running request now and free its blocks; False if it already finished."""
        request = self.requests.cancel(request_id)
        if request is not None:
            self._finish(request, "cancelled")
        return request is not None

    def reset_prefix_cache(self) -> None:
        """Forget the prefixes cached so far (vLLM's `LLM.reset_prefix_cache`): later requests compute their prompts
        again, while what runs keeps its blocks and its results. A warm generator then serves a workload as a fresh one
        would, with the memory it already holds. Nothing to do without prefix caching."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def has_work(self) -> bool:
        return self.requests.has_work()

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
        """The scheduler's batch (admitting, preempting under pressure, swapping requests back in:
        `RequestScheduler.next_batch`), one packed forward, sampling, finished requests retired."""
        batch = self.requests.next_batch(len(self.history))
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
        if self.config.defragment_threshold is not None and holes > self.config.defragment_threshold:
            self.defragment()
            holes = largest_hole_share(self.template)
        self._record(sum(q for _, q in batch), holes)

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
        checkpoints = self.prefix_cache is not None and self.prefix_cache.checkpoints is not None
        cuts = StateCuts([[mark - request.fed for mark in request.marks if request.fed < mark < request.fed + q]
                          for request, q in batch]) if checkpoints else None  # fmt: skip
        try:
            logits = packed_logits(self.model, chunks, self.sliding, self.per_request, self.compiled, self.onednn,
                                   self.fused, cuts)  # fmt: skip
            samples = self._next_tokens(batch, logits)
        except BaseException as error:
            self._roll_back(batch, states)
            if not isinstance(error, Exception) or isinstance(error, MODEL_REFUSALS):
                raise
            self._isolate(batch, error)
            return
        for index, ((request, q), token) in enumerate(zip(batch, samples)):
            self.counters.recomputed_tokens += max(min(request.fed + q, request.peak) - request.fed, 0)
            cut = {request.fed + offset: saved for offset, saved in cuts.taken[index].items()} if cuts is not None else {}
            request.fed += q
            request.peak = max(request.peak, request.fed)
            if self.prefix_cache is not None:
                self._register(request, cut)
            if token is None:
                continue
            if isinstance(token, Exception):
                request.output.error = f"sampling failed: {type(token).__name__}: {token}"
                self.requests.retire(request)
                self._finish(request, "error")
                continue
            request.output.generated_tokens.append(token)
            reason = request.settings.finish_reason(request.tokens, len(request.output.generated_tokens))
            if reason is not None:
                self.requests.retire(request)
                self._finish(request, reason)

    def _prefix_cache(self) -> PrefixCache | None:
        """The prefix cache, where `prefix_caching` asks for one and the caches support it; a hybrid model's keeps
        its states after cached prefixes within `checkpoint_memory` (none there: no hits, no prefix cache)."""
        if not (self.config.prefix_caching and self.template.options.sharing
                and PrefixCache.supports(self.template, self.states.state)):  # fmt: skip
            return None
        if not self.states.slot_bytes:
            return PrefixCache(self.template)
        checkpoints = StateCheckpoints(self.config.checkpoint_bytes(self.states.pool_bytes), self.states.slot_bytes)
        usable = checkpoints.capacity and self.per_request is not None and self.per_request.cuts_states
        return PrefixCache(self.template, checkpoints) if usable else None

    def _register(self, request: Request, cut: dict[int, Saved]) -> None:
        """After a step: the request's new full blocks are cached, and its state kept at its marks: those inside
        the step's chunk as its per-request layers copied them there (`cut`, by position), one at its end from its
        slot."""
        request.keys = self.prefix_cache.register(request.cache, request.tokens[: request.fed], request.keys)
        for position, saved in cut.items():
            self.prefix_cache.keep_state(request.keys, position, saved)
        if request.fed in request.marks:
            self.prefix_cache.keep_state(request.keys, request.fed, self.states.saved(request.cache))
        request.marks = [mark for mark in request.marks if mark > request.fed]

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
        """Undo a step that failed: each of its requests is queued again, to be computed from its tokens
        (`RequestScheduler.roll_back`; the prefix cache may recover whole blocks), and its sampling generator goes
        back to its state before the step. Nothing of the step was recorded, so every request then produces what
        it would have."""
        for (request, _q), state in zip(batch, states):
            request.settings.restore(state)
        self.requests.roll_back(batch)

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
        self.requests.waiting.remove(request)  # queued again by the roll-back
        request.output.error = f"its forward failed: {type(error).__name__}: {error}"
        self._finish(request, "error")

    def _finish(self, request: Request, reason: str) -> None:
        request.output.finish_reason = reason
        self.requests.release(request)
        self.finished.append(request.output)
        self.counters.finished += 1
        if self._progress is not None:
            self._progress.update(1)

    def _record(self, scheduled: int, holes: float) -> None:
        prefix = self.prefix_cache.stats if self.prefix_cache is not None else None
        requests = self.requests
        queues = (len(requests.running), len(requests.waiting), len(requests.swapped) + requests.waited)
        state = self.states.usage([request.cache for request in requests.running])
        kept = self.prefix_cache.checkpoints if self.prefix_cache is not None else None
        self.history.append(self.counters.snapshot(
            len(self.history), time.perf_counter() - self._started, queues, scheduled, self.config.max_batch_tokens,
            self.template.metrics(), prefix, self.swap.stats, self.swap.copies.stats, holes, state,
            (len(kept), kept.nbytes) if kept is not None else (0, 0),
            self.onednn.packed_bytes if self.onednn is not None else 0,
        ))  # fmt: skip

    def defragment(self, keep_free: int | None = None) -> tuple[dict[str, Fragmentation], dict[str, Fragmentation]]:
        """Move the blocks in use to the low end of every pool (`memory/defragment.py`; with `keep_free`, shrink
        each growable pool to its blocks in use plus that many; fixed pools keep their size). Returns the
        fragmentation before and after."""
        self.swap.copies.fence()  # a pending copy in writes the ids it was given, which defragmenting moves
        before = fragmentation(self.template)
        prefix = self.prefix_cache  # its entries hold block ids too
        held = [] if prefix is None else [functools.partial(prefix.remap, pools=self.template.blocks.group_pools())]
        defragment(self.template, held, keep_free)
        self.counters.defragmentations += 1
        return before, fragmentation(self.template)

    def compact(self, keep_free: int | None = None) -> tuple[dict[str, Fragmentation], dict[str, Fragmentation]]:
        """Deprecated: `defragment` (in this library, "compact" is what eviction does to a row)."""
        warnings.warn("`BatchGenerator.compact` is `defragment`", FutureWarning, stacklevel=2)
        return self.defragment(keep_free)

    def metrics(self) -> BatchMetrics | None:
        """The latest snapshot (None before the first step)."""
        return self.history[-1] if self.history else None

    def run(self) -> list[GenerationOutput]:
        """Serve every queued request; results in request order."""
        results = {}
        if self.config.progress:
            from tqdm.auto import tqdm

            self._progress = tqdm(total=len(self.requests.waiting) + len(self.requests.running), desc="requests")
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

