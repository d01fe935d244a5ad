"""The capacity command: sequences that fit, from the exact byte estimate."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tiny_models import MODELS_BY_NAME

from hf_paged_cache.capacity import main
from hf_paged_cache.accounting import estimate_kv_bytes, max_sequences
from hf_paged_cache.sequence_state import sequence_state

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import zoo  # noqa: E402


def test_sequences_that_fit_follow_the_estimate_linearly(tmp_path):
    _model, config = MODELS_BY_NAME["llama_gqa"].build()
    one = estimate_kv_bytes(config, 1, 1024)
    assert max_sequences(config, 1024, 10 * one + one // 2) == 10
    assert estimate_kv_bytes(config, 1, 2048) == 2 * one  # linear in the length, not quadratic
    config.save_pretrained(tmp_path)
    rows = main(["--model", str(tmp_path), "--memory", str(10 * one), "--tokens", "1024", "2048", "--quant", "int4"])
    assert rows[0]["sequences"] > 10 and rows[1]["sequences"] > 5  # int4 fits more than fp16 (10 and 5)


def test_a_hybrid_sequence_costs_its_state_besides_its_kv_per_token(tmp_path):
    config = zoo.tiny_config("qwen3_next")
    state = sequence_state(config, torch.float16).nbytes
    blocks = estimate_kv_bytes(config, 1, 1024) - state
    assert state > 0 and estimate_kv_bytes(config, 1, 2048) == state + 2 * blocks  # the state does not grow
    assert max_sequences(config, 1024, 3 * (state + blocks)) == 3
    config.save_pretrained(tmp_path)
    rows = main(["--model", str(tmp_path), "--memory", str(3 * (state + blocks)), "--tokens", "1024"])
    assert rows == [{"tokens": 1024, "bytes_per_sequence": state + blocks, "state_bytes_per_sequence": state,
                     "sequences": 3}]  # fmt: skip


def test_served_counts_a_state_checkpoint_per_hybrid_sequence(tmp_path):
    config = zoo.tiny_config("qwen3_next")
    state = sequence_state(config, torch.float16).nbytes
    per_sequence = estimate_kv_bytes(config, 1, 64)  # short sequences: the state is most of a sequence's bytes
    memory = 3 * (per_sequence + state)
    assert max_sequences(config, 64, memory) == memory // per_sequence > 3
    assert max_sequences(config, 64, memory, served=True) == 3
    _model, llama = MODELS_BY_NAME["llama_gqa"].build()  # no state: nothing more per sequence
    assert max_sequences(llama, 1024, 10**6, served=True) == max_sequences(llama, 1024, 10**6)
    config.save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--memory", str(memory), "--tokens", "64", "--served"])[0]["sequences"] == 3
