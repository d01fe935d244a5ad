"""Block copies between device and host memory, off the compute path: on CUDA a side stream ordered by events, so
copies overlap the forwards that do not need them; elsewhere the same calls run synchronously.

A transfer has two parts: `copy`, enqueued after everything the compute stream has enqueued so far (so the blocks
it reads are final), and `finish`, run on the host once the copy has completed (e.g. scattering a staged
device-to-host copy into its host slots). Transfers complete in submission order (one stream). Two rules keep
the classic asynchronous-copy bugs out, and the scheduler follows them:

- `fence()` before the compute stream touches blocks again: it waits for every copy submitted so far (on CUDA a
  device-side wait; the host does not block). A forward then never writes a device block that a copy out has
  not read yet (those blocks went back to the pool when the copy was submitted), nor reads one that a copy in
  has not filled.
- `Transfer.wait()` before the host reads what a copy wrote (host slots, before they are copied in again).

Modes: "sync" runs each transfer when it is submitted (the default off CUDA); "async" uses the CUDA side stream;
"deferred" holds every transfer until a wait or a fence needs it -- the latest moment the rules allow -- so that
tests on CPU catch a missing fence or wait (the outputs change).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch


COPY_MODES = ("auto", "sync", "async", "deferred")


@dataclass
class CopyStats:
    """Since the stream was made: transfers submitted, seconds the copies took, and seconds the host or the compute
    stream waited for them (a copy that overlapped compute entirely costs no stall)."""

    transfers: int = 0
    copy_seconds: float = 0.0
    stall_seconds: float = 0.0


class Transfer:
    """One submitted copy; `done()` polls it without blocking, `wait()` blocks the host until it has completed (and
    its `finish` has run). Both retire every earlier transfer first: transfers complete in order."""

    def __init__(self, stream: CopyStream, device: torch.device | None, copy: Callable[[], None],
                 finish: Callable[[], None] | None):  # fmt: skip
        self._owner = stream
        self.device = device
        self.copy = copy
        self.finish = finish
        self.completed = False
        self.events: tuple | None = None  # CUDA: (start, end) recorded on the side stream

    def done(self) -> bool:
        self._owner.poll()
        return self.completed

    def wait(self) -> None:
        self._owner.retire(self)

    def complete(self) -> None:
        """Mark it completed and let go of its parts (and the staging buffers they hold)."""
        self.completed = True
        self.copy = self.finish = None


class CopyStream:
    """Runs transfers by `mode` ("auto": "async" when the first transfer's device is CUDA, "sync" otherwise)."""

    def __init__(self, mode: str = "auto"):
        if mode not in COPY_MODES:
            raise ValueError(f"`swap_copies` must be one of {COPY_MODES}, got {mode!r}")
        self.mode = mode
        self.stats = CopyStats()
        self._pending: deque[Transfer] = deque()  # submitted, not yet completed, in order
        self._fences: list[tuple] = []  # CUDA: (compute-stream event at a fence, the copy end it waited for)
        self._side: torch.cuda.Stream | None = None

    def submit(self, device: torch.device | None, copy: Callable[[], None],
               finish: Callable[[], None] | None = None) -> Transfer:  # fmt: skip
        """Queue `copy` (then `finish`) for blocks on `device` (None: blocks on several devices, or none: run
        synchronously, after every copy queued before); returns its `Transfer`."""
        self.check(device)
        transfer = Transfer(self, device, copy, finish)
        self.stats.transfers += 1
        if device is None:
            self.synchronize()
            self._run(transfer)
            return transfer
        if self.mode == "auto":
            self.mode = "async" if device.type == "cuda" else "sync"
        if self.mode == "sync":
            self._run(transfer)
        elif self.mode == "deferred":
            self._pending.append(transfer)
        else:
            self._launch(transfer, device)
        return transfer

    def check(self, device: torch.device | None) -> None:
        """Raise (before anything is copied) if the mode cannot copy blocks on `device`."""
        if self.mode == "async" and device is not None and device.type != "cuda":
            raise ValueError(f"`swap_copies='async'` needs blocks on a CUDA device, they are on {device}: use 'auto'")

    def fence(self) -> None:
        """Order the compute stream after every copy submitted so far (deferred copies run now)."""
        if not self._pending:
            return
        if self.mode == "deferred":
            self.retire(self._pending[-1])
            return
        compute = torch.cuda.current_stream(self._side.device)
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(compute)
        end = self._pending[-1].events[1]
        compute.wait_event(end)
        self._fences.append((mark, end))

    def poll(self) -> None:
        """Retire the transfers that have completed (on CUDA: whose end event has passed), without blocking."""
        while self.mode == "async" and self._pending and self._pending[0].events[1].query():
            self._complete(self._pending.popleft())
        self._count_fence_stalls()

    def retire(self, transfer: Transfer) -> None:
        """Block until `transfer` and every earlier one have completed, and run their `finish`."""
        while not transfer.completed:
            earliest = self._pending.popleft()
            if self.mode == "deferred":
                self._run(earliest)
            else:
                started = time.perf_counter()
                earliest.events[1].synchronize()
                self.stats.stall_seconds += time.perf_counter() - started
                self._complete(earliest)
        self._count_fence_stalls()

    def synchronize(self) -> None:
        """Block until every transfer submitted so far has completed."""
        if self._pending:
            self.retire(self._pending[-1])

    @property
    def in_flight(self) -> int:
        """Transfers submitted and not yet completed."""
        return len(self._pending)

    # ------------------------------------------------------------------ helpers
    def _run(self, transfer: Transfer) -> None:
        """Copy and finish on the host's time (sync and deferred modes): the caller waits for all of it (on CUDA the
        copy is enqueued on the compute stream, which the host waits for before the finish reads its result)."""
        started = time.perf_counter()
        transfer.copy()
        _drain(transfer.device)
        if transfer.finish is not None:
            transfer.finish()
        seconds = time.perf_counter() - started
        self.stats.copy_seconds += seconds
        self.stats.stall_seconds += seconds
        transfer.complete()

    def _launch(self, transfer: Transfer, device: torch.device) -> None:
        """Enqueue the copy on the side stream, after the compute stream's work so far (it wrote the source)."""
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            start.record()
            transfer.copy()
            end.record()
        transfer.events = (start, end)
        self._pending.append(transfer)

    def _complete(self, transfer: Transfer) -> None:
        start, end = transfer.events
        self.stats.copy_seconds += start.elapsed_time(end) / 1e3
        if transfer.finish is not None:
            transfer.finish()
        transfer.complete()

    def _count_fence_stalls(self) -> None:
        """A fence stalled the compute stream for as long as the copy it waited for ended after it reached the
        fence (measured once both events have passed)."""
        waiting = []
        for mark, end in self._fences:
            if mark.query() and end.query():
                self.stats.stall_seconds += max(mark.elapsed_time(end), 0.0) / 1e3
            else:
                waiting.append((mark, end))
        self._fences = waiting


def _drain(device: torch.device | None) -> None:
    """Wait for the work queued on the compute stream of `device` (None: of every GPU, for blocks on several) so
    that a copy's result can be read on the host."""
    if device is None and torch.cuda.is_initialized():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
    elif device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
