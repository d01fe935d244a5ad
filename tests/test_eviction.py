"""Token eviction: budgets, freed blocks, positions, protection, batches, references, composition.

Most tests decode step by step through a tiny model with the `"paged"` attention so that the cache
can be inspected after every step; `generate()` runs end to end on every architecture at the end.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cache_state import cache_state
from tiny_models import MODELS, MODELS_BY_NAME, PAD_ID, VOCAB, padded_batch
from transformers import AttentionInterface, DynamicCache

from hf_paged_cache import (
    H2O,
    TOVA,
    KeepRatio,
    KeyDiff,
    KeyNorm,
    KeyNovelty,
    OutOfBlocksError,
    PagedCache,
    RandomEviction,
    SnapKV,
    StreamingLLM,
)
from hf_paged_cache.attention import torch_path as torch_attention

BLOCK = 4
BUDGET = 16
SINKS = 2
WINDOW = 4

POLICIES = {
    "streaming": lambda **kw: StreamingLLM(budget=BUDGET, sinks=SINKS, window=WINDOW, **kw),
    "h2o": lambda **kw: H2O(budget=BUDGET, sinks=SINKS, window=WINDOW, **kw),
    "h2o_decay": lambda **kw: H2O(budget=BUDGET, sinks=SINKS, window=WINDOW, decay=0.9, **kw),
    "snapkv": lambda **kw: SnapKV(budget=BUDGET, sinks=SINKS, window=WINDOW, observation_window=4, **kw),
    "tova": lambda **kw: TOVA(budget=BUDGET, sinks=SINKS, window=WINDOW, **kw),
    "keynorm": lambda **kw: KeyNorm(budget=BUDGET, sinks=SINKS, window=WINDOW, **kw),
    "keydiff": lambda **kw: KeyDiff(budget=BUDGET, sinks=SINKS, window=WINDOW, **kw),
    "novelty": lambda **kw: KeyNovelty(budget=BUDGET, sinks=SINKS, window=WINDOW, **kw),
    "keep_ratio_novel": lambda **kw: KeepRatio(budget=0.5, sinks=SINKS, window=WINDOW, protect_novel=0.25, **kw),
    "keep_ratio": lambda **kw: KeepRatio(budget=0.5, sinks=SINKS, window=WINDOW, **kw),
    "random": lambda **kw: RandomEviction(budget=BUDGET, sinks=SINKS, window=WINDOW, **kw),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _model(name: str = "llama_gqa"):
    model, _config = MODELS_BY_NAME[name].build()
    return model


def _full_groups(cache: PagedCache):
    return [group for group in cache.groups.values() if group.sliding_window is None]


def _decode(model, cache, input_ids, attention_mask, steps: int, check=None):
    """Prefill, then `steps` greedy one-token forwards under "paged"; `check(cache)` after every step."""
    model.set_attn_implementation("paged")
    mask = attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache).logits
        outputs = [logits[:, -1]]
        for _ in range(steps):
            if check is not None:
                check(cache)
            token = logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache).logits
            outputs.append(logits[:, -1])
    if check is not None:
        check(cache)
    return torch.stack(outputs, dim=1)


# ---------------------------------------------------------------------------------------------- options
def test_policies_validate_their_options():
    with pytest.raises(ValueError, match="budget"):
        H2O(budget=0)
    with pytest.raises(ValueError, match="ratio"):
        SnapKV(budget=1.5)
    with pytest.raises(ValueError, match="decay"):
        H2O(budget=8, sinks=SINKS, window=WINDOW, decay=0.0)
    with pytest.raises(ValueError, match="sinks"):
        StreamingLLM(budget=8, sinks=-1)
    with pytest.raises(ValueError, match="layer_budgets"):
        TOVA(budget=8, layer_budgets=[1.0, -1.0])
    with pytest.raises(ValueError, match="eviction"):
        PagedCache(_model().config, eviction="snapkv")
    with pytest.raises(ValueError, match="evict_every"):
        PagedCache(_model().config, eviction=H2O(), evict_every=0)


# ---------------------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
@pytest.mark.parametrize("name", POLICIES)
def test_rows_stay_within_budget_plus_a_block_and_evicted_blocks_return(name, per_head):
    model = _model()
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES[name](per_head=per_head))
    input_ids, attention_mask = padded_batch((0, 5), 30, seed=1)

    def check(cache):
        for group in _full_groups(cache):
            index = int(group.name.split("@")[1])
            for row in range(len(group.tables)):
                real = group.length - group.pads[row]
                budget = cache.options.eviction.budget_for(real, index)
                assert group.stored_count(row) <= budget + BLOCK
                for positions in group.stored_positions(row).view(-1, group.stored_count(row)):  # each KV head's
                    assert positions[-1] == group.length - 1 and bool((positions.diff() > 0).all())
                    assert bool((positions[:SINKS] == group.pads[row] + torch.arange(SINKS)).all())
                    assert bool((positions[-WINDOW:] == torch.arange(group.length - WINDOW, group.length)).all())
            held = sum(-(-len(table) * BLOCK // BLOCK) for table in group.tables)
            assert group.pool.num_used == held  # no block leaked, none double-counted

    _decode(model, cache, input_ids, attention_mask, 24, check)
    metrics = cache.metrics()
    assert metrics.evictions > 0 and metrics.evicted_tokens > 0


def test_positions_of_new_tokens_are_unchanged_by_eviction():
    """The logical length (hence every new token's RoPE position) is the no-eviction run's."""
    model = _model()
    input_ids, attention_mask = padded_batch((0, 3), 30, seed=2)
    evicting = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["h2o"]())
    lengths = []
    _decode(model, evicting, input_ids, attention_mask, 12, lambda cache: lengths.append(cache.get_seq_length()))
    plain = PagedCache(model.config, block_size=BLOCK)
    expected = []
    _decode(model, plain, input_ids, attention_mask, 12, lambda cache: expected.append(cache.get_seq_length()))
    assert lengths == expected
    assert evicting.metrics().evicted_tokens > 0


def _streaming_reference(model, input_ids: torch.Tensor, steps: int, budget: int) -> torch.Tensor:
    """StreamingLLM computed independently: the full DynamicCache read through a 4D mask that shows
    only the tokens StreamingLLM keeps (first SINKS + most recent), with the cache's timing: down to the
    budget after the prompt, then again once a block more than the budget is held."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    length = input_ids.shape[1]
    kept = list(range(length))
    outputs = []
    with torch.no_grad():
        logits = model(input_ids=input_ids, cache=cache).logits
        outputs.append(logits[:, -1])
        for step in range(steps):
            if len(kept) > budget + (BLOCK if step else 0):
                kept = kept[:SINKS] + kept[len(kept) - (budget - SINKS) :]
            token = logits[:, -1:].argmax(-1)
            kept.append(length)
            mask = torch.zeros(1, 1, 1, length + 1, dtype=torch.bool)
            mask[..., kept] = True
            logits = model(input_ids=token, attention_mask=mask, position_ids=torch.tensor([[length]]), cache=cache).logits
            outputs.append(logits[:, -1])
            length += 1
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3", "phi3", "gpt2"])
def test_streaming_llm_equals_an_independent_masked_reference(name):
    model = _model(name)
    input_ids = torch.randint(3, VOCAB, (1, 27), generator=torch.Generator().manual_seed(3))
    policy = StreamingLLM(budget=BUDGET, sinks=SINKS, window=BUDGET - SINKS)
    cache = PagedCache(model.config, block_size=BLOCK, eviction=policy)
    got = _decode(model, cache, input_ids, torch.ones_like(input_ids), 14)
    expected = _streaming_reference(model, input_ids, 14, BUDGET)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.metrics().evicted_tokens > 0


def test_rows_of_a_batch_decide_independently():
    model = _model()
    input_ids, attention_mask = padded_batch((0, 4), 28, seed=4)
    batched = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["keynorm"]())
    _decode(model, batched, input_ids, attention_mask, 10)
    alone = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["keynorm"]())
    _decode(model, alone, input_ids[1:, 4:], attention_mask[1:, 4:], 10)
    for group, single in zip(_full_groups(batched), _full_groups(alone)):
        assert torch.equal(group.stored_positions(1) - 4, single.stored_positions(0))


def test_evict_now_frees_blocks_and_counts_them():
    model = _model()
    policy = H2O(budget=8, sinks=SINKS, window=WINDOW)
    cache = PagedCache(model.config, block_size=BLOCK, eviction=policy, evict_between_chunks=False)
    model.set_attn_implementation("paged")
    with torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (1, 40)), cache=cache)
    before = cache.metrics()
    evicted = cache.evict_now()
    after = cache.metrics()
    assert evicted == before.tokens_stored - after.tokens_stored > 0
    assert after.blocks_used < before.blocks_used and after.used_bytes < before.used_bytes
    assert after.evicted_tokens == evicted and cache.evict_now() == 0
    with pytest.raises(ValueError, match="eviction"):
        PagedCache(model.config).evict_now()


def test_other_attention_implementations_refuse_an_evicted_cache():
    model = _model()
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["streaming"]())
    input_ids = torch.randint(3, VOCAB, (1, 30))
    _decode(model, cache, input_ids, torch.ones_like(input_ids), 2)
    model.set_attn_implementation("sdpa")
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match='has evicted tokens, which only the "paged" attention reads'), torch.no_grad():
        model(input_ids=input_ids[:, :1], cache=cache)
    assert cache_state(cache) == before


def test_eviction_without_the_paged_attention_fails_at_the_first_forward_and_changes_nothing():
    model = _model()
    model.set_attn_implementation("sdpa")
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["streaming"]())
    fresh = cache_state(cache)
    expected = (
        r'has an eviction policy, which only the "paged" attention reads, but the config this cache was built from '
        r"selects the 'sdpa' attention: call `model.set_attn_implementation\(\"paged\"\)` or load with "
        r'`attn_implementation="paged"` .*`register_paged_attention\(\)`'
    )
    with pytest.raises(RuntimeError, match=expected), torch.no_grad():
        model(input_ids=torch.randint(3, VOCAB, (1, 30)), cache=cache)
    assert cache_state(cache) == fresh
    neox = _model("gpt_neox")  # calls update() without attention kwargs: nothing can read its blocks in place
    neox.set_attn_implementation("paged")
    cache = PagedCache(neox.config, block_size=BLOCK, eviction=POLICIES["streaming"]())
    fresh = cache_state(cache)
    with pytest.raises(RuntimeError, match=r"without attention kwargs.*build the cache without `eviction`"), torch.no_grad():
        neox(input_ids=torch.randint(3, VOCAB, (1, 30)), cache=cache)
    assert cache_state(cache) == fresh


def test_an_evicted_cache_read_by_a_second_sdpa_model_object_gets_the_library_error():
    model = _model()
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["streaming"]())
    input_ids = torch.randint(3, VOCAB, (1, 30))
    _decode(model, cache, input_ids, torch.ones_like(input_ids), 2)
    second, _config = MODELS_BY_NAME["llama_gqa"].build()  # the same weights, another object, "sdpa"
    with pytest.raises(RuntimeError, match=r'handed this layer\'s K/V to the "paged" attention'), torch.no_grad():
        second(input_ids=input_ids[:, :1], cache=cache)


def test_pool_pressure_evicts_instead_of_failing():
    model = _model()
    input_ids = torch.randint(3, VOCAB, (1, 24))
    fixed = dict(block_size=BLOCK, num_blocks=8)  # 32 tokens per layer
    with pytest.raises(OutOfBlocksError):
        _decode(model, PagedCache(model.config, **fixed), input_ids, torch.ones_like(input_ids), 12)
    policy = H2O(budget=24, sinks=SINKS, window=WINDOW)  # budget + a block = 28 < 32: pressure evicts early
    cache = PagedCache(model.config, eviction=policy, evict_every=1000, **fixed)
    _decode(model, cache, input_ids, torch.ones_like(input_ids), 12)
    assert cache.metrics().evictions > 0


def test_between_chunks_eviction_bounds_peak_memory():
    model = _model()
    input_ids = torch.randint(3, VOCAB, (1, 64))
    peaks = {}
    for between in (True, False):
        cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["snapkv"](), evict_between_chunks=between)
        model.set_attn_implementation("paged")
        peak = 0
        with torch.no_grad():
            for first in range(0, 64, 8):
                model(input_ids=input_ids[:, first : first + 8], cache=cache)
                peak = max(peak, cache.metrics().tokens_stored)
        peaks[between] = peak
    layers = model.config.num_hidden_layers
    assert peaks[True] <= layers * (BUDGET + 8 + BLOCK)
    assert peaks[False] == layers * 64


def test_eviction_decisions_follow_beams():
    model = _model()
    input_ids, attention_mask = padded_batch((0,), 30, seed=5)
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["h2o"]())
    model.set_attn_implementation("paged")
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache, max_new_tokens=10,
                             num_beams=3, num_return_sequences=1, do_sample=False, pad_token_id=PAD_ID)  # fmt: skip
    assert out.shape == (1, 40) and cache.metrics().evicted_tokens > 0
    for group in _full_groups(cache):
        for row in range(len(group.tables)):
            assert group.stored_count(row) <= BUDGET + BLOCK


@pytest.mark.parametrize("options", [{}, {"protect_novel": 0.5}], ids=["plain", "novel"])
def test_quantized_survivors_stay_quantized(options):
    """Sealed blocks are kept whole or dropped, and novel tokens in them take no more than the budget."""
    model = _model()
    policy = POLICIES["h2o"](**options)
    cache = PagedCache(model.config, block_size=BLOCK, quant="int4", residual_length=4, eviction=policy)
    input_ids = torch.randint(3, VOCAB, (1, 40))
    sealed = {}

    def check(cache):
        for group in _full_groups(cache):
            layer = next(layer for layer in cache.paged_layers if layer.tables is group)
            present = {}
            for block in group.qtables[0]:
                present[block] = layer.qkey["codes"][block].clone()
                if block in sealed.get(group.name, {}):  # a surviving quantized block was never rewritten
                    assert torch.equal(sealed[group.name][block], present[block])
            sealed[group.name] = present  # blocks evicted since may be reused for new seals
            assert group.stored_count(0) <= BUDGET + BLOCK

    _decode(model, cache, input_ids, torch.ones_like(input_ids), 16, check)
    assert cache.metrics().evicted_tokens > 0 and cache.metrics().quantized_tokens > 0


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_mass_one_chunk_and_chunked_agree_with_a_dense_softmax(softcap):
    """The torch statistics take one softmax for a row held in one chunk and two passes over several
    chunks (quantized rows); both equal a dense softmax, and a query that sees no key adds nothing."""
    gen = torch.Generator().manual_seed(0)
    kv_heads, group, queries, keys, dim = 2, 3, 5, 11, 8
    q = torch.randn(kv_heads, group * queries, dim, generator=gen)
    k = torch.randn(kv_heads, keys, dim, generator=gen)
    visible = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    visible[0] = False  # e.g. a padded query
    logits = q @ k.transpose(-1, -2) * 0.3
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    mask = visible[None].expand(group, -1, -1).reshape(1, -1, keys)
    expected = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0).sum(1)
    one = torch_attention.attention_mass(q, lambda: iter([k]), visible, group, 0.3, softcap)
    split = torch_attention.attention_mass(q, lambda: iter([k[:, :4], k[:, 4:9], k[:, 9:]]), visible, group, 0.3, softcap)
    torch.testing.assert_close(one, expected)
    torch.testing.assert_close(split, expected)
    assert torch_attention.attention_mass(q, lambda: iter([]), visible[:, :0], group, 0.3, softcap).shape == (kv_heads, 0)


def test_attention_mass_with_sinks_keeps_the_sink_in_the_denominator():
    """With learned sinks (gpt-oss) every query gives the keys the model's probabilities: a softmax over the
    keys and the sink column, the sink column dropped -- one chunk or several."""
    gen = torch.Generator().manual_seed(1)
    kv_heads, group, queries, keys, dim = 2, 3, 5, 11, 8
    q = torch.randn(kv_heads, group * queries, dim, generator=gen)
    k = torch.randn(kv_heads, keys, dim, generator=gen)
    sinks = torch.randn(kv_heads * group, generator=gen)
    visible = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    visible[0] = False  # a query that sees no key gives nothing (its probability is all the sink's)
    logits = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~visible[None].expand(group, -1, -1).reshape(1, -1, keys),
                                                         float("-inf"))  # fmt: skip
    sink_column = sinks.view(kv_heads, group, 1, 1).expand(-1, -1, queries, 1).reshape(kv_heads, -1, 1)
    expected = torch.softmax(torch.cat([logits, sink_column], -1), -1)[..., :keys].sum(1)
    for chunks in ([k], [k[:, :4], k[:, 4:9], k[:, 9:]]):
        mass = torch_attention.attention_mass(q, lambda: iter(chunks), visible, group, 0.3, None, sinks)
        torch.testing.assert_close(mass, expected)
    assert (expected.sum(-1) < group * (queries - 1) - 0.1).all(), "the sinks take a share"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_statistics_with_sinks_equal_the_models_attention_weights(backend):
    """gpt-oss: H2O's scores after a prefill are eager's attention weights (which leave out the sink's share),
    summed over each KV head's query group and the queries, on the torch path and through the mass kernel."""
    model = _model("gpt_oss")
    ids = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("eager")
    with torch.no_grad():
        weights = model(ids, output_attentions=True).attentions
    cache = PagedCache(model.config, block_size=BLOCK, eviction=H2O(budget=64, sinks=1, window=2), backend=backend)
    _decode(model, cache, ids, torch.ones_like(ids), 0)
    assert cache.evictor.layers, "no layer keeps statistics"
    for index in cache.evictor.layers:
        heads = weights[index][0]  # [heads, queries, keys]
        expected = heads.sum(1).view(cache.evictor.stats[index].scores.shape[1], -1, ids.shape[1]).sum(1)
        torch.testing.assert_close(cache.evictor.stats[index].scores[0, :, :10], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", [H2O, SnapKV])
def test_kernel_statistics_equal_the_torch_path(policy):
    """The Triton path's attention mass (`paged_attention_mass`, interpreted on CPU) equals the torch
    path's, statistic by statistic, through prefill, eviction and decoding of a left-padded batch."""
    model = _model()
    input_ids, attention_mask = padded_batch((0, 3), 13, seed=7)
    stats = {}
    for backend in ("torch", "triton"):
        cache = PagedCache(model.config, block_size=BLOCK, eviction=policy(budget=6, sinks=1, window=2), backend=backend)
        _decode(model, cache, input_ids, attention_mask, 2)
        stats[backend] = [(cache.evictor.stats[index].scores, [layer.tables.stored_count(r) for r in range(2)])
                          for index, layer in cache.evictor.layers.items()]
    for (torch_stats, counts), (kernel_stats, kernel_counts) in zip(stats["torch"], stats["triton"]):
        assert counts == kernel_counts
        for row, count in enumerate(counts):
            torch.testing.assert_close(kernel_stats[row, :, :count], torch_stats[row, :, :count], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- per head
def _per_head_reference(model, input_ids: torch.Tensor, kept: list[dict[int, torch.Tensor]]) -> torch.Tensor:
    """Logits of a full DynamicCache whose decode steps read, in each layer and KV head, only the positions
    `kept[step][layer]` (`[kv_heads, n]`) plus the new token: a per-head 4D mask over the whole history."""
    current: dict[int, torch.Tensor] = {}

    def masked_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        heads, kv_heads = query.shape[1], key.shape[1]
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        if query.shape[2] > 1:  # the prompt: plain causality, nothing evicted yet
            mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool).tril()
        else:
            visible = torch.zeros(kv_heads, key.shape[2], dtype=torch.bool)
            visible.scatter_(1, current[module.layer_idx], True)
            visible[:, -1] = True
            mask = visible.repeat_interleave(heads // kv_heads, dim=0)[None, :, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("per_head_reference", masked_sdpa)
    model.set_attn_implementation("per_head_reference")
    cache, length, outputs = DynamicCache(config=model.config), input_ids.shape[1], []
    with torch.no_grad():
        logits = model(input_ids=input_ids, cache=cache).logits
        outputs.append(logits[:, -1])
        for step_kept in kept:
            current.clear()
            current.update(step_kept)
            token = logits[:, -1:].argmax(-1)
            logits = model(input_ids=token, position_ids=torch.tensor([[length]]), cache=cache).logits
            outputs.append(logits[:, -1])
            length += 1
    return torch.stack(outputs, dim=1)


@pytest.mark.parametrize("name", ["keynorm", "tova", "snapkv"])
def test_per_head_logits_equal_a_dense_reference_with_a_per_head_mask(name):
    """Each KV head attends exactly over its own survivors: the logits equal a full cache read through a
    per-head mask that hides, head by head, exactly the tokens the cache evicted."""
    model = _model()
    input_ids = torch.randint(3, VOCAB, (1, 29), generator=torch.Generator().manual_seed(8))
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES[name](per_head=True))
    kept = []

    def record(cache):
        kept.append({index: layer.tables.stored_positions(0).expand(layer.kv_shape[0], -1)
                     for index, layer in cache.evictor.layers.items()})  # fmt: skip

    got = _decode(model, cache, input_ids, torch.ones_like(input_ids), 12, record)
    assert any(not torch.equal(positions[0], positions[1]) for positions in kept[-1].values())  # heads differ
    expected = _per_head_reference(model, input_ids, kept[:-1])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_per_head_streaming_llm_keeps_what_head_shared_streaming_llm_keeps():
    model = _model()
    input_ids, attention_mask = padded_batch((0, 3), 27, seed=9)
    results = {}
    for per_head in (False, True):
        cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["streaming"](per_head=per_head))
        logits = _decode(model, cache, input_ids, attention_mask, 10)
        positions = [group.stored_positions(row) for group in _full_groups(cache) for row in range(2)]
        results[per_head] = logits, positions, cache.metrics().kv_bytes
    (logits, positions, used), (head_logits, head_positions, head_used) = results[False], results[True]
    torch.testing.assert_close(head_logits, logits)
    assert used == head_used
    for shared, per_head in zip(positions, head_positions):
        assert per_head.dim() == 2 and torch.equal(per_head, shared.expand_as(per_head))


def test_per_head_eviction_frees_as_many_blocks_as_head_shared():
    model = _model()
    input_ids, attention_mask = padded_batch((0, 5), 30, seed=1)
    used = {}
    for per_head in (False, True):
        cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["h2o"](per_head=per_head))
        _decode(model, cache, input_ids, attention_mask, 9)
        used[per_head] = [group.pool.num_used for group in _full_groups(cache)]
    assert used[True] == used[False]


def test_per_head_crop_that_would_split_heads_raises_and_changes_nothing():
    model = _model()
    input_ids = torch.randint(3, VOCAB, (1, 29), generator=torch.Generator().manual_seed(8))
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["keynorm"](per_head=True))
    _decode(model, cache, input_ids, torch.ones_like(input_ids), 3)
    before = cache_state(cache)
    with pytest.raises(RuntimeError, match="evicted per head"):
        cache.crop(-20)  # to 12 tokens: inside the per-head survivors
    assert cache_state(cache) == before
    cache.crop(-1)  # into the tokens stored since the eviction: every head alike
    assert cache.get_seq_length() == 31
    shared = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["keynorm"]())
    _decode(model, shared, input_ids, torch.ones_like(input_ids), 3)
    shared.crop(-20)  # a head-shared evicted row crops anywhere (its survivors before position 12 stay)
    assert shared.get_seq_length() == 12


@pytest.mark.parametrize("name", ["keynorm", "h2o"])
def test_per_head_kernels_equal_the_torch_path(name):
    """The Triton kernels (interpreted on CPU) read per-head survivors like the torch path: every head has
    the same stored length, so the kernels need no per-head lengths; only what the slots hold differs."""
    model = _model()
    input_ids, attention_mask = padded_batch((0, 3), 21, seed=7)
    logits = {}
    for backend in ("torch", "triton"):
        cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES[name](per_head=True), backend=backend)
        logits[backend] = _decode(model, cache, input_ids, attention_mask, 6)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_per_head_survives_save_and_load(tmp_path):
    model = _model()
    input_ids = torch.randint(3, VOCAB, (1, 29), generator=torch.Generator().manual_seed(8))
    cache = PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["keynorm"](per_head=True))
    _decode(model, cache, input_ids, torch.ones_like(input_ids), 3)
    cache.save(tmp_path / "cache.safetensors")
    loaded = PagedCache.load(tmp_path / "cache.safetensors", model.config)
    assert loaded.options.eviction.per_head
    for group, twin in zip(_full_groups(cache), _full_groups(loaded)):
        assert torch.equal(group.stored_positions(0), twin.stored_positions(0))


# ---------------------------------------------------------------------------------------------- everywhere
@pytest.mark.parametrize("entry", MODELS, ids=lambda entry: entry.name)
def test_eviction_with_quantization_and_beam_search_on_every_architecture(entry):
    model, _config = entry.build()
    if not entry.passes_attention_kwargs:
        pytest.skip(f"{entry.name} calls update() without attention kwargs: it cannot read an evicted cache")
    if entry.reuses_kv:
        pytest.skip(f"{entry.name} reuses K/V across layers: eviction is refused for it (see the test below)")
    if entry.caches_latents:
        pytest.skip(f"{entry.name} caches latents: eviction is refused for it (see the test below)")
    input_ids, attention_mask = padded_batch((0, 3), 24, seed=6)
    policy = POLICIES["tova"](per_head=entry.name.endswith("gqa"))  # per-head eviction composes too
    if not any(layer_type.evictable for layer_type in PagedCache(model.config).layer_types):
        with pytest.raises(ValueError, match="`eviction` cannot take effect .* lets eviction drop tokens"):
            PagedCache(model.config, block_size=BLOCK, eviction=policy)  # every layer slides: nothing to evict
        return
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=4, eviction=policy)
    model.set_attn_implementation("paged")
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache, max_new_tokens=8,
                             num_beams=2, do_sample=False, pad_token_id=PAD_ID)  # fmt: skip
    assert out.shape == (2, 32)
    full = _full_groups(cache)
    if full:
        assert cache.metrics().evicted_tokens > 0
    for group in full:
        for row in range(len(group.tables)):
            assert group.stored_count(row) <= BUDGET + BLOCK


def test_eviction_is_refused_for_models_that_cache_latents():
    """Multi-head latent attention reads K/V expanded from the gathered history, never the blocks eviction scores
    and leaves gaps in: refused when the cache is built; without eviction the same model is served exactly."""
    model, config = MODELS_BY_NAME["deepseek_v3"].build()
    with pytest.raises(ValueError, match=r"`eviction` cannot serve DeepseekV3 model: it caches compressed latents"):
        PagedCache(config, block_size=BLOCK, eviction=POLICIES["tova"]())
    input_ids, attention_mask = padded_batch((0, 3), 12, seed=6)
    outputs = []
    for implementation, cache in (("sdpa", DynamicCache(config=config)), ("paged", PagedCache(config, block_size=4))):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            outputs.append(model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                                          max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID))  # fmt: skip
    assert torch.equal(outputs[0], outputs[1])


def test_eviction_is_refused_for_layers_that_reuse_another_layers_kv():
    """Gemma-3n's KV-shared layers read their producer's blocks later in the same forward, after the producer's
    eviction may have moved its tokens: refused when the cache is built, naming the option and the layers."""
    model, _config = MODELS_BY_NAME["gemma3n"].build()
    with pytest.raises(ValueError, match=r"`eviction` cannot serve Gemma3nText model: its layers \[2, 3\] reuse"):
        PagedCache(model.config, block_size=BLOCK, eviction=POLICIES["tova"]())
    gemma3 = _model("gemma3")  # the same sliding / full mix without KV sharing evicts
    assert PagedCache(gemma3.config, block_size=BLOCK, eviction=POLICIES["tova"]()).evictor is not None
