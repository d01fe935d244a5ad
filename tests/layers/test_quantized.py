"""`QuantizedLayer`: blocks sealed by position (whatever the step sizes), long steps read in query tiles."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, feed_chunks, padded_batch, shared_model, token_by_token

from hf_paged_cache import PagedCache
from hf_paged_cache.layers import quantized as quantized_layers
from hf_paged_cache.layers.paged import stored_keys
from hf_paged_cache.read_paths import quantized as quantized_read

BLOCK = 4
RESIDUAL = 4

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_contents_and_logits_follow_positions_not_step_sizes(spec):
    """Token by token, in one chunk, or in chunks shorter and longer than the residual window: every position
    is read as one token at a time reads it, so the same blocks are sealed with the same codes, and every
    logit (the prompt's and the next tokens') is the same. Only float rounding differs between a chunk's
    matmuls and single tokens', and it can tip a code over a rounding boundary: one code step (3e-4 in the
    logits here) is allowed; sealing by step size differed by 1e-2 to 2e-1."""
    model = shared_model("llama_gqa")
    model.set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (1, 33), generator=torch.Generator().manual_seed(1))
    results = []
    for chunks in ([1] * 30, [30], [3, 9, 2, 16], [5, 25], [13, 17]):
        cache = PagedCache(model.config, block_size=BLOCK, quant=spec, residual_length=RESIDUAL + 1)
        logits = feed_chunks(model, cache, tokens, chunks + [1, 1, 1])  # then three tokens one at a time
        (group,) = cache.groups.values()
        keys = [stored_keys(layer, 0) for layer in cache.layers]
        results.append((logits, list(group.qtables[0]), group.base[0], keys))  # a cache let go frees its rows
    reference_logits, sealed, base, reference_keys = results[0]
    assert len(sealed) == (33 - RESIDUAL - 1) // BLOCK and base == len(sealed) * BLOCK
    for logits, other_sealed, other_base, keys in results[1:]:
        assert (len(other_sealed), other_base) == (len(sealed), base)
        torch.testing.assert_close(logits, reference_logits, atol=1e-3, rtol=0)
        for got, want in zip(keys, reference_keys):
            assert (got - want).abs().mean() < 1e-4


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_a_long_chunk_read_in_query_tiles_gives_the_untiled_logits(spec, monkeypatch):
    """A long step's queries are attended `QUERY_TILE` (`TRANSITION_TILE` in a step with a transition) at a time:
    bounded transients on long prompts, and each tile reads only the columns it sees. With tiles of 5 queries the
    prompt's and the next tokens' logits are the untiled read's, whose transition blocks, prefix and suffix reads
    each query sees the same way."""
    model = shared_model("llama_gqa")
    model.set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (1, 45), generator=torch.Generator().manual_seed(3))
    results = []
    for tile in (10**6, 5):
        monkeypatch.setattr(quantized_read, "QUERY_TILE", tile)
        monkeypatch.setattr(quantized_read, "TRANSITION_TILE", tile)
        cache = PagedCache(model.config, block_size=BLOCK, quant=spec, residual_length=RESIDUAL)
        results.append(feed_chunks(model, cache, tokens, [7, 30, 1, 1]))  # a warm chunk over a quantized prefix too
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=0)


def test_a_long_chunk_seals_its_own_blocks_as_they_arrive():
    """A chunk longer than the residual window takes full-precision blocks only for its last R tokens (and
    what is left of a partial block), and the sealed blocks read back what one token at a time reads."""
    model = shared_model("llama_gqa")
    model.set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (1, 42), generator=torch.Generator().manual_seed(2))
    cache = PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=RESIDUAL)
    feed_chunks(model, cache, tokens, [2, 40])
    (group,) = cache.groups.values()
    assert len(group.qtables[0]) == (42 - RESIDUAL) // BLOCK and group.pool.num_used == 2  # [36, 42): 6 tokens
    assert group.pool.num_blocks <= 3  # the pool never staged the chunk's sealed blocks in full precision


@pytest.mark.parametrize("chunk_tokens", [8, 2048])
@pytest.mark.parametrize("spec", ["int8", "int4", "int2", "fp8_e4m3"])
@pytest.mark.parametrize("name", ["llama_gqa", "gemma2", "gpt_oss"])
def test_the_paged_read_is_attention_over_the_dequantized_copy(name, spec, chunk_tokens, monkeypatch):
    """The paged read (chunks decoded into buffers, the suffix joined to the last one, merged by log-sum-exp) gives
    the logits of eager attention over the transient dequantized copy that `update()` hands other implementations:
    a padded batch token by token, with soft-capping and sliding windows (Gemma-2), sinks (gpt-oss), one chunk or
    several per row."""
    monkeypatch.setattr(quantized_layers, "CHUNK_TOKENS", chunk_tokens)
    model = shared_model(name)
    input_ids, attention_mask = padded_batch((0, 3), 30, seed=4)
    logits = []
    for attn in ("eager", "paged"):
        model.set_attn_implementation(attn)
        cache = PagedCache(model.config, block_size=BLOCK, quant=spec, residual_length=RESIDUAL)
        logits.append(token_by_token(model, cache, input_ids, attention_mask))
        assert cache.metrics().quantized_tokens > 0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


