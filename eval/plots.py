"""Figures of what the eval scripts measured (their `--plot FILE` option): one function per script, each
taking the rows the script also writes as JSON. matplotlib is imported only when a figure is drawn
(it is in the `eval` extra), with a non-interactive backend; the file type follows FILE's extension."""

from __future__ import annotations

import os
from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'matplotlib>=3.8' (or -e '.[eval]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.clf()
    return path


def perplexity(rows: list[dict], title: str, path: str | os.PathLike) -> Path:
    """perplexity.py: perplexity against KV bytes per token, one labelled point per cache configuration."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in rows:
        ax.scatter(row["kv_bytes_per_token"], row["perplexity"], s=40)
        ax.annotate(f"{row['config']} ({row['delta_pct']:+.2f}%)", (row["kv_bytes_per_token"], row["perplexity"]),
                    textcoords="offset points", xytext=(5, 4), fontsize=8)  # fmt: skip
    ax.set(xscale="log", xlabel="KV bytes per token held (log)", ylabel="perplexity", title=title)
    return _save(fig, path)


def eviction(payloads: dict[str, dict], path: str | os.PathLike) -> Path:
    """eviction.py: one panel per task run (compress, passkey, decode, peak)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(payloads), figsize=(6 * len(payloads), 4.2), squeeze=False)
    for ax, (task, payload) in zip(axes[0], payloads.items()):
        rows = payload["results"]
        if task == "compress":
            full = rows[0]["perplexity"]
            for policy in dict.fromkeys(row["policy"] for row in rows[1:]):
                points = sorted((row["budget"], row["perplexity"]) for row in rows if row["policy"] == policy)
                ax.plot(*zip(*points), marker="o", label=policy)
            ax.axhline(full, color="k", ls="--", lw=1, label="full cache")
            budgets = sorted({row["budget"] for row in rows[1:]})
            ax.set(xscale="log", xlabel="budget (tokens kept per layer)", ylabel="perplexity",
                   title="(a) context compression")  # fmt: skip
            ax.set_xticks(budgets, [str(budget) for budget in budgets])
            ax.set_xticks([], minor=True)
        elif task == "passkey":
            labels = [f"{row['policy']} {row['framing']}".strip(" -") for row in rows]
            ax.barh(labels, [row["accuracy"] for row in rows])
            ax.set(xlim=(0, 1), xlabel="passkey accuracy", title="(b) passkey retrieval")
            ax.invert_yaxis()
        elif task == "decode":
            for row in rows:
                trace = row["trace"]
                ax.plot([p["tokens_fed"] for p in trace], [p["used_bytes"] / 2**20 for p in trace],
                        label=f"{row['policy']} (ppl {row['perplexity']:.2f})")  # fmt: skip
            ax.set(xlabel="tokens fed", ylabel="KV MiB in use", title="(c) decode-time eviction")
        elif task == "peak":
            labels = [f"{row['policy']}\n{row['evict']}" for row in rows]
            ax.bar(labels, [row["peak_kv_bytes"] / 2**20 for row in rows])
            ax.set(ylabel="peak KV MiB", title="(d) peak KV bytes of a chunked prefill")
            ax.tick_params(axis="x", labelsize=7)
        if task in ("compress", "decode"):
            ax.legend(fontsize=7)
    return _save(fig, path)


def decode(single: list[dict], ragged: list[dict], path: str | os.PathLike) -> Path:
    """bench_decode.py: decode tokens/s against context (batch 1) and the ragged batch's KV bytes."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if ragged else 1, figsize=(12 if ragged else 6.5, 4.2), squeeze=False)
    ax = axes[0][0]
    for config in dict.fromkeys(row["config"] for row in single):
        points = sorted((row["context"], row["tokens_per_s"]) for row in single if row["config"] == config)
        ax.plot(*zip(*points), marker="o", label=config)
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s", title="batch 1, greedy decode")
    ax.legend(fontsize=8)
    if ragged:
        ax = axes[0][1]
        labels = [row["config"] for row in ragged]
        ax.bar(labels, [row["kv_bytes"] / 2**20 for row in ragged], label="KV bytes held")
        ax.axhline(ragged[0]["ideal_bytes"] / 2**20, color="k", ls="--", lw=1, label="ideal (tokens x bytes/token)")
        ax.set(ylabel="KV MiB", title=f"ragged batch of {ragged[0]['batch']}, left-padded")
        ax.legend(fontsize=8)
    return _save(fig, path)
