"""One decode admission call per eviction policy and pool, for Nsight Compute: the pool of
bench_slot_cache.py's admission rows (4,096 slots, K 8, a quarter of the call's experts missing;
mostly free slots) and the same pool filled (victims among owned slots, by the policy's keys), each
call run a few times untimed (state restored after each), then once between cudaProfilerStart and
cudaProfilerStop, so `ncu --profile-from-start off` reads exactly one call per policy and pool. The gpu_check.sh step ncu-admission runs it under ncu (warp stall reasons and the source
counters: where hit density's extra time over LRU goes) and writes the report to $OUT."""
import argparse

import torch

import ft_ops
from bench_slot_cache import aged_pool
from ft_ops.policies import POLICIES


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=4096)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--miss-share", type=float, default=0.25)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_admission.py runs the CUDA admission kernels: run it on a machine with a GPU")
    cudart = torch.cuda.cudart()
    for (name, policy), fill in ((p, f) for f in (False, True) for p in POLICIES.items()):
        state, policy_state, routing = aged_pool(args.slots, args.k, args.miss_share, policy, fill)
        mutated = [*state, *([policy_state] if policy_state is not None else [])]
        snapshot = [t.clone() for t in mutated]
        layer = len(routing) - 1

        def call():
            out = ft_ops.dedup_and_admit(*state, layer, routing[layer], policy=policy, policy_state=policy_state)
            for t, s in zip(mutated, snapshot):
                t.copy_(s)
            return out

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"{name}{' full' if fill else ''}")
        cudart.cudaProfilerStart()
        ft_ops.dedup_and_admit(*state, layer, routing[layer], policy=policy, policy_state=policy_state)
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        torch.cuda.nvtx.range_pop()
        print(f"[ncu_admission] profiled one {name} call ({args.slots} slots, K {args.k}, "
              f"{'a full pool' if fill else 'mostly free slots'})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
