"""Runs the decode path of expert_gemm eagerly (1 token, top-8 of a Qwen3-30B-A3B layer, bf16,
slots scattered over a 1,024-slot bank) a few times, for a profiler to look at its two kernels:
    ncu --clock-control none -k regex:"gate_up|down_combine" --section SpeedOfLight \
        --section Occupancy --section WarpStateStats python3 benchmarks/probe_decode_gemm.py
"""
import torch

import ft_ops

E, H, I, K, S = 128, 2048, 768, 8, 1024
w13 = torch.randn(S, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
w2 = torch.randn(S, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
weights = torch.full((1, K), 1.0 / K, device="cuda")
for step in range(4):
    slots = torch.randperm(S, device="cuda")[:K].view(1, K).int()
    ft_ops.expert_gemm(x, slots, weights, w13, w2)
torch.cuda.synchronize()
print("probe done")
