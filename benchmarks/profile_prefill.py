"""Where a streamed prompt loses time against its link bound: one prefill through a stack of MoE
layers (every layer streamed from an empty cache) under torch.profiler, and the device timeline
read back as intervals. Prints, against the pass's wall time and the link bound:
- head: from the pass's first device work to its first host-to-device copy (the link idle);
- link busy: the union of host-to-device copies, their count and their rate while busy;
- link gaps: the link idle between copies, in total and the largest ones with the kernels that
  ran meanwhile (what the link waited for);
- tail: from the last copy's end to the pass's end (the last layer's compute);
- the kernels' total time by name.
Writes profile_prefill_<format>.json to $OUT (default: the repository's out/), the Chrome trace to $TRACE_DIR (default: the
temporary directory), for chrome://tracing or Perfetto.

  python3 benchmarks/profile_prefill.py --layers 12 --tokens 8192             # bf16, Qwen3-30B-A3B shape
  python3 benchmarks/profile_prefill.py --format mxfp4 --layers 8 --tokens 8192  # GPT-OSS-120B shape
  python3 benchmarks/profile_prefill.py --transformers --layers 12                # through generate()
  python3 benchmarks/profile_prefill.py --transformers --warm --layers 48 --cache-gib 16  # a warm cache

With --transformers the prompt runs through `generate(max_new_tokens=1)` of a Qwen3-MoE model
offloaded by the plugin (the model of `freetoken bench`), and the summary adds the host side: from
the generate call to the first device work and to the first host-to-device copy, and from the last
copy's end to generate's return. With --warm as well, the profiled prompt starts from the cache the
same prompt's untimed run left (`freetoken bench`'s warm prompt), and its bound is the experts it
copied; the link's gaps then show what a partly resident layer's copies wait for.
"""
import argparse
import json
import os
import tempfile
from typing import Dict, List, Tuple

Interval = Tuple[float, float]  # (start, end) in microseconds


TRACE_DIR = os.environ.get("TRACE_DIR", tempfile.gettempdir())

def trace_events(prof, name: str) -> List[Dict]:
    """The Chrome-trace events of a finished torch.profiler run, its trace kept as
    $TRACE_DIR/<name>.trace.json."""
    path = os.path.join(TRACE_DIR, f"{name}.trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)["traceEvents"]


def union(intervals: List[Interval]) -> List[Interval]:
    """The union of intervals as disjoint intervals in ascending order."""
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def analyze(events: List[Dict], min_gap_us: float = 20.0, top: int = 8) -> Dict:
    """The timeline summary of Chrome-trace device events (dicts with cat, name, ts, dur and args:
    "kernel", "gpu_memcpy" or "gpu_memset"). Host-to-device copies are the memcpy events whose
    name or "copy kind" says HtoD."""
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not device:
        raise ValueError("the trace has no device events: was the pass run on a GPU under the profiler?")
    first = min(e["ts"] for e in device)
    last = max(e["ts"] + e["dur"] for e in device)
    h2d = [e for e in device if e["cat"] == "gpu_memcpy"
           and ("HtoD" in e["name"] or e.get("args", {}).get("copy kind") == "HtoD")]
    busy = union([(e["ts"], e["ts"] + e["dur"]) for e in h2d])
    kernels = [e for e in device if e["cat"] == "kernel"]
    gaps = []
    for (_, end), (start, _) in zip(busy, busy[1:]):
        if start - end >= min_gap_us:
            during: Dict[str, float] = {}
            for k in kernels:
                overlap = min(k["ts"] + k["dur"], start) - max(k["ts"], end)
                if overlap > 0:
                    during[k["name"]] = during.get(k["name"], 0.0) + overlap
            names = sorted(during, key=during.get, reverse=True)[:3]
            gaps.append(dict(at_ms=round((end - first) / 1e3, 3), gap_us=round(start - end, 1),
                             kernels_meanwhile=[f"{n[:60]} ({during[n]:.0f} us)" for n in names]))
    by_name: Dict[str, float] = {}
    for k in kernels:
        by_name[k["name"]] = by_name.get(k["name"], 0.0) + k["dur"]
    h2d_bytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in h2d)
    busy_us = sum(end - start for start, end in busy)
    all_gaps_us = sum(start - end for (_, end), (start, _) in zip(busy, busy[1:]))
    return dict(
        wall_ms=round((last - first) / 1e3, 3),
        head_ms=round(((busy[0][0] if busy else last) - first) / 1e3, 3),
        link_busy_ms=round(busy_us / 1e3, 3),
        copies=len(h2d),
        copy_GBps_while_busy=round(h2d_bytes / busy_us / 1e3, 1) if busy_us and h2d_bytes else None,
        link_gaps_ms=round(sum(g["gap_us"] for g in gaps) / 1e3, 3),
        link_gaps_all_ms=round(all_gaps_us / 1e3, 3),
        tail_ms=round((last - (busy[-1][1] if busy else first)) / 1e3, 3),
        largest_gaps=sorted(gaps, key=lambda g: g["gap_us"], reverse=True)[:top],
        h2d_copies=copy_rates(h2d, [e for e in device if e["cat"] == "gpu_memcpy" and e not in h2d], first, last),
        kernels_ms={n[:80]: round(t / 1e3, 3) for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]},
    )


def copy_rates(h2d: List[Dict], others: List[Dict], first: float, last: float) -> Dict:
    """Where host-to-device copies lose rate: GB/s within copies (bytes over their own durations) by
    size class, for copies that overlap another copy (device-to-device ones included) or none, and
    by eighth of the pass."""
    def rate(group):
        b = sum(int(e.get("args", {}).get("bytes", 0)) for e in group)
        t = sum(e["dur"] for e in group)
        return dict(copies=len(group), GB=round(b / 1e9, 3), ms=round(t / 1e3, 3),
                    GBps=round(b / t / 1e3, 2) if t else None)
    out: Dict[str, Dict] = {}
    for lo, hi, label in ((0, 4 << 20, "<4MB"), (4 << 20, 8 << 20, "4-8MB"), (8 << 20, 16 << 20, "8-16MB"),
                          (16 << 20, 1 << 62, ">=16MB")):
        out["size " + label] = rate([e for e in h2d if lo <= int(e.get("args", {}).get("bytes", 0)) < hi])
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in others + h2d)
    def overlaps(e):
        s, t = e["ts"], e["ts"] + e["dur"]
        return any(a < t and b > s and (a, b) != (s, t) for a, b in spans)
    alone = [e for e in h2d if not overlaps(e)]
    out["overlapping another copy"] = rate([e for e in h2d if e not in alone])
    out["alone"] = rate(alone)
    out["device-to-device"] = rate(others)
    step = (last - first) / 8 or 1.0
    for i in range(8):
        out[f"eighth {i}"] = rate([e for e in h2d if first + i * step <= e["ts"] < first + (i + 1) * step])
    return out


def build_stack(fmt: str, layers: int, cache_gib: float):
    """The host pool, runtime, MoE modules and routing top-k of the format's model shape."""
    import torch

    from ft_ops import formats
    from ft_ops.moe import OffloadedExperts, OffloadRuntime

    if fmt == "mxfp4":
        from bench_mxfp4 import K, mxfp4_host_pool
        from ft_ops.activations import SWIGLUOAI

        host, activation, top_k = mxfp4_host_pool(layers), SWIGLUOAI, K
    else:
        from moe_setup import K, random_host_pool

        host = random_host_pool(layers, formats.FP8 if fmt == "fp8" else formats.DENSE)
        activation, top_k = None, K
    slots = int(cache_gib * 2**30) // host.shape.expert_bytes
    kwargs = dict(activation=activation) if activation is not None else {}
    runtime = OffloadRuntime(host, slots, "cuda", **kwargs)
    modules = [OffloadedExperts(runtime, layer) for layer in range(layers)]
    torch.cuda.synchronize()
    return host, runtime, modules, top_k


def bench_model_arguments(layers: int, tokens: int):
    """The arguments of `freetoken bench`'s build_model for one prompt of `tokens` tokens through
    `layers` Qwen3-30B-A3B-shaped layers and its one generated token."""
    from types import SimpleNamespace

    return SimpleNamespace(hidden=2048, layers=layers, experts=128, top_k=8, expert_intermediate=768,
                           prompts=str(tokens), turn=f"{tokens},1", decode_tokens=1)


def profile_generate(layers: int, tokens: int, cache_gib: float, warm: bool = False):
    """One time-to-first-token prompt through generate() of the `freetoken bench` model, offloaded
    with an empty cache, under torch.profiler (after one untimed run); returns the trace events, the
    bytes the prompt copied over the link and the wall seconds. `warm`: the cache is not emptied
    before the profiled run, so it starts as the untimed run of the same prompt left it (as
    `freetoken bench`'s ttft_warm) and only the experts it lacks cross the link."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import freetoken_plugin
    from freetoken_plugin.bench_e2e import build_model, experts_copied

    model = build_model(bench_model_arguments(layers, tokens), torch.device("cuda"))
    handle = freetoken_plugin.offload_experts(model, cache_bytes=int(cache_gib * 2**30), device="cuda", progress=False)
    ids = torch.randint(1, 32768, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to("cuda")

    def ttft():
        if not warm:
            handle.runtime.pool.invalidate()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), record_function("generate"):
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    ttft()  # warm-up
    before = experts_copied(handle)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = ttft()
    moved = (experts_copied(handle) - before) * handle.runtime.shape.expert_bytes
    return trace_events(prof, "profile_prefill_generate" + ("_warm" if warm else "")), moved, seconds


def host_side(events: List[Dict]) -> Dict:
    """From the `generate` range (host) to the device's first work and first host-to-device copy,
    and from the last copy's end to the range's end (ms)."""
    spans = [e for e in events if e.get("name") == "generate" and e.get("ph") == "X"]
    if not spans:
        return {}
    start, end = spans[0]["ts"], spans[0]["ts"] + spans[0]["dur"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    # The layer copies: host-to-device copies of at least 1 MiB (generate's own small inputs and
    # the pass's hints are not the link's work).
    h2d = [e for e in device if e["cat"] == "gpu_memcpy"
           and ("HtoD" in e["name"] or e.get("args", {}).get("copy kind") == "HtoD")
           and int(e.get("args", {}).get("bytes", 0)) >= 1 << 20]
    out = dict(generate_ms=round((end - start) / 1e3, 3))
    if device:
        out["call_to_first_device_work_ms"] = round((min(e["ts"] for e in device) - start) / 1e3, 3)
    if h2d:
        out["call_to_first_copy_ms"] = round((min(e["ts"] for e in h2d) - start) / 1e3, 3)
        out["last_copy_to_return_ms"] = round((end - max(e["ts"] + e["dur"] for e in h2d)) / 1e3, 3)
    return out


def report(summary: Dict, path: str, title: str, keys) -> None:
    """Writes the summary as JSON and prints its `keys`, the largest link gaps and the kernels."""
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"\n## {title}")
    for key in keys:
        print(f"{key:<30}{summary.get(key)}")
    print("largest link gaps:")
    for gap in summary["largest_gaps"]:
        print(f"  at {gap['at_ms']:>9} ms  {gap['gap_us']:>8} us  {'; '.join(gap['kernels_meanwhile'])}")
    if summary.get("h2d_copies"):
        print("host-to-device copies (GB/s within copies):")
        for label, r in summary["h2d_copies"].items():
            print(f"  {label:<26}{r['copies']:>6} copies {r['GB']:>8} GB {r['ms']:>9} ms  {r['GBps']} GB/s")
    print("kernels (ms):")
    for name, ms in summary["kernels_ms"].items():
        print(f"  {ms:>9}  {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["bf16", "fp8", "mxfp4"], default="bf16")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=8192)
    # Smaller than the layers' experts (12 bf16 layers are 13.5 GiB), as offloading is used.
    parser.add_argument("--cache-gib", type=float, default=4.0)
    parser.add_argument("--transformers", action="store_true",
                        help="the prompt through generate() of an offloaded transformers model (bf16)")
    parser.add_argument("--warm", action="store_true",
                        help="with --transformers: the cache as the same prompt's last run left it; the bound is "
                             "what the profiled prompt copied")
    args = parser.parse_args()
    if args.warm and not args.transformers:
        parser.error("--warm profiles a prompt through generate(): add --transformers")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill.py profiles the CUDA path: run it on a machine with a GPU")
    from torch.profiler import ProfilerActivity, profile

    from common import pinned_copy_gbps

    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "out")  # as common.write_report
    os.makedirs(out_dir, exist_ok=True)
    if args.transformers:
        if args.format != "bf16":
            raise SystemExit("--transformers profiles the bf16 model of `freetoken bench`: drop --format")
        events, moved_bytes, seconds = profile_generate(args.layers, args.tokens, args.cache_gib, args.warm)
        summary = analyze(events)
        link = pinned_copy_gbps(256 << 20)
        bound_ms = moved_bytes / (link * 1e9) * 1e3
        summary.update(host_side(events), format="bf16", layers=args.layers, tokens=args.tokens, warm=args.warm,
                       ttft_ms=round(seconds * 1e3, 3), link_bound_ms=round(bound_ms, 3), link_GBps=round(link, 1),
                       of_link_bound=round(bound_ms / (seconds * 1e3), 3))
        name = "profile_prefill_generate" + ("_warm" if args.warm else "")
        report(summary, os.path.join(out_dir, f"{name}.json"),
               f"one {'warm ' if args.warm else ''}prompt through generate(), {args.layers} layers, {args.tokens} "
               f"tokens (link {link:.1f} GB/s)",
               ("ttft_ms", "link_bound_ms", "of_link_bound", "generate_ms", "call_to_first_device_work_ms",
                "call_to_first_copy_ms", "last_copy_to_return_ms", "wall_ms", "head_ms", "link_busy_ms", "copies",
                "copy_GBps_while_busy", "link_gaps_ms", "tail_ms"))
        return 0

    host, runtime, modules, top_k = build_stack(args.format, args.layers, args.cache_gib)
    experts, hidden = host.shape.experts, host.shape.hidden
    g = torch.Generator(device="cuda").manual_seed(args.tokens)
    x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    routing = []
    for _ in range(args.layers):
        w, ids = torch.softmax(torch.randn(args.tokens, experts, device="cuda", generator=g), -1).topk(top_k, dim=-1)
        routing.append((ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)))

    def one_pass():
        runtime.pool.invalidate()  # every layer crosses the link
        h = x
        for module, (ids, w) in zip(modules, routing):
            h = h + module(h, ids, w)
        return h

    one_pass()  # warm-up: allocations, kernel selection
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        one_pass()
        end.record()
        torch.cuda.synchronize()
    summary = analyze(trace_events(prof, f"profile_prefill_{args.format}"))
    link = pinned_copy_gbps(256 << 20)
    bound_ms = args.layers * experts * host.shape.expert_bytes / (link * 1e9) * 1e3
    summary.update(format=args.format, layers=args.layers, tokens=args.tokens, event_ms=round(start.elapsed_time(end), 3),
                   link_bound_ms=round(bound_ms, 3), link_GBps=round(link, 1))
    report(summary, os.path.join(out_dir, f"profile_prefill_{args.format}.json"),
           f"one streamed prefill, {args.format}, {args.layers} layers, {args.tokens} tokens (link {link:.1f} GB/s)",
           ("event_ms", "link_bound_ms", "wall_ms", "head_ms", "link_busy_ms", "copies", "copy_GBps_while_busy",
            "link_gaps_ms", "tail_ms"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
