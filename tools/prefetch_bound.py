"""How much of decode's miss traffic a prefetcher could hide, at best (issue 20's goal of offloaded
compiled decode within 1.15x of resident at >= 85 % hits).

A model, not a measurement: the misses of each (token, layer) come from replaying routing through
the eviction policy offline (ft_ops/eviction.py, the runtime's rules), and the time of a token
from a timeline of two resources calibrated to a measured run: the GPU, which runs each layer as
an attention part `a` and an experts part `g` (the GEMM, which waits for the layer's missing
experts), and the link, which copies one expert in `x` and serves copies in the order they are
asked for. Without prefetch, a layer's misses are asked for when its routing is known (the start
of its experts part) and the GEMM waits for them. A prefetcher asks for layer l's experts at the
start of layer l - 1's experts part (pre-gating: the next layer's router on the hidden state that
enters layer l - 1's experts), so their copies overlap layer l - 1's GEMM and layer l's attention;
a layer's unpredicted misses are asked for at its own routing, behind whatever the link has queued.
Layer 0 of a token is never predicted (its routing depends on the token). Rules:
  none        every miss on demand (what the runtime does)
  oracle      every miss of layers 1.. predicted (an unlimited, perfect prefetcher)
  oracle, B   at most B of a layer's misses predicted (a perfect prefetcher of B experts a layer)
  oracle, d layers ahead   every miss of layers d.. predicted at layer l - d (its copies may
              start d layers early: how much the link's bursts cost)
  recall r    each miss of layers 1.. predicted with probability r, independently (a predictor
              that catches that share of the misses: tools/pregate_prediction.py measures it)
Wrong guesses cost nothing here (an idle link, no evictions), so every row is a lower bound for
a real prefetcher of that recall.

The layer time c = a + g is calibrated so that `none` reproduces the measured time of a token:
c = (token time - misses a token x x) / layers.

    python tools/prefetch_bound.py --token-ms 12.77 --resident-ms 7.66 --slots 1820
"""
import argparse
import json
import os
import random
import sys
from typing import Dict, List, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ft_ops import eviction  # noqa: E402
from ft_ops.synthetic_routing import calibrate  # noqa: E402
from ft_ops.traces import Trace  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "routing", "byte_qwen3moe_8x32_top4.safetensors")


def misses_per_call(trace: Trace, slots: int, policy: str = "Duel") -> List[List[int]]:
    """[token][layer] misses of the trace's decode calls (every sequence, in order) through a cache
    of `slots` under the named policy of ft_ops.eviction."""
    requests = eviction.requests_from_trace(trace)
    chosen = [p for p in eviction.policies() if p.name == policy]
    if not chosen:
        raise ValueError(f"unknown policy {policy!r}; choose from {[p.name for p in eviction.policies()]}")
    flat: List[int] = []
    eviction.simulate(chosen[0], requests, slots, observe=lambda ci, chunk, slot_ids, plan, owner: flat.append(len(plan)))
    L = trace.layers
    return [flat[i:i + L] for i in range(0, len(flat), L)]


def token_times(misses: Sequence[Sequence[int]], a: float, g: float, x: float, predicted,
                ahead: int = 1) -> List[float]:
    """Each token's time on the timeline of the module docstring. `predicted(t, l, m)`: how many of
    the m misses of (token t, layer l) the prefetcher asks for `ahead` layers early (at the start
    of layer l - ahead's experts part; never for layers l < ahead, whose routing depends on the
    token)."""
    now = 0.0         # the GPU: when the current layer starts
    link_free = 0.0   # the link: when it finishes what it was asked for
    out = []
    for t, row in enumerate(misses):
        start = now
        L = len(row)
        done_ahead = {}  # layer -> when its prefetched copies are done
        for l, m in enumerate(row):
            moe = now + a                                        # routing known: the experts part starts
            p = min(m, predicted(t, l, m)) if l >= ahead else 0  # asked for at layer l - ahead
            ready = done_ahead.get(l, moe) if p > 0 else moe
            if m - p > 0:                                        # the rest on demand, behind the queue
                link_free = max(link_free, moe) + (m - p) * x
                ready = max(ready, link_free)
            # Layer l + ahead's predicted misses are asked for now, behind this layer's copies.
            target = l + ahead
            if target < L:
                m_next = row[target]
                p_next = min(m_next, predicted(t, target, m_next))
                if p_next > 0:
                    link_free = max(link_free, moe) + p_next * x
                    done_ahead[target] = link_free
            now = max(moe, ready) + g
        out.append(now - start)
    return out


def bound_rows(misses, token_ms: float, resident_ms: float, x_us: float, g_us: float,
               budgets=(1, 2), aheads=(2, 4), recalls=(0.3, 0.54, 0.8), recalls_two_ahead=(0.54, 0.8),
               seed: int = 0) -> Dict:
    L = len(misses[0])
    per_token = sum(map(sum, misses)) / len(misses)
    c = (token_ms * 1000.0 - per_token * x_us) / L
    if c <= g_us:
        raise ValueError(f"the calibrated layer time {c:.1f} us is not above the GEMM part {g_us} us: the measured "
                         f"token time ({token_ms} ms) is below its misses' copies ({per_token:.1f} x {x_us:.1f} us)")
    a = c - g_us
    rules = [("none", lambda t, l, m: 0, 1), ("oracle", lambda t, l, m: m, 1)]
    rules += [(f"oracle, {b} a layer", (lambda b: lambda t, l, m: min(m, b))(b), 1) for b in budgets]
    rules += [(f"oracle, {d} layers ahead", lambda t, l, m: m, d) for d in aheads]
    for r in recalls:
        rng = random.Random(seed)
        draws: Dict[tuple, int] = {}

        def caught(t, l, m, r=r, rng=rng, draws=draws):
            key = (t, l)
            if key not in draws:
                draws[key] = sum(rng.random() < r for _ in range(m))
            return draws[key]
        rules.append((f"recall {r:.2f}", caught, 1))
        if r in recalls_two_ahead:
            rules.append((f"recall {r:.2f}, 2 layers ahead", caught, 2))
    rows = []
    for name, rule, ahead in rules:
        times = token_times(misses, a, g_us, x_us, rule, ahead)
        ms = sum(times) / len(times) / 1000.0
        rows.append({"rule": name, "ms_per_token": round(ms, 3), "x_resident": round(ms / resident_ms, 3),
                     "tokens_per_s": round(1000.0 / ms, 1)})
    return {"layers": L, "misses_per_token": round(per_token, 2), "layer_us": round(c, 1), "attention_us": round(a, 1),
            "gemm_us": g_us, "copy_us": x_us, "token_ms_measured": token_ms, "resident_ms": resident_ms, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--token-ms", type=float, required=True, help="measured offloaded compiled decode, ms a token")
    ap.add_argument("--resident-ms", type=float, required=True, help="measured resident compiled decode, ms a token")
    ap.add_argument("--slots", type=int, default=1820, help="cache slots (1,820: 16 GiB of bf16 Qwen3-30B-A3B experts)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400, help="decode tokens of the synthetic trace")
    ap.add_argument("--expert-mb", type=float, default=9.437184, help="bytes of an expert, MB (bf16 Qwen3-30B-A3B)")
    ap.add_argument("--copy-GBps", type=float, default=50.6,
                    help="the decode copy's rate (copy_experts: 0.92 of a 55 GB/s pinned copy on the H200)")
    ap.add_argument("--gemm-us", type=float, default=25.0, help="a layer's expert GEMM (waits for its misses)")
    ap.add_argument("--policy", default="Duel", help="a policy of ft_ops.eviction by name (default Duel, the runtime's default)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    for flag in ("token_ms", "resident_ms", "expert_mb", "copy_GBps", "gemm_us"):
        if not getattr(args, flag) > 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    fixture = Trace.load(FIXTURE)
    model, _ = calibrate(fixture)
    trace = model.trace(args.layers, args.experts, args.top_k, tokens=args.tokens, seed=2)
    misses = misses_per_call(trace, args.slots, args.policy)
    x_us = args.expert_mb * 1e6 / (args.copy_GBps * 1e9) * 1e6
    try:
        report = bound_rows(misses, args.token_ms, args.resident_ms, x_us, args.gemm_us)
    except ValueError as error:
        ap.error(str(error))
    hits = 1 - report["misses_per_token"] / (args.layers * args.top_k)
    print(f"synthetic routing (repeat {model.repeat:.3f}, zipf {model.zipf:.3f}), {args.layers} x {args.experts} top-"
          f"{args.top_k}, {args.tokens} tokens, {args.slots} slots ({args.policy}): {report['misses_per_token']} misses "
          f"a token (about {hits:.3f} of the routed pairs hit)")
    print(f"calibrated: layer {report['layer_us']} us (attention part {report['attention_us']}, GEMM {args.gemm_us}), "
          f"an expert's copy {x_us:.1f} us; resident {args.resident_ms} ms a token\n")
    print("| prefetch rule | ms a token | tokens/s | against resident |")
    print("|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['rule']} | {r['ms_per_token']:.2f} | {r['tokens_per_s']} | {r['x_resident']:.2f}x |")
    if args.out:
        report.update(command="python tools/prefetch_bound.py " + " ".join(argv if argv is not None else sys.argv[1:]))
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
