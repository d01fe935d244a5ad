"""`PagedLayer` reads: rows cut into several runs of blocks, or gathered slot by slot, read like DynamicCache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MODELS_BY_NAME, PAD_ID, padded_batch
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from hf_paged_cache.kernels import cpu_attention, cpu_write
from hf_paged_cache.layers import storage

PADS = (0, 3, 7)
NEW_TOKENS = 16
BLOCK_SIZE = 2


def _generate(model, attn: str, cache):
    input_ids, attention_mask = padded_batch(PADS, 12)
    model.set_attn_implementation(attn)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache, pad_token_id=PAD_ID,
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)  # fmt: skip


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("max_runs", [0, 8])
@pytest.mark.parametrize("attn", ["sdpa", "paged"])
def test_rows_cut_into_runs_read_like_dynamic_cache(attn, max_runs, monkeypatch):
    """A pool with no room to spare: every row's run breaks as it grows, so rows are read from several runs
    (`max_runs` 8) or, past `MAX_RUNS`, slot by slot (0)."""
    monkeypatch.setattr(storage, "MAX_RUNS", max_runs)
    model, _config = MODELS_BY_NAME["llama_gqa"].build()
    stored = [12 - pad + NEW_TOKENS - 1 for pad in PADS]
    cache = PagedCache(model.config, block_size=BLOCK_SIZE, num_blocks=sum(-(-n // BLOCK_SIZE) for n in stored))
    expected, actual = _generate(model, "sdpa", DynamicCache(config=model.config)), _generate(model, attn, cache)
    assert torch.equal(actual.sequences, expected.sequences)
    for want, got in zip(expected.logits, actual.logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    tables = cache.layers[0].tables
    assert max(len(runs) for runs in tables.plan.runs()) > 1
    layer, plan = cache.layers[0], tables.plan
    for row in range(len(PADS)):  # the first tokens of a row's read range (a prefix other rows share) cut its runs
        keys, values = layer.storage.row_kv(plan, row)
        for count in (1, 3, keys.shape[1] - 1):
            first_keys, first_values = layer.storage.row_kv(plan, row, count)
            assert torch.equal(first_keys, keys[:, :count]) and torch.equal(first_values, values[:, :count])


def test_a_gathered_batch_is_contiguous_like_dynamic_cache():
    """Some models `view()` the K/V `update()` returns (GPT-NeoX-Japanese): a padded batch gathered from blocks
    must be contiguous, as `DynamicCache`'s concatenation is, and hold the same values past each row's padding."""
    model, _config = MODELS_BY_NAME["llama_gqa"].build()
    input_ids, attention_mask = padded_batch(PADS, 12)
    paged, dynamic = PagedCache(model.config, block_size=BLOCK_SIZE), DynamicCache(config=model.config)
    with torch.no_grad():
        for cache in (paged, dynamic):
            model(input_ids=input_ids, attention_mask=attention_mask, cache=cache)
    batch, heads, _n, dim = dynamic.layers[0].keys.shape
    step = torch.randn(batch, heads, 1, dim)
    for got, want in zip(paged.update(step, step, 0), dynamic.update(step, step, 0)):
        assert got.is_contiguous() and got.shape == want.shape
        got.view(batch * heads, -1, dim)  # what GPT-NeoX-Japanese does: raised on the transposed gather
        for row, pad in enumerate(PADS):
            torch.testing.assert_close(got[row, :, pad:], want[row, :, pad:], rtol=0, atol=0)


@pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU kernels could not be built here")
def test_the_cpu_kernel_write_stores_what_index_copy_stores(monkeypatch):
    """Where the CPU kernels are loaded a layer writes its K/V with `write_kv_cpu` (backend "auto"); backend "torch"
    keeps `index_copy_`: a padded batch's prompt, then decode steps, leave the same bits in both storages."""
    calls, write = [], cpu_write.write_kv_cpu
    monkeypatch.setattr(cpu_write, "write_kv_cpu", lambda *args: calls.append(1) or write(*args))
    model, _config = MODELS_BY_NAME["llama_gqa"].build()
    caches = {backend: PagedCache(model.config, block_size=BLOCK_SIZE, backend=backend)
              for backend in ("auto", "torch")}  # fmt: skip
    written = {}
    for backend, cache in caches.items():
        _generate(model, "paged", cache)
        written[backend] = len(calls)
    auto, plain = (cache.layers[0] for cache in caches.values())
    assert written["auto"] == NEW_TOKENS * model.config.num_hidden_layers and written["torch"] == written["auto"]
    assert torch.equal(auto.key_blocks, plain.key_blocks) and torch.equal(auto.value_blocks, plain.value_blocks)
