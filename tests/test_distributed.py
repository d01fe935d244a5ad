"""Beyond one device: tensor parallelism over 2 gloo ranks on CPU, and accelerate device maps with disk offload.

The tensor-parallel test runs the launcher `eval/tp_generate.py` under `torchrun --standalone` (which picks
a free port) on a tiny Llama saved into `tmp_path`: each rank loads it with `tp_plan="auto"` and holds one of
its two KV heads. One job runs every configuration, so processes start once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from hf_paged_cache import PagedCache, estimate_kv_bytes, register_paged_attention
from hf_paged_cache.distributed import reduce_scores, tensor_parallel_size
from tiny_models import llama_gqa

REPO = Path(__file__).resolve().parent.parent
PROMPT, NEW = 40, 24
EVICT = "budget=24,sinks=2,window=4"
CACHES = {
    "dynamic": "dynamic",
    "plain": "paged:attn=paged",
    "int8": "paged:attn=paged,quant=int8,residual_length=16",
    "max_memory": "paged:attn=paged,max_memory=64KiB",
    "streaming": f"paged:attn=paged,eviction=streaming,{EVICT}",
    "h2o": f"paged:attn=paged,eviction=h2o,{EVICT}",
    "random": f"paged:attn=paged,eviction=random,{EVICT}",  # seeded: the same on every rank, reduced all the same
    "per_head": f"paged:attn=paged,eviction=keydiff,per_head=true,{EVICT}",  # each rank selects for its own heads
}


def _torchrun(folder: Path, out: Path, ranks: int = 2, timeout: int = 240) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(REPO / "eval" / "tp_generate.py"), "--model", str(folder), "--prompt-tokens", str(PROMPT),
               "--max-new-tokens", str(NEW), "--out", str(out), "--caches", *CACHES.values()]  # fmt: skip
    try:
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{error.stdout}\n{error.stderr}")
    output = f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"  # the table, and every rank's traceback
    assert result.returncode == 0, f"torchrun failed with {result.returncode}:\n{output}"
    return json.loads(out.read_text())


def test_tensor_parallel_matches_one_process_with_half_the_bytes_per_rank(tmp_path):
    model, config = llama_gqa()
    model.save_pretrained(tmp_path / "tiny")
    rows = {name: row for name, row in zip(CACHES, _torchrun(tmp_path / "tiny", tmp_path / "tp.json")["rows"])}
    dynamic_tokens = rows["dynamic"]["single_tokens"]
    for name, row in rows.items():
        assert row["tokens_equal"] and row["kept_equal"], f"{name}: the 2 ranks differ from one process: {row}"
        assert [rank["kv_bytes"] * 2 for rank in row["per_rank"]] == [row["single_kv_bytes"]] * 2, name
    for name in ("dynamic", "plain", "int8", "max_memory"):  # lossless here (int8 too): DynamicCache's tokens
        assert rows[name]["tokens"] == dynamic_tokens, name
    # max_memory is per rank: each rank fills the same 64 KiB with blocks of half the heads (twice the tokens).
    assert [rank["pool_bytes"] for rank in rows["max_memory"]["per_rank"]] == [64 * 1024] * 2
    for name in ("streaming", "h2o", "random", "per_head"):  # eviction ran; the ranks kept what one process kept
        assert rows[name]["evicted_tokens"] > 0 and rows[name]["kept"] is not None, name
    plain = rows["plain"]["per_rank"]
    stored = PROMPT + NEW - 1  # the last generated token is never fed back
    assert plain[0]["kv_bytes"] == estimate_kv_bytes(config, 1, stored, dtype=torch.float32, tp_size=2)
    assert [rank["tp_size"] for rank in plain] == [2, 2]
    assert plain[0]["metrics_total_kv_bytes"] == 2 * plain[0]["metrics_kv_bytes"]


def test_estimate_per_rank_and_one_process_needs_no_collective():
    _, config = llama_gqa()
    whole = estimate_kv_bytes(config, 2, 100, dtype=torch.float32)
    assert estimate_kv_bytes(config, 2, 100, dtype=torch.float32, tp_size=2) * 2 == whole
    with pytest.raises(ValueError, match="`tp_size`=3 .* 2 KV heads"):
        estimate_kv_bytes(config, 2, 100, tp_size=3)
    assert tensor_parallel_size(config) == 1 and PagedCache(config).metrics().tp_size == 1
    scores = torch.tensor([[1.0, 2.0, 6.0], [3.0, 2.0, 0.0]])
    assert torch.equal(reduce_scores(scores, 1), torch.tensor([2.0, 2.0, 3.0]))  # mean over heads, no group


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    model, _ = llama_gqa()
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    ids = torch.randint(3, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # a left-padded row
    reference = model.generate(ids, attention_mask=mask, cache=DynamicCache(config=model.config), max_new_tokens=10,
                               do_sample=False)  # fmt: skip
    return folder, ids, mask, reference


@pytest.mark.parametrize(
    "placement",
    [
        {"device_map": {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                        "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}},
        {"device_map": "auto", "max_memory": {"cpu": "200KB"}},
    ],
    ids=["cpu+disk", "auto"],
)  # fmt: skip
def test_device_map_with_disk_offload_generates_like_the_whole_model(saved_tiny, tmp_path, placement):
    folder, ids, mask, reference = saved_tiny
    model = AutoModelForCausalLM.from_pretrained(folder, offload_folder=tmp_path / "offload", dtype=torch.float32,
                                                 **placement).eval()  # fmt: skip
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}, model.hf_device_map
    register_paged_attention()
    for attn in ("sdpa", "paged"):
        model.set_attn_implementation(attn)
        cache = PagedCache(model.config)
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False)
        assert torch.equal(out, reference), attn
        for layer, decoder in zip(cache.paged_layers, model.model.layers):  # storage on the execution device
            hook = getattr(decoder, "_hf_hook", None) or getattr(model, "_hf_hook")
            assert layer.key_blocks.device == torch.device(hook.execution_device), attn
