"""Block storage growth: in place within the allocation's room (no copy), into a fresh allocation past it; the old
blocks kept, the new ones zeros; and a growable CPU cache's storage growing in place as it generates."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import MODELS_BY_NAME

from hf_paged_cache import PagedCache
from hf_paged_cache.kernels.layout import allocate_kv_blocks
from hf_paged_cache.layers.storage import CPU_RESERVE, CPU_ROOM_BYTES, block_capacity, grown_blocks, reserved_blocks
from hf_paged_cache.quantization.registry import format_from_spec

BLOCK_SIZE = 2


def _nan_filled(storage: torch.Tensor) -> torch.Tensor:
    """`storage` with its whole allocation (room included) filled with NaN: what reused memory may hold."""
    flat = torch.empty(0, dtype=storage.dtype).set_(storage.untyped_storage())
    flat.fill_(float("nan"))
    return storage


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 3), blocks=st.integers(1, 6), room=st.integers(0, 6), more=st.integers(0, 12))
def test_kv_storage_grows_in_place_within_its_room_and_copies_past_it(heads, blocks, room, more):
    storage = _nan_filled(allocate_kv_blocks(blocks, BLOCK_SIZE, heads, 4, torch.float32, capacity=blocks + room))
    assert block_capacity(storage) == blocks + room
    old = torch.randn(blocks, BLOCK_SIZE, heads, 4)
    storage.copy_(old)
    fresh = []
    grown = grown_blocks(storage, blocks + more, lambda: fresh.append(1) or _nan_filled(
        allocate_kv_blocks(blocks + more, BLOCK_SIZE, heads, 4, torch.float32)))  # fmt: skip
    assert bool(fresh) == (more > room)  # a fresh allocation only past the room
    assert (grown.data_ptr() == storage.data_ptr()) == (more <= room)
    assert grown.shape == (blocks + more, BLOCK_SIZE, heads, 4) and grown.stride()[-1] == 1
    assert torch.equal(grown[:blocks], old) and torch.equal(grown[blocks:], torch.zeros_like(grown[blocks:]))
    # each head's blocks stay one run: the head-major layout the kernels and the torch path read
    assert grown.stride(0) == BLOCK_SIZE * 4 and grown.stride(1) == 4


def test_quantized_fields_grow_in_place_within_their_room():
    fields = format_from_spec("int4").key.allocate(3, BLOCK_SIZE, 2, 8, capacity=10)
    for name, tensor in fields.items():
        assert block_capacity(tensor) == 10 and torch.equal(tensor, torch.zeros_like(tensor)), name
        tensor[1:] = 1
        grown = grown_blocks(tensor, 9, lambda: None)  # within the room: never allocates
        assert grown.data_ptr() == tensor.data_ptr() and grown.shape[0] == 9
        assert (grown[1:3] == 1).all() and (grown[3:] == 0).all()


def test_only_a_growable_cpu_pool_reserves_room():
    big = CPU_ROOM_BYTES  # blocks this large: the room is CPU_RESERVE times the blocks
    assert reserved_blocks(10, big, torch.device("cpu"), growable=True) == 10 * CPU_RESERVE
    assert reserved_blocks(10, 1024, torch.device("cpu"), growable=True) == CPU_ROOM_BYTES // 1024  # the floor
    assert reserved_blocks(10, 1024, torch.device("cpu"), growable=False) == 10
    assert reserved_blocks(10, 1024, torch.device("meta"), growable=True) == 10  # a device allocator commits it


def test_a_growable_cache_grows_its_storage_in_place():
    """Generating past the first allocation grows the pool several times: the storage stays one allocation
    (its blocks never copied) within its room, and the store's nbytes counts the blocks, not the room."""
    model, _config = MODELS_BY_NAME["llama_gqa"].build()
    cache = PagedCache(model.config, block_size=BLOCK_SIZE)
    ids = torch.randint(5, 100, (1, 3))
    sizes, pointers = [], set()
    with torch.no_grad():
        for _ in range(4):  # prompt, then 3 x 8 tokens
            ids = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=8,
                                 min_new_tokens=8, do_sample=False, pad_token_id=0)  # fmt: skip
            layer = cache.layers[0]
            sizes.append(len(layer.key_blocks))
            pointers.add(layer.key_blocks.data_ptr())
    assert len(set(sizes)) > 2 and sizes[-1] <= block_capacity(layer.key_blocks)  # grew, within the first room
    assert len(pointers) == 1
    assert layer.storage.nbytes == 2 * layer.key_blocks.numel() * layer.key_blocks.element_size()
