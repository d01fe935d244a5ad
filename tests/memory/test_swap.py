"""Swapping a cache's blocks to host memory and back: bit-exact, and fair to the blocks others hold."""

from __future__ import annotations

import functools

import pytest
import torch
from cache_state import quantized_fields, stored_blocks
from tiny_models import MODELS_BY_NAME, VOCAB

from hf_paged_cache import PagedCache
from hf_paged_cache.memory.swap import SwapSpace

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    model.set_attn_implementation("paged")
    return model


def _feed(model, cache: PagedCache, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens]), cache=cache).logits[0, -1]


def _scribble(cache: PagedCache) -> None:
    """Overwrite every free device block, so a swap in cannot lean on contents left behind."""
    for name, group in cache.groups.items():
        for layer in cache.group_layers(name):
            quantized = quantized_fields(layer)
            for pool, tensors in ((group.pool, [layer.key_blocks, layer.value_blocks]),
                                  (group.pools()[1], quantized)):  # fmt: skip
                free = [block for block in range(1, pool.num_blocks + 1) if pool.is_free(block)] if pool else []
                for tensor in tensors:
                    tensor[free] = (torch.rand_like(tensor[free].float()) * 7).to(tensor.dtype)


@pytest.mark.parametrize("name,options", [
    ("llama_gqa", {}),
    ("llama_gqa", {"quant": "int8", "residual_length": 4}),
    ("mistral_sliding", {}),
], ids=["full", "int8", "sliding"])  # fmt: skip
def test_swap_out_and_in_is_bit_exact_and_keeps_shared_blocks(name, options):
    model = _model(name)
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    parent = PagedCache(model.config, block_size=4, num_blocks=40, **options)
    _feed(model, parent, tokens[:18])
    child, twin = parent.fork(), parent.fork()  # child is swapped; twin is the same state never swapped
    for cache in (child, twin):
        _feed(model, cache, tokens[18:21])
    pools = [p for g in parent.groups.values() for p in (g.pool, g.pools()[1]) if p is not None]
    used = [pool.num_used for pool in pools]
    before, parent_before = stored_blocks(child), stored_blocks(parent)
    space = SwapSpace(parent)
    expected_bytes = space.swap_bytes(child)
    space.swap_out(child)
    assert space.is_swapped(child) and space.stats.out_blocks > 0 and space.stats.out_bytes == expected_bytes > 0
    # Blocks the parent and the twin hold stay; only what the child alone held went back.
    assert all(pool.num_used <= count for pool, count in zip(pools, used))
    _scribble(parent)
    assert all(torch.equal(a, b) for a, b in zip(stored_blocks(parent), parent_before))
    space.swap_in(child)
    assert not space.is_swapped(child) and space.stats.in_blocks == space.stats.out_blocks
    after = stored_blocks(child)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    # Storage is bit-exact; the next logits may differ in the last bits only because the blocks now sit in other
    # runs (a contiguous view instead of a gather changes how reads are chunked).
    torch.testing.assert_close(_feed(model, child, tokens[21:24]), _feed(model, twin, tokens[21:24]))


def test_a_swapped_cache_that_is_reset_or_dropped_frees_its_host_blocks():
    model = _model("llama_gqa")
    tokens = torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    template = PagedCache(model.config, block_size=4, num_blocks=20)
    space = SwapSpace(template, num_blocks=4)
    cache = template.fork()
    _feed(model, cache, tokens)
    assert space.out_demand(cache) == 4 and space.can_swap_out(cache)
    space.swap_out(cache)
    assert template.groups["full_attention"].pool.num_free == 20
    other = template.fork()
    _feed(model, other, tokens[:5])
    with pytest.raises(ValueError, match="swap_blocks"):  # the host pool is full; nothing changes
        space.swap_out(other)
    assert not space.is_swapped(other)
    cache.reset()
    space.swap_out(other)
    assert space.is_swapped(other)
    with pytest.raises(ValueError, match="positive int"):
        SwapSpace(template, num_blocks=0)


# Compressed host copies return within a stated share of each stored tensor's largest magnitude: fp8 (e4m3, a
# scale per token) to 2^-4, int4 (affine, step = range / 15) to half a step of a range of at most twice it.
# Bytes: int4 keys carry a zero point and a scale per channel and block, so at blocks of 4 tokens int4 takes
# about a quarter of fp32 (at blocks of 16, 0.16).
@pytest.mark.parametrize("compression,tolerance,ratio", [("fp8", 0.0625, 0.3), ("int4", 0.07, 0.27)])
def test_compressed_swapping_stays_within_tolerance_and_quantized_blocks_move_as_they_are(compression, tolerance,
                                                                                           ratio):  # fmt: skip
    model = _model("llama_gqa")
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    for options in ({}, {"quant": "int8", "residual_length": 4}):
        template = PagedCache(model.config, block_size=4, num_blocks=40, **options)
        cache = template.fork()
        _feed(model, cache, tokens[:17])
        _feed(model, cache, tokens[17:21])  # the second step seals the blocks before the residual tokens
        before = stored_blocks(cache)
        assert bool(options) == any(not t.is_floating_point() and t.numel() for t in before)
        plain, compressed = SwapSpace(template), SwapSpace(template, compression=compression)
        shrunk = compressed.swap_bytes(cache) / plain.swap_bytes(cache)
        assert shrunk <= ratio if not options else ratio < shrunk < 1  # sealed blocks are not compressed again
        compressed.swap_out(cache)
        compressed.swap_in(cache)
        for a, b in zip(stored_blocks(cache), before):
            if a.is_floating_point() and a.numel():
                assert (a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max()
            elif not a.is_floating_point():  # quantized codes: moved as they are
                assert torch.equal(a, b)
        assert compressed.stats.in_bytes == compressed.stats.out_bytes == compressed.swap_bytes(cache)
    with pytest.raises(ValueError, match="valid formats"):
        SwapSpace(template, compression="int3")


def test_deferred_copies_are_bit_exact_and_a_swap_in_waits_for_its_swap_out():
    """Copies that land as late as the rules allow: the device blocks go back at once, the host reads a swap-out's
    copy only after it completed, and a swap-in's blocks are usable after the fence."""
    model = _model("llama_gqa")
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    template = PagedCache(model.config, block_size=4, num_blocks=20)
    cache = template.fork()
    _feed(model, cache, tokens[:18])
    before = stored_blocks(cache)
    space = SwapSpace(template, copies="deferred")
    space.swap_out(cache)
    assert space.in_flight(cache) == "out" and template.groups["full_attention"].pool.num_free == 20
    space.swap_in(cache)  # waits for the swap-out (its copy reads the device blocks, still as they were)
    assert space.in_flight(cache) == "in" and space.copies.in_flight == 1
    space.copies.fence()
    assert space.in_flight(cache) is None and all(torch.equal(a, b) for a, b in zip(stored_blocks(cache), before))
    stats = space.copies.stats
    assert stats.transfers == 2 and stats.stall_seconds == stats.copy_seconds > 0
    with pytest.raises(ValueError, match="CUDA device"):  # checked before anything changes
        SwapSpace(template, copies="async").swap_out(cache)
    assert all(torch.equal(a, b) for a, b in zip(stored_blocks(cache), before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="asynchronous copies need CUDA")
@pytest.mark.parametrize("compression", [None, "fp8"])
def test_cuda_side_stream_swaps_match_synchronous_ones(compression):
    model, _config = MODELS_BY_NAME["llama_gqa"].build()  # not the cached CPU model: it moves to the GPU
    model.to("cuda").set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    stored = []
    for copies in ("sync", "async"):
        template = PagedCache(model.config, block_size=4, num_blocks=20, device="cuda")
        cache = template.fork()
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens[:18]], device="cuda"), cache=cache)
        space = SwapSpace(template, compression=compression, copies=copies)
        space.swap_out(cache)
        space.copies.fence()  # the compute stream may write the freed blocks only after the copy read them
        _scribble(template)
        space.swap_in(cache)
        space.copies.fence()
        stored.append([t.cpu() for t in stored_blocks(cache)])
        assert space.copies.mode == copies
    assert all(torch.equal(a, b) for a, b in zip(*stored))
