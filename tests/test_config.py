"""Configuration: every bad value fails at construction and names its parameter."""

import pytest
import torch

from hf_paged_cache import PagedCacheConfig, parse_bytes
from hf_paged_cache.config import MAX_BLOCK_SIZE


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 * 2**30), ("512 MB", 512 * 10**6), ("1.5GB", 1_500_000_000), ("64kib", 65536), (4096, 4096), ("7", 7)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["2 lightyears", "", "GiB", -5, 0, "0GiB", 1.5, True])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="max_memory"):
        parse_bytes(bad)


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 16.0}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 8, "max_memory": "1GiB"}, "num_blocks"),
        ({"max_memory": "lots"}, "max_memory"),
        ({"dtype": torch.int8}, "dtype"),
        ({"dtype": "float16"}, "dtype"),
        ({"device": "not-a-device"}, "device"),
        ({"initial_blocks": 0}, "initial_blocks"),
        ({"block_size": 2**31}, "block_size"),
        ({"device": f"cuda:{torch.cuda.device_count()}"}, "device"),
    ],
)
def test_invalid_options_name_the_parameter(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        PagedCacheConfig(**kwargs)


def test_defaults_and_normalisation():
    config = PagedCacheConfig(max_memory="1MiB", device="cpu")
    assert config.block_size == 16
    assert config.max_memory == 2**20
    assert config.device == torch.device("cpu")
    assert not config.growable
    assert PagedCacheConfig().growable


def test_a_device_this_machine_lacks_fails_at_construction():
    missing = f"cuda:{torch.cuda.device_count() + 6}"
    with pytest.raises(ValueError, match=rf"`device`='{missing}' does not exist on this machine .* or None"):
        PagedCacheConfig(device=missing)


def test_block_size_is_bounded():
    assert PagedCacheConfig(block_size=MAX_BLOCK_SIZE).block_size == 2**16
    with pytest.raises(ValueError, match=r"`block_size`=65537 is larger than 65536 tokens"):
        PagedCacheConfig(block_size=MAX_BLOCK_SIZE + 1)


def test_triton_backend_off_cuda_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"`backend`='triton' on cpu needs Triton's CPU interpreter: set .*TRITON_INTERPRET=1"):
        PagedCacheConfig(backend="triton", device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert PagedCacheConfig(backend="triton", device="cpu").backend == "triton"


@pytest.mark.parametrize("share_with", [{1: 0, 0: 1}, {0: 1, 1: 0}])
def test_share_with_cycle_reports_the_backward_pair_not_a_self_reference(share_with):
    # A cycle used to be reported as a chain whose remedy pointed layer 1 at layer 1 (itself refused).
    with pytest.raises(ValueError, match=r"maps layer 0 to 1: .* source earlier") as error:
        PagedCacheConfig(share_with=share_with)
    assert "point layer" not in str(error.value)


def test_share_with_chain_remedy_names_an_earlier_layer():
    with pytest.raises(ValueError, match="point layer 2 at layer 0 directly"):
        PagedCacheConfig(share_with={1: 0, 2: 1})
    assert PagedCacheConfig(share_with={2: 0, 1: 0}).share_with == {2: 0, 1: 0}
