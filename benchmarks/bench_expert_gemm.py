"""expert_gemm on the H200: prefill (grouped path) against a torch._grouped_mm pipeline on
resident weights, decode (in-place path) against the HBM floor, and the CPU path against the
host's memory-read bandwidth. Qwen3-30B-A3B layer shape, bf16, a 4,096-slot pool with the layer's
experts scattered over it. Writes expert_gemm.json."""
import argparse
import time

import torch
import torch.nn.functional as F

import ft_ops
from common import bf16_matmul_tflops, decode_routings, hbm_floor_gbps, graph_ms_per_call, median_ms, print_table, warm_gpu, write_report

E, H, I, K = 128, 2048, 768, 8
SLOTS = 4096


def build_pool(slots=SLOTS):
    torch.manual_seed(0)
    w13 = torch.empty(slots, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(slots, H, I, dtype=torch.bfloat16, device="cuda")
    slot_of_expert = torch.randperm(slots, device="cuda")[:E].int()
    r13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device="cuda") * H ** -0.5
    r2 = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") * I ** -0.5
    w13[slot_of_expert.long()] = r13
    w2[slot_of_expert.long()] = r2
    return w13, w2, slot_of_expert, r13, r2


def routing(tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, E, device="cuda", generator=g)
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def reference_pipeline(x, ids, weights, r13, r2):
    """What a user would write with torch._grouped_mm on resident [E, ...] weights."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device="cuda").scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    token = order // K
    xs = x.index_select(0, token)
    h = torch._grouped_mm(xs, r13.transpose(1, 2), offs=offs)
    a = F.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(a, r2.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def prefill_rows(w13, w2, slot_of_expert, r13, r2, peak, tokens_list=(2048, 8192, 16384)):
    rows = []
    slots = w13.shape[0]
    for tokens in tokens_list:
        x = torch.randn(tokens, H, dtype=torch.bfloat16, device="cuda")
        ids, weights = routing(tokens, tokens)
        slot_ids = slot_of_expert[ids]
        ours_out = ft_ops.expert_gemm(x, slot_ids, weights, w13, w2)
        ref_out = reference_pipeline(x, ids, weights, r13, r2)
        err = float((ours_out.float() - ref_out.float()).norm() / ref_out.float().norm())
        warm_gpu()
        ours = median_ms(lambda: ft_ops.expert_gemm(x, slot_ids, weights, w13, w2))
        ref = median_ms(lambda: reference_pipeline(x, ids, weights, r13, r2))
        flops = 6 * tokens * K * H * I
        rows.append(dict(pool_slots=slots, tokens=tokens, ours_ms=round(ours, 3), ref_ms=round(ref, 3),
                         speedup=round(ref / ours, 3), ours_TFLOPs=round(flops / ours / 1e9, 1),
                         ref_TFLOPs=round(flops / ref / 1e9, 1), peak_TFLOPs=round(peak, 1),
                         rel_err_vs_ref=f"{err:.1e}", goal="speedup >= 1.0"))
    return rows




def decode_rows(w13, w2, slot_of_expert, hbm_gbps):
    rows = []
    expert_bytes = (2 * I * H + H * I) * 2
    for tokens in (1, 4, 16):
        calls = 16  # per graph, each routed (1 or 4 tokens) to none of the previous call's experts
        inputs = []
        unique = 0
        g = torch.Generator(device="cuda").manual_seed(1000 * tokens)
        for w, ids in decode_routings(calls, tokens, E, K, g):
            x = torch.randn(tokens, H, dtype=torch.bfloat16, device="cuda")
            inputs.append((x, slot_of_expert[ids], (w / w.sum(-1, keepdim=True)).float()))
            unique += ids.unique().numel()
        it = iter(range(10 ** 9))

        def one_call():
            x, s, w = inputs[next(it) % calls]
            ft_ops.expert_gemm(x, s, w, w13, w2)

        warm_gpu()
        ms = graph_ms_per_call(one_call, calls)
        floor_us = unique / calls * expert_bytes / (hbm_gbps * 1e9) * 1e6
        # The naive decode: gather the selected weights, then einsum.
        x, s, w = inputs[0]
        naive = median_ms(lambda: torch.einsum(
            "tkh,tk->th",
            torch.einsum("tki,tkhi->tkh",
                         (lambda h: F.silu(h[..., :I]) * h[..., I:])(torch.einsum("th,tkoh->tko", x, w13[s.long()])),
                         w2[s.long()]), w.to(x.dtype)))
        rows.append(dict(tokens=tokens, unique_experts=round(unique / calls, 1), ours_us=round(ms * 1000, 1),
                         floor_us=round(floor_us, 1), ratio_to_floor=round(ms * 1000 / floor_us, 2),
                         naive_gather_us=round(naive * 1000, 1), 
                         goal="<= 1.5 at 1 token"))
    return rows


def cpu_rows():
    threads = torch.get_num_threads()
    host13 = torch.randn(E, 2 * I, H).to(torch.bfloat16)
    host2 = torch.randn(E, H, I).to(torch.bfloat16)
    big = torch.ones(1 << 28)  # 1 GiB of float32
    big.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        big.sum()
    read_gbps = 5 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
    expert_bytes = (2 * I * H + H * I) * 2
    rows = []
    for experts in (1, 4, 16):
        for tokens in (1, 4, 16):
            top_k = min(experts, K)
            # Each repetition routes to other experts (the layer is 1.2 GB), so the weights come
            # from memory, not from a cache that the previous repetition filled.
            calls = []
            for r in range(E // experts):
                chosen = torch.arange(r * experts, (r + 1) * experts)
                ids = torch.stack([chosen[torch.randperm(experts)[:top_k]] for _ in range(tokens)])
                calls.append((torch.randn(tokens, H).to(torch.bfloat16), ids, torch.rand(tokens, top_k)))
            used = sum(c[1].unique().numel() for c in calls) / len(calls)
            ft_ops.expert_gemm(calls[0][0], calls[0][1], calls[0][2], host13, host2)
            t0 = time.perf_counter()
            for x, ids, w in calls:
                ft_ops.expert_gemm(x, ids, w, host13, host2)
            sec = (time.perf_counter() - t0) / len(calls)
            gbps = used * expert_bytes / sec / 1e9
            rows.append(dict(tokens=tokens, experts=round(used, 1), ms=round(sec * 1000, 2), weight_GBps=round(gbps, 1),
                             memory_read_GBps=round(read_gbps, 1), ratio=round(gbps / read_gbps, 3)))
    return rows, threads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--decode-only", action="store_true", help="only the decode rows (no JSON written)")
    args = parser.parse_args()
    hbm, copy_gbps, read_gbps = hbm_floor_gbps()
    print(f"device copy {copy_gbps:.0f} GB/s (read + write), device read {read_gbps:.0f} GB/s (the floor's rate: {hbm:.0f})",
          flush=True)
    if args.decode_only:
        w13, w2, slot_of_expert, _, _ = build_pool(SLOTS)
        print_table("decode: expert_gemm vs HBM floor (graph replay)",
                    decode_rows(w13, w2, slot_of_expert, hbm),
                    ["tokens", "unique_experts", "ours_us", "floor_us", "ratio_to_floor", "gate_up_kernel"])
        return
    peak = bf16_matmul_tflops()
    w13, w2, slot_of_expert, r13, r2 = build_pool(1000)
    prefill = prefill_rows(w13, w2, slot_of_expert, r13, r2, peak)
    del w13, w2, r13, r2
    torch.cuda.empty_cache()
    w13, w2, slot_of_expert, r13, r2 = build_pool(SLOTS)
    prefill += prefill_rows(w13, w2, slot_of_expert, r13, r2, peak)
    decode = decode_rows(w13, w2, slot_of_expert, hbm)
    del w13, w2, r13, r2
    torch.cuda.empty_cache()
    cpu, threads = ([], 0) if args.skip_cpu else cpu_rows()
    write_report("expert_gemm", prefill + decode + cpu,
                 {"bf16_matmul_TFLOPs": round(peak, 1), "hbm_GBps": round(hbm, 1), "device_copy_GBps": round(copy_gbps, 1),
                  "device_read_GBps": round(read_gbps, 1), "cpu_threads": threads})
    print(f"measured ceilings: bf16 8192^3 matmul {peak:.0f} TFLOP/s, HBM floor rate {hbm:.0f} GB/s (the faster of a device copy and a read)")
    print_table("prefill: expert_gemm (experts scattered over the pool) vs torch._grouped_mm pipeline (resident)", prefill,
                ["pool_slots", "tokens", "ours_ms", "ref_ms", "speedup", "ours_TFLOPs", "ref_TFLOPs", "peak_TFLOPs", "rel_err_vs_ref"])
    print_table("decode: expert_gemm vs HBM floor (graph replay)", decode,
                ["tokens", "unique_experts", "ours_us", "floor_us", "ratio_to_floor", "naive_gather_us", "gate_up_kernel"])
    if cpu:
        print_table(f"CPU path ({threads} threads), bf16 host layer", cpu,
                    ["tokens", "experts", "ms", "weight_GBps", "memory_read_GBps", "ratio"])


if __name__ == "__main__":
    main()
