"""`keep_freed_host_memory` and `BatchConfig(keep_host_memory=True)`: glibc's malloc keeps what the forwards free
inside the process; elsewhere the option is refused before anything changes."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
from batch_workloads import random_prompts, tiny_model

from hf_paged_cache.memory import host_heap
from hf_paged_cache.serving.batch_config import BatchConfig
from hf_paged_cache.serving.generator import BatchGenerator

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# In a fresh process (the setting is process-wide): a 20 MiB tensor, allocated and freed, with and without the setting;
# glibc's `mallinfo2` tells the bytes in fresh mappings while it lives and the heap's size once it is freed.
_PROBE = textwrap.dedent("""
    import ctypes, sys, torch
    from hf_paged_cache.memory.host_heap import keep_freed_host_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                          "fsmblks", "uordblks", "fordblks", "keepcost")]
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    kept = keep_freed_host_memory() if sys.argv[1] == "keep" else None
    before = mallinfo2()
    tensor = torch.ones(5 * 2**20)  # 20 MiB
    mapped = mallinfo2().hblkhd - before.hblkhd
    del tensor
    print(kept, mapped, mallinfo2().arena - before.arena)
""")


def _probe(mode: str) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True).stdout
    kept, mapped, heap = out.split()
    return kept, int(mapped), int(heap)


@glibc
def test_freed_memory_stays_in_the_heap_once_set():
    kept, mapped, heap = _probe("keep")
    assert kept == "True"
    assert mapped == 0  # served from the heap, not a fresh mapping
    # and kept there after the free (the heap grows by less where free room at its top served part of the tensor)
    assert heap >= 19 * 2**20
    _, mapped_default, heap_default = _probe("default")
    assert mapped_default >= 20 * 2**20 and heap_default < 19 * 2**20  # glibc's own thresholds: mapped, then returned


def test_keep_host_memory_must_be_a_bool():
    with pytest.raises(ValueError, match="`keep_host_memory` must be a bool"):
        BatchConfig(keep_host_memory=1)


@pytest.fixture
def uncached():
    """`keep_freed_host_memory` answers once per process: forget its answer around a test that fakes the C library."""
    host_heap.keep_freed_host_memory.cache_clear()
    yield
    host_heap.keep_freed_host_memory.cache_clear()


def test_the_option_is_refused_without_glibc_and_nothing_changes(monkeypatch, uncached):
    monkeypatch.setattr(host_heap.platform, "libc_ver", lambda: ("", ""))
    assert host_heap.keep_freed_host_memory() is False
    host_heap.keep_freed_host_memory.cache_clear()
    model = tiny_model("llama_gqa")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="`keep_host_memory=True` sets glibc's malloc thresholds.*leave it False"):
        BatchGenerator(model, keep_host_memory=True, do_sample=False, max_new_tokens=2)
    assert model.config._attn_implementation == before


@glibc
def test_the_generator_sets_it_when_built(monkeypatch):
    calls = []
    monkeypatch.setattr("hf_paged_cache.serving.generator.keep_freed_host_memory", lambda: calls.append(1) or True)
    model = tiny_model("llama_gqa")
    generator = BatchGenerator(model, keep_host_memory=True, do_sample=False, max_new_tokens=2)
    assert calls == [1]
    for prompt in random_prompts([5, 9]):
        generator.add_request(prompt)
    assert all(len(output.generated_tokens) == 2 for output in generator.run())
