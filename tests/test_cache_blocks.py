"""`CacheBlocks`: what a cache's rows hold of its pools, read and edited without reaching into its groups."""

from __future__ import annotations

import torch
from tiny_models import MODELS_BY_NAME, VOCAB

from hf_paged_cache import PagedCache


def _model(name: str = "llama_gqa"):
    model, _config = MODELS_BY_NAME[name].build()
    model.set_attn_implementation("sdpa")
    return model


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_held_ids_pools_and_storage_agree_with_the_rows():
    model = _model()
    cache = PagedCache(model.config, block_size=4, quant="int4", residual_length=4)
    model(input_ids=_ids(22), cache=cache)
    fork = cache.fork()
    view = cache.blocks
    named = view.named_pools()
    assert set(named) == {name for group in cache.groups for name in (group, f"{group}/quantized")}
    assert {id(pool) for pool, _kind in view.pools()} == {id(pool) for pool, _kind in named.values()}
    held = view.held()
    for (pool, kind), ids in held.items():
        assert len(ids) == len(set(ids)) and all(pool.ref_count(block) == 2 for block in ids)  # the fork's and ours
        lists = view.block_lists(pool)
        assert sorted({block for blocks in lists for block in blocks.ids}) == sorted(ids)
        tensors = view.storage(pool, kind)
        assert tensors and all(len(tensor) == pool.num_blocks + 1 for tensor in tensors)
    assert view.held_count() == sum(len(ids) for ids in held.values())  # no id held twice by one cache
    assert fork.blocks.held() == held
    # A quantized layer's storage per kind: its full-precision K/V, or its sealed fields.
    kinds = {kind for _pool, kind in held}
    assert kinds == {"blocks", "quantized"}


@torch.no_grad()
def test_attaching_a_prefix_takes_references_and_sets_the_lengths():
    model = _model()
    cache = PagedCache(model.config, block_size=4)
    prompt = _ids(13)
    model(input_ids=prompt, cache=cache)
    full = cache.blocks.full_blocks()
    sibling = cache.sibling()
    found = {name: (first * 4, ids[:2]) for name, (first, ids) in full.items()}
    pools = cache.blocks.group_pools()
    before = {name: [pools[name].ref_count(block) for block in ids] for name, (_base, ids) in found.items()}
    sibling.blocks.attach_prefix(found, 8)
    assert sibling.get_seq_length() == 8
    for name, (_base, ids) in found.items():
        assert [pools[name].ref_count(block) for block in ids] == [count + 1 for count in before[name]]
    # The sibling continues from the attached prefix exactly as a cache that computed it.
    alone = PagedCache(model.config, block_size=4)
    model(input_ids=prompt[:, :8], cache=alone)
    rest = prompt[:, 8:]
    positions = torch.arange(8, 13)[None]
    got = model(input_ids=rest, cache=sibling, position_ids=positions).logits
    want = model(input_ids=rest, cache=alone, position_ids=positions).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert sibling.blocks.held_count() == alone.blocks.held_count()


@torch.no_grad()
def test_a_sliding_group_reads_its_prefix_from_the_window():
    model, _config = MODELS_BY_NAME["gemma2"].build()
    cache = PagedCache(model.config, block_size=4)
    window = model.config.sliding_window
    starts = cache.blocks.prefix_reads_from(window + 9)
    assert starts["full_attention"] == 0
    sliding = [name for name in starts if name != "full_attention"]
    assert sliding and all(starts[name] > 0 for name in sliding)
