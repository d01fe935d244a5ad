"""Who runs at a step, and who waits: the `RequestScheduler` owns the batch generator's queues of requests -- waiting
(new, or dropped to be computed again), running, swapped out to host memory -- and decides each step's batch: it
admits requests while their blocks fit, preempts under memory pressure (the victim policy picks, the preemption
strategy swaps or drops) and swaps requests back in. Each request's memory is one `RequestMemory`.

A step is scheduled only when the pools hold the blocks it takes; a new request is admitted only when its first chunk
fits with a block of headroom left for each running request. A request whose next block a running one is still
computing is admitted once it has (prefix caching), and requests that cannot fit even alone fail.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator

from ..blocks.pool import BlockPool
from ..cache import PagedCache
from ..memory.swap import SwapSpace
from .batch_config import BatchConfig
from .metrics import ServingCounters
from .preemption import RECOMPUTE, SWAP
from .prefix_cache import PrefixCache
from .request_memory import RequestMemory
from .requests import Request
from .scheduler import BlockRoom
from .state_pool import StatePool

Batch = list[tuple[Request, int]]  # the requests of a step and the tokens each computes
Finish = Callable[[Request, str], None]  # how a request leaves (its memory released first): the generator's
NEIGHBOURS = 64  # queued requests whose prompts a hybrid model's new request looks for a shared prefix with


class RequestScheduler:
    """The queues of one generator and the decisions that move requests between them."""

    def __init__(self, config: BatchConfig, template: PagedCache, states: StatePool, swap: SwapSpace,
                 prefix_cache: PrefixCache | None, counters: ServingCounters, finish: Finish,
                 whole_prompts: bool = False):  # fmt: skip
        self.order = config.make_scheduler()
        self.victims = config.make_victims()
        self.preemption = config.make_preemption()
        self.max_num_seqs, self.max_batch_tokens = config.max_num_seqs, config.max_batch_tokens
        self.template, self.states, self.swap, self.prefix_cache = template, states, swap, prefix_cache
        self.room = BlockRoom(template, config.swap_threshold)
        self.counters = counters
        self.finish = finish
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # preempted to host memory, oldest first
        self.waited = 0  # running requests that waited for blocks at the latest step
        self.step = 0  # the step being scheduled (the victim policies' clock)
        # The model's recurrent layers restart their state at a multi-token chunk: a prompt is computed whole.
        self.whole_prompts = whole_prompts

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def cancel(self, request_id: int) -> Request | None:
        """Take a queued, running or swapped request out of its queue, its memory released; None if none is there."""
        for queue in (self.waiting, self.running, self.swapped):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    self.release(request)
                    return request
        return None

    def release(self, request: Request) -> None:
        """Give back whatever the request holds (blocks, state slot, host copies)."""
        if request.memory is not None:
            request.memory.release()
            request.memory = None

    def next_batch(self, step: int) -> Batch:
        """The requests that run at `step` and the tokens each computes. Relieves the pools first (`swap_threshold`),
        brings swapped requests back, and admits new ones; the swap-ins started while the batch's forward will run are
        prefetches (`copy_stream.py`'s rules: the fence orders the forward after every copy so far)."""
        self.step = step
        copies = self.swap.copies
        copies.poll()
        if self.room.threshold is not None:
            self._relieve()
        if not self.running:  # no forward to overlap: swapped requests come back first and run now
            self._swap_in({}, prefetch=False)
        batch, taken = self._schedule()
        copies.fence()
        self._swap_in(taken, prefetch=bool(batch))
        if self.room.growable:  # a pool that grows reallocates its storage: a pending copy in would write the old one
            copies.fence()
        return batch

    def roll_back(self, batch: Batch) -> None:
        """The batch's forward failed: its caches may hold part of the step (the layers before the failure wrote), so
        each of its requests drops its memory and is queued first again, to be computed from its tokens."""
        for request, _q in reversed(batch):
            self.running.remove(request)
            self._requeue(request)

    def retire(self, request: Request) -> None:
        """A running request is done (finished, failed or cancelled by its sampling)."""
        self.running.remove(request)

    # ------------------------------------------------------------------ one step
    def _schedule(self) -> tuple[Batch, dict[BlockPool, int]]:
        """Running requests in the order hook's order, each preempting the last unscheduled ones while its step does
        not fit; then new requests while the pools hold them. Returns the batch and the blocks it takes per pool."""
        budget, batch, taken = self.max_batch_tokens, [], {}
        self.waited = 0
        queue = deque(self.order.order(list(self.running), self._priority))
        while queue and budget > 0:
            request = queue.popleft()
            q = self._chunk(request, budget, alone=not batch)
            if q == 0:  # a prompt computed whole that does not fit the rest of the budget: at a later step
                continue
            q = self._make_room(request, q, queue, taken, scheduled=bool(batch))
            if q == 0:
                self.waited += 1
            else:
                batch.append((request, q))
                budget -= q
                self.victims.touch(request, self.step)
        deferred = []  # requests that wait for a running request's blocks, in their order
        while self.waiting and not self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.memory is None:
                request.memory = RequestMemory(self.template.sibling(), self.states)
                if self.prefix_cache is not None:
                    request.fed, request.memory.start = self.prefix_cache.attach(request.cache, request.tokens)
                    request.marks = self.prefix_cache.checkpoint_marks(request.cache, request.tokens, request.fed,
                                                                       self._neighbours(request))  # fmt: skip
            if self.prefix_cache is not None and self.prefix_cache.computed_by_others(
                    request.tokens, request.fed, [(other.tokens, other.fed, other.marks) for other in self.running
                                                  if other.pending > 1]):  # fmt: skip
                self._drop_waiting_cache()  # it attaches again once the running request's blocks are cached
                deferred.append(self.waiting.popleft())  # the requests behind it are admitted meanwhile
                continue
            q = self._chunk(request, budget, alone=not batch and not self.running)
            if q == 0:
                break
            demand = request.memory.step_demand(q)
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
            request.memory.take_slot()  # a slot is free: at most `max_num_seqs` run
            if not request.admitted:  # its first admission (not a recompute)
                self._admit(request)
            batch.append((request, q))
            budget -= q
            self.victims.touch(request, self.step)
        self.waiting.extendleft(reversed(deferred))
        return batch, taken

    def _chunk(self, request: Request, budget: int, alone: bool) -> int:
        """Tokens `request` computes this step within `budget` tokens. Where a prompt is computed whole
        (`whole_prompts`), its first step takes all of it or nothing (beyond the budget when it runs alone)."""
        q = min(request.pending, budget)
        if self.whole_prompts and request.fed == 0 and q < request.pending:
            return request.pending if alone else 0
        return q

    def _neighbours(self, request: Request) -> Iterator[list[int]]:
        """The prompts a new request may share a prefix with: the running requests' and the next ones queued."""
        for other in itertools.chain(self.running, itertools.islice(self.waiting, NEIGHBOURS)):
            if other is not request:
                yield other.output.prompt_ids

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
        demand = request.memory.step_demand(q)
        while not self.room.fits(demand, taken, headroom=0):
            if queue:
                self._preempt(queue.pop())
            elif scheduled:  # a smaller chunk, where prompts may be cut
                whole = self.whole_prompts and request.fed == 0
                return 0 if whole else self.room.largest_chunk(request.cache, q - 1, taken)
            elif self._drop_waiting_cache():  # a queued request's prefix hit held blocks; it attaches again later
                continue
            else:
                self.running.remove(request)
                self._fail(request, q)
                return 0
        return q

    def _priority(self, request: Request) -> tuple[float, int]:
        """Higher is kept longer (the victim is the lowest), by the victim policy."""
        return self.victims.priority(request, self.step, self.room.total_blocks())

    # ------------------------------------------------------------------ preemption
    def _preempt(self, request: Request) -> None:
        """Swap `request` out or drop it for recompute, as the preemption strategy chooses."""
        mechanism = self.preemption.choose(request, self.swap, self.counters.compute_rate)
        if mechanism not in (SWAP, RECOMPUTE):
            raise ValueError(f"{type(self.preemption).__name__}.choose returned {mechanism!r}, not SWAP or RECOMPUTE")
        self.running.remove(request)
        if mechanism == SWAP:
            request.memory.swap_out(self.swap)
            self.swapped.append(request)
            self.counters.preempted[mechanism] += 1
        else:
            self._requeue(request)
            self.counters.preempted[RECOMPUTE] += 1

    def _requeue(self, request: Request) -> None:
        """Drop the request's memory (device or host) and queue it first, to be computed again from its tokens."""
        self.release(request)
        request.fed, request.keys, request.marks = 0, [], []
        self.waiting.appendleft(request)

    def _swap_in(self, taken: dict[BlockPool, int], prefetch: bool) -> None:
        """Swapped requests come back, oldest first, while the pools hold their blocks besides this step's (`taken`)
        and a block of headroom for every running request (and themselves); they run from the next step
        (`prefetch`: a forward runs meanwhile). One that cannot come back even into an idle pool (its shared
        blocks came back as copies) is recomputed instead."""
        while self.swapped and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            demand = request.memory.swap_demand(self.swap)
            stepped = {pool: demand.get(pool, 0) + taken.get(pool, 0) for pool in demand.keys() | taken.keys()}
            fits = self.room.fits(demand, dict(taken), headroom=len(self.running) + 1)
            if self.room.below_threshold(stepped, idle=not self.running) and fits:
                request.memory.swap_in(self.swap)
                self.counters.prefetched += prefetch
                self.running.append(self.swapped.popleft())
                self.victims.touch(request, self.step)  # coming back is an access: not the next victim
            elif not self.running:
                self._requeue(self.swapped.popleft())
                self.counters.preempted[RECOMPUTE] += 1
            else:
                break

    def _relieve(self) -> None:
        """`swap_threshold`: preempt the lowest-priority running requests while a pool is fuller than it."""
        while len(self.running) > 1 and not self.room.below_threshold({}, idle=False):
            self._preempt(self.victims.victims(self.running, self.step, self.room.total_blocks())[0])

    def _drop_waiting_cache(self) -> bool:
        """Let the next queued request's prefix hit go (its blocks back to the pool); False if it held none."""
        if not self.waiting or self.waiting[0].memory is None:
            return False
        request = self.waiting[0]
        self.release(request)
        request.fed, request.marks = 0, []
        return True

    def _fail(self, request: Request, q: int) -> None:
        pools = {pool.num_blocks for pool in request.memory.step_demand(q)}
        request.output.error = (
            f"request {request.request_id} ({len(request.tokens)} tokens, {request.fed} of them in its cache) "
            f"needs more blocks for its next {q} tokens than the whole pool holds ({sorted(pools)} blocks of "
            f"{self.template.options.block_size}): give a larger `num_blocks` / `max_memory`, or a smaller "
            "`max_batch_tokens` so that prompts are computed in smaller chunks"
        )
        self.finish(request, "error")
