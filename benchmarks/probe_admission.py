"""Runs dedup_and_admit eagerly from a fixed pool state (S=4096, E=128, top-8 of one token, every
expert missing), for a profiler to time the kernel alone:
    ncu --clock-control none -k regex:dedup_and_admit --metrics gpu__time_duration.sum python3 benchmarks/probe_admission.py
"""
import torch

import ft_ops

E, S, LAYERS = 128, 4096, 8
state = (torch.full((LAYERS, E), -1, dtype=torch.int32, device="cuda"),
         torch.full((S,), -1, dtype=torch.int32, device="cuda"),
         torch.randint(1, 1000, (S,), dtype=torch.int64, device="cuda"),
         torch.full((1,), 1000, dtype=torch.int64, device="cuda"))
snapshot = [t.clone() for t in state]
for misses in (0, 2, 8):
    ids = torch.randperm(E, device="cuda")[:8]
    for layer in range(LAYERS):
        for t, s in zip(state, snapshot):
            t.copy_(s)
        if misses < 8:  # make 8 - misses of them resident first
            ft_ops.dedup_and_admit(*state, layer, ids[: 8 - misses])
        ft_ops.dedup_and_admit(*state, layer, ids)
torch.cuda.synchronize()
print("probe done")
