"""A fast slice of the model-zoo sweep (eval/zoo.py): representative model types, greedy on both read paths.

Every cell must end exact or as a clean refusal, never as a silent difference or a raw error; the models the paged
attention refuses (compressed attention layers) must still be exact through the gather path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "eval"))
import zoo  # noqa: E402

from hf_paged_cache import UnsupportedAttentionError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# plain, no-kwargs update, softcap, sliding, hybrid with linear attention, learned sinks, cached latents
EXACT = ["llama", "gpt_neox", "gemma2", "mistral", "qwen3_next", "gpt_oss", "deepseek_v3", "minicpm3"]
REFUSED_BY_PAGED = ["deepseek_v4"]  # compressed attention layers


@pytest.mark.parametrize("model_type", EXACT)
def test_exact_on_both_read_paths(model_type):
    result = zoo.sweep_model(model_type, zoo.FAST_MODES, time_limit=60)
    assert not result.skipped, result.skipped
    statuses = {key: cell.status for key, cell in result.cells.items()}
    assert statuses == {"gather/greedy": "exact", "paged/greedy": "exact"}, result


@pytest.mark.parametrize("model_type", REFUSED_BY_PAGED)
def test_refused_by_the_paged_attention_and_exact_through_gather(model_type):
    result = zoo.sweep_model(model_type, zoo.FAST_MODES, time_limit=60)
    assert result.cells["gather/greedy"].status == "exact", result
    paged = result.cells["paged/greedy"]
    assert paged.status == "refused" and 'with the "paged" attention' in paged.detail, paged


def test_a_model_that_ignores_attn_implementation_has_no_paged_cells():
    """XGLM's attention is its own code: only the gather path exists, and generate_batch refuses it cleanly."""
    result = zoo.sweep_model("xglm", ("greedy", "batch"), time_limit=60)
    statuses = {key: cell.status for key, cell in result.cells.items()}
    assert statuses == {"gather/greedy": "exact", "paged/greedy": "n/a", "paged/batch": "refused"}, result


def test_hybrid_tiny_config_keeps_one_layer_of_each_type():
    config = zoo.tiny_config("qwen3_next")
    assert config.num_hidden_layers <= 4
    full_size = zoo.CONFIG_MAPPING["qwen3_next"]()
    assert zoo.layer_kinds(config) == zoo.layer_kinds(full_size) == {"linear_attention", "full_attention"}


def test_compare_reports_a_changed_token_and_a_changed_logit():
    model, impl = zoo.build("llama")
    make = lambda: zoo.DynamicCache(config=model.config)  # noqa: E731
    expected = zoo.run_mode(model, impl, make, "greedy")
    assert zoo.compare(expected, zoo.run_mode(model, impl, make, "greedy")) is None
    tokens = type(expected)(**{**expected, "sequences": expected.sequences.clone()})
    tokens.sequences[1, -1] += 1
    assert zoo.compare(expected, tokens) == f"tokens differ first at row 1, position {tokens.sequences.shape[1] - 1}"
    logits = type(expected)(**{**expected, "logits": tuple(step + 1e-3 for step in expected.logits)})
    assert zoo.compare(expected, logits).startswith("logits of step 0 differ by 1.00e-03")


def test_failures_are_told_apart():
    refusal = zoo.classify_failure(UnsupportedAttentionError("no sinks"))
    assert (refusal.status, refusal.detail) == ("refused", "no sinks")
    try:
        torch.zeros(2) @ torch.zeros(3)  # raised inside torch: not a refusal of ours
    except RuntimeError as exc:
        raw = zoo.classify_failure(exc)
    assert raw.status == "error" and raw.detail.startswith("RuntimeError")
