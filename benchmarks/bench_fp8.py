"""FP8 experts against bf16 on the GPU, Qwen3-30B-A3B layer shape (128 experts, hidden 2048,
intermediate 768, top-8), in one run:
- capacity: experts a 16 GiB cache holds in each format;
- decode GEMM: expert_gemm on FP8 slots (dequantized in registers) against the HBM floor of the FP8
  bytes it reads, and bf16 expert_gemm on the same routing (CUDA-graph replay, 16 routings per graph);
  the same on FP8 slots with one scale a row (fp8_rows) against its own floor;
- decode through 8 layers, every expert cached, each step one CUDA graph (as compiled decode runs):
  FP8 against bf16;
- time to first token of the MoE stack: 48 layers, a 16 GiB cache, an 8k-token prompt streamed from
  an empty cache, FP8 against bf16, each against its link bound (bytes / pinned rate of this run).
Writes fp8.json."""
import argparse
import gc

import torch

import ft_ops
from ft_ops import formats
from ft_ops.moe import OffloadedExperts, OffloadRuntime
from ft_ops.slot_pool import ExpertShape
from common import (capture_graph, decode_routings, hbm_floor_gbps, gemv_reference_us, graph_ms_per_call, pinned_copy_gbps, prefill_ms, print_table,
                    warm_gpu, write_report)
from moe_setup import E, H, I, K, admit_every_expert, random_host_pool, uniform_routing

CACHE_BYTES = 16 * 2**30


def free_memory() -> None:
    """Returns freed device memory and the pinned host blocks torch caches (a 48-layer pool is tens
    of GiB of pinned memory: two formats in a row do not fit beside a cached one)."""
    gc.collect()
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()


def capacity_rows():
    rows = []
    for fmt in (formats.DENSE, formats.FP8):
        per_expert = ExpertShape(48, E, H, I, torch.bfloat16, False, fmt).expert_bytes
        rows.append(dict(format=fmt, expert_MiB=round(per_expert / 2**20, 3), experts_in_16GiB=CACHE_BYTES // per_expert))
    rows[1]["vs_bf16"] = round(rows[1]["experts_in_16GiB"] / rows[0]["experts_in_16GiB"], 3)
    rows[1]["goal"] = ">= 1.9"
    return rows


def decode_gemm_rows(hbm_gbps: float):
    torch.manual_seed(0)
    slots = 1024  # the layer's 128 experts scattered over a pool (as bench_expert_gemm, smaller)
    w13 = torch.randn(slots, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(slots, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
    # Quantized 256 slots at a time (the quantizer's float32 temporaries of the whole bank would
    # not fit).
    pieces13 = [formats.quantize_fp8(w13[i:i + 256], parts=2) for i in range(0, slots, 256)]
    pieces2 = [formats.quantize_fp8(w2[i:i + 256]) for i in range(0, slots, 256)]
    q13, s13 = torch.cat([q for q, _ in pieces13]), torch.cat([s for _, s in pieces13])
    q2, s2 = torch.cat([q for q, _ in pieces2]), torch.cat([s for _, s in pieces2])
    del pieces13, pieces2
    by_rows = [(formats.quantize_fp8_rows(w13[i:i + 256]), formats.quantize_fp8_rows(w2[i:i + 256]))
               for i in range(0, slots, 256)]
    rows13 = [torch.cat([p[0][j] for p in by_rows]) for j in (0, 1)]
    rows2 = [torch.cat([p[1][j] for p in by_rows]) for j in (0, 1)]
    del by_rows
    slot_of_expert = torch.randperm(slots, device="cuda")[:E].int()
    fp8_bytes = ExpertShape(1, E, H, I, torch.bfloat16, False, formats.FP8).expert_bytes
    rows_bytes = ExpertShape(1, E, H, I, torch.bfloat16, False, formats.FP8_ROWS).expert_bytes
    rows = []
    for tokens in (1, 4, 16):
        calls, inputs, unique = 16, [], 0
        g = torch.Generator(device="cuda").manual_seed(tokens)
        for w, ids in decode_routings(calls, tokens, E, K, g):
            inputs.append((torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16), slot_of_expert[ids], w.float()))
            unique += ids.unique().numel()
        x, s, w = inputs[0]
        got = ft_ops.expert_gemm(x, s, w, q13, q2, w13_scale=s13, w2_scale=s2)
        used = s.flatten().unique()
        d13, d2 = torch.zeros_like(w13), torch.zeros_like(w2)
        d13[used] = formats.dequantize_fp8(q13[used], s13[used], 2, torch.bfloat16)
        d2[used] = formats.dequantize_fp8(q2[used], s2[used], 1, torch.bfloat16)
        want = ft_ops.expert_gemm(x, s, w, d13, d2)
        del d13, d2
        err = float((got.float() - want.float()).norm() / want.float().norm())
        times = {}
        for name, args in (("fp8", dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)), ("bf16", dict(w13=w13, w2=w2)),
                           ("fp8_rows", dict(w13=rows13[0], w2=rows2[0], w13_scale=rows13[1], w2_scale=rows2[1]))):
            it = iter(range(10 ** 9))

            def one_call():
                xx, ss, ww = inputs[next(it) % calls]
                ft_ops.expert_gemm(xx, ss, ww, **args)

            warm_gpu()
            times[name] = graph_ms_per_call(one_call, calls) * 1000
        floor = unique / calls * fp8_bytes / (hbm_gbps * 1e9) * 1e6
        rows_floor = unique / calls * rows_bytes / (hbm_gbps * 1e9) * 1e6
        # The peer: cuBLAS bf16 GEMVs reading the FP8 call's bytes, gate_up's then down's.
        experts = round(unique / calls)
        gemv = gemv_reference_us([(experts * I, H), (experts * H // 2, I)])
        rows.append(dict(tokens=tokens, unique_experts=round(unique / calls, 1), fp8_us=round(times["fp8"], 1),
                         floor_us=round(floor, 1), ratio_to_floor=round(times["fp8"] / floor, 2),
                         cublas_gemv_same_bytes_us=round(gemv, 1), fp8_vs_gemv=round(times["fp8"] / gemv, 2),
                         bf16_us=round(times["bf16"], 1), fp8_vs_bf16=round(times["fp8"] / times["bf16"], 3),
                         rel_err_vs_dequantized=f"{err:.1e}", goal="<= 1.5 at 1 token",
                         fp8_rows_us=round(times["fp8_rows"], 1),
                         fp8_rows_ratio_to_floor=round(times["fp8_rows"] / rows_floor, 2)))
    del w13, w2, q13, q2, rows13, rows2
    torch.cuda.empty_cache()
    return rows


def cached_decode_rows(layers: int = 8, steps: int = 200):
    rows = []
    for fmt in (formats.DENSE, formats.FP8):
        host = random_host_pool(layers, fmt=fmt)
        runtime = OffloadRuntime(host, layers * E, "cuda", stream_prefill=False)
        admit_every_expert(runtime)
        modules = [OffloadedExperts(runtime, l) for l in range(layers)]
        x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
        weights = torch.full((1, K), 1.0 / K, device="cuda", dtype=torch.bfloat16)
        trace = [torch.stack([ids.reshape(1, K) for ids, _ in uniform_routing(1, layers, 7 + t)]) for t in range(steps)]
        static_ids = torch.zeros(layers, 1, K, dtype=torch.int64, device="cuda")

        def step():
            for l, m in enumerate(modules):
                m(x, static_ids[l], weights)

        graph = capture_graph(step)
        warm_gpu()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for t in range(steps):
            static_ids.copy_(trace[t])
            graph.replay()
        end.record()
        end.synchronize()
        rows.append(dict(format=fmt, layers=layers, ms_per_token=round(start.elapsed_time(end) / steps, 4)))
        del runtime, modules, graph, host
        free_memory()
    rows[1]["vs_bf16"] = round(rows[1]["ms_per_token"] / rows[0]["ms_per_token"], 3)
    rows[1]["goal"] = "<= 1.1"
    return rows


def ttft_rows(layers: int, tokens: int, link_gbps: float, reps: int = 3):
    rows = []
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    routing = uniform_routing(tokens, layers, tokens)
    for fmt in (formats.DENSE, formats.FP8):
        host = random_host_pool(layers, fmt=fmt)
        slots = CACHE_BYTES // host.shape.expert_bytes
        runtime = OffloadRuntime(host, slots, "cuda")
        modules = [OffloadedExperts(runtime, l) for l in range(layers)]
        ms = prefill_ms(runtime, modules, x, routing, reps)[0]
        bound = layers * E * host.shape.expert_bytes / (link_gbps * 1e9) * 1e3
        rows.append(dict(format=fmt, layers=layers, tokens=tokens, cache_slots=slots, ms=round(ms, 1),
                         link_bound_ms=round(bound, 1), of_link_bound=round(bound / ms, 3)))
        del runtime, modules, host
        free_memory()
    rows[1]["vs_bf16"] = round(rows[1]["ms"] / rows[0]["ms"], 3)
    rows[1]["goal"] = "<= 0.55"
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--parts", default="capacity,gemm,decode,ttft")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"capacity", "gemm", "decode", "ttft"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from capacity,gemm,decode,ttft")
    hbm, copy_gbps, read_gbps = hbm_floor_gbps()
    link = pinned_copy_gbps(256 << 20)
    print(f"device copy {copy_gbps:.0f} GB/s (read + write), device read {read_gbps:.0f} GB/s (the floor's rate: "
          f"{hbm:.0f}), pinned host->device {link:.1f} GB/s", flush=True)
    rows = []
    # Each part prints its table as soon as it is measured; the large pinned pools of the time to
    # first token go first, while the host has the most free memory.
    if "ttft" in parts:
        rows += (ttft := ttft_rows(args.layers, args.tokens, link))
        print_table(f"time to first token of the MoE stack ({args.layers} layers, 16 GiB cache, empty)", ttft,
                    ["format", "layers", "tokens", "cache_slots", "ms", "link_bound_ms", "of_link_bound", "vs_bf16",
                     "goal"])
    if "capacity" in parts:
        rows += (capacity := capacity_rows())
        print_table("capacity of a 16 GiB cache", capacity, ["format", "expert_MiB", "experts_in_16GiB", "vs_bf16", "goal"])
    if "gemm" in parts:
        rows += (gemm := decode_gemm_rows(hbm))
        print_table("decode expert_gemm, FP8 slots vs the HBM floor of their bytes (graph replay)", gemm,
                    ["tokens", "unique_experts", "fp8_us", "floor_us", "ratio_to_floor", "cublas_gemv_same_bytes_us",
                     "fp8_vs_gemv", "bf16_us", "fp8_vs_bf16",
                     "rel_err_vs_dequantized", "goal", "fp8_rows_us", "fp8_rows_ratio_to_floor"])
    if "decode" in parts:
        rows += (decode := cached_decode_rows())
        print_table("decode through 8 layers, every expert cached, one CUDA graph per step", decode,
                    ["format", "layers", "ms_per_token", "vs_bf16", "goal"])
    write_report("fp8", rows, {"hbm_GBps": round(hbm, 1), "device_copy_GBps": round(copy_gbps, 1),
                               "device_read_GBps": round(read_gbps, 1), "pinned_link_GBps": round(link, 1)})


if __name__ == "__main__":
    main()
