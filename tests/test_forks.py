"""Forks and siblings (`ForkingCache`): a fork holds the same rows in the same pools and storage, a sibling
starts empty in them, and a fork that goes away returns the blocks only it held."""

from __future__ import annotations

import gc

import torch
from tiny_models import MODELS_BY_NAME, VOCAB

from hf_paged_cache import PagedCache


def _model():
    model, _config = MODELS_BY_NAME["llama_gqa"].build()
    model.set_attn_implementation("sdpa")
    return model


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_a_fork_and_a_sibling_share_the_pools_and_storage():
    model = _model()
    cache = PagedCache(model.config, block_size=4)
    model(input_ids=_ids(6), cache=cache)
    fork, sibling = cache.fork(), cache.sibling()
    for name, group in cache.groups.items():
        assert fork.groups[name].pool is group.pool and sibling.groups[name].pool is group.pool
        assert fork.groups[name].tables == group.tables and fork.groups[name].length == group.length
        assert sibling.groups[name].length == 0
    assert fork.layers[0].storage is cache.layers[0].storage and sibling.layers[0].storage is cache.layers[0].storage
    assert {id(each) for each in cache.caches_sharing_pools()} == {id(cache), id(fork), id(sibling)}


@torch.no_grad()
def test_a_dropped_fork_frees_the_blocks_only_it_held():
    model = _model()
    cache = PagedCache(model.config, block_size=4)
    model(input_ids=_ids(6), cache=cache)
    pool = cache.groups["full_attention"].pool
    used = pool.num_used
    fork = cache.fork()
    assert pool.num_used == used  # the fork holds the same blocks by reference
    model(input_ids=_ids(5, seed=1), cache=fork)  # its own copy of the shared partial block, and new ones
    assert pool.num_used > used
    del fork
    gc.collect()
    assert pool.num_used == used
    assert cache.caches_sharing_pools() == [cache]
