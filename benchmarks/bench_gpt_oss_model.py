"""A GPT-OSS-120B-shaped model through transformers with its experts in MXFP4 (issue 22): decode
tokens/s, eager and compiled (transformers' static cache and CUDA graphs), under the calibrated
routing of the decode issue, with a 16 GiB cache against a pool that holds every expert.

The model is transformers' GptOssForCausalLM at GPT-OSS-120B's configuration (36 layers, 128
experts, hidden 2880, intermediate 2880, top-4, 64 heads of 64, 8 KV heads, sliding windows of
128 on every other layer, a 201,088-token vocabulary), every weight but the experts random bf16 on
the device; the experts are random MXFP4 bytes filled straight into the pinned host pool (one
layer generated, copied to the others: 61 GB; expanded to bf16 they would be 229 GB). Decode runs
through generate(): a 64-token prompt, then each step's experts replayed from routing drawn by
ft_ops.synthetic_routing calibrated to the recorded fixture (random weights route almost
constantly), each timed run on steps no earlier run saw, as `freetoken bench` does. The pool that
holds every expert (61 GB, where the GPU has room for it) is the reference: its decode misses
only once per expert.

    python3 benchmarks/bench_gpt_oss_model.py                      # an H200: about 5 minutes
    python3 benchmarks/bench_gpt_oss_model.py --caches 16          # the 16 GiB cache alone

Prints one table and writes gpt_oss_model.json to $OUT (default ./out)."""
import argparse
import math
import os
import sys
import time
import types

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugin")]

import torch  # noqa: E402

from bench_mxfp4 import mxfp4_host_pool  # noqa: E402
from common import print_table, write_report  # noqa: E402
from freetoken_plugin import bench_e2e  # noqa: E402
from freetoken_plugin.backend import register  # noqa: E402
from freetoken_plugin.loader import _materialize_computed_buffers  # noqa: E402
from freetoken_plugin.offload import find_experts, install, read_layouts  # noqa: E402
from ft_ops import formats  # noqa: E402
from ft_ops.moe import OffloadRuntime  # noqa: E402
from ft_ops.slot_pool import ExpertShape, HostPool  # noqa: E402

EAGER_RUNS, COMPILED_RUNS = 2, 2  # each: a warm-up run, then the timed one (compiled adds the compiling run)


def gpt_oss_config(args):
    import transformers as tf

    heads = max(1, args.hidden // 45)  # 2880 -> 64, as GPT-OSS-120B
    return tf.GptOssConfig(num_hidden_layers=args.layers, num_local_experts=args.experts,
                           num_experts_per_tok=args.top_k, hidden_size=args.hidden,
                           intermediate_size=args.expert_intermediate, head_dim=64 if args.hidden >= 1024 else 16,
                           num_attention_heads=heads, num_key_value_heads=max(1, heads // 8),
                           vocab_size=args.vocab, max_position_embeddings=4096, pad_token_id=0,
                           bos_token_id=None, eos_token_id=None)


def random_non_experts(model, experts, device) -> None:
    """Every parameter but the experts' random on `device` (norms 1, biases and attention sinks 0,
    matrices N(0, 0.02)); computed buffers (rotary frequencies) as from_pretrained computes them.
    The experts stay on the meta device: install() takes them from the host pool."""
    skip = {id(p) for _, module in experts for p in module.parameters()}
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            if id(p) in skip:
                continue
            value = torch.empty(p.shape, dtype=p.dtype, device=device)
            if p.dim() >= 2:
                value.normal_(0.0, 0.02, generator=gen)
            else:
                value.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            module_name, _, leaf = name.rpartition(".")
            model.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
        _materialize_computed_buffers(model)


def build(args, host: HostPool, slots: int, device):
    """The model with its experts served from `host` through a cache of `slots` slots."""
    import transformers as tf

    register()  # the experts implementation install() selects
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(gpt_oss_config(args), dtype=torch.bfloat16)
    experts = find_experts(model)
    layouts = read_layouts(experts)
    random_non_experts(model, experts, device)
    runtime = OffloadRuntime(host, slots, device, activation=[layout.activation for layout in layouts],
                             top_k=args.top_k)
    handle = install(model, experts, layouts, runtime, device)
    return model.eval(), handle


def measure(args, host: HostPool, name: str, slots: int, routing, device) -> dict:
    model, handle = build(args, host, slots, device)
    routers = bench_e2e.install_replay_routers(model, "router")
    row = dict(cache=name, slots=slots, cache_GB=round(slots * host.shape.expert_bytes / 1e9, 2))
    hits = bench_e2e.DecodeHits(handle)
    started = time.perf_counter()
    row["eager_tok_s"] = round(bench_e2e.decode_rate(model, routers, routing, args.decode_tokens, device, False,
                                                     runs=EAGER_RUNS, hits=hits), 1)
    row["eager_hit_rate"] = hits.rate()
    if not args.no_compile and device.type == "cuda":
        before = bench_e2e.cuda_graph_skips()
        row["compiled_tok_s"] = round(bench_e2e.decode_rate(model, routers, routing, args.decode_tokens, device, True,
                                                            runs=COMPILED_RUNS, hits=hits, first_run=EAGER_RUNS), 1)
        row["compiled_hit_rate"] = hits.rate()
        row["cuda_graphs_skipped"] = bench_e2e.cuda_graph_skips() - before
    row["seconds"] = round(time.perf_counter() - started, 1)
    print(f"[gpt-oss] {name}: {row}", flush=True)
    del model, handle, routers, hits
    bench_e2e.free()  # its compiled graphs too, before the next cache's model compiles its own
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--expert-intermediate", type=int, default=2880)
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--caches", default="16,all",
                        help="comma-separated: GiB of cache, or all (a pool of every expert, where the GPU holds it)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true", help="eager decode only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.decode_tokens < 3:
        parser.error(f"--decode-tokens {args.decode_tokens}: give at least 3 (the rate is timed from the third token)")
    if args.vocab < 32768:
        parser.error(f"--vocab {args.vocab}: the decode prompt draws ids below 32768; give at least that")
    for option in ("layers", "experts", "top_k", "hidden", "expert_intermediate"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be positive, got {getattr(args, option)}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} routes more experts than a layer has (--experts {args.experts})")
    if args.hidden % 32 or args.expert_intermediate % 32:
        parser.error(f"--hidden {args.hidden} and --expert-intermediate {args.expert_intermediate}: MXFP4 groups 32 "
                     "values of a row, so both must be multiples of 32")
    shape = ExpertShape(args.layers, args.experts, args.hidden, args.expert_intermediate, torch.bfloat16, True,
                        formats.MXFP4)
    caches = []  # (name, slots), checked before the host pool is filled
    everything = shape.layers * shape.experts
    for value in (v.strip() for v in args.caches.split(",")):
        if value == "all":
            caches.append(("all", everything))
            continue
        try:
            gib = float(value)
        except ValueError:
            gib = float("nan")
        slots = min(everything, int(gib * 2**30 // shape.expert_bytes)) if math.isfinite(gib) and gib > 0 else 0
        if slots < shape.experts:  # a prompt streams whole layers through the pool
            parser.error(f"--caches: {value!r} is not a number of GiB that holds one layer's {shape.experts} experts "
                         f"({shape.experts * shape.expert_bytes / 2**30:.2f} GiB), nor all")
        caches.append((f"{gib:g} GiB", slots))
    device = torch.device(args.device)
    host = mxfp4_host_pool(args.layers, device, args.experts, args.hidden, args.expert_intermediate)
    print(f"[gpt-oss] {shape.layers} layers x {shape.experts} experts of {shape.expert_bytes / 2**20:.1f} MiB "
          f"(MXFP4): {host.nbytes / 1e9:.1f} GB in the {'pinned ' if host.is_pinned else ''}host pool", flush=True)
    # Steps for every run of each cache (eager and compiled, the compiling run included).
    runs = EAGER_RUNS + COMPILED_RUNS + 1
    routing = bench_e2e.calibrated_decode_routing(types.SimpleNamespace(layers=args.layers, experts=args.experts,
                                                                        top_k=args.top_k),
                                                  (args.decode_tokens + 8) * runs)
    rows = []
    for name, slots in caches:
        if name == "all":
            name = f"every expert ({host.nbytes / 2**30:.0f} GiB)"
            if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < host.nbytes + (8 << 30):
                print(f"[gpt-oss] {name}: skipped, the GPU has {torch.cuda.mem_get_info(device)[0] / 2**30:.0f} GiB "
                      "free", flush=True)
                continue
        rows.append(measure(args, host, name, slots, routing, device))
    reference = next((r for r in rows if r["slots"] == everything), None)
    for row in rows:
        for kind in ("eager", "compiled"):
            if reference is not None and f"{kind}_tok_s" in row and f"{kind}_tok_s" in reference:
                row[f"{kind}_vs_every_expert"] = round(row[f"{kind}_tok_s"] / reference[f"{kind}_tok_s"], 3)
    print_table("GPT-OSS-120B-shaped model, MXFP4 experts: decode through transformers, calibrated routing", rows,
                ["cache", "slots", "cache_GB", "eager_tok_s", "eager_hit_rate", "eager_vs_every_expert",
                 "compiled_tok_s", "compiled_hit_rate", "compiled_vs_every_expert", "cuda_graphs_skipped"])
    write_report("gpt_oss_model", rows, {"shape": dict(layers=args.layers, experts=args.experts, top_k=args.top_k,
                                                       hidden=args.hidden, intermediate=args.expert_intermediate),
                                         "host_pool_GB": round(host.nbytes / 1e9, 2),
                                         "decode_tokens": args.decode_tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
