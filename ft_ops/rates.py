"""The rates that decide between streaming a whole layer and admitting only the routed experts,
measured on the runtime's own pools: host-to-device rows per second through copy_experts, and the
expert GEMM's FLOP rate on a prompt-sized call (the defaults are below an H200's measured rates)."""
import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import ops
from .activations import Activation
from .expert_compute import gemm_on_layer
from .formats import FP8_FORMATS, INT4, MXFP4, PACKED_FORMATS


@dataclass
class Rates:
    """Link and expert-GEMM rates (defaults: a little below an H200's, PCIe 5 x16)."""
    link_bytes_per_s: float = 50e9       # pinned host -> device (H200: 52-55 GB/s)
    gemm_flops_per_s: float = 300e12     # expert GEMMs, grouped, bf16 (H200: ~440 TFLOP/s)


def _seconds(fn: Callable[[], None], device: torch.device, reps: int = 5) -> float:
    """Median seconds of fn after one warm-up call (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _link_copy(pool, host, rows: int, who: str):
    """(n, copy): a copy_experts of n = min(rows, E, S) experts of layer 0 into slots 0..n-1 of an
    empty pool (it refuses one that holds experts: those rows are overwritten)."""
    device = pool.device
    n = min(rows, pool.shape.experts, pool.slots)
    if bool((pool.owner_of[:n] >= 0).any()):
        raise RuntimeError(f"{who} overwrites slots 0..rows-1: call it on an empty pool")
    plan = torch.arange(n, dtype=torch.int32, device=device)
    count = torch.tensor([n], dtype=torch.int32, device=device)
    host_rows = host.device_layer_rows(0, device) if device.type == "cuda" else host.layer_rows(0)
    return n, lambda: ops.copy_experts(pool.banks, host_rows, plan, plan, count)


def measure_rates(pool, host, activation: Activation, rows: int = 8, tokens: int = 512) -> Rates:
    """Times, on an empty slot pool, a copy of `rows` experts of layer 0 into slots 0..rows-1 and
    an expert GEMM of `tokens` tokens routed over those slots (random weights written there first).
    Overwrites those bank rows, so it refuses a pool that holds experts already."""
    shape, device = pool.shape, pool.device
    n, copy = _link_copy(pool, host, rows, "measure_rates")
    link_s = _seconds(copy, device)

    # The region the prefill GEMM reads is a bank of its own (E slots at most): time it that way,
    # FP8 experts with the dequantization the prompt path does (ft_ops/expert_compute.py).
    _fill_random(pool, n)
    top_k = min(8, n)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, shape.hidden, generator=gen).to(device=device, dtype=shape.dtype)
    slot_ids = torch.stack([torch.randperm(n, generator=gen)[:top_k] for _ in range(tokens)]).int().to(device)
    weights = torch.full((tokens, top_k), 1.0 / top_k, device=device)
    region = torch.arange(n, dtype=torch.int32, device=device)
    gemm_s = _seconds(lambda: gemm_on_layer(pool, region, hidden, slot_ids, weights, activation), device)
    flops = tokens * top_k * shape.flops_per_pair
    return Rates(link_bytes_per_s=n * shape.expert_bytes / link_s, gemm_flops_per_s=flops / gemm_s)


def _fill_random(pool, n: int) -> None:
    """Random experts in slots 0..n-1 of the pool's banks, written in place: a quantized format's
    codes are drawn directly (every one finite, scales keeping values within a few cols^-1/2). The rates
    do not depend on the values, and quantizing random floats took several GB of temporaries for a
    GPT-OSS-120B layer's experts (and seconds on a CPU) at every load."""
    gen = torch.Generator(device=pool.device).manual_seed(0)
    fmt = pool.shape.format
    for weight, scale in ((pool.w13, pool.w13_scale), (pool.w2, pool.w2_scale)):
        rows = weight[:n]
        cols = weight.shape[-1] * (2 if fmt in PACKED_FORMATS else 1)  # two 4-bit values a byte
        if fmt == INT4:
            rows.random_(0, 256, generator=gen)  # any byte is two int4 values (mean size ~4)
            scale[:n].fill_(cols ** -0.5 / 4)
        elif fmt == MXFP4:
            rows.random_(0, 256, generator=gen)  # any byte is two finite e2m1 values (mean size ~2.3)
            scale[:n].fill_(127 + round(math.log2(cols ** -0.5 / 2.3)))  # e8m0: 2^(code - 127)
        elif fmt in FP8_FORMATS:
            codes = rows.view(torch.uint8)
            codes.random_(0, 0x7F, generator=gen)  # 0x7F and 0xFF are e4m3fn's NaNs
            codes[..., 1::2].bitwise_or_(0x80)     # every other column negative
            scale[:n].fill_(cols ** -0.5 / 448)    # the largest code, 448, gives cols^-1/2
        else:
            rows.normal_(0.0, cols ** -0.5, generator=gen)
    for bias in (pool.b13, pool.b2):
        if bias is not None:
            bias[:n].normal_(0.0, 0.1, generator=gen)


@dataclass
class CpuSplit:
    """This machine's costs of the CPU share against the link, for fetch_fraction="auto": one
    expert's copy over the link on the decode path, and the CPU share's time per call (posting,
    waking the worker, the join) and per expert of a one-token call, measured while the link copies
    (the CPU computes from host memory that the link's transfers read at the same time)."""
    link_expert_s: float
    cpu_expert_s: float
    cpu_call_s: float

    @property
    def cpu_expert_cost(self) -> float:
        """CPU seconds per expert in units of one expert's link copy (dedup_and_admit's argument)."""
        return self.cpu_expert_s / self.link_expert_s

    @property
    def cpu_call_cost(self) -> float:
        return self.cpu_call_s / self.link_expert_s


def measure_cpu_split(pool, host, cpu_share, top_k: int, rows: int = 8) -> CpuSplit:
    """Times, on an empty slot pool, copy_experts of `rows` experts of layer 0 (the link per
    expert), and the CPU share's submit + join of a one-token call with 1 and with `top_k` distinct
    experts on the CPU, each while copies of layer 0 run on a side stream (CUDA). Each call takes
    the next layer's experts, so the CPU reads them from memory as decode does, not from its cache."""
    shape, device = pool.shape, pool.device
    n, copy = _link_copy(pool, host, rows, "measure_cpu_split")
    link_expert_s = _seconds(copy, device) / n

    k = min(top_k, shape.experts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, shape.hidden, generator=gen).to(device=device, dtype=shape.dtype)
    weights = torch.full((1, top_k), 1.0 / top_k, device=device)
    out = torch.zeros(1, shape.hidden, device=device, dtype=shape.dtype)

    calls = itertools.count()

    def one_call(experts: int):
        slots = torch.zeros(1, top_k, dtype=torch.int32)
        slots[0, :experts] = -1  # left to the CPU
        slots = slots.to(device)
        ids = torch.arange(top_k, device=device).reshape(1, top_k) % shape.experts
        return lambda: cpu_share.join(out, cpu_share.submit(next(calls) % shape.layers, x, slots, ids, weights))

    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    times = {}
    for experts in sorted({1, k}):
        if side is not None:  # keep the link busy meanwhile: host memory is shared with it
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(40):
                    copy()
        times[experts] = _seconds(one_call(experts), device)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    cpu_expert_s = (times[k] - times[1]) / (k - 1) if k > 1 else times[1] / 2
    cpu_expert_s = max(cpu_expert_s, 1e-9)
    cpu_call_s = max(times[1] - cpu_expert_s, 0.0)
    return CpuSplit(link_expert_s=link_expert_s, cpu_expert_s=cpu_expert_s, cpu_call_s=cpu_call_s)
