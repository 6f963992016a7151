"""Timing, reference ceilings and reporting shared by the GPU benchmarks."""
import datetime
import json
import os
import statistics
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ft_ops.replay import capture_graph  # noqa: F401  (the benchmarks capture with it)


def median_ms(fn: Callable[[], None], iters: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_stack(modules, x: torch.Tensor, routing) -> torch.Tensor:
    """x through a stack of offloaded MoE layers with each layer's (ids, weights), the residual
    added as a decoder layer adds it."""
    for module, (ids, w) in zip(modules, routing):
        x = x + module(x, ids, w)
    return x


def prefill_ms(runtime, modules, x: torch.Tensor, routing, reps: int = 3, warmup: int = 1,
               before: Optional[Callable[[], None]] = None):
    """(median ms, last output) of x through the stack from an emptied pool (then `before()`, e.g.
    experts made resident), timed with CUDA events; `warmup` passes untimed first."""
    times, out = [], None
    for rep in range(warmup + reps):
        runtime.pool.invalidate()  # an empty cache: every layer crosses the link
        if before is not None:
            before()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run_stack(modules, x, routing)
        end.record()
        end.synchronize()
        if rep >= warmup:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], out


def warm_gpu(seconds: float = 0.3) -> None:
    """Keeps the SMs busy for a moment so the clocks leave their idle state before a timing of
    small kernels (an idle H200 reads 345 MHz; tiny kernels alone may not raise it)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def graph_ms_per_call(fn: Callable[[], None], calls: int, replays: int = 30) -> float:
    """Captures `calls` back-to-back invocations of fn in one CUDA graph and returns the median
    replay time divided by `calls` (launch gaps shrink to what graphs leave)."""
    def many():
        for _ in range(calls):
            fn()
    return median_ms(capture_graph(many).replay, iters=replays) / calls


def gemv_reference_us(parts, calls: int = 16) -> float:
    """The peer reference of a decode expert_gemm: cuBLAS GEMVs (torch.mv, bf16 matrices) reading
    the same bytes in the same split, timed the same way (`calls` calls per CUDA graph, each call on
    its own matrices, so nothing stays in L2). parts: one (rows, cols) per kernel of the call, e.g.
    gate_up's bytes then down's."""
    mats = [[torch.randn(r, c, device="cuda", dtype=torch.bfloat16) for r, c in parts] for _ in range(calls)]
    vecs = [torch.randn(c, device="cuda", dtype=torch.bfloat16) for _, c in parts]
    outs = [[torch.empty(r, device="cuda", dtype=torch.bfloat16) for r, _ in parts] for _ in range(calls)]
    it = iter(range(10 ** 9))

    def one_call():
        i = next(it) % calls
        for m, v, o in zip(mats[i], vecs, outs[i]):
            torch.mv(m, v, out=o)

    warm_gpu()
    us = graph_ms_per_call(one_call, calls) * 1000
    del mats, outs
    torch.cuda.empty_cache()
    return us


def device_copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-memory bandwidth, counting bytes read plus bytes written (the convention of bandwidth tests)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / ms / 1e6


def decode_routings(calls: int, tokens: int, experts: int, k: int, gen) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """`calls` routings of `tokens` tokens (softmax top-k of random logits: (weights, ids)) for a
    graph that replays them in a cycle. Where each call routes at most a third of the experts, a
    call routes none of the previous call's experts (the last none of the first's either), as the
    calls of consecutive layers in a decode step do: no call then reads its experts' bytes from L2
    where the one before it left them, so the time is the HBM's."""
    disjoint = 3 * tokens * k <= experts
    routings, first = [], None
    for c in range(calls):
        logits = torch.randn(tokens, experts, device=gen.device, generator=gen)
        if disjoint and routings:
            logits[:, routings[-1][1].flatten()] = float("-inf")
            if c == calls - 1:
                logits[:, first] = float("-inf")
        w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
        routings.append((w, ids))
        if first is None:
            first = ids.flatten()
    return routings


def device_read_gbps(nbytes: int = 2 << 30) -> float:
    """Device-memory read bandwidth: a sum that reads every byte once and writes a few."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    ms = median_ms(lambda: src.sum(), iters=10)
    return nbytes / ms / 1e6


def hbm_floor_gbps() -> Tuple[float, float, float]:
    """The rate an HBM floor divides by: the faster of a device copy (read + write bytes) and a
    plain read (a kernel that only reads its weights can reach either), so the floor is never
    lenient; returns (that rate, the copy's, the read's)."""
    copy, read = device_copy_gbps(), device_read_gbps()
    return max(copy, read), copy, read


def pinned_copy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = median_ms(lambda: dst.copy_(src, non_blocking=True), iters=10)
    return nbytes / ms / 1e6


def bf16_matmul_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, iters=10)
    return 2 * n ** 3 / ms / 1e9


def write_report(name: str, rows: List[Dict], extra: Dict) -> str:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    report = {
        "benchmark": name,
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        **extra,
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    return path


def print_table(title: str, rows: List[Dict], columns: List[str]) -> None:
    if not rows:
        return
    print(f"\n## {title}")
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).rjust(w) for c, w in zip(columns, widths)))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)
