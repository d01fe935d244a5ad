"""`SealedBlocks`: sealing codes blocks as their format does, decodes them back, and keeps them with its pool."""

from __future__ import annotations

import pytest
import torch

from hf_paged_cache.blocks.pool import BlockPool
from hf_paged_cache.layers.sealed_blocks import SealedBlocks
from hf_paged_cache.quantization import format_from_spec

BLOCK, HEADS, DIM = 4, 2, 16


def _store(spec: str, blocks: int = 6) -> SealedBlocks:
    store = SealedBlocks(format_from_spec(spec))
    store.allocate(BlockPool(blocks, growable=True), BLOCK, HEADS, (DIM, DIM), torch.device("cpu"))
    return store


def _blocks(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(count, BLOCK, HEADS, DIM, generator=generator) for _ in range(2))  # type: ignore[return-value]


@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "fp8"])
def test_sealed_blocks_decode_as_their_format_codes_them(spec):
    store = _store(spec)
    keys, values = _blocks(3)
    errors = store.seal(keys, values, torch.tensor([0, 2]), [5, 1], kernels=False, cpu=False)
    assert set(errors) == {"qkey", "qvalue"} and all(errors.values())
    decoded_keys, decoded_values = store.decoded([5, 1], torch.float32)
    fmt = store.kv_format
    for side, blocks, decoded in (("key", keys, decoded_keys), ("value", values, decoded_values)):
        codec = getattr(fmt, side)
        scratch = codec.allocate(2, BLOCK, HEADS, DIM)
        codec.quantize(blocks[[0, 2]], scratch, range(2))
        want = codec.dequantize(scratch, slice(0, 2), torch.float32).flatten(0, 1).transpose(0, 1)
        torch.testing.assert_close(decoded, want, rtol=0, atol=0)
    # What a block reads as once sealed, without sealing it.
    trip = store.round_trip(keys[[0, 2]], values[[0, 2]])
    rotated = store.decoded([5, 1], torch.float32, rotated=True)
    for got, want in zip(trip, rotated):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sealed_blocks_grow_and_shrink_with_the_pool_and_survive_a_save():
    store = _store("int4", blocks=3)
    keys, values = _blocks(2, seed=1)
    store.seal(keys, values, torch.tensor([0, 1]), [1, 2], kernels=False, cpu=False)
    before = store.decoded([1, 2], torch.float32)
    store.pool.grow(5)
    store.fit()
    assert all(len(tensor) == 9 for tensor in store.tensors.values())
    assert all(torch.equal(a, b) for a, b in zip(store.decoded([1, 2], torch.float32), before))
    store.pool.shrink(3)
    store.fit()
    assert all(len(tensor) == 4 for tensor in store.tensors.values())
    saved = store.saved([2, 1])
    assert {name: (tuple(t.shape), t.dtype) for name, t in saved.items()} == store.saved_shapes(2)
    other = _store("int4", blocks=3)
    other.load(saved, [1, 3])
    for got, want in zip(other.decoded([3, 1], torch.float32), before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert store.block_bytes * 4 == store.nbytes
