"""Prefill through a stack of offloaded Qwen3-30B-A3B-shaped MoE layers (128 experts, hidden 2048,
intermediate 768, top-8, bf16). First a pool of 2E + 25 % of E slots, every layer streamed from an
empty pool, against the link bound (expert bytes over the pinned bandwidth measured in the same
run) and against the serialized single-region mode. Then pools that hold a share of the experts
outside the regions (as decode leaves them): only the missing rows cross the link, so the bound is
(1 - share) x the link bound; the same pool with skip_resident=False (every row over the link) is
the reference. Writes prefill.json."""
import argparse

import torch

import ft_ops
from common import median_ms, pinned_copy_gbps, prefill_ms, print_table, warm_gpu, write_report
from ft_ops.moe import OffloadedExperts, OffloadRuntime
from moe_setup import E, K, random_host_pool, uniform_routing


def time_prefill(runtime, modules, tokens, layers, reps, resident_share=0.0):
    """Median ms of one prefill through the stack; before each, the pool is emptied and (with
    resident_share) that share of every layer's experts admitted outside the regions."""
    x = torch.randn(tokens, runtime.shape.hidden, device="cuda", dtype=torch.bfloat16)
    routing = uniform_routing(tokens, layers, tokens)
    before = (lambda: admit_share(runtime, resident_share)) if resident_share else None
    return prefill_ms(runtime, modules, x, routing, reps, warmup=0, before=before)[0]


def admit_share(runtime, share: float) -> int:
    """Admits the first share x E experts of every layer into slots outside the two regions (as
    decode would have); returns how many are resident."""
    pool, E_ = runtime.pool, runtime.shape.experts
    n = int(share * E_)
    for layer in range(runtime.shape.layers):
        out = ft_ops.dedup_and_admit(*pool.state, layer, torch.arange(n, device="cuda"), 1.0, 0, 2 * E_)
        ft_ops.copy_experts(pool.banks, runtime.host.layer_rows(layer), *out[1:])
    resident = int((pool.slot_of >= 2 * E_).sum())
    assert resident == n * runtime.shape.layers, "the pool must hold the share outside the regions"
    return resident


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
    # Pools holding a share of every layer's experts outside the regions: resident rows are copied
    # within the pool, the rest cross the link. The last pool has more than the grouped GEMM's
    # 1,023 groups (ft_ops.LIMITS["grouped_gemm_max_slots"]); the GEMM reads the region either way.
    resident_rows = []
    for share in (0.25, 0.5, 0.75):
        pool_slots = 2 * E + int(share * E) * layers
        if pool_slots >= layers * E:
            # Such a pool holds every expert: it streams each layer home, not through two regions.
            print(f"[bench_prefill] share {share}: {pool_slots} slots hold all {layers * E} experts, skipped "
                  f"(use more layers, e.g. --layers 10)")
            continue
        for skip in (True, False):
            runtime = OffloadRuntime(host, pool_slots, "cuda", skip_resident=skip)
            mods = [OffloadedExperts(runtime, l) for l in range(layers)]
            t = time_prefill(runtime, mods, 8192, layers, 3, resident_share=share)
            crossing = (1 - int(share * E) / E) if skip else 1.0
            bound = crossing * layers * layer_bytes / link / 1e6
            resident_rows.append(dict(resident_share=share, pool_slots=pool_slots, skip_resident=skip, tokens=8192,
                                      ms=round(t, 1), bound_ms=round(bound, 1),
                                      ms_over_bound=round(t / bound, 3),
                                      link_bound_ms=round(layers * layer_bytes / link / 1e6, 1)))
            del runtime, mods
            torch.cuda.empty_cache()
    write_report("prefill", rows + resident_rows, {"layers": layers, "slots": slots, "pinned_link_GBps": round(link, 1),
                                           "layer_MiB": round(layer_bytes / 2**20)})
    print(f"pinned link {link:.1f} GB/s; {layers} layers of {layer_bytes / 2**20:.0f} MiB; pool of {slots} slots")
    print_table("prefill, every layer streamed (goal: >= 0.93 of the link bound at 8k/16k; exposed/max <= 1.07)", rows,
                ["tokens", "ms", "tokens_per_s", "link_bound_ms", "of_link_bound", "serialized_ms",
                 "speedup_vs_serialized", "layer_transfer_ms", "layer_compute_ms", "exposed_over_max"])
    print_table("prefill at 8k tokens with a share of the experts resident outside the regions (goal: ms_over_bound "
                "<= 1.03 with skip_resident; bound = (1 - share) x link bound; skip_resident=False sends every row)",
                resident_rows, ["resident_share", "pool_slots", "skip_resident", "ms", "bound_ms", "ms_over_bound",
                                "link_bound_ms"])

if __name__ == "__main__":
    main()
