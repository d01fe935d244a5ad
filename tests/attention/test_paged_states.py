"""The new K/V `update()` hands to the "paged" attention: guarded against any other reader, and carrying the
producing layer's handle, whose reader a KV-shared layer gets only when it asks."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache.attention.paged_states import MISREAD, paged_only, reused_paged_kv
from hf_paged_cache.layers.handle import PackedPagedKV, PagedKV


def _handle(calls: list) -> PagedKV:
    return PagedKV("layer", "plan", lambda *args: calls.append("after"), lambda: calls.append("undo"))


def test_a_reused_state_gives_a_reader_of_its_source_made_when_asked():
    calls = []
    source = _handle(calls)
    states = paged_only(torch.zeros(1, 2, 3, 4), source)
    first, second = reused_paged_kv(states), reused_paged_kv(states)
    assert first is not source and first is not second  # a fresh reader per asking layer
    assert (first.layer, first.plan, first.after_attention) == ("layer", "plan", None)
    first.finish(torch.zeros(1), None, 1.0, None)  # the eviction work stays with the source
    first.undo()
    assert calls == ["undo"]


def test_a_packed_source_gives_a_reader_for_every_sequence():
    calls = []
    packed = PackedPagedKV([(0, 1, _handle(calls)), (1, 3, _handle(calls))], memo={"shared": 1})
    reader = reused_paged_kv(paged_only(torch.zeros(1, 2, 3, 4), packed))
    assert isinstance(reader, PackedPagedKV) and reader.memo is packed.memo
    assert [(start, stop, part.after_attention) for start, stop, part in reader.parts] == [(0, 1, None), (1, 3, None)]


def test_states_without_a_source_reuse_nothing_and_other_readers_fail():
    assert reused_paged_kv(torch.zeros(2)) is None
    assert reused_paged_kv(paged_only(torch.zeros(2))) is None
    guarded = paged_only(torch.zeros(1, 2, 3, 4), _handle([]))
    assert guarded.shape == (1, 2, 3, 4)  # metadata is allowed
    with pytest.raises(RuntimeError, match="different model object"):
        guarded + 1
    assert "paged" in MISREAD
