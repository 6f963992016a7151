"""The CPU expert_gemm at one token (the CPU share's and the CPU-only strategy's call), per expert
format, against two references in the same run: a plain read of the same bytes (`max` over them as
uint8, on all threads: the memory's rate) and the path it replaced, the expert dequantized to float32
(`dequantize_experts`) then ATen's GEMMs (bf16: ATen's GEMMs on the bf16 rows). Each call takes the
next layer's experts, so they come from memory, not the CPU's cache. `share_us`: the same call posted
to a CPU share session by a CPU producer (submit, then join), so that the kernel runs on the share's
own row threads as in decode, not on ATen's. Runs on any machine (CPU only).

  python3 benchmarks/bench_cpu_gemv.py                      # Qwen3-30B-A3B's expert shape, 8 layers
  python3 benchmarks/bench_cpu_gemv.py --hidden 2880 --intermediate 2880 --formats mxfp4   # GPT-OSS's
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common import print_table, write_report
from ft_ops import formats, ops
from ft_ops.activations import SILU
from ft_ops.cpu_share import CpuShare
from ft_ops.slot_pool import HostPool


def host_layers(fmt: str, layers: int, experts: int, hidden: int, inter: int) -> list:
    """`layers` layers of `experts` random experts in the format, as expert_gemm's keyword arguments."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
        w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
        if fmt == "bf16":
            out.append(dict(w13=w13.bfloat16(), w2=w2.bfloat16()))
        elif fmt == "fp8":
            (a, sa), (b, sb) = formats.quantize_fp8(w13, parts=2), formats.quantize_fp8(w2)
            out.append(dict(w13=a, w2=b, w13_scale=sa, w2_scale=sb))
        elif fmt == "int4":  # groups of 128 (quantize="int4"'s default), or the largest that divides
            group = formats.int4_groups_dividing(hidden, inter)[0]
            (a, sa), (b, sb) = formats.quantize_int4(w13, group), formats.quantize_int4(w2, group)
            out.append(dict(w13=a, w2=b, w13_scale=sa, w2_scale=sb))
        else:
            (a, sa), (b, sb) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
            out.append(dict(w13=a, w2=b, w13_scale=sa, w2_scale=sb))
    return out


def replaced_path(x, layer, k, inter):
    """What the CPU kernel did before: each expert dequantized to float32, then two GEMMs."""
    out = torch.zeros(1, x.shape[1])
    xf = x.float()
    for e in range(k):
        if "w13_scale" in layer:
            slot = torch.tensor([e])
            w13 = ops.dequantize_experts(layer["w13"], layer["w13_scale"], slot, 2, torch.float32)[0]
            w2 = ops.dequantize_experts(layer["w2"], layer["w2_scale"], slot, 1, torch.float32)[0]
            h = xf @ w13.t()
        else:
            w13, w2 = layer["w13"][e], layer["w2"][e]
            h = (x @ w13.t()).float()
        a = F.silu(h[:, :inter]) * h[:, inter:]
        out += (a.to(w2.dtype) @ w2.t()).float() / k
    return out


def median_us(fn, layers: int, reps: int) -> float:
    """Median microseconds of fn(layer) over `reps` calls after a warm-up, the layer cycling."""
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        fn(rep % layers)
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def kernel_and_read_us(layer_of, layers: int, x, k: int, reps: int):
    """(expert_gemm of one token over experts 0..k-1 of layer l, a plain read of those experts'
    bytes), median microseconds each, l cycling over `layers`; layer_of(l) gives expert_gemm's
    weight arguments (w13, w2 and any scales) of layer l."""
    ids = torch.arange(k, dtype=torch.int32).reshape(1, k)
    weights = torch.full((1, k), 1.0 / k)
    kernel = median_us(lambda l: ops.expert_gemm(x, ids, weights, activation=SILU, **layer_of(l)), layers, reps)
    # The bytes as uint8: a plain read at vector speed, whatever the format.
    read = median_us(lambda l: [t[:k].view(torch.uint8).max() for t in layer_of(l).values()], layers, reps)
    return kernel, read


def share_us(layers: list, x, k: int, reps: int) -> dict:
    """The call of kernel_and_read_us through a CPU share session (its worker and row threads) with
    a CPU producer: median microseconds of submit + join (`share_us`), the layer cycling; of that,
    the worker's mean time a job (`share_worker_us`: its compute, the rest being the hand-off through
    the mailbox), and the share of the row loops' chunks that ran on the worker itself rather than
    on its helper threads (`share_worker_chunks`: near 1 when the helpers do not keep up)."""
    banks = {name: torch.stack([layer[name] for layer in layers]) for name in layers[0]}
    share = CpuShare(HostPool(**banks, dtype=x.dtype), SILU, k, "cpu")
    ids = torch.arange(k).reshape(1, k)
    left_to_cpu = torch.full((1, k), -1, dtype=torch.int32)
    weights = torch.full((1, k), 1.0 / k)
    out = torch.zeros_like(x)
    call = lambda l: share.join(out, share.submit(l, x, left_to_cpu, ids, weights))
    try:
        call(0)  # the first job starts the row threads
        jobs0, busy0 = share.worker_counters()
        rows0 = share.row_thread_counters()
        total = median_us(call, len(layers), reps)
        jobs1, busy1 = share.worker_counters()
        rows1 = share.row_thread_counters()
    finally:
        share.close()
    chunks = rows1["chunks"] - rows0["chunks"]
    worker_chunks = rows1["worker_chunks"] - rows0["worker_chunks"]
    return dict(share_us=round(total), share_worker_us=round((busy1 - busy0) / max(1, jobs1 - jobs0) * 1e6),
                share_worker_chunks=round(worker_chunks / chunks, 3) if chunks else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="bf16,fp8,mxfp4,int4")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 8], help="distinct experts a call")
    parser.add_argument("--layers", type=int, default=8, help="layers to cycle through (more than the cache holds)")
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    rows = []
    for fmt in args.formats.split(","):
        if fmt not in ("bf16", "fp8", "mxfp4", "int4"):
            raise SystemExit(f"--formats: {fmt!r} is not bf16, fp8, mxfp4 or int4")
        k_max = max(args.experts)
        layers = host_layers(fmt, args.layers, k_max, args.hidden, args.intermediate)
        x = torch.randn(1, args.hidden).bfloat16()
        nbytes_expert = sum(t[0].numel() * t.element_size() for t in layers[0].values())
        for k in args.experts:
            kernel, read = kernel_and_read_us(lambda l: layers[l], args.layers, x, k, args.reps)
            shared = share_us(layers, x, k, args.reps)
            before = median_us(lambda l: replaced_path(x, layers[l], k, args.intermediate), args.layers, args.reps)
            mb = k * nbytes_expert / 1e6
            rows.append(dict(format=fmt, experts=k, MB=round(mb, 2), kernel_us=round(kernel), **shared,
                             read_us=round(read), replaced_us=round(before), kernel_GBps=round(mb / kernel * 1e3, 1),
                             kernel_vs_read=round(read / kernel, 3), speedup_vs_replaced=round(before / kernel, 2)))
            print(f"[bench_cpu_gemv] {rows[-1]}", flush=True)
    print_table(f"CPU expert_gemm, one token, H {args.hidden}, I {args.intermediate}, {torch.get_num_threads()} "
                f"threads, a layer not read recently each call; share_us: the same call on the CPU share's row threads "
                f"(share_worker_us of it in the worker's job, share_worker_chunks the share of the row chunks the "
                f"worker ran itself); references: a plain read of the bytes, the dequantize-then-GEMM path it "
                f"replaced", rows,
                ["format", "experts", "MB", "kernel_us", "share_us", "share_worker_us", "share_worker_chunks",
                 "read_us", "replaced_us", "kernel_GBps", "kernel_vs_read", "speedup_vs_replaced"])
    write_report("cpu_gemv", rows, dict(hidden=args.hidden, intermediate=args.intermediate,
                                        threads=torch.get_num_threads()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
