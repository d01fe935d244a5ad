"""Saving and loading caches (`persistence/save.py`, `persistence/load.py`): a loaded cache continues exactly as the
saved one (bit-identical logits on CPU) for plain, quantized, evicted, sliding-window and left-padded batched caches;
corrupted files, another model's config and mismatched options fail clearly and change nothing."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tracemalloc

import pytest
import torch
from cache_state import cache_state
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from test_smollm2 import PROMPTS, needs_wheel
from tiny_models import MODELS_BY_NAME, VOCAB, padded_batch
from transformers import DynamicCache

from hf_paged_cache import H2O, CacheFileError, PagedCache, PagedCacheConfig, RandomEviction, SnapKV, block_layout
from hf_paged_cache.persistence.save import DIGEST, FORMAT, digest
from hf_paged_cache.quantization import format_from_spec
from hf_paged_cache.quantization.registry import kv_format_fields
from hf_paged_cache.smollm2 import load_smollm2

PREFIX, PROMPT, STEPS = 10, 16, 6
POOL_KEYS = ("blocks_total", "blocks_free", "pool_bytes")  # the loaded pool is sized to the blocks it holds

CASES = {  # name: (model, attention, PagedCache options)
    "plain": ("llama_gqa", "sdpa", {}),
    "fp16_storage": ("llama_gqa", "paged", {"dtype": torch.float16}),
    "int8": ("llama_gqa", "sdpa", {"quant": "int8", "residual_length": 0}),
    "int4_paged": ("llama_gqa", "paged", {"quant": "int4", "residual_length": 4}),
    "int4_layer_1": ("llama_gqa", "sdpa", {"quant_layers": {1: "int4"}, "residual_length": 0}),
    "snapkv": ("llama_gqa", "paged", {"eviction": SnapKV(budget=8, sinks=2, window=4, observation_window=4)}),
    "h2o_int8": ("llama_gqa", "paged", {"eviction": H2O(budget=8, sinks=2, window=4), "quant": "int8",
                                        "residual_length": 4}),  # fmt: skip
    "random_eviction": ("llama_gqa", "paged", {"eviction": RandomEviction(budget=8, sinks=2, window=4)}),
    "mistral_sliding": ("mistral_sliding", "sdpa", {}),
    "qwen2_sliding_int8": ("qwen2_sliding", "paged", {"quant": "int8", "residual_length": 4}),
    "deepseek_v3_latents": ("deepseek_v3", "paged", {}),  # keys (the latent) wider than values (the positional key)
    "deepseek_v2_latents_int8": ("deepseek_v2", "paged", {"quant": "int8", "residual_length": 4}),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _forward(model, cache, ids, mask=None) -> torch.Tensor:
    """One forward; with a left-padding `mask`, at the positions `generate()` gives (padding stores nothing)."""
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache).logits


def _continue(model, cache, ids, mask=None) -> list[torch.Tensor]:
    """Feed `ids` after the cached tokens, then STEPS greedy tokens: the logits of every step."""
    logits = [_forward(model, cache, ids, mask)]
    for _ in range(STEPS):
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits.append(_forward(model, cache, logits[-1][:, -1:].argmax(-1), mask))
    return logits


def _comparable(cache: PagedCache) -> dict:
    """`metrics()` without the pool's size (a loaded pool holds only the blocks in use)."""
    metrics = {key: value for key, value in cache.metrics().as_dict().items() if key not in POOL_KEYS}
    metrics["groups"] = {name: {key: value for key, value in group.items() if key not in POOL_KEYS}
                         for name, group in metrics["groups"].items()}  # fmt: skip
    return metrics


def prefilled_cache(case: str) -> tuple:
    name, attention, options = CASES[case]
    model = _model(name)
    model.set_attn_implementation(attention)
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    cache = PagedCache(model.config, block_size=4, **options)
    _forward(model, cache, ids[:, :PREFIX])
    return model, cache, ids


@pytest.mark.parametrize("case", CASES)
def test_save_load_continues_exactly(case, tmp_path):
    model, original, ids = prefilled_cache(case)
    if "eviction" in CASES[case][2]:
        assert original.metrics().evicted_tokens > 0  # the file holds an evicted cache
    before = cache_state(original)
    original.save(tmp_path / "cache.safetensors")
    assert cache_state(original) == before
    loaded = PagedCache.load(tmp_path / "cache.safetensors", model.config)
    assert loaded.options == original.options and _comparable(loaded) == _comparable(original)
    assert loaded.metrics().blocks_total == original.metrics().blocks_used  # sized to the blocks it holds
    expected, got = _continue(model, original, ids[:, PREFIX:]), _continue(model, loaded, ids[:, PREFIX:])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert _comparable(loaded) == _comparable(original)  # same evictions, quantization error, bytes


def test_eviction_state_carries_over(tmp_path):
    """Decode-time eviction every 3 steps by accumulated attention: which tokens survive after the load depends
    on the saved scores and on the step counter, so both must come back exactly."""
    model = _model("llama_gqa")
    model.set_attn_implementation("paged")
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(5))
    original = PagedCache(model.config, block_size=4, eviction=H2O(budget=10, sinks=1, window=2), evict_every=3)
    logits = _forward(model, original, ids)
    for _ in range(4):
        logits = _forward(model, original, logits[:, -1:].argmax(-1))
    original.save(tmp_path / "evicted.safetensors")
    loaded = PagedCache.load(tmp_path / "evicted.safetensors", model.config)
    token = logits[:, -1:].argmax(-1)
    expected, got = _continue(model, original, token), _continue(model, loaded, token)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert _comparable(loaded) == _comparable(original) and original.metrics().evictions > 2


def test_left_padded_batch_with_shared_and_scattered_blocks(tmp_path):
    """Rows that decoded in turns hold interleaved blocks, and a reorder makes two rows share theirs: the
    file renumbers them densely, and the loaded cache continues exactly (sdpa and the paged attention)."""
    model = _model("llama_gqa")
    ids, prompt_mask = padded_batch((0, 3, 5), 9)
    for attention in ("sdpa", "paged"):
        mask = prompt_mask
        model.set_attn_implementation(attention)
        cache = PagedCache(model.config, block_size=4, num_blocks=64)
        logits = _continue(model, cache, ids, mask)
        mask = torch.cat([mask, torch.ones(3, STEPS, dtype=mask.dtype)], dim=1)
        cache.reorder_cache(torch.tensor([0, 0, 2]))
        tables = block_layout(cache)["full_attention"].tables
        assert tables[0] == tables[1] and max(map(max, tables)) > len({b for table in tables for b in table})  # holes
        cache.save(tmp_path / "batch.safetensors")
        loaded = PagedCache.load(tmp_path / "batch.safetensors", model.config, num_blocks=64)
        assert loaded.groups["full_attention"].pads == [0, 0, 5]
        assert _comparable(loaded) == _comparable(cache)
        token = logits[-1][:, -1:].argmax(-1)
        expected, got = _continue(model, cache, token, mask), _continue(model, loaded, token, mask)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("options", [{}, {"quant": "int8", "residual_length": 4}], ids=["plain", "int8"])
def test_a_crop_into_a_rows_left_padding_round_trips(options, tmp_path):
    """Cropping a left-padded batch below a row's padding leaves that row's base past the length and no blocks: a
    state the header checks must accept, and the loaded cache continues as the cropped one."""
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    ids, mask = padded_batch((0, 5), 9)
    cache = PagedCache(model.config, block_size=4, **options)
    _continue(model, cache, ids, mask)
    cache.crop(4 - cache.get_seq_length())
    assert cache.groups[next(iter(cache.groups))].base[1] > cache.get_seq_length()
    cache.save(tmp_path / "cropped.safetensors")
    loaded = PagedCache.load(tmp_path / "cropped.safetensors", model.config)
    assert loaded.groups[next(iter(loaded.groups))].base == cache.groups[next(iter(cache.groups))].base
    rest, rest_mask = ids[:, 4:], mask[:, :9]
    expected, got = _continue(model, cache, rest, rest_mask), _continue(model, loaded, rest, rest_mask)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_a_scattered_row_reads_as_it_did(tmp_path):
    """A row left alone after its batch decoded in turns holds ids in several runs. The file renumbers them
    into one run, but the loaded row reads through the same path as the original (a gather, not a view of
    one run), because the paths differ in float rounding; that keeps its logits bit-identical."""
    model = _model("llama_gqa")
    model.set_attn_implementation("paged")
    ids, mask = padded_batch((0, 0), 9)
    cache = PagedCache(model.config, block_size=4)
    logits = _continue(model, cache, ids, mask)
    tables = block_layout(cache)["full_attention"].tables
    row = next(i for i, t in enumerate(tables) if t != list(range(t[0], t[0] + len(t))))  # a row in several runs
    cache.batch_select_indices(torch.tensor([row]))
    (table,) = block_layout(cache)["full_attention"].tables
    assert table != list(range(table[0], table[0] + len(table)))  # not one run
    cache.save(tmp_path / "row.safetensors")
    loaded = PagedCache.load(tmp_path / "row.safetensors", model.config)
    assert block_layout(loaded)["full_attention"].tables == [list(range(1, len(table) + 1))]
    token = logits[-1][row : row + 1, -1:].argmax(-1)
    expected, got = _continue(model, cache, token), _continue(model, loaded, token)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_generate_on_a_loaded_prompt_cache(tmp_path):
    """The prompt-cache recipe across processes: prefill, save; later load and `generate()` the full prompt."""
    model, original, ids = prefilled_cache("int4_paged")
    original.save(tmp_path / "prompt.safetensors")

    def generate(cache):
        mask = torch.ones_like(ids)
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=STEPS, do_sample=False)[0, PROMPT:]

    loaded = PagedCache.load(tmp_path / "prompt.safetensors", model.config)
    assert generate(loaded).tolist() == generate(original).tolist()


def test_pool_options_size_the_loaded_pool(tmp_path):
    model, original, ids = prefilled_cache("int8")
    path = tmp_path / "cache.safetensors"
    original.save(path)
    used = original.metrics().blocks_used
    fixed = PagedCache.load(path, model.config, num_blocks=50)
    assert fixed.metrics().blocks_total == 50 and not fixed.options.growable
    grown = PagedCache.load(path, model.config, initial_blocks=2 * used)
    assert grown.metrics().blocks_total >= 2 * used
    with pytest.raises(CacheFileError, match="raise `num_blocks`"):
        PagedCache.load(path, model.config, num_blocks=1)
    expected = _continue(model, original, ids[:, PREFIX:])
    assert all(torch.equal(a, b) for a, b in zip(expected, _continue(model, fixed, ids[:, PREFIX:])))


def test_max_memory_pools(tmp_path):
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    original = PagedCache(model.config, block_size=4, max_memory="64KiB")
    _forward(model, original, ids[:, :PREFIX])
    original.save(tmp_path / "cache.safetensors")
    loaded = PagedCache.load(tmp_path / "cache.safetensors", model.config)
    assert loaded.metrics().blocks_total == original.metrics().blocks_total  # the same budget, the same pool
    expected, got = _continue(model, original, ids[:, PREFIX:]), _continue(model, loaded, ids[:, PREFIX:])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("options", [{}, {"max_memory": "64KiB"}, {"quant": "int8"}], ids=["grows", "budget", "int8"])
@pytest.mark.parametrize("when", ["never_run", "after_reset"])
def test_empty_caches_round_trip(when, options, tmp_path):
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    cache = PagedCache(model.config, block_size=4, **options)
    if when == "after_reset":
        _forward(model, cache, ids)
        cache.reset()
    cache.save(tmp_path / "empty.safetensors")
    loaded = PagedCache.load(tmp_path / "empty.safetensors", model.config)
    assert loaded.get_seq_length() == 0 and loaded.options == cache.options
    fresh = PagedCache(model.config, block_size=4, **options)
    assert torch.equal(_forward(model, loaded, ids), _forward(model, fresh, ids))


# ---------------------------------------------------------------------------------------------- errors
@pytest.fixture
def saved(tmp_path):
    """A saved int8 cache with eviction: (model, path, the file's bytes)."""
    model, cache, _ids = prefilled_cache("h2o_int8")
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    return model, path, path.read_bytes()


def _rewrite_header(source, target, edit, edit_tensors=None) -> None:
    """Copy a cache file with its header changed by `edit(header)` (and its tensors by `edit_tensors(tensors)`)
    and a matching digest, computed as `save` does: a file that passes the integrity check."""
    with safe_open(source, framework="pt") as handle:
        header = json.loads(handle.metadata()[FORMAT])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    edit(header)
    if edit_tensors is not None:
        edit_tensors(tensors)
    _write(target, json.dumps(header, sort_keys=True), tensors)


def _write(target, text: str, tensors: dict) -> None:
    save_file(tensors, target, metadata={FORMAT: text, DIGEST: digest(text, tensors)})


def test_a_spec_whose_meaning_changed_since_the_file_was_written_is_refused(tmp_path):
    """A version-1 file records no resolved format: its "int2" meant unrotated values (today's 'K2V2'), and today's
    rotated "int2" would decode its codes wrongly, so it is refused; a version-1 file of an unchanged spec loads."""
    model = _model("llama_gqa")
    model.set_attn_implementation("paged")
    cache = PagedCache(model.config, block_size=4, quant="K2V2", residual_length=4)
    _forward(model, cache, torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1)))
    cache.save(tmp_path / "new.safetensors")

    def as_version_one(spec):
        def edit(header):
            header["version"], header["options"]["quant"] = 1, spec
            for group in header["groups"]:
                group["name"] = group["name"].replace("K2V2", spec)
            for layer in header["layers"]:
                del layer["kv_format"]
        return edit

    for spec in ("int2", "K2V2"):
        _rewrite_header(tmp_path / "new.safetensors", tmp_path / f"{spec}.safetensors", as_version_one(spec))
    with pytest.raises(CacheFileError, match="before rotated formats existed.*version that saved it"):
        PagedCache.load(tmp_path / "int2.safetensors", model.config)
    assert cache_state(PagedCache.load(tmp_path / "K2V2.safetensors", model.config)) == cache_state(cache)

    def drifted(header):  # a version-2 file whose spec text stayed but whose format did not
        header["layers"][0]["kv_format"] = "KVFormat(key=IntN(bits=2), value=IntN(bits=2))"

    _rewrite_header(tmp_path / "new.safetensors", tmp_path / "drifted.safetensors", drifted)
    with pytest.raises(CacheFileError, match="layer 0 was quantized as KVFormat\\(key=IntN\\(bits=2\\)"):
        PagedCache.load(tmp_path / "drifted.safetensors", model.config)


def test_formats_are_saved_by_name_and_fields_and_files_with_their_repr_still_load(tmp_path):
    """A layer's format is written as registry names and dataclass fields; files that wrote its repr (version 2
    before formats were named) load alike, and a named format other than the options' is refused."""
    model = _model("llama_gqa")
    model.set_attn_implementation("paged")
    cache = PagedCache(model.config, block_size=4, quant="int2", residual_length=4)
    _forward(model, cache, torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1)))
    cache.save(tmp_path / "new.safetensors")
    with safe_open(tmp_path / "new.safetensors", framework="pt") as handle:
        layers = json.loads(handle.metadata()[FORMAT])["layers"]
    assert all(layer["kv_format"] == kv_format_fields(format_from_spec("int2")) for layer in layers)
    assert layers[0]["kv_format"]["value"] == {
        "name": "intn", "fields": {"bits": 2, "axis": "token", "group_size": None, "scale_bits": 16, "rotate": True},
    }  # fmt: skip

    def written(value):
        def edit(header):
            for layer in header["layers"]:
                layer["kv_format"] = value
        return edit

    edits = {"repr": repr(format_from_spec("int2")), "other": kv_format_fields(format_from_spec("K2V2")),
             "unknown": {"key": {"name": "int3", "fields": {}}, "value": {"name": "int8", "fields": {}}}}  # fmt: skip
    for name, value in edits.items():
        _rewrite_header(tmp_path / "new.safetensors", tmp_path / f"{name}.safetensors", written(value))
    assert cache_state(PagedCache.load(tmp_path / "repr.safetensors", model.config)) == cache_state(cache)
    with pytest.raises(CacheFileError, match="layer 0 was quantized as KVFormat\\(key=IntN\\(bits=2, axis='channel'"):
        PagedCache.load(tmp_path / "other.safetensors", model.config)
    with pytest.raises(CacheFileError, match="kv_format` is no format .*unknown quantization format name 'int3'"):
        PagedCache.load(tmp_path / "unknown.safetensors", model.config)


def test_chunked_layers_saved_in_the_sliding_group_of_their_chunk_size_load(tmp_path):
    """Files written before chunked attention had a group of its own name its group `sliding_attention[C]`."""
    model = _model("llama4_chunked")
    cache = PagedCache(model.config, block_size=4)
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    _forward(model, cache, ids)
    cache.save(tmp_path / "new.safetensors")

    def sliding_name(header):
        for group in header["groups"]:
            group["name"] = group["name"].replace("chunked_attention[", "sliding_attention[")

    _rewrite_header(tmp_path / "new.safetensors", tmp_path / "old.safetensors", sliding_name)
    loaded = PagedCache.load(tmp_path / "old.safetensors", model.config)
    assert loaded.groups["chunked_attention[8]"].tables == cache.groups["chunked_attention[8]"].tables
    step = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_forward(model, loaded, step), _forward(model, cache, step), rtol=0, atol=0)


def test_a_policy_saved_before_per_head_existed_loads_head_shared(saved, tmp_path):
    model, path, _data = saved

    def as_version_one(header):
        header["version"] = 1
        for name in ("per_head", "protect_novel", "rotary"):
            del header["options"]["eviction"]["fields"][name]
        for layer in header["layers"]:
            layer.pop("kv_format", None)

    _rewrite_header(path, tmp_path / "old.safetensors", as_version_one)
    loaded = PagedCache.load(tmp_path / "old.safetensors", model.config)
    assert loaded.options.eviction == H2O(budget=8, sinks=2, window=4, per_head=False)  # as it ran when saved
    assert PagedCache.load(path, model.config).options.eviction.per_head  # today's default in today's files


def test_corrupted_and_truncated_files_are_refused(saved, tmp_path):
    model, path, data = saved
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    cases = {
        "flipped.safetensors": (bytes(flipped), "checksum does not match"),
        "truncated.safetensors": (data[: len(data) - 100], "truncated or corrupted"),
        "header_only.safetensors": (data[:40], "truncated or corrupted"),
        "pickle.pt": (b"\x80\x04\x95" + bytes(64), "not a readable safetensors file"),
    }
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CacheFileError, match=message):
            PagedCache.load(tmp_path / name, model.config)
        assert (tmp_path / name).read_bytes() == content
    save_file({"x": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(CacheFileError, match="without a PagedCache header"):
        PagedCache.load(tmp_path / "other.safetensors", model.config)
    assert path.read_bytes() == data


def test_a_newer_file_format_is_refused(saved, tmp_path):
    model, path, _data = saved
    _rewrite_header(path, tmp_path / "v4.safetensors", lambda header: header.update(version=4))
    with pytest.raises(CacheFileError, match="format version 4.*reads versions 1, 2, 3"):
        PagedCache.load(tmp_path / "v4.safetensors", model.config)


def test_an_unknown_policy_class_is_not_imported(saved, tmp_path):
    model, path, _data = saved

    def rename(header):
        header["options"]["eviction"]["class"] = "os.system"

    _rewrite_header(path, tmp_path / "policy.safetensors", rename)
    with pytest.raises(CacheFileError, match="'os.system', a class that is not imported"):
        PagedCache.load(tmp_path / "policy.safetensors", model.config)


@pytest.mark.parametrize(
    "other, message",
    [
        ("mistral_sliding", "a 'llama' model with 2 layers, but the config is of a 'mistral' model"),
        ("llama_mqa", "layer 0 stores 2 KV heads of key size 16 and value size 16 in the file, but this config has \\(1, 16, 16\\)"),
        ("qwen2_sliding", "'llama' model with 2 layers, but the config is of a 'qwen2' model with 3 layers"),
    ],
)
def test_another_models_config_is_refused(saved, other, message):
    _model_, path, data = saved
    with pytest.raises(CacheFileError, match=message):
        PagedCache.load(path, _model(other).config)
    assert path.read_bytes() == data


@pytest.mark.parametrize(
    "options, message",
    [
        ({"block_size": 16}, "saved with block_size=4 but the options give block_size=16"),
        ({"quant": "int4"}, "quant='int8' but the options give quant='int4'"),
        ({"residual_length": 8}, "residual_length=4 but the options give residual_length=8"),
        ({"eviction": SnapKV(budget=8, sinks=2, window=4)}, "eviction=H2O.*but the options give eviction=SnapKV"),
        ({"eviction": H2O(budget=12, sinks=2, window=4)}, "eviction=H2O\\(budget=8.*give eviction=H2O\\(budget=12"),
        ({"dtype": torch.float16}, "dtype=None but the options give dtype=torch.float16"),
        ({"evict_every": 2}, "evict_every=None but the options give evict_every=2"),
    ],
)
def test_mismatched_options_are_refused(saved, options, message):
    model, path, data = saved
    with pytest.raises(CacheFileError, match=message + ".*load with"):
        PagedCache.load(path, model.config, **options)
    full = dataclasses.replace(PagedCache.load(path, model.config).options, **options)
    with pytest.raises(CacheFileError, match=message):
        PagedCache.load(path, model.config, full)
    assert path.read_bytes() == data


def test_a_device_this_machine_lacks_needs_the_device_option(saved, tmp_path):
    model, path, _data = saved

    def move(header):
        for layer in header["layers"]:
            layer["device"] = "cuda:99"

    _rewrite_header(path, tmp_path / "moved.safetensors", move)
    with pytest.raises(CacheFileError, match="layers.0 was saved on cuda:99, which this machine lacks: load with"):
        PagedCache.load(tmp_path / "moved.safetensors", model.config)
    loaded = PagedCache.load(tmp_path / "moved.safetensors", model.config, device="cpu")
    assert loaded.options.device == torch.device("cpu") and loaded.layers[0].key_blocks.device.type == "cpu"


def test_bad_load_arguments(saved):
    model, path, _data = saved
    with pytest.raises(TypeError, match="unknown option\\(s\\) \\['blocksize'\\]"):
        PagedCache.load(path, model.config, blocksize=4)
    with pytest.raises(ValueError, match="not both"):
        PagedCache.load(path, model.config, PagedCacheConfig(block_size=4), device="cpu")
    with pytest.raises(ValueError, match="`num_blocks` must be a positive int"):
        PagedCache.load(path, model.config, num_blocks=0)
    with pytest.raises(FileNotFoundError):
        PagedCache.load(path.with_name("missing.safetensors"), model.config)


# ---------------------------------------------------------------------------------------------- crafted files
@pytest.fixture
def plain(tmp_path):
    """A saved full-precision cache of 10 tokens in blocks of 4 (3 blocks): (model, path, the file's bytes)."""
    model, cache, _ids = prefilled_cache("plain")
    path = tmp_path / "plain.safetensors"
    cache.save(path)
    return model, path, path.read_bytes()


def _setting(edits: dict):
    """A header edit that sets each field, named by its keys and list indices, to its value."""

    def edit(header):
        for path, value in edits.items():
            node = header
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value

    return edit


def _one_block_four_times(tensors):
    tensors["groups.0.blocks"] = torch.zeros(4, dtype=torch.long)


CRAFTED_HEADERS = {  # name: (edits, tensor edit or None, what the refusal says)
    "blocks_1e6": ({("groups", 0, "blocks"): 10**6}, None, "each of the 1000000 blocks of `groups\\[0\\].blocks`"),
    "blocks_1e9": ({("groups", 0, "blocks"): 10**9}, None, "each of the 1000000000 blocks of `groups\\[0\\].blocks`"),
    "value_dim_1e7": ({("layers", 0, "value_dim"): 10**7}, None,
                      "'layers.0.values' is torch.float32 \\(2, 3, 4, 16\\), expected .* \\(2, 3, 4, 10000000"),
    "negative_length": ({("groups", 0, "length"): -3}, None, "`groups\\[0\\].length` is -3, expected int >= 0"),
    "base_4": ({("groups", 0, "rows", 0, "base"): 4}, None,
               "`groups\\[0\\].rows\\[0\\]` is inconsistent: expected 3 blocks of 4 tokens to hold the 6 from base 4"),
    "length_94": ({("groups", 0, "length"): 94}, None, "expected 3 blocks of 4 tokens to hold the 94 from base 0"),
    "one_block_four_times": ({("groups", 0, "length"): 16, ("groups", 0, "blocks"): 1,
                              ("groups", 0, "rows", 0, "blocks"): 4}, _one_block_four_times,
                             "'groups.0.blocks' names one block twice in row 0"),
    "pads_text": ({("groups", 0, "rows", 0, "pads"): "0"}, None, "`groups\\[0\\].rows\\[0\\].pads` is '0', expected"),
    "record_past_int": ({("groups", 0, "record_past"): 1}, None, "`groups\\[0\\].record_past` is 1, expected bool"),
    "run_from": ({("groups", 0, "rows", 0, "run_from"): 3}, None, "`groups\\[0\\].rows\\[0\\].run_from` is 3"),
    "device": ({("layers", 1, "device"): "no-such-device"}, None, "`layers\\[1\\].device` is 'no-such-device'"),
    "layer_group": ({("layers", 1, "group"): 1}, None, "`layers\\[1\\].group` is 1, expected int >= 0 <= 0"),
    "model_layers": ({("model", "layers"): "2"}, None, "`model.layers` is '2', expected int >= 0"),
    "layer_count": ({("model", "layers"): 3}, None, "`layers` has 2 entries, `model.layers` 3"),
    "layer_missing": ({("layers", 1): None}, None, "the header's `layers\\[1\\]` is null, but its group holds rows"),
    "groups_object": ({("groups",): {}}, None, "`header.groups` is \\{\\}, expected list"),
    "policy": ({("options", "eviction"): {"class": 3}}, None, "`options.eviction.class` is 3, expected str"),
    "block_size": ({("options", "block_size"): 0}, None, "`options.block_size` is 0, expected int >= 1"),
    "unknown_option": ({("options", "blocksize"): 4}, None, "its options are not valid PagedCache options"),
    "option_value": ({("options", "residual_length"): -1}, None, "options are not valid .*`residual_length`"),
    "eviction_without_policy": ({("eviction",): {"counts": {}}}, None, "the header lacks `eviction.decode_steps`"),
}  # fmt: skip


@pytest.mark.parametrize("case", CRAFTED_HEADERS)
def test_crafted_headers_are_refused_before_anything_is_allocated(plain, tmp_path, case):
    """A header edited after saving, its digest recomputed (the digest has no key), is a `CacheFileError` naming the
    field and its value, raised before anything is allocated from the header's sizes; no file changes."""
    model, path, data = plain
    edits, edit_tensors, message = CRAFTED_HEADERS[case]
    crafted = tmp_path / "crafted.safetensors"
    _rewrite_header(path, crafted, _setting(edits), edit_tensors)
    content = crafted.read_bytes()
    tracemalloc.start()
    try:
        with pytest.raises(CacheFileError, match=message):
            PagedCache.load(crafted, model.config)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**23  # 8 MiB: the free list of a pool of 10**6 blocks alone takes more
    assert crafted.read_bytes() == content and path.read_bytes() == data


def test_crafted_header_text_is_refused(plain, tmp_path):
    """Header text that is not JSON, JSON nested too deeply to parse, or not an object, with a matching digest."""
    model, path, _data = plain
    with safe_open(path, framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    cases = {"{not json": "is not JSON a PagedCache wrote \\(JSONDecodeError\\)",
             "[" * 100_000 + "]" * 100_000: "is not JSON a PagedCache wrote \\(RecursionError\\)",
             "[2]": "format version None"}  # fmt: skip
    for text, message in cases.items():
        _write(tmp_path / "text.safetensors", text, tensors)
        with pytest.raises(CacheFileError, match=message):
            PagedCache.load(tmp_path / "text.safetensors", model.config)


def test_a_failed_load_changes_nothing_it_was_given(saved, tmp_path):
    """Loading builds a new cache, so what a failed load could change is what it was handed: the file, the options
    and their eviction policy (whose random state the loaded cache must not share)."""
    model, path, data = saved
    options = PagedCache.load(path, model.config).options
    before = (dataclasses.asdict(options), options.eviction)
    _rewrite_header(path, tmp_path / "crafted.safetensors", _setting({("groups", 1, "rows", 0, "base"): 3}))
    with pytest.raises(CacheFileError, match="`groups\\[1\\].rows\\[0\\]` is inconsistent"):
        PagedCache.load(tmp_path / "crafted.safetensors", model.config, options)
    assert (dataclasses.asdict(options), options.eviction) == before and path.read_bytes() == data


def test_crafted_layers_options_and_eviction_state_are_refused(saved, tmp_path):
    model, path, _data = saved

    def scores(tensors):
        tensors["eviction.scores.1"] = tensors["eviction.scores.1"][:, :1]

    def kept_one_head(tensors):
        tensors["groups.0.kept"] = tensors["groups.0.kept"][:8]

    cases = [
        ({("eviction", "counts", "full_attention@0/int8"): [1]}, None, "`eviction.counts.full_attention@0/int8` is"),
        ({("eviction", "scored_layers"): [0, 0]}, None, "`eviction.scored_layers` names a layer twice"),
        ({("eviction", "scored_layers"): [2]}, None, "`eviction.scored_layers.0` is 2, expected int >= 0 <= 1"),
        ({}, scores, "'eviction.scores.1' is torch.float32 \\(1, 1, 64\\), expected floating scores of \\[rows, 2"),
        ({("eviction", "generators"): ["generator"]}, None, "the policy's random state 'generator' does not fit H2O"),
        ({("eviction",): None}, None, "the header's `eviction` is absent but the options do evict"),
        ({("groups", 0, "rows", 0, "kept_heads"): 1}, kept_one_head, "keeps positions of other than 2 KV heads"),
        ({("layers", 0, "error_stats"): {"key": [0.0]}}, None, "`layers\\[0\\].error_stats.key` is \\[0.0\\]"),
        ({("layers", 0, "error_stats"): None}, None, "layer 0 is quantized but the header's `layers\\[0\\]` has no"),
        ({("layers", 1): None}, None, "`eviction.scored_layers` names layer 1, which it does not hold"),
        ({("options", "device"): "x"}, None, "its options are not valid PagedCache options \\(Expected one of cpu"),
        ({("options", "full_precision_layers"): 3}, None, "options do not fit this config \\(`full_precision_layers`"),
    ]
    for edits, edit_tensors, message in cases:
        _rewrite_header(path, tmp_path / "crafted.safetensors", _setting(edits), edit_tensors)
        with pytest.raises(CacheFileError, match=message):
            PagedCache.load(tmp_path / "crafted.safetensors", model.config)


@pytest.mark.parametrize("option, value", [("num_blocks", 10**12), ("initial_blocks", 10**12), ("max_memory", 2**60)])
def test_a_files_pool_size_is_bounded_by_this_machine(plain, tmp_path, option, value):
    """A file's own pool size is honoured (the loaded cache gets the saved one's), but not one beyond this machine's
    memory: that would allocate without bound before a block is read. Passing a size loads the same file."""
    model, path, _data = plain
    _rewrite_header(path, tmp_path / "huge.safetensors", _setting({("options", option): value}))
    with pytest.raises(CacheFileError, match=f"sizes its pool by {option}={value} .* more than this machine's memory"):
        PagedCache.load(tmp_path / "huge.safetensors", model.config)
    loaded = PagedCache.load(tmp_path / "huge.safetensors", model.config, num_blocks=8, max_memory=None)
    assert loaded.metrics().blocks_total == 8
    assert _comparable(loaded) == _comparable(PagedCache.load(path, model.config))


@functools.lru_cache(maxsize=None)
def _fuzz_source(directory: str) -> tuple:
    """A saved left-padded batch of two int8 rows with sealed blocks (sdpa, so continuing is quick), and the ids
    and mask of its next token."""
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    ids, mask = padded_batch((0, 3), 14)
    cache = PagedCache(model.config, block_size=4, quant="int8", residual_length=4)
    token = _forward(model, cache, ids, mask)[:, -1:].argmax(-1)
    mask = torch.cat([mask, torch.ones_like(token)], dim=1)
    token = _forward(model, cache, token, mask)[:, -1:].argmax(-1)  # seals the blocks before the residual window
    assert cache.metrics().quantized_tokens > 0
    path = os.path.join(directory, "source.safetensors")
    cache.save(path)
    return model, path, token, torch.cat([mask, torch.ones_like(token)], dim=1)


def _fields(node, path=()):
    """The path (keys and list indices) of every value in a header, placement options left out: a file's pool size
    is what the saved cache had (see `test_a_files_pool_size_is_bounded_by_this_machine`)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if path != ("options",) or key not in ("num_blocks", "max_memory", "initial_blocks"):
            yield (*path, key)
            yield from _fields(value, (*path, key))


FUZZ_VALUES = st.one_of(
    st.sampled_from([10**6, 10**9, 10**18, -1, -3, 0, 1, 2, 3, 94, True, False, None, "", "x", [], [0, 0], {}, 1.5]),
    st.integers(-5, 40),
    st.lists(st.integers(-1, 4), max_size=5),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_are_refused_or_load_and_continue(tmp_path_factory, data):
    """Any header field set to a huge, negative, wrong-typed or list value (digest recomputed) is refused with a
    `CacheFileError` alone, or, where the edit is harmless, loads a cache that continues."""
    model, source, token, mask = _fuzz_source(str(tmp_path_factory.getbasetemp()))
    with safe_open(source, framework="pt") as handle:
        header = json.loads(handle.metadata()[FORMAT])
    edits = data.draw(st.dictionaries(st.sampled_from(sorted(_fields(header), key=repr)), FUZZ_VALUES, min_size=1,
                                      max_size=2))  # fmt: skip
    crafted = tmp_path_factory.getbasetemp() / "fuzzed.safetensors"
    try:
        _rewrite_header(source, crafted, _setting(edits))
    except (TypeError, KeyError, IndexError):  # an edit below a value the other edit replaced
        return
    try:
        loaded = PagedCache.load(crafted, model.config)
    except CacheFileError:
        return
    # A harmless edit may shorten the file's length within its last blocks: a consistent crop, which continues from
    # there (the digest was recomputed, so nothing tells it from a cache cropped before saving).
    length = loaded.get_seq_length()
    _setting(edits)(header)
    assert length == header["groups"][0]["length"] <= 15
    logits = _forward(model, loaded, token, torch.cat([mask[:, :length], mask[:, -1:]], dim=1))
    assert logits.shape == (2, 1, VOCAB) and loaded.get_seq_length() == length + 1


def test_a_directory_is_refused_clearly(plain, tmp_path):
    model, path, _data = plain
    with pytest.raises(IsADirectoryError, match="is a directory; give the path of a file that `PagedCache.save`"):
        PagedCache.load(tmp_path, model.config)
    cache = PagedCache.load(path, model.config)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(IsADirectoryError, match="is a directory; give the path of a file to write"):
        cache.save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == before


# ---------------------------------------------------------------------------------------------- the real model
@pytest.mark.slow
@needs_wheel
def test_smollm2_int4_cache_continues_exactly_after_loading(tmp_path):
    """SmolLM2-135M: a quantized prompt cache (int4, sealed blocks and a full-precision residual) saved, loaded
    and continued gives the saved cache's logits bit for bit."""
    model, tokenizer = load_smollm2(attn_implementation="paged")
    ids = tokenizer(" ".join(PROMPTS) * 4, return_tensors="pt")["input_ids"]
    original = PagedCache(model.config, quant="int4", residual_length=32)
    _forward(model, original, ids[:, :64])
    _forward(model, original, ids[:, 64:-1])  # seals the blocks older than the residual window
    original.save(tmp_path / "smollm2.safetensors")
    loaded = PagedCache.load(tmp_path / "smollm2.safetensors", model.config)
    assert loaded.metrics().quantized_tokens > 0 and _comparable(loaded) == _comparable(original)
    expected, got = _continue(model, original, ids[:, -1:]), _continue(model, loaded, ids[:, -1:])
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_forks_share_with_and_identical_rows_round_trip(tmp_path):
    """A saved fork (its own rows only), a `share_with` cache and a batch of identical rows continue with the
    same tokens after loading (a fork's file holds only the blocks it references)."""
    model = _model("llama_gqa")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    parent = PagedCache(model.config, block_size=4)
    _forward(model, parent, ids[:, :PREFIX])
    fork = parent.fork()
    _forward(model, fork, ids[:, PREFIX : PREFIX + 2])
    shared = PagedCache(model.config, block_size=4, share_with={1: 0})
    _forward(model, shared, ids[:, :PREFIX])
    twins = PagedCache(model.config, block_size=4)
    _forward(model, twins, ids[:, :PREFIX].expand(3, -1))
    assert twins.metrics().shared_blocks > 0
    for index, (cache, rest) in enumerate([(fork, ids[:, PREFIX + 2 :]), (shared, ids[:, PREFIX:]),
                                           (twins, ids[:, PREFIX:].expand(3, -1))]):  # fmt: skip
        path = tmp_path / f"{index}.safetensors"
        cache.save(path)
        loaded = PagedCache.load(path, model.config)
        assert loaded.metrics().blocks_used <= cache.metrics().blocks_used
        expected, got = _continue(model, cache, rest), _continue(model, loaded, rest)
        assert [t[:, -1].argmax(-1).tolist() for t in expected] == [t[:, -1].argmax(-1).tolist() for t in got]


def test_a_kv_shared_model_round_trips_and_forks(tmp_path):
    """Gemma-3n's KV-shared layers store nothing to save: a loaded cache and a fork rebuild them on their producers'
    blocks and continue with the logits of DynamicCache (past the sliding window)."""
    model = _model("gemma3n")
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation("sdpa")
    reference = DynamicCache(config=model.config)
    _forward(model, reference, ids[:, :PREFIX])
    expected = _continue(model, reference, ids[:, PREFIX:])
    model.set_attn_implementation("paged")
    cache = PagedCache(model.config, block_size=4)
    _forward(model, cache, ids[:, :PREFIX])
    cache.save(tmp_path / "kv_shared.safetensors")
    for continued in (PagedCache.load(tmp_path / "kv_shared.safetensors", model.config), cache.fork(), cache):
        for got, want in zip(_continue(model, continued, ids[:, PREFIX:]), expected):
            torch.testing.assert_close(got, want)


DATA = os.path.join(os.path.dirname(__file__), "data")  # files saved by commit 8b790c2, before the redesign
with open(os.path.join(DATA, "expected.json")) as recorded_file:
    SAVED_FILES = json.load(recorded_file)


@pytest.mark.parametrize("name", SAVED_FILES)
def test_files_saved_before_the_redesign_load_and_continue_as_recorded(name):
    """Each file in `data/` (saved by commit 8b790c2 after `generate`; `expected.json` records the sequences it was
    saved after and the 5 greedy tokens its loaded cache continued with) loads and continues the same way."""
    import tiny_models

    recorded = SAVED_FILES[name]
    model, _config = getattr(tiny_models, recorded["factory"])()
    model.set_attn_implementation("paged")
    cache = PagedCache.load(os.path.join(DATA, f"{name}.safetensors"), model.config)
    first = torch.tensor(recorded["first"])
    out = model.generate(first, cache=cache, max_new_tokens=5, do_sample=False)
    assert out[:, first.shape[1] :].tolist() == recorded["continuation"]


def test_a_length_cut_within_the_last_blocks_loads_as_a_crop(tmp_path_factory):
    """A header whose group length is shortened within the rows' last blocks (digest recomputed) is consistent: it
    loads as the cache cropped to that length and continues from there."""
    model, source, token, mask = _fuzz_source(str(tmp_path_factory.getbasetemp()))
    crafted = tmp_path_factory.getbasetemp() / "cut.safetensors"
    _rewrite_header(source, crafted, _setting({("groups", 0, "length"): 13}))
    loaded = PagedCache.load(crafted, model.config)
    assert loaded.get_seq_length() == 13
    logits = _forward(model, loaded, token, torch.cat([mask[:, :13], mask[:, -1:]], dim=1))
    assert logits.shape == (2, 1, VOCAB) and loaded.get_seq_length() == 14
