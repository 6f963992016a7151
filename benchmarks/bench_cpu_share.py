"""Decode under real misses with the CPU share (issue 20), at the Qwen3-30B-A3B shape (48 layers of
128 experts, hidden 2048, intermediate 768, top-8, bf16), routing from the synthetic model
calibrated to the recorded fixture, one CUDA graph per decode token (as compiled decode runs it),
every strategy in one run:
- fetch-only: a 16 GiB cache, every miss copied over the link (fetch_fraction 1);
- split: the same cache, each call's misses divided between the link and the CPU share by this
  machine's measured costs (fetch_fraction "auto");
- split-idle (not in the default list): the split's kernels (submit and join every layer) with CPU
  costs so high that no call gives the CPU an expert: the split's fixed cost against fetch-only;
- CPU-only: no cache (top_k slots, nothing admitted): the CPU share computes every routed expert
  from the host pool (the llama.cpp --cpu-moe strategy);
- resident: a pool of every expert, all admitted before the timing (every step hits).
Prints tokens/s, each row against the better of fetch-only (of its cache size) and CPU-only, and
writes cpu_share.json and a plot, cpu_share.png (with matplotlib).
First, the CPU kernel alone: expert_gemm on the host pool for one token and 1 or 8 experts, each call
on the next layer's experts (read from memory, not the CPU's cache), against a plain read (a max) of
the same bytes by torch on all threads (bench_cpu_gemv.py's timing): the kernel's share of the
host's read bandwidth.

  python3 benchmarks/bench_cpu_share.py                    # 48 layers, 16 GiB, 64 decode tokens
  python3 benchmarks/bench_cpu_share.py --cache-gib 16,1   # every strategy at two cache sizes, one process
  python3 benchmarks/bench_cpu_share.py --layers 8 --cache-gib 2.7
"""
import argparse
import gc
import os

import torch

from bench_cpu_gemv import kernel_and_read_us
from common import print_table, write_report
from ft_ops import admission, rates
from ft_ops.replay import replay
from ft_ops.synthetic_routing import calibrate
from ft_ops.traces import Trace
from freetoken_plugin.host_memory import available_host_bytes
from moe_setup import E, H, I, K, random_host_pool

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "routing",
                       "byte_qwen3moe_8x32_top4.safetensors")


def cpu_kernel_rows(host, reps: int = 12) -> list:
    """expert_gemm on the CPU over the host pool (one token, k distinct experts of a layer, a
    different layer each call) against a plain read of the same experts' bytes."""
    x = torch.randn(1, H).to(torch.bfloat16)
    rows = []
    for k in (1, K):
        g, r = kernel_and_read_us(lambda l: dict(w13=host.w13[l], w2=host.w2[l]), host.shape.layers, x, k, reps)
        nbytes = k * host.shape.expert_bytes
        rows.append(dict(experts=k, MB=round(nbytes / 1e6, 1), cpu_gemm_us=round(g), read_us=round(r),
                         gemm_GBps=round(nbytes / g / 1e3, 1), read_GBps=round(nbytes / r / 1e3, 1),
                         gemm_vs_read=round(r / g, 3)))
    return rows


CACHED = ("fetch-only", "split", "split-idle")  # strategies run at every cache size; the others once


def cache_sizes(text: str) -> list:
    """The --cache-gib values, or [] when they are not positive numbers."""
    try:
        sizes = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        return []
    return sizes if all(0 < v < float("inf") for v in sizes) else []


def plot(rows: list, path: str) -> bool:
    """Tokens/s of every strategy at each cache size (CPU-only and resident as lines across)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench_cpu_share] matplotlib is not installed: no plot")
        return False
    sizes = sorted({r["cache_gib"] for r in rows if r["strategy"] in CACHED}, reverse=True)
    names = [n for n in CACHED if any(r["strategy"] == n for r in rows)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        values = [next((r["tokens_per_s"] for r in rows if r["strategy"] == name and r["cache_gib"] == c), 0)
                  for c in sizes]
        ax.bar([j + i * width for j in range(len(sizes))], values, width, label=name)
    for name, style in (("cpu-only", "--"), ("resident", ":")):
        row = next((r for r in rows if r["strategy"] == name), None)
        if row is not None:
            ax.axhline(row["tokens_per_s"], linestyle=style, color="gray", label=f"{name} ({row['tokens_per_s']:g})")
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{c:g} GiB" for c in sizes])
    ax.set_ylabel("decode tokens/s (one CUDA graph a token)")
    ax.set_title("Decode under misses: the link, the CPU share, both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--cache-gib", default="16", help="cache sizes in GiB, comma-separated (e.g. 16,1)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--strategies", default="fetch-only,split,cpu-only,resident")
    args = parser.parse_args()
    sizes = cache_sizes(args.cache_gib)
    if not sizes:
        parser.error(f"--cache-gib: give positive GiB values separated by commas (e.g. 16,1), got {args.cache_gib!r}")
    if args.layers < 1:
        parser.error(f"--layers must be positive, got {args.layers}")
    if args.decode_tokens < 2:
        parser.error(f"--decode-tokens must be at least 2 (the first warms up, unmeasured), got {args.decode_tokens}")
    expert_bytes = 3 * H * I * 2  # a bf16 expert of this shape (w13 and w2)
    for gib in sizes:
        if int(gib * 2**30) // expert_bytes < K:
            parser.error(f"--cache-gib {gib:g} holds fewer than one call's {K} experts "
                         f"({expert_bytes / 2**20:g} MiB each); give at least {K * expert_bytes / 2**30:.2f}")
    names = args.strategies.split(",")
    known = (*CACHED, "cpu-only", "resident")
    for name in names:
        if name not in known:
            parser.error(f"--strategies: unknown {name!r}; choose from {', '.join(known)}")
    host_bytes = args.layers * E * expert_bytes  # the pinned host pool
    available = available_host_bytes()
    if available is not None and host_bytes > 0.9 * available:
        parser.error(f"--layers {args.layers}: the host pool takes {host_bytes / 2**30:.1f} GiB of pinned memory and "
                     f"this machine has {available / 2**30:.1f} GiB available; pass at most "
                     f"--layers {max(1, int(0.9 * available // (E * expert_bytes)))}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_cpu_share.py measures the CUDA path: run it on a machine with a GPU")
    host = random_host_pool(args.layers)
    kernel = cpu_kernel_rows(host)
    print_table(f"CPU expert_gemm on the host pool, one token, {torch.get_num_threads()} threads, a layer not read "
                f"recently each call; reference: a max over the same bytes (a plain read)", kernel,
                ["experts", "MB", "cpu_gemm_us", "read_us", "gemm_GBps", "read_GBps", "gemm_vs_read"])
    model, _ = calibrate(Trace.load(FIXTURE))
    trace = model.trace(args.layers, E, K, tokens=args.decode_tokens, seed=3, hidden=H, intermediate=I)
    plans = []  # (strategy, cache GiB or None, replay arguments)
    for gib in sizes:
        slots = int(gib * 2**30) // host.shape.expert_bytes
        for name in names:
            if name in CACHED:
                plans.append((name, gib, dict(cache_slots=slots, fetch_fraction=1.0 if name == "fetch-only" else "auto")))
    if "cpu-only" in names:
        plans.append(("cpu-only", None, dict(cache_slots=K, fetch_fraction=0.0, stream_prefill=False)))
    if "resident" in names:
        plans.append(("resident", None, dict(cache_slots=args.layers * E, all_resident=True)))
    rows = []
    for name, gib, plan in plans:
        measured = admission.measure_cpu_split
        if name == "split-idle":  # a second of CPU time an expert: the rule never picks the CPU
            admission.measure_cpu_split = lambda *a, **k: rates.CpuSplit(link_expert_s=194e-6, cpu_expert_s=1.0,
                                                                          cpu_call_s=1.0)
        try:
            row = replay(trace, device="cuda", host=host, dtype=torch.bfloat16, rates=None, **plan)
        finally:
            admission.measure_cpu_split = measured
        rows.append(dict(strategy=name, cache_gib=gib, slots=row["slots"], hit_rate=row["hit_rate"],
                         MB_over_link_per_token=row["MB_over_link_per_token"],
                         cpu_rows_per_token=row["cpu_rows_per_token"],
                         cpu_worker_ms_per_token=row["cpu_worker_ms_per_token"],
                         cpu_worker_us_per_job=row["cpu_worker_us_per_job"],
                         cpu_helper_chunk_share=row["cpu_helper_chunk_share"],
                         cpu_wakes_per_job=row["cpu_wakes_per_job"], ms_per_token=row["ms_per_token"],
                         tokens_per_s=round(1e3 / row["ms_per_token"], 1), cuda_graph=row["cuda_graph"],
                         cpu_split=row["cpu_split"]))
        print(f"[bench_cpu_share] {rows[-1]}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    cpu_only = next((r for r in rows if r["strategy"] == "cpu-only"), None)
    for r in rows:
        # Against the pure strategies of the same cache size (CPU-only has no cache: one row for all).
        fetch = next((f for f in rows if f["strategy"] == "fetch-only" and f["cache_gib"] == r["cache_gib"]), None)
        pure = [x["ms_per_token"] for x in (fetch, cpu_only) if x is not None]
        if pure and r["strategy"] in CACHED:
            r["vs_better_pure"] = round(min(pure) / r["ms_per_token"], 3)  # > 1: faster than both
        if fetch is not None:
            r["speedup_vs_fetch_only"] = round(fetch["ms_per_token"] / r["ms_per_token"], 3)
    for r in rows:
        if r["cpu_split"]:
            print(f"[bench_cpu_share] {r['strategy']} at {r['cache_gib']:g} GiB: measured costs {r['cpu_split']}")
    print_table(f"decode, {args.layers} layers, calibrated routing (repeat {model.repeat:.3f}, zipf {model.zipf:.3f}), "
                f"{args.decode_tokens} tokens, one CUDA graph per token; goals: split within 1.05x of the better pure "
                f"strategy (vs_better_pure >= 0.952), >= 1.3x fetch-only where the rates are within 2x",
                rows, ["strategy", "cache_gib", "slots", "hit_rate", "MB_over_link_per_token", "cpu_rows_per_token",
                       "cpu_worker_ms_per_token", "cpu_worker_us_per_job", "cpu_helper_chunk_share",
                       "cpu_wakes_per_job", "ms_per_token", "tokens_per_s", "vs_better_pure", "speedup_vs_fetch_only",
                       "cuda_graph"])
    path = write_report("cpu_share", rows, dict(layers=args.layers, cache_gib=sizes, decode_tokens=args.decode_tokens,
                                                cpu_kernel=kernel, threads=torch.get_num_threads()))
    image = os.path.splitext(path)[0] + ".png"
    if plot(rows, image):
        print(f"[bench_cpu_share] wrote {image}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
