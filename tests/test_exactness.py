"""Exactness of `PagedCache` against `DynamicCache` on tiny random-weight models.

For every architecture of `tiny_models.MODELS`, every generation scenario and both read paths
("gather": sdpa/eager attention on K/V that `update()` gathers through the block tables; "paged": the
"paged" attention reading the blocks itself), the greedy / beam / seeded-sampled tokens must be
identical to those produced with `DynamicCache(config=model.config)` and the gather implementation,
and every step's scores and logits must agree within 1e-4.

Every (architecture, scenario, read path, block size) combination runs; on one thread (see
`_one_thread`) the whole file takes well under a minute on two cores.
"""

from __future__ import annotations

import functools
import math
import random
from contextlib import contextmanager

import pytest
import torch
from tiny_models import MODELS, MODELS_BY_NAME, PAD_ID, VOCAB, padded_batch
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from hf_paged_cache.attention.contract import PAGED_KV_KWARG

ATOL = 1e-4
BLOCK_SIZES = (1, 4, 16)
READ_PATHS = ("gather", "paged")
PROMPT_LEN = 12
NEW_TOKENS = 20
PADS = (0, 3, 7)  # left padding of the rows of the padded batch
BEAM_PADS = (0, 5)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- inputs
def _padded_batch(pads: tuple[int, ...], length: int = PROMPT_LEN, seed: int = 0):
    return padded_batch(pads, length, seed)


def _lookup_prompt():
    """One row with repeated n-grams, so prompt lookup proposes candidates (some accepted, some not)."""
    pattern = [17, 42, 99, 5, 63]
    input_ids = torch.tensor([pattern + pattern + pattern[:2]])
    return input_ids, torch.ones_like(input_ids)


@functools.lru_cache(maxsize=None)
def _model(name: str):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _generate(model, attn_impl: str, cache, input_ids, attention_mask, cache_kwarg: str = "cache", seed=None, **kwargs):
    model.set_attn_implementation(attn_impl)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pad_token_id=PAD_ID,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=True,
            **{cache_kwarg: cache},
            **kwargs,
        )


# ---------------------------------------------------------------------------------------------- scenarios
def run_scenario(name: str, scenario: str, attn_impl: str, make_cache, cache_kwarg: str = "cache") -> list:
    """Run one generation scenario; returns the list of generate() outputs to compare."""
    model = _model(name)
    gen = functools.partial(_generate, model, attn_impl, cache_kwarg=cache_kwarg)
    if scenario == "padded_greedy":
        ids, mask = _padded_batch(PADS)
        return [gen(make_cache(model), ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False)]
    if scenario == "beam_search":
        ids, mask = _padded_batch(BEAM_PADS, seed=1)
        return [
            gen(
                make_cache(model), ids, mask, max_new_tokens=12, do_sample=False, num_beams=4,
                num_return_sequences=2, early_stopping=True,
            )
        ]  # fmt: skip
    if scenario == "sampling":
        ids, mask = _padded_batch(PADS, seed=2)
        return [gen(make_cache(model), ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, seed=1234)]
    if scenario == "chunked_prefill":
        ids, mask = _padded_batch(PADS, seed=3)
        return [gen(make_cache(model), ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, prefill_chunk_size=4)]
    if scenario == "prompt_lookup":
        ids, mask = _lookup_prompt()
        return [gen(make_cache(model), ids, mask, max_new_tokens=NEW_TOKENS, do_sample=False, prompt_lookup_num_tokens=3)]
    if scenario == "second_generate":
        ids, mask = _padded_batch(PADS, seed=4)
        cache = make_cache(model)
        first = gen(cache, ids, mask, max_new_tokens=8, do_sample=False)
        more = torch.randint(3, VOCAB, (len(PADS), 3), generator=torch.Generator().manual_seed(5))
        ids2 = torch.cat([first.sequences, more], dim=-1)
        mask2 = torch.cat([mask, torch.ones_like(ids2[:, mask.shape[1] :])], dim=-1)
        second = gen(cache, ids2, mask2, max_new_tokens=8, do_sample=False)
        return [first, second]
    raise ValueError(scenario)


SCENARIOS = ("padded_greedy", "beam_search", "sampling", "chunked_prefill", "prompt_lookup", "second_generate")


def _dynamic(model):
    return DynamicCache(config=model.config)


def _paged(block_size: int):
    return lambda model: PagedCache(model.config, block_size=block_size)


@functools.lru_cache(maxsize=None)
def reference(name: str, scenario: str) -> list:
    """DynamicCache + the gather attention implementation: what every PagedCache run must reproduce."""
    return run_scenario(name, scenario, MODELS_BY_NAME[name].gather_impl, _dynamic)


def _impl(name: str, read_path: str) -> str:
    return MODELS_BY_NAME[name].gather_impl if read_path == "gather" else "paged"


# ---------------------------------------------------------------------------------------------- comparison
def assert_same_generation(expected, actual, label: str = "") -> None:
    if not torch.equal(expected.sequences, actual.sequences):
        diff = (expected.sequences != actual.sequences).nonzero()
        raise AssertionError(
            f"{label}: tokens differ first at (row, position) {tuple(diff[0].tolist())}\n"
            f"expected {expected.sequences.tolist()}\nactual   {actual.sequences.tolist()}"
        )
    for field in ("scores", "logits"):
        want, got = getattr(expected, field), getattr(actual, field)
        assert len(want) == len(got), f"{label}: {field}: {len(want)} steps expected, got {len(got)}"
        for step, (a, b) in enumerate(zip(want, got)):
            torch.testing.assert_close(b, a, rtol=0, atol=ATOL, msg=lambda m, f=field, s=step: f"{label}: {f}[{s}]: {m}")
    if getattr(expected, "sequences_scores", None) is not None:
        torch.testing.assert_close(actual.sequences_scores, expected.sequences_scores, rtol=0, atol=ATOL)
        assert torch.equal(actual.beam_indices, expected.beam_indices), f"{label}: beam indices differ"


def assert_same_outputs(expected: list, actual: list, label: str = "") -> None:
    assert len(expected) == len(actual)
    for call, (want, got) in enumerate(zip(expected, actual)):
        assert_same_generation(want, got, f"{label} generate() call {call}")


@contextmanager
def read_path_spy(monkeypatch):
    """Records, per `PagedCache.update()` call, whether it left a paged handle for the attention to read
    the blocks (the "paged" read path) or returned gathered K/V (the "gather" read path, with or without a
    `gathered` handle); and crops."""
    counts = {"handle": 0, "gathered": 0, "crops": []}
    update, crop = PagedCache.update, PagedCache.crop

    def recording_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        result = update(self, key_states, value_states, layer_idx, *args, **kwargs)
        handle = (kwargs.get("kwargs") or {}).get(PAGED_KV_KWARG)
        counts["handle" if handle is not None and not handle.gathered else "gathered"] += 1
        return result

    def recording_crop(self, tokens_to_remove):
        counts["crops"].append(tokens_to_remove)
        return crop(self, tokens_to_remove)

    monkeypatch.setattr(PagedCache, "update", recording_update)
    monkeypatch.setattr(PagedCache, "crop", recording_crop)
    yield counts


def _check_read_path(counts, name: str, read_path: str) -> None:
    entry = MODELS_BY_NAME[name]
    if read_path == "gather" or not entry.passes_attention_kwargs or entry.caches_latents:
        assert counts["gathered"] > 0 and counts["handle"] == 0, counts
    else:
        assert counts["handle"] > 0 and counts["gathered"] == 0, counts


# ---------------------------------------------------------------------------------------------- the grid
def _grid():
    for entry in MODELS:
        for scenario in SCENARIOS:
            for read_path in READ_PATHS:
                for block_size in BLOCK_SIZES:
                    yield pytest.param(
                        entry.name, scenario, read_path, block_size,
                        id=f"{entry.name}-{scenario}-{read_path}-bs{block_size}",
                    )  # fmt: skip


@pytest.mark.parametrize(("name", "scenario", "read_path", "block_size"), list(_grid()))
def test_matches_dynamic_cache(name, scenario, read_path, block_size, monkeypatch):
    expected = reference(name, scenario)
    with read_path_spy(monkeypatch) as counts:
        actual = run_scenario(name, scenario, _impl(name, read_path), _paged(block_size))
    assert_same_outputs(expected, actual, f"{name}/{scenario}/{read_path}/bs{block_size}")
    _check_read_path(counts, name, read_path)
    if scenario == "prompt_lookup":
        assert any(n < 0 for n in counts["crops"]), f"no candidate was ever rejected: crops {counts['crops']}"


def _random_cases(count: int = 40, seed: int = 0):
    """Seeded random shapes: odd block sizes, padding longer than the window, chunk sizes up to past the window."""
    rng = random.Random(seed)
    for case in range(count):
        name = rng.choice(["mistral_sliding", "gemma2", "qwen2_sliding", "gemma3", "llama_mqa", "gpt_neox"])
        length = rng.randint(2, 20)
        pads = tuple(rng.randint(0, length - 1) for _ in range(rng.randint(1, 3)))
        options = {"max_new_tokens": rng.randint(1, 15), "do_sample": False}
        mode = rng.choice(["plain", "chunked", "beams"])
        if mode == "chunked":
            options["prefill_chunk_size"] = rng.randint(1, 11)
        if mode == "beams":
            options.update(num_beams=rng.choice([2, 3]), num_return_sequences=2)
        read_path, block_size = rng.choice(READ_PATHS), rng.choice([1, 2, 3, 5, 8, 16])
        label = f"{case}-{name}-{read_path}-bs{block_size}-L{length}-pads{'_'.join(map(str, pads))}-{mode}"
        yield pytest.param(name, read_path, block_size, length, pads, options, case, id=label)


@pytest.mark.parametrize(("name", "read_path", "block_size", "length", "pads", "options", "seed"), list(_random_cases()))
def test_random_shapes_match_dynamic_cache(name, read_path, block_size, length, pads, options, seed):
    model = _model(name)
    ids, mask = _padded_batch(pads, length=length, seed=seed)
    expected = _generate(model, MODELS_BY_NAME[name].gather_impl, _dynamic(model), ids, mask, **options)
    actual = _generate(model, _impl(name, read_path), PagedCache(model.config, block_size=block_size), ids, mask, **options)
    assert_same_generation(expected, actual, f"{name}/{read_path}/bs{block_size}")


# ---------------------------------------------------------------------------------------------- generate() kwargs
@pytest.mark.parametrize("read_path", READ_PATHS)
@pytest.mark.parametrize("cache_kwarg", ["cache", "past_key_values"])
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
def test_cache_and_past_key_values_kwargs(name, cache_kwarg, read_path):
    expected = reference(name, "padded_greedy")
    actual = run_scenario(name, "padded_greedy", _impl(name, read_path), _paged(4), cache_kwarg=cache_kwarg)
    assert_same_outputs(expected, actual, f"{name}/{cache_kwarg}/{read_path}")


# ---------------------------------------------------------------------------------------------- reuse
@pytest.mark.parametrize("read_path", READ_PATHS)
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sliding"])
def test_reset_then_reuse_matches_fresh_cache(name, read_path):
    model = _model(name)
    impl = _impl(name, read_path)
    cache = PagedCache(model.config, block_size=4)
    ids, mask = _padded_batch(PADS, seed=6)
    _generate(model, impl, cache, ids, mask, max_new_tokens=10, do_sample=False)
    cache.reset()
    assert cache.get_seq_length() == 0
    ids2, mask2 = _padded_batch((2, 0), length=9, seed=7)  # a new batch of another size
    reused = _generate(model, impl, cache, ids2, mask2, max_new_tokens=10, do_sample=False)
    fresh = _generate(model, impl, PagedCache(model.config, block_size=4), ids2, mask2, max_new_tokens=10, do_sample=False)
    assert_same_generation(fresh, reused, "reset cache vs fresh cache")
    dynamic = _generate(model, MODELS_BY_NAME[name].gather_impl, _dynamic(model), ids2, mask2, max_new_tokens=10, do_sample=False)
    assert_same_generation(dynamic, reused, "reset cache vs DynamicCache")


@pytest.mark.parametrize("read_path", READ_PATHS)
def test_reuse_without_reset_for_another_batch_size_raises(read_path):
    model = _model("llama_gqa")
    impl = _impl("llama_gqa", read_path)
    cache = PagedCache(model.config, block_size=4)
    ids, mask = _padded_batch(PADS, seed=8)
    _generate(model, impl, cache, ids, mask, max_new_tokens=6, do_sample=False)
    # Longer than what the cache holds, so generate() feeds only the tokens the cache lacks.
    ids2, mask2 = _padded_batch((0, 0), length=PROMPT_LEN + 10, seed=9)
    with pytest.raises(ValueError, match="reset"):
        _generate(model, impl, cache, ids2, mask2, max_new_tokens=4, do_sample=False)


# ---------------------------------------------------------------------------------------------- metrics
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("name", ["llama_gqa", "gemma2", "gpt_neox"])
def test_metrics_after_padded_generation(name, block_size):
    entry = MODELS_BY_NAME[name]
    model = _model(name)
    cache = PagedCache(model.config, block_size=block_size)
    ids, mask = _padded_batch(PADS, seed=10)
    new_tokens = 10
    _generate(model, entry.gather_impl, cache, ids, mask, max_new_tokens=new_tokens, do_sample=False)
    length = PROMPT_LEN + new_tokens - 1  # the last sampled token is never fed back
    real = [length - pad for pad in PADS]
    metrics = cache.metrics()
    assert metrics.block_size == block_size
    total_blocks = 0
    for group_name, group in cache.groups.items():
        stats = metrics.groups[group_name]
        stored = [group.stored_tokens(row) for row in range(len(PADS))]
        if group.sliding_window is None:
            expected = real if entry.passes_position_ids else [length] * len(PADS)
            assert stored == expected, f"{group_name}: stored {stored}, expected {expected} (padding stored?)"
        else:
            window = group.sliding_window
            for row, count in enumerate(stored):
                needed = min(real[row], window - 1)  # what the next step reads besides the new token
                assert needed <= count <= needed + block_size, f"{group_name} row {row}: {count} tokens stored"
        blocks = sum(math.ceil(count / block_size) for count in stored)
        assert stats["blocks_used"] == blocks, f"{group_name}: {stats}"
        assert stats["tokens_stored"] == sum(stored)
        assert stats["blocks_used"] + stats["blocks_free"] == stats["blocks_total"]
        total_blocks += blocks
    assert metrics.blocks_used == total_blocks
    cache.reset()
    after = cache.metrics()
    assert after.blocks_used == 0 and after.tokens_stored == 0
    assert all(stats["blocks_used"] == 0 for stats in after.groups.values())


# ---------------------------------------------------------------------------------------------- fixed pools
@pytest.mark.parametrize("read_path", READ_PATHS)
@pytest.mark.parametrize("pool", [{"num_blocks": 64}, {"max_memory": "1MiB"}], ids=["num_blocks", "max_memory"])
def test_fixed_pools_match_dynamic_cache(pool, read_path):
    """A fixed pool (sized in blocks, or in bytes once the first K/V arrive) changes no output."""
    name = "gemma2"  # two groups (sliding and full), each with its own pool
    expected = reference(name, "padded_greedy")
    actual = run_scenario(name, "padded_greedy", _impl(name, read_path), lambda m: PagedCache(m.config, block_size=4, **pool))
    assert_same_outputs(expected, actual, f"{name}/{pool}/{read_path}")


def test_max_memory_pool_fits_the_budget():
    model = _model("llama_gqa")
    budget = 64 * 1024
    cache = PagedCache(model.config, block_size=4, max_memory=budget)
    ids, mask = _padded_batch(PADS)
    _generate(model, "sdpa", cache, ids, mask, max_new_tokens=2, do_sample=False)
    assert cache.metrics().pool_bytes <= budget
