"""Command line: `freetoken demo`."""
import argparse
import sys
import time

import torch


def _ops_demo(args) -> int:
    """Runs a few MoE layers of random experts through the freetoken ops (admission, copy plan,
    expert GEMM) with a cache smaller than the model and checks every output against the
    pure-torch reference."""
    import ft_ops
    from ft_ops import reference

    device = args.device
    layers, experts, top_k, hidden, inter = 4, 16, 4, 64, 32
    slots = experts + experts // 2
    gen = torch.Generator().manual_seed(0)
    host13 = torch.randn(layers, experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    host2 = torch.randn(layers, experts, hidden, inter, generator=gen) * inter ** -0.5
    if device == "cuda":
        host13, host2 = host13.pin_memory(), host2.pin_memory()
    state = (torch.full((layers, experts), -1, dtype=torch.int32, device=device),
             torch.full((slots,), -1, dtype=torch.int32, device=device),
             torch.zeros(slots, dtype=torch.int64, device=device),
             torch.zeros(1, dtype=torch.int64, device=device))
    w13 = torch.empty(slots, 2 * inter, hidden, device=device)
    w2 = torch.empty(slots, hidden, inter, device=device)
    worst, copies, t0 = 0.0, 0, time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(2, hidden, generator=gen)
        for layer in range(layers):
            ids = torch.randint(experts, (2, top_k), generator=gen)
            weights = torch.softmax(torch.randn(2, top_k, generator=gen), -1)
            slot_ids, plan_e, plan_s, n = ft_ops.dedup_and_admit(*state, layer, ids.to(device))
            ft_ops.copy_experts([w13, w2], [host13[layer], host2[layer]], plan_e, plan_s, n)
            copies += int(n)
            y = ft_ops.expert_gemm(x.to(device), slot_ids, weights.to(device), w13, w2)
            want = reference.expert_gemm(x, ids, weights, host13[layer], host2[layer])
            worst = max(worst, float((y.double().cpu() - want).norm() / want.norm()))
            x = x + y.cpu()
    elapsed = time.perf_counter() - t0
    print(f"{'layers':>8} {'experts':>8} {'slots':>6} {'steps':>6} {'copies':>7} {'max rel err':>12} {'time':>8}")
    print(f"{layers:>8} {experts:>8} {slots:>6} {args.steps:>6} {copies:>7} {worst:>12.2e} {elapsed:>7.2f}s")
    ok = worst < 1e-4
    print("outputs match the reference" if ok else "MISMATCH against the reference")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="freetoken")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run MoE layers through the offloaded-expert ops and check them")
    demo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    demo.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _ops_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
