"""Where offloaded compiled decode spends the time that resident compiled decode does not (issue
20's fixed tax): the same Qwen3-MoE model (bench_compile.py's, 8 layers, random bf16 weights, of
either of its shapes) generates under transformers' compiled decode (CUDA graphs), fully resident
and then offloaded with every expert cached (all hits), each under torch.profiler. Per decode token it
prints the wall time, the kernels launched, the time some kernel runs (busy) and the time none
does (idle), and the kernels whose total time differs most between the two. Writes
profile_decode.json (profile_decode_trained.json for that shape) to $OUT (default: the repository's
out/), the Chrome traces to $TRACE_DIR (default: the temporary directory), for chrome://tracing or
Perfetto.

  python3 benchmarks/profile_decode.py --layers 8 --new-tokens 32
  python3 benchmarks/profile_decode.py --shape trained     # the small trained model's shape
"""
import argparse
import json
import os
from typing import Dict, List

from bench_compile import SHAPES
from profile_prefill import trace_events, union



def summarize_decode(events: List[Dict], tokens: int) -> Dict:
    """Per-token figures of the kernels in Chrome-trace device events (cat "kernel"), and the
    kernels' total time by name."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise ValueError("the trace has no kernels: was decode run on a GPU under the profiler?")
    first = min(k["ts"] for k in kernels)
    last = max(k["ts"] + k["dur"] for k in kernels)
    busy = sum(end - start for start, end in union([(k["ts"], k["ts"] + k["dur"]) for k in kernels]))
    by_name: Dict[str, float] = {}
    for k in kernels:
        by_name[k["name"]] = by_name.get(k["name"], 0.0) + k["dur"]
    return dict(ms_per_token=round((last - first) / tokens / 1e3, 4),
                kernels_per_token=round(len(kernels) / tokens, 1),
                busy_ms_per_token=round(busy / tokens / 1e3, 4),
                idle_ms_per_token=round((last - first - busy) / tokens / 1e3, 4),
                kernel_us_per_token={n: round(t / tokens, 2) for n, t in by_name.items()})


def differences(resident: Dict, offloaded: Dict, top: int = 12) -> List[Dict]:
    """The kernels whose time per token differs most between the two summaries (offloaded minus
    resident), largest first."""
    a, b = resident["kernel_us_per_token"], offloaded["kernel_us_per_token"]
    names = set(a) | set(b)
    rows = [dict(kernel=n[:90], resident_us=a.get(n, 0.0), offloaded_us=b.get(n, 0.0),
                 delta_us=round(b.get(n, 0.0) - a.get(n, 0.0), 2)) for n in names]
    return sorted(rows, key=lambda r: -abs(r["delta_us"]))[:top]


def profiled_kernels(model, prompt, new_tokens: int, how: Dict, name: str) -> List[Dict]:
    """The kernels of one generate() under torch.profiler, in start order (Chrome trace kept as
    $TRACE_DIR/<name>.trace.json)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **how)
        torch.cuda.synchronize()
    events = trace_events(prof, name)
    return sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])


def profiled_decode(model, prompt, new_tokens: int, name: str) -> Dict:
    """The per-token summary of compiled decode: a generate of one token gives the kernels of the
    prompt and the first token, which are left out of a generate of new_tokens tokens."""
    import torch
    from transformers import CompileConfig

    how = dict(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"), cache_implementation="static",
               do_sample=False)
    for _ in range(2):  # compile and capture, then one warm run
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **how)
    torch.cuda.synchronize()
    first = profiled_kernels(model, prompt, 1, how, f"profile_decode_{name}_prompt")
    every = profiled_kernels(model, prompt, new_tokens, how, f"profile_decode_{name}")
    return summarize_decode(every[len(first):], new_tokens - 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="bench_compile.py's model shapes")
    args = parser.parse_args()
    if min(args.layers, args.prompt) < 1 or args.new_tokens < 2:
        parser.error("--layers and --prompt must be positive and --new-tokens at least 2")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py profiles compiled decode on CUDA: run it on a machine with a GPU")
    import freetoken_plugin
    from bench_compile import build_model
    from moe_setup import admit_every_expert

    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "out")  # as common.write_report
    os.makedirs(out_dir, exist_ok=True)
    fields = SHAPES[args.shape][0]
    model = build_model(args.layers, args.shape)
    prompt = torch.randint(1, fields["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    suffix = "" if args.shape == "qwen3-30b-a3b" else f"_{args.shape}"  # each shape its own report and traces
    resident = profiled_decode(model, prompt, args.new_tokens, f"resident{suffix}")
    del model  # the offloaded run gets a model of its own (the same weights), as in bench_compile.py
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    model = build_model(args.layers, args.shape)
    handle = freetoken_plugin.offload_experts(model, cache_slots=args.layers * fields["num_experts"], device="cuda",
                                              progress=False)
    admit_every_expert(handle.runtime)
    offloaded = profiled_decode(model, prompt, args.new_tokens, f"offloaded{suffix}")
    diff = differences(resident, offloaded)
    with open(os.path.join(out_dir, f"profile_decode{suffix}.json"), "w") as f:
        json.dump(dict(shape=args.shape, layers=args.layers, resident=resident, offloaded=offloaded, differences=diff),
                  f, indent=1)
    print(f"\n## compiled decode, {args.layers} layers of the {args.shape} shape, every expert cached: per token")
    print(f"{'':<12}{'ms':>9}{'kernels':>9}{'busy ms':>9}{'idle ms':>9}")
    for name, s in (("resident", resident), ("offloaded", offloaded)):
        print(f"{name:<12}{s['ms_per_token']:>9}{s['kernels_per_token']:>9}{s['busy_ms_per_token']:>9}"
              f"{s['idle_ms_per_token']:>9}")
    print("kernels whose time per token differs most (us, offloaded - resident):")
    for r in diff:
        print(f"  {r['delta_us']:>8}  ({r['resident_us']} -> {r['offloaded_us']})  {r['kernel']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
