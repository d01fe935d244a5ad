"""PagedCache behaviour beyond exactness: pool sizing, errors that leave the cache unchanged, metrics,
sliding windows returning blocks, sharing on reorder."""

import importlib
import threading

import pytest
import torch
from cache_state import cache_state
from transformers import (AttentionInterface, DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import hf_paged_cache
from hf_paged_cache import H2O, TOVA, OutOfBlocksError, PagedCache, StreamingLLM, estimate_kv_bytes, kv_bytes_per_token
from hf_paged_cache.paged_attention import paged_attention_forward


def tiny_llama(layers=2, kv_heads=2):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tiny_mistral(window=8):
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=window, pad_token_id=0,
    )  # fmt: skip
    return MistralForCausalLM(config).eval()


def forward(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=True).logits


def test_out_of_blocks_raises_names_counts_and_leaves_cache_unchanged():
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4, num_blocks=5)
    ids = torch.randint(1, 128, (1, 14))
    forward(model, cache, ids[:, :10])  # 3 blocks
    before = cache_state(cache)
    with pytest.raises(OutOfBlocksError) as error:
        forward(model, cache, torch.randint(1, 128, (1, 12)))  # needs 3 more (10+12=22 -> 6 blocks), 2 free
    assert isinstance(error.value, RuntimeError)
    message = str(error.value)
    assert "needs 3 blocks" in message and "only 2 of 5" in message and "num_blocks" in message
    assert cache_state(cache) == before
    # The cache still works and still matches DynamicCache.
    reference = DynamicCache(config=model.config)
    forward(model, reference, ids[:, :10])
    torch.testing.assert_close(forward(model, cache, ids[:, 10:]), forward(model, reference, ids[:, 10:]))


def test_growable_pool_grows_and_keeps_contents():
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4, initial_blocks=2)
    reference = DynamicCache(config=model.config)
    ids = torch.randint(1, 128, (2, 30))
    torch.testing.assert_close(forward(model, cache, ids[:, :20]), forward(model, reference, ids[:, :20]))
    assert cache.metrics().blocks_total >= 10
    torch.testing.assert_close(forward(model, cache, ids[:, 20:]), forward(model, reference, ids[:, 20:]))


def test_max_memory_sets_blocks_from_the_first_key_values():
    model = tiny_llama(layers=2, kv_heads=2)
    per_block = 2 * 8 * 2 * 16 * 4 * 2  # K+V, block 8, 2 heads, head dim 16, fp32, 2 layers
    cache = PagedCache(model.config, block_size=8, max_memory=per_block * 10 + 5)
    forward(model, cache, torch.randint(1, 128, (1, 5)))
    assert cache.metrics().blocks_total == 9  # plus the null block of each layer: 10 blocks' storage
    assert cache.metrics().pool_bytes == per_block * 10


def test_max_memory_too_small_is_a_clear_error():
    model = tiny_llama()
    cache = PagedCache(model.config, max_memory=100)
    with pytest.raises(ValueError, match="max_memory"):
        forward(model, cache, torch.randint(1, 128, (1, 5)))


def test_cache_of_another_model_fails_clearly():
    small, large = tiny_llama(layers=2), tiny_llama(layers=3)
    with pytest.raises(ValueError, match="2 layers"):
        forward(large, PagedCache(small.config), torch.randint(1, 128, (1, 4)))
    mqa = tiny_llama(layers=2, kv_heads=1)
    cache = PagedCache(small.config)
    forward(small, cache, torch.randint(1, 128, (1, 4)))
    cache.reset()
    with pytest.raises(ValueError, match="different model"):
        forward(mqa, cache, torch.randint(1, 128, (1, 4)))


def test_unknown_option_lists_the_options():
    model = tiny_llama()
    with pytest.raises(TypeError, match="block_size"):
        PagedCache(model.config, blocksize=16)


def test_batch_change_without_reset_is_an_error_and_reset_returns_every_block():
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4)
    forward(model, cache, torch.randint(1, 128, (2, 9)))
    with pytest.raises(ValueError, match="reset"):
        forward(model, cache, torch.randint(1, 128, (3, 1)))
    cache.reset()
    assert cache.metrics().blocks_used == 0 and cache.get_seq_length() == 0
    forward(model, cache, torch.randint(1, 128, (3, 5)))
    assert cache.metrics().blocks_used == 3 * 2


def test_waste_is_at_most_one_partial_block_per_row_and_matches_the_estimate():
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=16)
    forward(model, cache, torch.randint(1, 128, (3, 37)))
    metrics = cache.metrics()
    per_token = kv_bytes_per_token(model.config, torch.float32)
    assert metrics.tokens_stored == 3 * 37
    assert metrics.ideal_bytes == 3 * 37 * per_token
    assert metrics.waste_bytes <= 3 * 16 * per_token
    assert metrics.used_bytes == estimate_kv_bytes(model.config, 3, 37, 16, torch.float32)
    assert metrics.table_bytes == 4 * 3 * 3


def test_sliding_layers_return_blocks_that_leave_the_window():
    model = tiny_mistral(window=8)
    cache = PagedCache(model.config, block_size=4)
    reference = DynamicCache(config=model.config)
    ids = torch.randint(1, 128, (1, 40))
    torch.testing.assert_close(forward(model, cache, ids[:, :12]), forward(model, reference, ids[:, :12]))
    for step in range(12, 40):
        torch.testing.assert_close(
            forward(model, cache, ids[:, step : step + 1]), forward(model, reference, ids[:, step : step + 1])
        )
        # the previous window-1 tokens plus the new one, rounded out to blocks: at most 4 blocks of 4
        assert cache.metrics().blocks_used <= 4
    assert cache.get_seq_length() == 40


def test_crop_beyond_a_dropped_window_raises_and_changes_nothing():
    model = tiny_mistral(window=8)
    cache = PagedCache(model.config, block_size=4)
    forward(model, cache, torch.randint(1, 128, (1, 30)))
    forward(model, cache, torch.randint(1, 128, (1, 1)))
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-10)
    assert cache_state(cache) == before
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


@pytest.mark.parametrize("bad", [-1.5, -2.0, "-2", None, False])
def test_crop_by_a_non_integer_names_the_parameter_and_changes_nothing(bad):
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4)
    forward(model, cache, torch.randint(1, 128, (1, 10)))
    before = cache_state(cache)
    with pytest.raises(ValueError, match=r"`tokens_to_remove` must be an int <= 0 .* got"):
        cache.crop(bad)
    assert cache_state(cache) == before
    cache.crop(-2)
    assert cache.get_seq_length() == 8


def test_crop_with_recorded_past_is_exact():
    model = tiny_mistral(window=8)
    ids = torch.randint(1, 128, (1, 30))
    cache, reference = PagedCache(model.config, block_size=4), DynamicCache(config=model.config)
    cache.activate_past_recording()
    reference.activate_past_recording()
    for c in (cache, reference):
        forward(model, c, ids[:, :20])
        forward(model, c, ids[:, 20:25])
        c.crop(-3)
    assert cache.get_seq_length() == reference.get_seq_length() == 22
    torch.testing.assert_close(forward(model, cache, ids[:, 22:]), forward(model, reference, ids[:, 22:]))


def test_reorder_shares_blocks_and_copies_on_write():
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4)
    reference = DynamicCache(config=model.config)
    ids = torch.randint(1, 128, (2, 6))
    for c in (cache, reference):
        forward(model, c, ids)
    used = cache.metrics().blocks_used  # 2 rows x 2 blocks
    beams = torch.tensor([1, 1])
    cache.reorder_cache(beams)
    reference.reorder_cache(beams)
    assert cache.metrics().blocks_used == used // 2  # both rows now point at row 1's blocks
    step = torch.randint(1, 128, (2, 1))
    torch.testing.assert_close(forward(model, cache, step), forward(model, reference, step))
    # Each row wrote into the shared partial block, so one of them got a private copy.
    group = cache.groups["full_attention"]
    assert group.tables[0][0] == group.tables[1][0] and group.tables[0][1] != group.tables[1][1]


def test_chunked_attention_layers_use_the_kernels():
    """Chunked layers mask by chunk, which the kernels do (`chunk_size`), as they do by window."""
    from transformers import Llama4TextConfig

    from hf_paged_cache.layer_types.chunked import ChunkedAttention

    config = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8,
        layer_types=["chunked_attention", "full_attention"],
    )  # fmt: skip
    cache = PagedCache(config, backend="triton")
    chunked, full = cache.layers
    assert isinstance(chunked.layer_type, ChunkedAttention) and chunked.is_sliding and chunked.sliding_window == 8
    full.device = chunked.device = torch.device("cpu")
    assert chunked.uses_kernels() and full.uses_kernels()


@pytest.mark.parametrize("attn", ["sdpa", "paged"])
def test_half_precision_storage_for_a_float32_model(attn):
    model = tiny_llama()
    model.set_attn_implementation(attn)
    ids = torch.randint(1, 128, (2, 12))
    expected = forward(model, DynamicCache(config=model.config), ids)
    cache = PagedCache(model.config, dtype=torch.float16)
    actual = forward(model, cache, ids[:, :8])
    actual = torch.cat([actual, forward(model, cache, ids[:, 8:])], dim=1)
    assert cache.layers[0].key_blocks.dtype == torch.float16
    assert cache.metrics().ideal_bytes == 2 * 12 * kv_bytes_per_token(model.config, torch.float16)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)


def test_default_pool_is_sized_by_the_first_step_and_holds_at_most_1_25x_what_it_uses():
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4)
    forward(model, cache, torch.randint(1, 128, (1, 64)))  # 16 blocks in use
    metrics = cache.metrics()
    assert (metrics.blocks_used, metrics.blocks_total) == (16, 19)  # + the null block: 20 blocks of storage
    assert metrics.pool_bytes == 1.25 * metrics.used_bytes
    sizes = {metrics.blocks_total}
    for _ in range(48):
        forward(model, cache, torch.randint(1, 128, (1, 1)))
        metrics = cache.metrics()
        assert metrics.pool_bytes <= 1.25 * metrics.used_bytes
        sizes.add(metrics.blocks_total)
    assert sorted(sizes) == [19, 24, 30]  # grown to 1.25x the blocks in use when the pool ran out
    preallocated = PagedCache(model.config, block_size=4, initial_blocks=64)
    forward(model, preallocated, torch.randint(1, 128, (1, 8)))
    assert preallocated.metrics().blocks_total == 64  # an explicit `initial_blocks` is kept


def tiny_gemma3(window=512):
    """Gemma-3's proportions at a tiny width: five sliding layers per full one, one KV head."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], pad_token_id=0,
    )  # fmt: skip
    return Gemma3ForCausalLM(config).eval()


def held_per_group(cache):
    """Per group, storage held over bytes in use (the library's own accounting)."""
    return {name: group["pool_bytes"] / group["used_bytes"] for name, group in cache.metrics().groups.items()}


def test_sliding_window_pool_gives_back_what_leaves_the_window_and_stays_exact():
    # A 1,446-token prompt fills 91 blocks of the sliding group; the first decode step drops all but the window's.
    model = tiny_gemma3(window=512)
    cache, reference = PagedCache(model.config), DynamicCache(config=model.config)
    fixed = PagedCache(model.config, num_blocks=128)  # never trimmed: packing must change no result
    ids = torch.randint(1, 128, (1, 1446 + 20))
    logits = forward(model, cache, ids[:, :1446])
    torch.testing.assert_close(logits, forward(model, reference, ids[:, :1446]))
    assert torch.equal(logits, forward(model, fixed, ids[:, :1446]))
    assert max(held_per_group(cache).values()) <= 1.25
    after_prefill = cache.metrics().groups["sliding_attention[512]"]
    for step in range(1446, ids.shape[1]):  # crosses a block boundary: a block leaves, another is allocated
        step_ids = ids[:, step : step + 1]
        logits = forward(model, cache, step_ids)
        torch.testing.assert_close(logits, forward(model, reference, step_ids))
        assert torch.equal(logits, forward(model, fixed, step_ids))
        assert max(held_per_group(cache).values()) <= 1.25
    sliding = cache.metrics().groups["sliding_attention[512]"]
    assert sliding["blocks_used"] <= 34 < after_prefill["blocks_used"]
    assert sliding["pool_bytes"] < after_prefill["pool_bytes"] / 2  # the storage itself shrank


@pytest.mark.parametrize("policy", [H2O(budget=0.25), StreamingLLM(budget=0.25)], ids=["h2o", "streaming"])
def test_eviction_gives_back_the_storage_of_the_blocks_it_frees(policy):
    model = tiny_llama()
    model.set_attn_implementation("paged")
    cache = PagedCache(model.config, eviction=policy)
    fixed = PagedCache(model.config, eviction=policy, num_blocks=128)  # a fixed pool keeps its size
    ids = torch.randint(1, 128, (1, 800 + 20))
    torch.testing.assert_close(forward(model, cache, ids[:, :800]), forward(model, fixed, ids[:, :800]))
    assert cache.metrics().evicted_tokens > 0
    assert max(held_per_group(cache).values()) <= 1.25  # right after the prompt's compression
    for step in range(800, ids.shape[1]):
        step_ids = ids[:, step : step + 1]
        torch.testing.assert_close(forward(model, cache, step_ids), forward(model, fixed, step_ids))
        assert max(held_per_group(cache).values()) <= 1.25
    assert cache.metrics().tokens_stored == fixed.metrics().tokens_stored
    assert {group["blocks_total"] for group in fixed.metrics().groups.values()} == {128}


def test_crop_gives_back_storage_but_never_below_initial_blocks():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 201))
    for options, floor in (({}, 0), ({"initial_blocks": 40}, 40)):
        cache, reference = PagedCache(model.config, block_size=4, **options), DynamicCache(config=model.config)
        forward(model, cache, ids[:, :200]), forward(model, reference, ids[:, :200])
        cache.crop(-150)
        reference.crop(-150)
        assert cache.metrics().blocks_total == max(floor, 15)  # 13 blocks in use: 16 of storage with the null block
        assert floor or cache.metrics().pool_bytes <= 1.25 * cache.metrics().used_bytes
        torch.testing.assert_close(forward(model, cache, ids[:, 200:]), forward(model, reference, ids[:, 200:]))


def test_metrics_summary_shows_pool_bytes_next_to_bytes_in_use():
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4)
    forward(model, cache, torch.randint(1, 128, (2, 9)))
    metrics = cache.metrics()
    assert str(metrics) == metrics.summary()
    assert metrics.summary() == (
        f"18 tokens in 6 of 6 blocks of 4: {metrics.used_bytes:,} B in use (ideal {metrics.ideal_bytes:,} B, tables "
        f"24 B), pool {metrics.pool_bytes:,} B (1.17x in use)"
    )


def test_reset_before_a_max_memory_pool_exists_and_after_it_was_too_small():
    model = tiny_llama()
    cache = PagedCache(model.config, max_memory="1MB")
    fresh = cache_state(cache)
    cache.reset()
    assert cache_state(cache) == fresh
    small = PagedCache(model.config, max_memory=100)
    fresh = cache_state(small)
    with pytest.raises(ValueError, match="`max_memory`=100 bytes cannot hold two blocks"):
        forward(model, small, torch.randint(1, 128, (1, 5)))
    assert cache_state(small) == fresh
    small.reset()  # the advice after the error
    assert cache_state(small) == fresh


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        (torch.tensor([5]), r"holds 1 rows: a reorder takes one or more row indices, each in \[0, 1\); got \[5\]"),
        (torch.tensor([-1]), r"each in \[0, 1\); got \[-1\]"),
        (torch.tensor([], dtype=torch.long), r"one or more row indices.*got \[\]"),
        ([], r"one or more row indices.*got \[\]"),
        (torch.tensor([0.0]), r"`beam_idx` must be a 1-D tensor of row indices, got torch.float32 \(1,\)"),
        (torch.tensor([[0]]), r"`beam_idx` must be a 1-D tensor of row indices, got torch.int64 \(1, 1\)"),
    ],
)
def test_reorder_with_bad_indices_is_a_clear_error_and_changes_nothing(indices, message):
    model = tiny_llama()
    cache = PagedCache(model.config, block_size=4)
    forward(model, cache, torch.randint(1, 128, (1, 6)))
    before = cache_state(cache)
    with pytest.raises(ValueError, match=message):
        cache.reorder_cache(indices)
    assert cache_state(cache) == before


def test_options_that_count_layers_must_fit_the_model():
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match=r"`full_precision_layers`=3 but this model has 2 layers: at most 2"):
        PagedCache(model.config, quant="int8", full_precision_layers=3)
    assert not PagedCache(model.config, quant="int8", full_precision_layers=2).layers[1].is_quantized
    for budgets in ([1.0], [1.0, 1.0, 1.0]):
        with pytest.raises(ValueError, match=rf"`layer_budgets` .* has {len(budgets)} multipliers but this model has 2 "
                           r"layers: give one per layer \(e.g. `pyramid_budgets\(2\)`\)"):  # fmt: skip
            PagedCache(model.config, eviction=TOVA(budget=64, layer_budgets=budgets))


def test_triton_backend_on_cpu_tensors_fails_at_the_first_forward_before_changing_anything(monkeypatch):
    """With CUDA present, `backend="triton"` passes construction; K/V on the CPU then need the interpreter."""
    model = tiny_llama()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        cache = PagedCache(model.config, backend="triton")
    before = cache_state(cache)
    with pytest.raises(ValueError, match=r"`backend`='triton' on cpu needs Triton's CPU interpreter"):
        forward(model, cache, torch.randint(1, 128, (1, 5)))
    assert cache_state(cache) == before


def test_importing_the_package_registers_the_paged_attention(monkeypatch):
    monkeypatch.delitem(AttentionInterface._global_mapping, "paged")
    monkeypatch.delitem(AttentionMaskInterface._global_mapping, "paged")
    importlib.reload(hf_paged_cache)
    assert AttentionInterface._global_mapping["paged"] is paged_attention_forward
    assert AttentionMaskInterface._global_mapping["paged"] is sdpa_mask
    model = tiny_llama()
    model.set_attn_implementation("paged")  # no register call needed
    ids = torch.randint(1, 128, (1, 6))
    torch.testing.assert_close(forward(model, PagedCache(model.config), ids), forward(tiny_llama(), None, ids))


def test_a_model_running_another_attention_than_the_cache_expects_gets_the_library_error():
    """The cache reads "paged" from the config it was built from; a second model object running "sdpa"
    must not attend over the step's new tokens alone (or fail inside SDPA)."""
    paged_model, sdpa_model = tiny_llama(), tiny_llama()
    paged_model.set_attn_implementation("paged")
    ids = torch.randint(1, 128, (1, 9))
    cache = PagedCache(paged_model.config, block_size=4)
    forward(paged_model, cache, ids[:, :8])
    with pytest.raises(RuntimeError, match=r"handed this layer's K/V to the \"paged\" attention .* reads them with other code: a "
                       r"different model object .* call `cache.reset\(\)`"):  # fmt: skip
        forward(sdpa_model, cache, ids[:, 8:])
    cache.reset()
    torch.testing.assert_close(forward(paged_model, cache, ids), forward(sdpa_model, None, ids))


def test_a_second_thread_during_a_forward_step_fails_clearly_and_changes_nothing():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 12))
    reference = DynamicCache(config=model.config)
    forward(model, reference, ids[:, :8])
    expected = forward(model, reference, ids[:, 8:])
    cache = PagedCache(model.config, block_size=4)
    forward(model, cache, ids[:, :8])
    paused, resume, result = threading.Event(), threading.Event(), {}

    def pause(module, args):  # the first layer has written the step, the second not yet
        paused.set()
        resume.wait(30)

    hook = model.model.layers[1].register_forward_pre_hook(pause)
    worker = threading.Thread(target=lambda: result.update(logits=forward(model, cache, ids[:, 8:])))
    worker.start()
    assert paused.wait(30)
    hook.remove()
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match=r"in the middle of a forward step of another thread \(1 of 2 layers written\)"
                       r".*one generation at a time"):  # fmt: skip
        forward(model, cache, ids[:, 8:9])
    assert cache_state(cache) == before
    resume.set()
    worker.join(30)
    torch.testing.assert_close(result["logits"], expected)
    forward(model, cache, ids[:, :1])  # between steps, another thread may take the cache over
    assert cache.get_seq_length() == 13
