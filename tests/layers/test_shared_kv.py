"""`SharedKVLayer` (`share_with`): a layer that reads its source layer's blocks after the source wrote its step."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, feed_chunks, shared_model

from hf_paged_cache import PagedCache

BLOCK = 4
RESIDUAL = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_share_with_reader_reads_a_long_chunk_as_its_source_does():
    """A `share_with` layer attends over its source's step after the source: the full-precision copy of the
    blocks the step sealed as they arrived is still there for it, so a chunk reads as token by token."""
    model = shared_model("llama_gqa")
    model.set_attn_implementation("paged")
    tokens = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(6))
    logits = [
        feed_chunks(model, PagedCache(model.config, block_size=BLOCK, quant="int8", residual_length=RESIDUAL,
                                share_with={1: 0}), tokens, chunks)
        for chunks in ([1] * 30, [30])
    ]  # fmt: skip
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=0)
