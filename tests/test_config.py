"""Configuration: every bad value fails at construction and names its parameter."""

import pytest
import torch

from hf_paged_cache import PagedCacheConfig, parse_bytes


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
