"""The copy stream: transfers complete in order, a finish runs only after its copy, deferred copies run exactly
when a wait or a fence needs them, and on CUDA copies run on a side stream ordered after the compute stream."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache.memory.copy_stream import CopyStream

CPU = torch.device("cpu")


def _logged(stream: CopyStream, log: list[str], name: str):
    return stream.submit(CPU, lambda: log.append(f"copy {name}"), lambda: log.append(f"finish {name}"))


def test_sync_copies_run_when_submitted():
    stream, log = CopyStream(), []
    transfer = _logged(stream, log, "a")
    assert stream.mode == "sync" and log == ["copy a", "finish a"] and transfer.done() and stream.in_flight == 0
    stream.fence()
    assert stream.stats.transfers == 1 and stream.stats.stall_seconds == stream.stats.copy_seconds >= 0


def test_deferred_copies_run_in_order_at_the_wait_or_fence_that_needs_them():
    stream, log = CopyStream("deferred"), []
    first, second, third = (_logged(stream, log, name) for name in "abc")
    assert log == [] and not second.done() and stream.in_flight == 3
    second.wait()  # the first one completes before it: one stream, in order
    assert log == ["copy a", "finish a", "copy b", "finish b"] and first.done() and not third.done()
    first.wait()  # already done: nothing runs again
    stream.fence()
    assert log[4:] == ["copy c", "finish c"] and stream.in_flight == 0
    # A transfer without one device (blocks on several, or none) runs at once, after the ones queued before it.
    _logged(stream, log, "d")
    stream.submit(None, lambda: log.append("copy e"))
    assert log[6:] == ["copy d", "finish d", "copy e"] and stream.stats.transfers == 5


def test_modes_are_checked():
    with pytest.raises(ValueError, match="swap_copies"):
        CopyStream("later")
    stream = CopyStream("async")
    with pytest.raises(ValueError, match="CUDA device"):
        stream.submit(CPU, lambda: None)
    assert stream.in_flight == 0 and stream.stats.transfers == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs CUDA")
def test_cuda_copies_run_on_a_side_stream_after_the_compute_stream():
    stream = CopyStream()
    source = torch.zeros(64, 1 << 16, device="cuda")
    source += 1  # enqueued on the compute stream: the copy must see it
    host = torch.empty(source.shape, pin_memory=True)
    landed = []
    transfer = stream.submit(source.device, lambda: host.copy_(source, non_blocking=True),
                             lambda: landed.append(host.sum().item()))  # fmt: skip
    assert stream.mode == "async"
    stream.fence()
    source.zero_()  # after the fence: cannot reach the copy
    transfer.wait()
    assert landed == [source.numel()] and stream.in_flight == 0
    stream.poll()
    assert stream.stats.copy_seconds > 0 and stream.stats.stall_seconds >= 0
