"""Prefill through a stack of offloaded Qwen3-30B-A3B-shaped MoE layers (128 experts, hidden 2048,
intermediate 768, top-8, bf16), pool of 2E + 25 % of E slots, every layer streamed from an empty
pool. Reported against the link bound (expert bytes over the pinned bandwidth measured in the same
run) and against the serialized single-region mode. Writes prefill.json."""
import argparse

import torch

import ft_ops
from common import median_ms, pinned_copy_gbps, print_table, warm_gpu, write_report
from ft_ops.moe import OffloadedExperts, OffloadRuntime
from moe_setup import E, K, random_host_pool, uniform_routing


def run_stack(modules, x, routing):
    for module, (ids, w) in zip(modules, routing):
        x = x + module(x, ids, w)
    return x


def time_prefill(runtime, modules, tokens, layers, reps):
    x = torch.randn(tokens, runtime.shape.hidden, device="cuda", dtype=torch.bfloat16)
    routing = uniform_routing(tokens, layers, tokens)
    times = []
    for _ in range(reps):
        runtime.pool.invalidate()  # every layer crosses the link
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_stack(modules, x, routing)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def compute_only_ms(runtime, tokens):
    """One layer's expert GEMMs on weights already in the pool (region 0)."""
    x = torch.randn(tokens, runtime.shape.hidden, device="cuda", dtype=torch.bfloat16)
    ids, w = uniform_routing(tokens, 1, 99)[0]
    pool = runtime.pool
    return median_ms(lambda: ft_ops.expert_gemm(x, ids.int(), w, pool.w13, pool.w2), iters=10)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    layers = args.layers
    host = random_host_pool(layers)
    layer_bytes = host.nbytes / layers
    link = pinned_copy_gbps(int(layer_bytes))  # GB/s, one layer's size
    slots = 2 * E + E // 4
    double = OffloadRuntime(host, slots, "cuda")
    single = OffloadRuntime(host, E + E // 4, "cuda")
    rows = []
    for tokens in (2048, 8192, 16384):
        mods_d = [OffloadedExperts(double, l) for l in range(layers)]
        mods_s = [OffloadedExperts(single, l) for l in range(layers)]
        assert double.should_stream(tokens, K)
        warm_gpu()
        t_double = time_prefill(double, mods_d, tokens, layers, 3)
        t_single = time_prefill(single, mods_s, tokens, layers, 2)
        compute = compute_only_ms(double, tokens)
        transfer = layer_bytes / link / 1e6  # ms per layer
        link_bound_ms = layers * transfer
        rows.append(dict(
            tokens=tokens, ms=round(t_double, 1), tokens_per_s=round(tokens / t_double * 1e3),
            link_bound_ms=round(link_bound_ms, 1), of_link_bound=round(link_bound_ms / t_double, 3),
            serialized_ms=round(t_single, 1), speedup_vs_serialized=round(t_single / t_double, 2),
            layer_transfer_ms=round(transfer, 2), layer_compute_ms=round(compute, 2),
            exposed_over_max=round(t_double / layers / max(transfer, compute), 3)))
    # A pool larger than the grouped GEMM's group limit (ft_ops.LIMITS["grouped_gemm_max_slots"]) that still streams
    # (it must hold fewer than every expert, so this needs at least 9 layers): layers stream into
    # their regions whole, and the GEMM reads the region.
    big_slots = layers * E - E // 2
    large = []
    if big_slots > 1023:
        big = OffloadRuntime(host, big_slots, "cuda")
        for tokens in (2048, 8192):
            mods = [OffloadedExperts(big, l) for l in range(layers)]
            t_big = time_prefill(big, mods, tokens, layers, 2)
            bound = layers * layer_bytes / link / 1e6
            large.append(dict(pool_slots=big_slots, tokens=tokens, ms=round(t_big, 1), link_bound_ms=round(bound, 1),
                              of_link_bound=round(bound / t_big, 3), skip_resident=big.streamer.skip_resident))
    # The same pool streaming through the skip_resident copy kernel (16 SMs) instead of the copy
    # engine: with the runtime's carveout (the GEMM leaves the copy's SMs free, ft_ops/sm_share.py)
    # and without it (copy_sms forced to 0), against the same link bound.
    kernel_rows = []
    skipping = OffloadRuntime(host, slots, "cuda", skip_resident=True)
    carveout_sms = skipping.streamer.copy_sms
    for tokens in (8192, 16384):
        mods = [OffloadedExperts(skipping, l) for l in range(layers)]
        for sms in (carveout_sms, 0):
            skipping.streamer.copy_sms = sms
            t = time_prefill(skipping, mods, tokens, layers, 2)
            bound = layers * layer_bytes / link / 1e6
            kernel_rows.append(dict(tokens=tokens, gemm_sm_carveout=sms, ms=round(t, 1), link_bound_ms=round(bound, 1),
                                    of_link_bound=round(bound / t, 3)))
    skipping.streamer.copy_sms = carveout_sms
    write_report("prefill", rows + large + kernel_rows, {"layers": layers, "slots": slots, "pinned_link_GBps": round(link, 1),
                                           "layer_MiB": round(layer_bytes / 2**20)})
    print(f"pinned link {link:.1f} GB/s; {layers} layers of {layer_bytes / 2**20:.0f} MiB; pool of {slots} slots")
    print_table("prefill, every layer streamed (goal: >= 0.93 of the link bound at 8k/16k; exposed/max <= 1.07)", rows,
                ["tokens", "ms", "tokens_per_s", "link_bound_ms", "of_link_bound", "serialized_ms",
                 "speedup_vs_serialized", "layer_transfer_ms", "layer_compute_ms", "exposed_over_max"])
    if large:
        print_table(f"prefill with a pool of {big_slots} slots (more than the grouped GEMM's 1,023 groups)", large,
                    ["pool_slots", "tokens", "ms", "link_bound_ms", "of_link_bound", "skip_resident"])
    else:
        print("(the pool of more than 1,023 slots that still streams needs --layers 9 or more)")
    print_table("prefill streamed by the skip_resident copy kernel, GEMM with and without the SM carveout",
                kernel_rows, ["tokens", "gemm_sm_carveout", "ms", "link_bound_ms", "of_link_bound"])


if __name__ == "__main__":
    main()
