"""The CPU expert_gemm on a prompt (the CPU build's prefill, and the cpu-experts strategy's), per
expert format, against the CPU's own GEMM rate measured in the same run: the call's FLOPs (every
routed row through gate_up and down) at the rate of one large bf16 `torch.mm`. Each call routes a
fresh prompt (new row counts per expert, as every prompt and every layer gives). Runs on any
machine (CPU only).

  python3 benchmarks/bench_cpu_prompt.py                          # Qwen3-30B-A3B's layer shape
  python3 benchmarks/bench_cpu_prompt.py --tokens 512,2048 --formats bf16
"""
import argparse
import statistics
import time

import torch

from common import print_table, write_report
from ft_ops import formats, ops
from ft_ops.activations import SILU


def layer_weights(fmt: str, experts: int, hidden: int, inter: int) -> dict:
    """One layer of random experts in the format, as expert_gemm's keyword arguments."""
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    if fmt == "bf16":
        return dict(w13=w13.bfloat16(), w2=w2.bfloat16())
    quantize = formats.quantize_fp8 if fmt == "fp8" else formats.quantize_mxfp4
    (a, sa), (b, sb) = quantize(w13, **({"parts": 2} if fmt == "fp8" else {})), quantize(w2)
    return dict(w13=a, w2=b, w13_scale=sa, w2_scale=sb)


def mm_tflops(size: int = 4096, reps: int = 5) -> float:
    """The CPU's bf16 GEMM rate: one size^3 torch.mm, median of `reps` after a warm-up."""
    a = torch.randn(size, size).bfloat16()
    b = torch.randn(size, size).bfloat16()
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * size ** 3 / statistics.median(times) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="bf16,fp8")
    parser.add_argument("--tokens", default="512,2048,8192", help="prompt lengths")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    H, I, E, K = args.hidden, args.intermediate, args.experts, args.top_k
    rate = mm_tflops()
    gen = torch.Generator().manual_seed(1)
    rows = []
    for fmt in args.formats.split(","):
        weights = layer_weights(fmt, E, H, I)
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, H, generator=gen).bfloat16()

            # A mild skew over the experts, as trained routers have, in no order of expert id.
            skew = torch.linspace(0, 2, E)[torch.randperm(E, generator=gen)]

            def routed():
                logits = torch.randn(tokens, E, generator=gen) + skew
                w, ids = logits.softmax(-1).topk(K, -1)
                return ids.int(), (w / w.sum(-1, keepdim=True)).bfloat16()

            ops.expert_gemm(x, *routed(), activation=SILU, **weights)  # warm-up
            times = []
            for _ in range(args.reps):
                ids, w = routed()
                t0 = time.perf_counter()
                ops.expert_gemm(x, ids, w, activation=SILU, **weights)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            floor_ms = tokens * K * 6 * H * I / (rate * 1e12) * 1e3
            rows.append(dict(format=fmt, tokens=tokens, ms=round(ms, 2), gemm_floor_ms=round(floor_ms, 2),
                             over_floor=round(ms / floor_ms, 2)))
    print_table(f"CPU expert_gemm on a prompt, {E} experts, top-{K}, H {H}, I {I}, {torch.get_num_threads()} "
                f"threads; floor: the call's FLOPs at one bf16 mm's {rate:.2f} TFLOP/s",
                rows, ["format", "tokens", "ms", "gemm_floor_ms", "over_floor"])
    write_report("cpu_prompt", rows, dict(hidden=H, intermediate=I, experts=E, top_k=K, mm_tflops=round(rate, 3),
                                          threads=torch.get_num_threads()))


if __name__ == "__main__":
    main()
