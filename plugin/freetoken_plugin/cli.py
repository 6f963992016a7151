"""Command line: `freetoken demo`."""
import argparse
import sys
import time

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _demo(args) -> int:
    """A stack of MoE layers with random experts, offloaded to a (pinned) host pool with a device
    cache smaller than the model: a prompt is streamed layer by layer, then tokens are decoded with
    on-device admission. Every layer's output is checked against the same layers with every expert
    resident, and a table of times, hit rate and link traffic is printed."""
    import ft_ops  # noqa: F401
    from ft_ops.moe import OffloadedExperts, OffloadRuntime
    from ft_ops.slot_pool import HostPool

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layers, experts, top_k, hidden, inter = args.layers, args.experts, 4, args.hidden, args.hidden // 2
    gen = torch.Generator().manual_seed(0)
    w13 = (torch.randn(layers, experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(layers, experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    if device == "cuda":
        w13, w2 = w13.pin_memory(), w2.pin_memory()
    host = HostPool(w13, w2)
    slots = 2 * experts + experts // 2  # two streaming regions and a little cache for decode
    runtime = OffloadRuntime(host, slots, device)
    modules = [OffloadedExperts(runtime, l) for l in range(layers)]

    def route(tokens):
        logits = torch.randn(tokens, experts, generator=gen)
        logits[:, : experts // 8] += 1.5  # a few popular experts, as real routers have
        w, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        return ids, (w / w.sum(-1, keepdim=True))

    worst = 0.0

    def run(tokens):
        nonlocal worst
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        for layer, module in enumerate(modules):
            ids, w = route(tokens)
            y = module(x.to(device), ids.to(device), w.to(device))
            want = ft_ops.expert_gemm(x.float(), ids, w, host.w13[layer].float(), host.w2[layer].float())
            worst = max(worst, float((y.float().cpu() - want).norm() / want.norm()))
            x = (x.float() + y.float().cpu()).to(dtype)

    run(args.prompt_tokens)  # warm-up: kernels, allocator
    runtime.pool.invalidate()
    runtime.pool.stats.zero_()
    _sync(device)
    t0 = time.perf_counter()
    run(args.prompt_tokens)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.decode_tokens):
        run(1)
    _sync(device)
    decode_s = time.perf_counter() - t0
    stats = runtime.stats()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"\nfreetoken demo on {device}: {layers} MoE layers x {experts} experts (hidden {hidden}, "
          f"top-{top_k}, {dtype}), host pool {host.nbytes / 2**20:.1f} MiB, device cache {slots} slots "
          f"({runtime.pool.nbytes / 2**20:.1f} MiB)")
    print("(times include the reference computation of every layer)")
    rows = [
        ("prompt", f"{args.prompt_tokens} tokens", f"{prefill_s * 1e3:.1f} ms",
         f"{stats['prefill']['copied_rows']} rows", f"{stats['prefill']['bytes_over_link'] / 2**20:.1f} MiB", "streamed"),
        ("decode", f"{args.decode_tokens} tokens", f"{decode_s / args.decode_tokens * 1e3:.1f} ms/token",
         f"{stats['decode']['copied_rows']} rows", f"{stats['decode']['bytes_over_link'] / 2**20:.1f} MiB",
         f"hit rate {stats['decode']['hit_rate']:.2f}"),
    ]
    print(f"{'phase':<8}{'work':>12}{'time':>16}{'copied':>12}{'over link':>12}  note")
    for r in rows:
        print(f"{r[0]:<8}{r[1]:>12}{r[2]:>16}{r[3]:>12}{r[4]:>12}  {r[5]}")
    ok = worst < tol
    print(f"max relative error against the all-resident layers: {worst:.1e} "
          f"({'match' if ok else 'MISMATCH'}, tolerance {tol:g})")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="freetoken")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offload a stack of random MoE layers and check it against the resident stack")
    demo.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    demo.add_argument("--layers", type=int, default=6)
    demo.add_argument("--experts", type=int, default=32)
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--prompt-tokens", type=int, default=256)
    demo.add_argument("--decode-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
