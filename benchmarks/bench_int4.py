"""int4 experts (GPTQ / compressed-tensors W4A16, a float32 scale per 128 values) against bf16 and
block-FP8 on the GPU, Qwen3-30B-A3B layer shape (128 experts, hidden 2048, intermediate 768, top-8),
in one run:
- capacity: experts a 16 GiB cache holds in each format;
- decode GEMM: expert_gemm on int4 slots (dequantized in registers) against the HBM floor of the int4
  bytes it reads, with bf16 and FP8 expert_gemm on the same routing (CUDA-graph replay, 16 routings
  a graph), and the int4 output against bf16 expert_gemm on the same weights dequantized;
- prompt: one layer's 8k-token prompt through the dequantized grouped path (expert_gemm with the
  layer's slot map), int4 against bf16.
Writes int4.json.

    python3 benchmarks/bench_int4.py          # about a minute on an H100 machine"""
import argparse

import torch

import ft_ops
from ft_ops import formats
from ft_ops.slot_pool import ExpertShape
from common import decode_routings, graph_ms_per_call, hbm_floor_gbps, print_table, warm_gpu, write_report
from moe_setup import E, H, I, K

CACHE_BYTES = 16 * 2**30
GROUP = 128  # GPTQ's and llm-compressor's W4A16 default


def expert_bytes(fmt: str) -> int:
    return ExpertShape(1, E, H, I, torch.bfloat16, False, fmt, group=GROUP if fmt == formats.INT4 else 0).expert_bytes


def capacity_rows():
    rows = [dict(format=fmt, expert_MiB=round(expert_bytes(fmt) / 2**20, 3),
                 experts_in_16GiB=CACHE_BYTES // expert_bytes(fmt)) for fmt in (formats.DENSE, formats.FP8, formats.INT4)]
    for r in rows[1:]:
        r["vs_bf16"] = round(r["experts_in_16GiB"] / rows[0]["experts_in_16GiB"], 3)
    return rows


def quantized_banks(slots: int):
    """bf16 banks of `slots` random experts and the same experts in int4 (groups of 128) and block-FP8,
    quantized 256 slots at a time (the quantizers' float32 temporaries of a whole bank would not fit)."""
    w13 = torch.randn(slots, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(slots, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5

    def cat(pieces):
        return torch.cat([q for q, _ in pieces]), torch.cat([s for _, s in pieces])

    int4 = [cat([formats.quantize_int4(w[i:i + 256], GROUP) for i in range(0, slots, 256)]) for w in (w13, w2)]
    fp8 = [cat([formats.quantize_fp8(w[i:i + 256], parts=p) for i in range(0, slots, 256)])
           for w, p in ((w13, 2), (w2, 1))]
    return (w13, w2), int4, fp8


def decode_gemm_rows(hbm_gbps: float):
    torch.manual_seed(0)
    slots = 1024  # the layer's 128 experts scattered over a pool
    (w13, w2), ((q13, s13), (q2, s2)), ((f13, g13), (f2, g2)) = quantized_banks(slots)
    slot_of_expert = torch.randperm(slots, device="cuda")[:E].int()
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
        d13[used] = formats.dequantize_int4(q13[used], s13[used], torch.bfloat16)
        d2[used] = formats.dequantize_int4(q2[used], s2[used], torch.bfloat16)
        want = ft_ops.expert_gemm(x, s, w, d13, d2)
        del d13, d2
        err = float((got.float() - want.float()).norm() / want.float().norm())
        times = {}
        for name, args in (("int4", dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)), ("bf16", dict(w13=w13, w2=w2)),
                           ("fp8", dict(w13=f13, w2=f2, w13_scale=g13, w2_scale=g2))):
            it = iter(range(10 ** 9))

            def one_call():
                xx, ss, ww = inputs[next(it) % calls]
                ft_ops.expert_gemm(xx, ss, ww, **args)

            warm_gpu()
            times[name] = graph_ms_per_call(one_call, calls) * 1000
        floor = unique / calls * expert_bytes(formats.INT4) / (hbm_gbps * 1e9) * 1e6
        rows.append(dict(tokens=tokens, unique_experts=round(unique / calls, 1), int4_us=round(times["int4"], 1),
                         floor_us=round(floor, 1), ratio_to_floor=round(times["int4"] / floor, 2),
                         bf16_us=round(times["bf16"], 1), int4_vs_bf16=round(times["int4"] / times["bf16"], 3),
                         fp8_us=round(times["fp8"], 1), int4_vs_fp8=round(times["int4"] / times["fp8"], 3),
                         rel_err_vs_dequantized=f"{err:.1e}"))
    return rows


def prompt_rows(tokens: int = 8192):
    """One layer's prompt-sized call with the layer's slot map: int4 dequantizes the layer into a
    bf16 scratch bank and runs the grouped GEMM; bf16 runs it on the slots."""
    torch.manual_seed(1)
    (w13, w2), ((q13, s13), (q2, s2)), _ = quantized_banks(E)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)]).int()
    w = torch.full((tokens, K), 1.0 / K, device="cuda")
    layer = torch.arange(E, device="cuda", dtype=torch.int32)
    times = {}
    for name, args in (("int4", dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)), ("bf16", dict(w13=w13, w2=w2))):
        for _ in range(2):
            ft_ops.expert_gemm(x, ids, w, slot_map=layer, **args)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            ft_ops.expert_gemm(x, ids, w, slot_map=layer, **args)
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 5
    return [dict(tokens=tokens, int4_ms=round(times["int4"], 2), bf16_ms=round(times["bf16"], 2),
                 int4_vs_bf16=round(times["int4"] / times["bf16"], 3))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="capacity,gemm,prompt")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"capacity", "gemm", "prompt"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from capacity,gemm,prompt")
    hbm, copy_gbps, read_gbps = hbm_floor_gbps()
    print(f"device read {read_gbps:.0f} GB/s (the floor's rate: {hbm:.0f})", flush=True)
    rows = []
    if "capacity" in parts:
        rows += (capacity := capacity_rows())
        print_table("capacity of a 16 GiB cache", capacity, ["format", "expert_MiB", "experts_in_16GiB", "vs_bf16"])
    if "prompt" in parts:
        rows += (prompt := prompt_rows())
        print_table("one layer's 8k-token prompt, expert_gemm with the layer's map", prompt,
                    ["tokens", "int4_ms", "bf16_ms", "int4_vs_bf16"])
    if "gemm" in parts:
        rows += (gemm := decode_gemm_rows(hbm))
        print_table("decode expert_gemm, int4 slots vs the HBM floor of their bytes (graph replay)", gemm,
                    ["tokens", "unique_experts", "int4_us", "floor_us", "ratio_to_floor", "bf16_us", "int4_vs_bf16",
                     "fp8_us", "int4_vs_fp8", "rel_err_vs_dequantized"])
    write_report("int4", rows, {"hbm_GBps": round(hbm, 1), "device_read_GBps": round(read_gbps, 1)})


if __name__ == "__main__":
    main()
