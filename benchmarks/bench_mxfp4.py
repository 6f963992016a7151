"""MXFP4 experts on the GPU at GPT-OSS-120B's shape (36 layers, 128 experts, hidden 2880,
intermediate 2880, top-4, biases), in one run:
- host memory: the whole model's experts in an MXFP4 pinned host pool (random bytes, one layer
  generated and copied to the others), peak resident memory of the process against the MXFP4 bytes;
- time to first token of the MoE stack: an 8k-token prompt streamed from an empty 16 GiB cache,
  against the link bound of the MXFP4 bytes (bytes / pinned rate of this run);
- decode GEMM: expert_gemm on MXFP4 slots (dequantized in registers) against the HBM floor of the
  bytes it reads, and bf16 expert_gemm on the same routing (CUDA-graph replay, 16 routings per graph);
- decode with misses: routing drawn from the synthetic model calibrated to the recorded fixture,
  replayed through the runtime with the 16 GiB cache's share of the experts (28 % of them, at any
  layer count), one CUDA graph per token (as compiled decode runs), against the same replay in a
  pool that every expert fits (it starts empty too: the same compulsory misses, no evictions).
`--shape deepseek-v4-flash` runs the decode GEMM rows at DeepSeek-V4-Flash's expert shape instead
(256 experts, hidden 4096, intermediate 2048, top-6, no biases, silu clamped at 10; its FP4
experts are MXFP4's bytes). Writes mxfp4.json (mxfp4_deepseek-v4-flash.json)."""
import argparse
import gc
import os
import resource

import torch

import ft_ops
from ft_ops import formats
from ft_ops.activations import SWIGLUOAI, Activation
from ft_ops.moe import OffloadedExperts, OffloadRuntime
from ft_ops.replay import replay
from ft_ops.slot_pool import ExpertShape, HostPool
from ft_ops.synthetic_routing import calibrate
from ft_ops.traces import Trace
from common import decode_routings, hbm_floor_gbps, gemv_reference_us, graph_ms_per_call, pinned_copy_gbps, prefill_ms, print_table, warm_gpu, write_report

L, E, H, I, K = 36, 128, 2880, 2880, 4
# The decode GEMM's shapes: (experts, hidden, intermediate, top-k, biases, expert function).
GEMM_SHAPES = {"gpt-oss-120b": (E, H, I, K, True, SWIGLUOAI),
               "deepseek-v4-flash": (256, 4096, 2048, 6, False, Activation("silu", limit=10.0))}
CACHE_BYTES = 16 * 2**30
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "routing",
                       "byte_qwen3moe_8x32_top4.safetensors")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def random_mxfp4(rows: int, cols: int, n: int, gen: torch.Generator, device="cuda"):
    """n experts' rows of random e2m1 codes with scales 2^-9..2^-5 (|w| up to 0.19)."""
    blocks = torch.randint(0, 256, (n, rows, cols // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = torch.randint(118, 123, (n, rows, cols // 32), dtype=torch.uint8, device=device, generator=gen)
    return blocks, scales


def mxfp4_host_pool(layers: int, device="cuda", experts: int = E, hidden: int = H, inter: int = I) -> HostPool:
    """Random MXFP4 experts (GPT-OSS-120B's shape by default) in a host pool, pinned for a GPU: one
    layer drawn on `device` (biases N(0, 0.1)), copied to every layer."""
    device = torch.device(device)
    shape = ExpertShape(layers, experts, hidden, inter, torch.bfloat16, True, formats.MXFP4)
    host = HostPool.allocate(shape, pin=device.type == "cuda", progress=True)
    gen = torch.Generator(device=device).manual_seed(0)
    (q13, s13), (q2, s2) = random_mxfp4(2 * inter, hidden, experts, gen, device), random_mxfp4(hidden, inter, experts, gen, device)
    b13 = torch.randn(experts, 2 * inter, device=device, generator=gen).to(torch.bfloat16) * 0.1
    b2 = torch.randn(experts, hidden, device=device, generator=gen).to(torch.bfloat16) * 0.1
    for bank, layer0 in ((host.w13, q13), (host.w13_scale, s13), (host.w2, q2), (host.w2_scale, s2), (host.b13, b13),
                         (host.b2, b2)):
        bank[0].copy_(layer0)
        for layer in range(1, layers):
            bank[layer].copy_(bank[0])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host


def host_memory_rows(host: HostPool, rss_before: int):
    peak = peak_rss_bytes()
    bf16 = ExpertShape(L, E, H, I, torch.bfloat16, True, formats.DENSE).expert_bytes * L * E
    return [dict(layers=host.shape.layers, mxfp4_GB=round(host.nbytes / 1e9, 2), bf16_GB=round(bf16 / 1e9, 1),
                 peak_rss_GB=round(peak / 1e9, 2), rss_before_pool_GB=round(rss_before / 1e9, 2),
                 peak_vs_mxfp4=round(peak / host.nbytes, 3), goal="<= 1.2")]


def ttft_rows(host: HostPool, tokens: int, link_gbps: float, reps: int = 3):
    layers = host.shape.layers
    slots = CACHE_BYTES // host.shape.expert_bytes
    runtime = OffloadRuntime(host, slots, "cuda", activation=SWIGLUOAI)
    modules = [OffloadedExperts(runtime, l) for l in range(layers)]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
    routing = []
    for _ in range(layers):
        w, ids = torch.softmax(torch.randn(tokens, E, device="cuda", generator=g), -1).topk(K, dim=-1)
        routing.append((ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms, h = prefill_ms(runtime, modules, x, routing, reps)
    # GPU memory the prompts took beyond the pool, the routing and the input: the dequantized scratch
    # (a window of LIMITS["dequantize_window_bytes"]) and the activations of 8k tokens.
    beyond_pool = torch.cuda.max_memory_allocated() - before
    dequantized_layer = E * ExpertShape(1, E, H, I, torch.bfloat16, True, formats.DENSE).expert_bytes
    bound = layers * E * host.shape.expert_bytes / (link_gbps * 1e9) * 1e3
    finite = bool(torch.isfinite(h).all())
    del runtime, modules
    free_memory()
    return [dict(layers=layers, tokens=tokens, cache_slots=slots, ms=round(ms, 1), link_bound_ms=round(bound, 1),
                 ms_vs_link_bound=round(ms / bound, 3), finite_output=finite,
                 gpu_GB_beyond_pool=round(beyond_pool / 1e9, 2), layer_in_bf16_GB=round(dequantized_layer / 1e9, 2),
                 goal="<= 1.1")]


def decode_gemm_rows(hbm_gbps: float, shape: str = "gpt-oss-120b", slots: int = 256):
    E, H, I, K, bias, act = GEMM_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(1)
    (q13, s13), (q2, s2) = random_mxfp4(2 * I, H, slots, gen), random_mxfp4(H, I, slots, gen)
    b13 = (torch.randn(slots, 2 * I, device="cuda", generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    b2 = (torch.randn(slots, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    all_slots = torch.arange(slots, device="cuda")
    w13 = ft_ops.dequantize_experts(q13, s13, all_slots, 2, torch.bfloat16)  # the same weights in bf16
    w2 = ft_ops.dequantize_experts(q2, s2, all_slots, 1, torch.bfloat16)
    slot_of_expert = torch.randperm(slots, device="cuda", generator=gen)[:E].int()
    expert_bytes = ExpertShape(1, E, H, I, torch.bfloat16, bias, formats.MXFP4).expert_bytes
    rows = []
    for tokens in (1, 4, 16):
        calls, inputs, unique = 16, [], 0
        for w, ids in decode_routings(calls, tokens, E, K, gen):
            inputs.append((torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen),
                           slot_of_expert[ids], w.float()))
            unique += ids.unique().numel()
        x, s, w = inputs[0]
        got = ft_ops.expert_gemm(x, s, w, q13, q2, b13, b2, act, s13, s2)
        want = ft_ops.expert_gemm(x, s, w, w13, w2, b13, b2, act)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        times = {}
        for name, weights in (("mxfp4", (q13, q2, b13, b2, act, s13, s2)), ("bf16", (w13, w2, b13, b2, act))):
            it = iter(range(10 ** 9))

            def one_call():
                xx, ss, ww = inputs[next(it) % calls]
                ft_ops.expert_gemm(xx, ss, ww, *weights)

            warm_gpu()
            times[name] = graph_ms_per_call(one_call, calls) * 1000
        floor = unique / calls * expert_bytes / (hbm_gbps * 1e9) * 1e6
        # The peer: cuBLAS bf16 GEMVs reading the MXFP4 call's bytes (blocks and scales), gate_up's
        # then down's.
        experts = round(unique / calls)
        w13_bytes = q13[0].numel() + s13[0].numel()
        w2_bytes = q2[0].numel() + s2[0].numel()
        gemv = gemv_reference_us([(experts * w13_bytes // (2 * H), H), (experts * w2_bytes // (2 * I), I)])
        rows.append(dict(shape=shape, tokens=tokens, unique_experts=round(unique / calls, 1), mxfp4_us=round(times["mxfp4"], 1),
                         floor_us=round(floor, 1), ratio_to_floor=round(times["mxfp4"] / floor, 2),
                         cublas_gemv_same_bytes_us=round(gemv, 1), mxfp4_vs_gemv=round(times["mxfp4"] / gemv, 2),
                         bf16_us=round(times["bf16"], 1), mxfp4_vs_bf16=round(times["mxfp4"] / times["bf16"], 3),
                         rel_err_vs_bf16_of_same_weights=f"{err:.1e}", goal="<= 1.5 at 1 token"))
    del q13, q2, w13, w2
    free_memory()
    return rows


def decode_rows(host: HostPool, tokens: int):
    model, info = calibrate(Trace.load(FIXTURE))
    trace = model.trace(host.shape.layers, E, K, tokens=tokens, seed=3, hidden=H, intermediate=I)
    rows = []
    # The 16 GiB cache's share of the whole model's experts (28 %), also when fewer layers run; the
    # reference holds every expert: its first prompt streams every layer home, so decode only hits.
    share_bytes = CACHE_BYTES * host.shape.layers / L
    for name, slots in ((f"{share_bytes / 2**30:.1f} GiB cache (16 GiB at {L} layers)",
                         int(share_bytes // host.shape.expert_bytes)),
                        ("every expert fits", host.shape.layers * E)):
        row = replay(trace, slots, device="cuda", host=host, dtype=torch.bfloat16, rates=None)
        rows.append(dict(cache=name, slots=slots, hit_rate=row["hit_rate"],
                         MB_over_link_per_token=row["MB_over_link_per_token"], ms_per_token=row["ms_per_token"],
                         tokens_per_s=round(1e3 / row["ms_per_token"], 1), cuda_graph=row["cuda_graph"]))
        free_memory()
    rows[0]["vs_all_fit"] = round(rows[0]["ms_per_token"] / rows[1]["ms_per_token"], 3)
    rows[0]["routing"] = f"repeat {model.repeat:.3f}, zipf {model.zipf:.3f}"
    return rows


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=L)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--parts", default="ttft,gemm,decode")
    parser.add_argument("--shape", default="gpt-oss-120b", choices=sorted(GEMM_SHAPES),
                        help="the decode GEMM's expert shape (another than GPT-OSS-120B's runs that part alone)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"ttft", "gemm", "decode"}
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from ttft,gemm,decode")
    if args.shape != "gpt-oss-120b" and parts != {"gemm"}:
        parser.error(f"--shape {args.shape} measures the decode GEMM alone: add --parts gemm")
    hbm, copy_gbps, read_gbps = hbm_floor_gbps()
    link = pinned_copy_gbps(256 << 20)
    print(f"device copy {copy_gbps:.0f} GB/s (read + write), device read {read_gbps:.0f} GB/s (the floor's rate: "
          f"{hbm:.0f}), pinned host->device {link:.1f} GB/s", flush=True)
    rows = []
    if args.shape == "gpt-oss-120b":
        rss_before = peak_rss_bytes()
        host = mxfp4_host_pool(args.layers)
        rows = host_memory_rows(host, rss_before)
        print_table("MXFP4 host pool (GPT-OSS-120B experts)", rows,
                    ["layers", "mxfp4_GB", "bf16_GB", "peak_rss_GB", "rss_before_pool_GB", "peak_vs_mxfp4", "goal"])
    if "ttft" in parts:
        rows += (ttft := ttft_rows(host, args.tokens, link))
        print_table("time to first token of the MoE stack (16 GiB cache, empty)", ttft,
                    ["layers", "tokens", "cache_slots", "ms", "link_bound_ms", "ms_vs_link_bound", "finite_output",
                     "gpu_GB_beyond_pool", "layer_in_bf16_GB", "goal"])
    if "decode" in parts:
        rows += (decode := decode_rows(host, args.decode_tokens))
        print_table("decode with calibrated routing, one CUDA graph per token", decode,
                    ["cache", "slots", "hit_rate", "MB_over_link_per_token", "ms_per_token", "tokens_per_s",
                     "vs_all_fit", "routing"])
    if args.shape == "gpt-oss-120b":
        del host
        free_memory()
    if "gemm" in parts:
        rows += (gemm := decode_gemm_rows(hbm, args.shape))
        print_table(f"decode expert_gemm ({args.shape}), MXFP4 slots vs the HBM floor of their bytes (graph replay)",
                    gemm, ["tokens", "unique_experts", "mxfp4_us", "floor_us", "ratio_to_floor",
                           "cublas_gemv_same_bytes_us", "mxfp4_vs_gemv", "bf16_us", "mxfp4_vs_bf16",
                           "rel_err_vs_bf16_of_same_weights", "goal"])
    name = "mxfp4" if args.shape == "gpt-oss-120b" else f"mxfp4_{args.shape}"
    write_report(name, rows, {"hbm_GBps": round(hbm, 1), "device_copy_GBps": round(copy_gbps, 1),
                              "device_read_GBps": round(read_gbps, 1), "pinned_link_GBps": round(link, 1)})


if __name__ == "__main__":
    main()
