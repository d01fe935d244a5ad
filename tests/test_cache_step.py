"""`CacheStep`: the first layer of a forward plans the step of every group (here a sliding and a full one),
checking the free blocks of all of them before it changes any, and a step the attention refuses after some
layers wrote is taken back to the lengths before it."""

from __future__ import annotations

import pytest
import torch
from cache_state import cache_state
from tiny_models import MODELS_BY_NAME, VOCAB

from hf_paged_cache import OutOfBlocksError, PagedCache, UnsupportedAttentionError


def _model():
    model, _config = MODELS_BY_NAME["gemma3"].build()
    return model


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _layout(cache: PagedCache) -> dict:
    return {name: (group.length, group.tables) for name, group in cache.groups.items()}


@torch.no_grad()
def test_a_step_one_group_has_no_blocks_for_changes_no_group():
    model = _model()
    model.set_attn_implementation("sdpa")
    cache = PagedCache(model.config, block_size=4, num_blocks=6)
    model(input_ids=_ids(8), cache=cache)
    assert len(cache.groups) == 2
    before = cache_state(cache)
    with pytest.raises(OutOfBlocksError):
        model(input_ids=_ids(20, seed=1), cache=cache)  # the full group would need 7 blocks
    assert cache_state(cache) == before


@torch.no_grad()
def test_a_step_refused_after_the_first_layer_wrote_is_taken_back():
    model = _model()
    model.set_attn_implementation("paged")
    cache, reference = PagedCache(model.config, block_size=4), PagedCache(model.config, block_size=4)
    for each in (cache, reference):
        model(input_ids=_ids(4), cache=each)
    before = _layout(cache)
    hook = model.model.layers[2].self_attn.register_forward_pre_hook(
        lambda _module, args, kwargs: (args, {**kwargs, "position_bias": torch.zeros(1)}), with_kwargs=True)
    try:
        with pytest.raises(UnsupportedAttentionError, match="position_bias"):
            model(input_ids=_ids(2, seed=1), cache=cache)  # layers 0 and 1 wrote their step
    finally:
        hook.remove()
    assert _layout(cache) == before and cache.get_seq_length() == 4
    step = _ids(2, seed=2)
    torch.testing.assert_close(model(input_ids=step, cache=cache).logits, model(input_ids=step, cache=reference).logits)
