"""Draws the figures of docs/benchmarks.md from the JSON files the benchmarks write.
    python benchmarks/plot_results.py docs/results/2026-11-30-s3 docs/img
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(folder, name):
    with open(os.path.join(folder, f"{name}.json")) as f:
        return json.load(f)


def prefill(folder, out):
    rep = load(folder, "prefill")
    rows = [r for r in rep["rows"] if "serialized_ms" in r]  # the large-pool rows are a table only
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = range(len(tokens))
    ax.bar([i - 0.27 for i in x], [r["link_bound_ms"] for r in rows], 0.27, label="link bound (bytes / measured pinned rate)")
    ax.bar(list(x), [r["ms"] for r in rows], 0.27, label="double-buffered streaming")
    ax.bar([i + 0.27 for i in x], [r["serialized_ms"] for r in rows], 0.27, label="one region, serialized")
    ax.set_xticks(list(x), [f"{t:,} tokens" for t in tokens])
    ax.set_ylabel(f"ms for {rep['layers']} layers")
    ax.set_title(f"Prefill, {rep['layers']} Qwen3-30B-A3B MoE layers, {rep['device']}")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "prefill.png"), dpi=120)


def decode(folder, out):
    rep = load(folder, "decode")
    rows = rep["rows"]
    share = [f"{int(r['cache_share'] * 100)} %" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(share, [r["ms_per_token"] for r in rows], color="tab:orange")
    for i, r in enumerate(rows):
        ax.text(i, r["ms_per_token"], f"hit {r['hit_rate']:.2f}\n{r['MB_over_link_per_token']:.0f} MB", ha="center",
                va="bottom", fontsize=8)
    resident = [r for r in rows if "resident_gemms_ms" in r]
    if resident:
        ax.axhline(resident[0]["resident_gemms_ms"], color="gray", ls="--", lw=1, label="same GEMMs, all resident")
        ax.legend(fontsize=8)
    ax.set_xlabel("device cache, share of all experts")
    ax.set_ylabel("ms per token (8 MoE layers)")
    ax.set_ylim(0, max(r["ms_per_token"] for r in rows) * 1.3)
    ax.set_title(f"Decode, CUDA-graph steps, {rep['device']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "decode.png"), dpi=120)


def compiled(folder, out):
    if not os.path.exists(os.path.join(folder, "compile.json")):
        return
    rep = load(folder, "compile")
    rows = rep["rows"]
    labels = [f"{r['model']}\n{r['cache']}" if r["cache"] != "-" else r["model"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colors = ["tab:blue" if r["mode"] == "compiled" else "tab:gray" for r in rows]
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_s"], r["mode"], ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{rep['layers']}-layer Qwen3-MoE-shaped model, static cache, {rep['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "compile.png"), dpi=120)


if __name__ == "__main__":
    folder, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    prefill(folder, out)
    decode(folder, out)
    compiled(folder, out)
    print("wrote", os.listdir(out))
