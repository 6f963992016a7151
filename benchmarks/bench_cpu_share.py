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
Prints tokens/s, each row against the better of fetch-only and CPU-only, and writes cpu_share.json.
First, the CPU kernel alone: expert_gemm on the host pool for one token and 1 or 8 experts, each call
on the next layer's experts (read from memory, not the CPU's cache), against a plain read (a max) of
the same bytes by torch on all threads (bench_cpu_gemv.py's timing): the kernel's share of the
host's read bandwidth.

  python3 benchmarks/bench_cpu_share.py                    # 48 layers, 16 GiB, 64 decode tokens
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--cache-gib", type=float, default=16.0)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--strategies", default="fetch-only,split,cpu-only,resident")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cpu_share.py measures the CUDA path: run it on a machine with a GPU")
    host = random_host_pool(args.layers)
    kernel = cpu_kernel_rows(host)
    print_table(f"CPU expert_gemm on the host pool, one token, {torch.get_num_threads()} threads, a layer not read "
                f"recently each call; reference: a max over the same bytes (a plain read)", kernel,
                ["experts", "MB", "cpu_gemm_us", "read_us", "gemm_GBps", "read_GBps", "gemm_vs_read"])
    model, _ = calibrate(Trace.load(FIXTURE))
    trace = model.trace(args.layers, E, K, tokens=args.decode_tokens, seed=3, hidden=H, intermediate=I)
    cache_slots = int(args.cache_gib * 2**30) // host.shape.expert_bytes
    plans = {
        "fetch-only": dict(cache_slots=cache_slots, fetch_fraction=1.0),
        "split": dict(cache_slots=cache_slots, fetch_fraction="auto"),
        "split-idle": dict(cache_slots=cache_slots, fetch_fraction="auto"),
        "cpu-only": dict(cache_slots=K, fetch_fraction=0.0, stream_prefill=False),
        "resident": dict(cache_slots=args.layers * E, all_resident=True),
    }
    rows = []
    for name in args.strategies.split(","):
        if name not in plans:
            raise SystemExit(f"--strategies: unknown {name!r}; choose from {', '.join(plans)}")
        measured = admission.measure_cpu_split
        if name == "split-idle":  # a second of CPU time an expert: the rule never picks the CPU
            admission.measure_cpu_split = lambda *a, **k: rates.CpuSplit(link_expert_s=194e-6, cpu_expert_s=1.0,
                                                                          cpu_call_s=1.0)
        try:
            row = replay(trace, device="cuda", host=host, dtype=torch.bfloat16, **plans[name])
        finally:
            admission.measure_cpu_split = measured
        rows.append(dict(strategy=name, slots=row["slots"], hit_rate=row["hit_rate"],
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
    by = {r["strategy"]: r for r in rows}
    pure = [by[n]["ms_per_token"] for n in ("fetch-only", "cpu-only") if n in by]
    for r in rows:
        if pure:
            r["vs_better_pure"] = round(min(pure) / r["ms_per_token"], 3)  # > 1: faster than both
        if "fetch-only" in by:
            r["speedup_vs_fetch_only"] = round(by["fetch-only"]["ms_per_token"] / r["ms_per_token"], 3)
    for r in rows:
        if r["cpu_split"]:
            print(f"[bench_cpu_share] {r['strategy']}: measured costs {r['cpu_split']}")
    print_table(f"decode, {args.layers} layers, {args.cache_gib:g} GiB cache, calibrated routing (repeat "
                f"{model.repeat:.3f}, zipf {model.zipf:.3f}), one CUDA graph per token; goals: split >= 0.95 of "
                f"the better pure strategy, >= 1.3x fetch-only where the rates are within 2x",
                rows, ["strategy", "slots", "hit_rate", "MB_over_link_per_token", "cpu_rows_per_token",
                       "cpu_worker_ms_per_token", "cpu_worker_us_per_job", "cpu_helper_chunk_share",
                       "cpu_wakes_per_job", "ms_per_token", "tokens_per_s", "vs_better_pure", "speedup_vs_fetch_only", "cuda_graph"])
    write_report("cpu_share", rows, dict(layers=args.layers, cache_gib=args.cache_gib, decode_tokens=args.decode_tokens,
                                         cpu_kernel=kernel, threads=torch.get_num_threads()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
