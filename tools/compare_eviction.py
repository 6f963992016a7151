"""Decode hit rate of LRU, the candidate eviction policies and Belady's optimum (issue 23).

Traces: (a) the recorded fixture, a small MoE trained on real text (decode steps only), (b) and (c)
synthetic routing calibrated to it (ft_ops.synthetic_routing.calibrate) at the fixture's shape and
at a full-size shape (48 layers x 128 experts, top-8), (d) the fixture with every prompt streamed as
full layers before its decode and another prompt streamed every --stream-every decode tokens
(issue 23, item 3), (e) the recorded trace of a random-weight Qwen3-MoE (decode steps only), where
routing has no learned structure. With --trace, (a) and (d) are that trace's, (b) and (c)
calibrated to it, and (e) is left out. Cache sizes are shares of layers * experts. Prints one table per trace with the
goals checked, writes eviction.json and eviction.png (with matplotlib) under $OUT (or ./out).

    python tools/compare_eviction.py                                  # about 2 minutes on 2 cores
    python tools/compare_eviction.py --plot docs/img/eviction.png     # the docs' plot
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ft_ops import eviction  # noqa: E402
from ft_ops.synthetic_routing import calibrate  # noqa: E402
from ft_ops.traces import Trace, reuse_and_skew  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "routing", "byte_qwen3moe_8x32_top4.safetensors")
RANDOM_WEIGHT = os.path.join(ROOT, "tests", "fixtures", "routing", "random_qwen3moe_3x16_top2.safetensors")
SHARES = (0.05, 0.10, 0.15, 0.20, 0.25, 0.35, 0.50, 0.75)
GAP_SHARES = (0.10, 0.15, 0.20, 0.25)  # where a candidate should close half of LRU's distance to Belady
TOLERANCE = 0.01                        # never more than 1 point of hit rate below LRU


def sizes_of(layers: int, experts: int, top_k: int):
    return [max(top_k, round(s * layers * experts)) for s in SHARES]


def run_trace(name: str, requests, layers: int, experts: int, top_k: int, info: dict, references=()) -> dict:
    """Every policy of eviction.policies() at every size; `references` (policies that read more than
    the trace, as RoutingOracle reads its generator) go before Belady."""
    sizes = sizes_of(layers, experts, top_k)
    rows = {}
    t0 = time.perf_counter()
    policies = eviction.policies()
    for policy in policies[:-1] + list(references) + policies[-1:]:
        results = [eviction.simulate(policy, requests, s) for s in sizes]
        rows[policy.name] = {"rule": policy.rule(), "results": [r.as_dict() for r in results]}
    out = {"trace": name, "shape": {"layers": layers, "experts": experts, "top_k": top_k},
           "decode_calls": requests.decode_calls, "calls": len(requests), "shares": list(SHARES),
           "slots": sizes, "policies": rows, "seconds": round(time.perf_counter() - t0, 1), **info}
    out["goals"] = goals(out)
    return out


def hit_rates(trace: dict, policy: str):
    return [r["hit_rate"] for r in trace["policies"][policy]["results"]]


def goals(trace: dict) -> dict:
    """Per candidate: goal 1 (never more than TOLERANCE below LRU), goal 2 (at 10-25 % at least half
    of LRU's distance to Belady closed: the share closed per size), goal 3 (no cliff: above 0 at
    every size where Belady is; a cache of one call's experts hits nothing under any policy)."""
    lru, opt = hit_rates(trace, "LRU"), hit_rates(trace, "Belady")
    out = {}
    for name in trace["policies"]:
        if name in ("LRU", "Belady"):
            continue
        hr = hit_rates(trace, name)
        below = [round(h - l, 4) for h, l in zip(hr, lru)]
        closed = {}
        for share, h, l, o in zip(SHARES, hr, lru, opt):
            if share in GAP_SHARES:
                closed[f"{share:.2f}"] = round((h - l) / (o - l), 3) if o - l > 1e-9 else None
        out[name] = {
            "goal1_never_1pt_below_lru": min(below) >= -TOLERANCE - 1e-9,
            "worst_vs_lru": min(below),
            "goal2_half_gap_closed": all(c is None or c >= 0.5 for c in closed.values()),
            "gap_closed": closed,
            "goal3_no_cliff": all(h > 0 for h, o in zip(hr, opt) if o > 0),
        }
    return out


def table(trace: dict) -> str:
    shares = trace["shares"]
    columns = " | ".join(f"{round(s * 100)} % ({n})" for s, n in zip(shares, trace["slots"]))
    head = f"| policy | {columns} | levels / miss call |"
    lines = [head, "|---" * (len(shares) + 2) + "|"]
    for name, row in trace["policies"].items():
        rs = row["results"]
        levels = max(r["mean_levels"] for r in rs)
        top = max(r["max_levels"] for r in rs)
        cells = " | ".join(f"{r['hit_rate']:.3f}" for r in rs)
        bold = f"**{name}**" if name == RECOMMENDED else name
        lines.append(f"| {bold} | {cells} | {levels:.2f} (max {top}) |")
    return "\n".join(lines)


def goal_lines(trace: dict) -> str:
    lines = []
    for name, g in trace["goals"].items():
        closed = ", ".join(f"{round(float(k) * 100)} %: {'-' if v is None else f'{v:.0%}'}"
                           for k, v in g["gap_closed"].items())
        lines.append(f"  {name:15s} goal 1 {'yes' if g['goal1_never_1pt_below_lru'] else 'NO '} "
                     f"(worst vs LRU {g['worst_vs_lru'] * 100:+.1f} pt)  "
                     f"goal 2 {'yes' if g['goal2_half_gap_closed'] else 'NO '} "
                     f"(closed {closed})  goal 3 {'yes' if g['goal3_no_cliff'] else 'NO'}")
    return "\n".join(lines)


def plot(traces, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return False
    cols = 2
    rows = (len(traces) + cols - 1) // cols
    fig, grid = plt.subplots(rows, cols, figsize=(10, 4 * rows), sharey=True, squeeze=False)
    axes = grid.flatten()
    # One colour a policy; hit density dashed, as Duel draws over it wherever they agree.
    styles = {"LRU": dict(color="black", lw=2), "Belady": dict(color="gray", ls="--", lw=2),
              "RoutingOracle": dict(color="gray", ls=":", lw=2), "SequenceOracle": dict(color="gray", ls="-.", lw=1.6),
              "Duel": dict(color="tab:red", lw=2.2),
              "HitDensity": dict(color="tab:green", ls="--", lw=1.6), "Opportunity": dict(color="tab:blue", lw=1.2),
              "TokenLRU": dict(color="tab:olive", lw=1), "FrequencyBonus": dict(color="tab:purple", lw=1),
              "Segmented": dict(color="tab:brown", lw=1)}
    for ax, trace in zip(axes, traces):
        x = [s * 100 for s in trace["shares"]]
        for name in trace["policies"]:
            ax.plot(x, hit_rates(trace, name), marker="o", ms=3, label=name, **styles.get(name, dict(lw=1)))
        ax.set_title(trace["title"], fontsize=9)
        ax.set_xlabel("cache, % of layers x experts")
        ax.grid(alpha=0.3)
    for row in grid:
        row[0].set_ylabel("decode hit rate")
    for ax in axes[len(traces):]:
        ax.set_visible(False)
    legend = {}  # every policy once, whichever panels draw it (RoutingOracle: the synthetic ones)
    for ax in axes[:len(traces)]:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(name, handle)
    axes[0].legend(list(legend.values()), list(legend), fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


RECOMMENDED = "Duel"  # the runtime's default policy (ft_ops.policies.DEFAULT_EVICTION)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=FIXTURE, help="recorded routing trace (default: the fixture)")
    ap.add_argument("--full-tokens", type=int, default=400, help="decode tokens of the full-size synthetic trace")
    ap.add_argument("--stream-every", type=int, default=64, help="trace (d): a prompt streamed every N decode tokens")
    ap.add_argument("--out", default=os.environ.get("OUT") or "out", help="folder for eviction.json ($OUT or ./out)")
    ap.add_argument("--plot", default=None, help="the plot's path (default: eviction.png under --out; the docs' "
                                                 "plot is docs/img/eviction.png)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    for flag, value in (("--full-tokens", args.full_tokens), ("--stream-every", args.stream_every)):
        if value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    t0 = time.perf_counter()

    try:
        fixture = Trace.load(args.trace)
    except Exception as error:  # Trace.load says what the file is not
        ap.error(f"--trace: {' '.join(str(error).split())}")
    # The titles name the trace (the JSON keys stay those of the fixture's report).
    label = "fixture" if os.path.abspath(args.trace) == FIXTURE else f"trace {os.path.basename(args.trace)}"
    L, E, K = fixture.layers, fixture.experts, fixture.top_k
    decode_tokens = sum(fixture.decode_steps(i).shape[0] for i in range(len(fixture.sequences)))
    model, fit = calibrate(fixture)
    print(f"{label} {L} layers x {E} experts, top-{K}: {len(fixture.sequences)} sequences, "
          f"{decode_tokens} decode tokens; "
          f"reuse {fit['target']['reuse']:.3f}, top-10 % share {fit['target']['top10_share']:.3f}")
    print(f"calibrated synthetic routing: repeat {model.repeat:.3f}, zipf {model.zipf:.3f} "
          f"(reaches reuse {fit['reached']['reuse']:.3f}, share {fit['reached']['top10_share']:.3f})")
    small_orders, full_orders = [], []
    small = model.trace(L, E, K, tokens=decode_tokens, seed=1, orders=small_orders)
    full = model.trace(48, 128, 8, tokens=args.full_tokens, seed=2, orders=full_orders)
    # The synthetic traces' bound for rules that learn from the past: the generator's own probabilities.
    small_oracle = eviction.RoutingOracle(model.popularity(small_orders).numpy(), model.repeat, K)
    full_oracle = eviction.RoutingOracle(model.popularity(full_orders).numpy(), model.repeat, 8)

    # The recorded traces' bound for rules that estimate per-pair probabilities: each sequence's own.
    sequence_oracle = eviction.SequenceOracle(fixture)
    specs = [
        ("fixture", f"(a) {label} {L}x{E} top-{K}, decode", eviction.requests_from_trace(fixture), fixture,
         {"source": fixture.source}, (sequence_oracle,)),
        ("synthetic_fixture_shape", f"(b) synthetic {L}x{E} top-{K}", eviction.requests_from_trace(small), small,
         {"tokens": decode_tokens, **reuse_and_skew(small)}, (small_oracle,)),
        ("synthetic_full_size", f"(c) synthetic 48x128 top-8, {args.full_tokens} tokens",
         eviction.requests_from_trace(full), full, {"tokens": args.full_tokens}, (full_oracle,)),
        ("fixture_streamed_prompts", f"(d) {label} + prompt streamed every {args.stream_every}",
         eviction.requests_from_trace(fixture, prompts="stream", stream_every=args.stream_every), fixture,
         {"stream_every": args.stream_every}, (sequence_oracle,)),
    ]
    if os.path.abspath(args.trace) == FIXTURE:  # the other recorded trace: routing without learned structure
        random_weight = Trace.load(RANDOM_WEIGHT)
        specs.append(("random_weight", f"(e) random-weight Qwen3-MoE {random_weight.layers}x{random_weight.experts} "
                      f"top-{random_weight.top_k}, decode", eviction.requests_from_trace(random_weight),
                      random_weight, {"source": random_weight.source}, (eviction.SequenceOracle(random_weight),)))
    traces = []
    for name, title, requests, trace, info, references in specs:
        result = run_trace(name, requests, trace.layers, trace.experts, trace.top_k, info, references)
        result["title"] = title
        traces.append(result)
        print(f"\n## {title}: {result['decode_calls']} decode calls ({result['calls']} calls in all), "
              f"{result['seconds']} s")
        print(table(result))
        print(goal_lines(result))

    described = eviction.policies() + [small_oracle, sequence_oracle]
    print("\nPolicies:")
    for p in described:
        print(f"  {p.name}: {p.rule()}")
    os.makedirs(args.out, exist_ok=True)
    report = {"command": "python tools/compare_eviction.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "calibration": {"repeat": model.repeat, "zipf": model.zipf, **fit}, "recommended": RECOMMENDED,
              "policies": {p.name: p.rule() for p in described}, "traces": traces,
              "seconds": round(time.perf_counter() - t0, 1)}
    path = os.path.join(args.out, "eviction.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")
    if args.plot is None:  # beside the JSON: a run leaves the checkout as it was
        args.plot = os.path.join(args.out, "eviction.png")
    if not args.no_plot and plot(traces, args.plot):
        print(f"wrote {args.plot}")
    print(f"{time.perf_counter() - t0:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
