"""Decode speed of a Qwen3-MoE-shaped transformers model (random bf16 weights, 8 MoE layers)
offloaded by the plugin: eager vs torch.compile(mode="reduce-overhead", fullgraph=True) with a
static cache, against the same model fully resident (compiled and eager), at 100 % and smaller
caches, in one run. Shapes: `qwen3-30b-a3b` (its layer: 128 experts, hidden 2048, intermediate 768,
top-8; caches 100 / 25 %) and `trained` (the small MoE of tools/train_routing_model.py: 32 experts,
hidden 256, intermediate 128, top-4, vocab 256; caches 100 / 50 / 25 %), where a fixed cost per
layer weighs most against the tiny GEMMs.

  python3 benchmarks/bench_compile.py                    # Qwen3-30B-A3B's layer shape
  python3 benchmarks/bench_compile.py --shape trained

Per-token decode time is the median gap between consecutive generated tokens (a streamer stamps
each token; generate synchronizes once per step anyway). At 100 % every expert is admitted before
the timed run, so decode steps are all hits. Writes compile.json (compile_trained.json for that shape)."""
import argparse
import statistics
import time

import torch

from common import print_table, write_report
from moe_setup import admit_every_expert

# Per shape: the config's fields and the cache shares measured after 100 %.
SHAPES = {
    "qwen3-30b-a3b": (dict(vocab_size=32768, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           intermediate_size=6144), (0.25,)),
    "trained": (dict(vocab_size=256, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4, intermediate_size=512,
                     tie_word_embeddings=False),
                (0.5, 0.25)),
}


class Stamps:
    """A generate() streamer that records when each token arrives."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def build_model(layers: int, shape: str, seed: int = 0, device: str = "cuda"):
    import transformers as tf

    config = tf.Qwen3MoeConfig(num_hidden_layers=layers, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=4096, norm_topk_prob=True, **SHAPES[shape][0])
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def timed_generate(model, prompt, new_tokens: int, runs: int, compiled: bool):
    """Per-token decode ms (median gap), time to first token, tokens; the last of `runs` runs.
    Compiled: transformers' own route, decode steps under torch.compile(mode="reduce-overhead",
    fullgraph=True), the prefill eager."""
    from transformers import CompileConfig

    how = (dict(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")) if compiled
           else dict(disable_compile=True))
    for _ in range(runs):
        stamps = Stamps()
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                cache_implementation="static", streamer=stamps, **how)
        torch.cuda.synchronize()
    gaps = [b - a for a, b in zip(stamps.times[1:], stamps.times[2:])]
    return 1e3 * statistics.median(gaps), 1e3 * (stamps.times[1] - start), tokens


def main():
    import freetoken_plugin
    from torch._dynamo.utils import counters

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--caches", default=None,
                        help="cache shares measured after 100 %%, comma-separated (default: the shape's, e.g. 0.25)")
    args = parser.parse_args()
    if min(args.layers, args.prompt) < 1 or args.new_tokens < 3:
        parser.error("--layers and --prompt must be positive and --new-tokens at least 3 (the rate is a median gap)")
    try:
        shares = [float(x) for x in args.caches.split(",")] if args.caches else list(SHAPES[args.shape][1])
    except ValueError:
        parser.error(f"--caches {args.caches}: give shares in (0, 1), comma-separated, e.g. 0.5,0.25")
    if not all(0 < x < 1 for x in shares):
        parser.error(f"--caches {args.caches}: give shares in (0, 1), comma-separated, e.g. 0.5,0.25")
    L, fields = args.layers, SHAPES[args.shape][0]
    E = fields["num_experts"]
    small = [x for x in shares if int(x * L * E) < E]  # a pool streams a layer at a time
    if small and args.caches:
        parser.error(f"--caches {small[0]:g}: a cache of {L} MoE layer{'s' if L != 1 else ''} needs at least "
                     f"one layer's experts, a share of {1 / L:.3g} or more")
    if small:  # the shape's default shares that so few layers cannot take: 100 % and the rest only
        print(f"[bench_compile] {L} layers: skipping the cache shares below one layer "
              f"({', '.join(f'{x:g}' for x in small)})", flush=True)
        shares = [x for x in shares if x not in small]
    if not torch.cuda.is_available():
        raise SystemExit("bench_compile.py times compiled decode in CUDA graphs: run it on a machine with a GPU")
    prompt = torch.randint(1, fields["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    rows = []

    def record(config, cache, mode, model, runs):
        ms, ttft, tokens = timed_generate(model, prompt, args.new_tokens, runs, mode == "compiled")
        rows.append(dict(model=config, cache=cache, mode=mode, ms_per_token=round(ms, 3),
                         tokens_per_s=round(1e3 / ms, 1), ttft_ms=round(ttft, 1)))
        print(rows[-1], flush=True)
        return tokens

    model = build_model(L, args.shape)
    want = record("resident", "-", "eager", model, 2)
    torch._dynamo.reset()
    same = torch.equal(record("resident", "-", "compiled", model, 3), want)
    for share in (1.0, *shares):
        torch._dynamo.reset()  # the previous model's graphs and their memory go before the next is built
        if share != 1.0:
            model = build_model(L, args.shape)
        counters.clear()
        handle = freetoken_plugin.offload_experts(model, cache_slots=int(share * L * E), device="cuda",
                                                  progress=False)
        if share == 1.0:
            admit_every_expert(handle.runtime)
        tokens = record("offloaded", f"{share:.0%}", "eager", model, 2)
        compiled_tokens = record("offloaded", f"{share:.0%}", "compiled", model, 3)
        rows[-1]["tokens_equal_eager"] = bool(torch.equal(compiled_tokens, tokens))
        rows[-1]["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
        st = handle.stats()["admit"]
        rows[-1]["decode_hit_rate"] = round(st["hit_rate"], 3) if st["hit_rate"] is not None else None
        del model, handle
        torch.cuda.empty_cache()
    resident_ms = next(r["ms_per_token"] for r in rows if r["model"] == "resident" and r["mode"] == "compiled")
    for r in rows:
        r["vs_resident_compiled"] = round(r["ms_per_token"] / resident_ms, 3)
    name = "compile" if args.shape == "qwen3-30b-a3b" else f"compile_{args.shape}"
    write_report(name, rows, {"shape": args.shape, "layers": L, "prompt": args.prompt, "new_tokens": args.new_tokens,
                              "resident_compiled_tokens_equal_eager": same})
    print_table(f"decode of a {L}-layer Qwen3-MoE model of the {args.shape} shape (bf16), static cache; goal: "
                "offloaded compiled at >= 85 % hits within 1.15x of resident compiled", rows,
                ["model", "cache", "mode", "ms_per_token", "tokens_per_s", "ttft_ms", "vs_resident_compiled",
                 "tokens_equal_eager", "cudagraph_skips", "decode_hit_rate"])


if __name__ == "__main__":
    main()
