"""Saving (`persistence/save.py`): a save between steps only, atomic (a failed one keeps the earlier file), and a
write-protected file replaced only when asked. Round trips are in `test_load.py`."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from cache_state import cache_state
from test_load import prefilled_cache, plain  # noqa: F401  (`plain` is a fixture)

from hf_paged_cache import PagedCache

pytestmark = pytest.mark.usefixtures("one_thread")


def test_saving_mid_step_is_refused_and_writes_nothing(tmp_path):
    model, cache, _ids = prefilled_cache("plain")
    states = torch.zeros(1, 2, 1, 16)
    cache.update(states, states, 0)  # layer 0 wrote the next step, layer 1 has not: a forward in progress
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match="middle of a forward step"):
        cache.save(tmp_path / "cache.safetensors")
    assert cache_state(cache) == before and os.listdir(tmp_path) == []


def test_a_failed_save_keeps_the_earlier_file(tmp_path, monkeypatch):
    model, cache, _ids = prefilled_cache("plain")
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    data = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("hf_paged_cache.persistence.save.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        cache.save(path)
    assert path.read_bytes() == data and os.listdir(tmp_path) == ["cache.safetensors"]


def test_a_write_protected_file_is_replaced_only_with_overwrite(plain, tmp_path):
    """The atomic rename would replace a read-only file in a writable directory: `save` refuses unless
    `overwrite=True`. A writable file is still replaced without it."""
    model, path, data = plain
    _model_, cache, _ids = prefilled_cache("int8")
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    with pytest.raises(PermissionError, match="exists and is write-protected; pass `overwrite=True`"):
        cache.save(path)
    assert path.read_bytes() == data and os.listdir(tmp_path) == [path.name]
    cache.save(path, overwrite=True)
    assert PagedCache.load(path, model.config).options == cache.options
    other = tmp_path / "writable.safetensors"
    other.write_bytes(data)
    cache.save(other)
    assert other.read_bytes() != data and PagedCache.load(other, model.config).options == cache.options
    with pytest.raises(TypeError, match="`overwrite` must be a bool"):
        cache.save(other, overwrite="yes")


def test_a_hybrid_cache_saves_until_its_recurrent_layers_hold_state(tmp_path):
    """transformers' own recurrent layers are not saved: an empty one (whose token counter, a scalar, is no state) lets
    the cache be saved; once a forward filled it, the save is refused and writes nothing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "eval"))
    import zoo

    model, _implementation = zoo.build("qwen3_next")
    cache = PagedCache(model.config, block_size=4)
    cache.save(tmp_path / "empty.safetensors")
    with torch.no_grad():
        model(input_ids=torch.arange(3, 9)[None], cache=cache)
    with pytest.raises(ValueError, match="layer 0 is a transformers LinearAttentionLayer .* holds state"):
        cache.save(tmp_path / "filled.safetensors")
    assert not (tmp_path / "filled.safetensors").exists()
