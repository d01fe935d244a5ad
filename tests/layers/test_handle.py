"""The handles `update()` leaves for the attention: a reader handle shares the step without its after-attention
work, a packed handle acts for every sequence, and a handle's own mask is causal over the range it reads."""

from __future__ import annotations

import torch
from tiny_models import VOCAB, shared_model

from hf_paged_cache import PagedCache
from hf_paged_cache.attention.torch_path import causal_mask
from hf_paged_cache.layers.handle import PackedPagedKV, PagedKV
from hf_paged_cache.read_paths.rows import step_causal_mask


def _recording_handle(calls: list, gathered: bool = False) -> PagedKV:
    return PagedKV(None, None, lambda *args: calls.append("after"), lambda: calls.append("undo"), gathered)


def test_a_reader_takes_the_step_back_but_leaves_the_after_attention_work_to_its_source():
    calls = []
    source = _recording_handle(calls)
    reader = source.reader()
    reader.finish(torch.zeros(1), None, 1.0, None)
    assert calls == []
    reader.undo()
    source.finish(torch.zeros(1), None, 1.0, None)
    assert calls == ["undo", "after"]


def test_a_packed_handle_acts_for_every_sequence():
    calls = []
    packed = PackedPagedKV([(0, 2, _recording_handle(calls, gathered=True)), (2, 5, _recording_handle(calls))])
    assert not packed.gathered
    packed.undo()
    assert calls == ["undo", "undo"]
    readers = packed.reader()
    assert [(start, stop) for start, stop, _part in readers.parts] == [(0, 2), (2, 5)]
    readers.parts[0][2].finish(torch.zeros(1), None, 1.0, None)
    assert calls == ["undo", "undo"]


@torch.no_grad()
def test_the_own_mask_is_causal_over_the_read_range():
    """Plain causality is no mask (every reader takes a missing mask for it); a sliding layer's is windowed."""
    cpu = torch.device("cpu")
    for name, layer_index, window in (("llama_gqa", 0, None), ("qwen2_sliding", 0, 8), ("qwen2_sliding", 1, None)):
        model = shared_model(name)
        model.set_attn_implementation("sdpa")
        cache = PagedCache(model.config, block_size=4)
        model(input_ids=torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0)), cache=cache)
        layer = cache.layers[layer_index]
        handle = PagedKV(layer, layer.tables.plan)
        assert handle.read_len == 10
        assert handle.own_mask(1, cpu) is None
        if window is None:
            assert handle.own_mask(10, cpu) is None
        else:
            assert torch.equal(handle.own_mask(10, cpu), causal_mask(10, 10, cpu, window))
        assert torch.equal(step_causal_mask(layer.tables.plan, 10, cpu), causal_mask(10, 10, cpu))


@torch.no_grad()
def test_a_packed_handle_narrows_to_the_last_tokens_only_where_they_see_the_whole_read_range():
    """A last token alone sees its whole read range under plain causality, not under a window; a handle with work due
    after the attention (it reads every query) or a gathered history is not narrowed either."""
    cpu = torch.device("cpu")
    handles = {}
    for name, layer_index in (("llama_gqa", 0), ("qwen2_sliding", 0)):
        model = shared_model(name)
        model.set_attn_implementation("sdpa")
        cache = PagedCache(model.config, block_size=4)
        model(input_ids=torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0)), cache=cache)
        layer = cache.layers[layer_index]
        handles[name] = PagedKV(layer, layer.tables.plan)
    plain = handles["llama_gqa"]
    packed = PackedPagedKV([(0, 10, plain), (10, 11, plain)], memo={"shared": 1})
    last = packed.last_tokens(cpu)
    assert [(start, stop) for start, stop, _part in last.parts] == [(0, 1), (1, 2)]
    assert all(part is plain for _start, _stop, part in last.parts) and last.memo is packed.memo
    assert PackedPagedKV([(0, 10, handles["qwen2_sliding"])]).last_tokens(cpu) is None
    assert PackedPagedKV([(0, 1, handles["qwen2_sliding"])]).last_tokens(cpu) is not None  # one token sees its range
    after = PagedKV(plain.layer, plain.plan, lambda *args: None)
    gathered = PagedKV(plain.layer, plain.plan, gathered=True)
    assert PackedPagedKV([(0, 10, plain), (10, 11, after)]).last_tokens(cpu) is None
    assert PackedPagedKV([(0, 10, gathered)]).last_tokens(cpu) is None
