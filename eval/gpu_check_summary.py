"""summary.json of `eval/gpu_check.sh`: every step's status and duration, with the headline figures of its output.

`gpu_check.sh` calls it after each step, so a run stopped part-way still leaves a summary of the steps it ran.
Its input is the script's step record, one tab-separated line per step: name, rc (or `skipped`), seconds,
time limit, output file (relative to the results folder, `-` for none). It prints a short table last (the end
of a run's output is what a GPU lease returns first).

    python eval/gpu_check_summary.py STEPS_TSV RESULTS_DIR [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

TIMEOUT_RCS = (124, 137)  # `timeout` exit status, and the KILL that follows its --kill-after


def status_of(rc: str, output: Path | None) -> str:
    if rc == "skipped":
        return "skipped"
    if int(rc) in TIMEOUT_RCS:
        return "timeout"
    if int(rc) != 0:
        return "failed"
    return "ok" if output is None or output.exists() else "no output"


def pytest_headline(path: Path) -> dict:
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failing = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]  # fmt: skip
    return dict(counts, failing=failing[:20])


def json_headline(name: str, data: dict) -> dict:
    """The figures worth reading first in each result file."""
    if "skipped" in data and isinstance(data["skipped"], str):
        return {"skipped": data["skipped"]}
    if name == "generate_check":
        return dict(data["summary"], identical={row["system"]: f"{row['identical']}/{row['requests']}"
                                                for row in data["rows"] if "identical" in row})  # fmt: skip
    if name == "swap_overlap":
        return data["summary"]
    if name == "bench_kernels":
        headline = {"copy_bandwidth_GBps": data.get("copy_bandwidth_GBps")}
        headline["decode"] = [
            {k: cell.get(k) for k in ("shape", "batch", "context", "fraction_of_copy_bandwidth", "speedup_vs_sdpa",
                                      "error", "skipped") if k in cell}
            for cell in data.get("kernels", [])
        ]  # fmt: skip
        quantized = data.get("quantized_decode", [])
        headline["quantized_speedup_vs_bf16"] = (
            {cell["format"]: cell.get("speedup_vs_bf16", cell.get("error")) for cell in quantized[1:]}
            if isinstance(quantized, list) else quantized
        )  # fmt: skip
        headline["prefill_speedup_vs_sdpa"] = [
            {k: cell.get(k) for k in ("shape", "batch", "context", "speedup_vs_sdpa", "error") if k in cell}
            for cell in data.get("prefill", [])
        ]  # fmt: skip
        end_to_end = data.get("end_to_end", {})
        headline["end_to_end"] = {k: end_to_end[k] for k in ("speedup", "greedy_tokens_agreeing", "error")
                                  if k in end_to_end}  # fmt: skip
        return headline
    return {}


def headline(name: str, output: Path | None) -> dict:
    if output is None or not output.exists():
        return {}
    try:
        if output.suffix == ".xml":
            return pytest_headline(output)
        if output.suffix == ".json":
            return json_headline(name, json.loads(output.read_text()))
    except Exception as exc:  # a partial or malformed file: say so, keep the summary
        return {"unreadable": f"{type(exc).__name__}: {exc}"}
    return {}


def summarize(steps_tsv: Path, results: Path, dry_run: bool) -> dict:
    steps = []
    for line in steps_tsv.read_text().splitlines():
        name, rc, seconds, limit, output_name = line.split("\t")
        output = None if output_name == "-" else results / output_name
        steps.append({
            "name": name, "status": status_of(rc, output), "rc": None if rc == "skipped" else int(rc),
            "seconds": float(seconds), "limit_seconds": int(limit), "output": output_name,
            **({"headline": figures} if (figures := headline(name, output)) else {}),
        })  # fmt: skip
    return {
        "dry_run": dry_run, "all_ok": all(step["status"] in ("ok", "skipped") for step in steps),
        "seconds": sum(step["seconds"] for step in steps), "steps": steps,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps_tsv", type=Path)
    parser.add_argument("results", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    summary = summarize(args.steps_tsv, args.results, args.dry_run)
    (args.results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for step in summary["steps"]:
        print(f"{step['name']:<16} {step['status']:<10} {step['seconds']:>6.1f} s / {step['limit_seconds']} s  "
              f"{json.dumps(step.get('headline', {}))[:300]}")  # fmt: skip
    print(f"{'all ok' if summary['all_ok'] else 'NOT all ok'} in {summary['seconds']:.0f} s -> {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
