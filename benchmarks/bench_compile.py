"""Decode speed of a Qwen3-MoE-shaped transformers model (random bf16 weights, 8 MoE layers)
offloaded by the plugin: eager vs torch.compile(mode="reduce-overhead", fullgraph=True) with a
static cache, against the same model fully resident (compiled and eager), at 100 % and smaller
caches, in one run. Shapes: `qwen3-30b-a3b` (its layer: 128 experts, hidden 2048, intermediate 768,
top-8; caches 100 / 25 %) and `trained` (the small MoE of tools/train_routing_model.py: 32 experts,
hidden 256, intermediate 128, top-4, vocab 256; caches 100 / 50 / 25 %), where a fixed cost per
layer weighs most against the tiny GEMMs.

  python3 benchmarks/bench_compile.py                    # Qwen3-30B-A3B's layer shape
  python3 benchmarks/bench_compile.py --shape trained
  python3 benchmarks/bench_compile.py --model DIR --prompt-file FILE --prompt 256   # a trained checkpoint

`--model` takes a saved MoE checkpoint instead (tools/train_routing_model.py --save-model DIR writes
the small trained one), so the hit rates come from learned routing (caches 100 / 50 / 25 %).

Per-token decode time is the median gap between consecutive decode steps (a streamer stamps each
token; generate synchronizes once per step anyway). At 100 % every expert is admitted before the
timed runs, so decode steps are all hits. Each offloaded model's compiled runs alternate with the
resident model's (--rounds pairs, ABBA order, both models loaded): `paired_vs_resident` is the
median ratio of the pairs, the comparison that host-speed drift within a process does not move,
beside the resident runs' own median (`resident_paired_ms`). The decode hit rate is the mean over
those runs, each the same prompt. Writes compile.json (compile_trained.json for that shape,
compile_model.json for --model)."""
import argparse
import gc
import math
import os
import statistics
import time

import torch
import transformers

from common import print_table, write_report
from freetoken_plugin.bench_e2e import admission_counts
from moe_setup import admit_every_expert

# Per shape: the config's fields and the cache shares measured by default (1: every expert cached).
SHAPES = {
    "qwen3-30b-a3b": (dict(vocab_size=32768, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           intermediate_size=6144), (1.0, 0.25)),
    "trained": (dict(vocab_size=256, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     moe_intermediate_size=128, num_experts=32, num_experts_per_tok=4, intermediate_size=512,
                     tie_word_embeddings=False),
                (1.0, 0.5, 0.25)),
}


class Stamps:
    """A generate() streamer that records when each token arrives and, for an offloaded model, the
    admission counters after the prefill and at the end (the decode steps' hit rate)."""

    def __init__(self, handle=None):
        self.times, self.handle, self.counts = [], handle, []

    def put(self, value):
        self.times.append(time.perf_counter())
        # generate() puts the prompt before the prefill and the first token after it: decode's
        # admissions are those after the second put.
        if self.handle is not None and len(self.times) == 2:
            self.counts.append(admission_counts(self.handle))

    def end(self):
        if self.handle is not None:
            self.counts.append(admission_counts(self.handle))

    def hit_rate(self):
        """The share of the decode steps' distinct routed experts that were resident."""
        if len(self.counts) != 2 or self.counts[1][0] == self.counts[0][0]:
            return None
        return (self.counts[1][1] - self.counts[0][1]) / (self.counts[1][0] - self.counts[0][0])


def load_checkpoint(path: str, device: str = "cuda"):
    """A saved transformers MoE checkpoint (e.g. tools/train_routing_model.py --save-model), in bf16."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device).eval()


def read_config(path: str):
    """The checkpoint's transformers config, or a one-line error that says what is missing."""
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(f"--model {path}: not a checkpoint directory (no config.json): give a local directory "
                         "saved by save_pretrained, e.g. tools/train_routing_model.py --save-model DIR")
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as e:
        raise SystemExit(f"--model {path}: transformers cannot read its config.json ({str(e).splitlines()[0]})")


def text_prompt(path: str, model_path: str, tokens: int) -> torch.Tensor:
    """The first `tokens` tokens of a text file: through the checkpoint's tokenizer where it has one,
    else as bytes (a byte-level model, vocabulary 256)."""
    data = open(path, "rb").read()
    # Only a checkpoint with tokenizer files has a tokenizer (transformers would build an empty one).
    if any(os.path.exists(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                 "tokenizer.model")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
        ids = tokenizer(data.decode("utf-8", "replace"), return_tensors="pt").input_ids[0]
    else:
        vocab = read_config(model_path).get_text_config().vocab_size
        if vocab != 256:
            raise SystemExit(f"--prompt-file: {model_path} has no tokenizer and a vocabulary of {vocab}, not bytes (256): "
                             "save its tokenizer beside it")
        ids = torch.tensor(list(data), dtype=torch.long)
    if ids.numel() < tokens:
        raise SystemExit(f"--prompt-file {path}: {ids.numel()} tokens, fewer than --prompt {tokens}")
    return ids[None, :tokens]


def moe_layers_and_experts(config):
    """(MoE layers, experts a layer) of a checkpoint's model as the plugin finds them, whatever the
    family calls them in its config (num_experts, n_routed_experts, num_local_experts; dense
    layers left out): counted on an empty model (the meta device), so nothing is loaded."""
    from freetoken_plugin.offload import find_experts, read_layouts

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = find_experts(model)
    if not experts:
        raise SystemExit(f"--model: the plugin finds no experts in a {type(model).__name__}: give an MoE checkpoint")
    return len(experts), read_layouts(experts)[0].experts


def build_model(layers: int, shape: str, seed: int = 0, device: str = "cuda"):
    config = transformers.Qwen3MoeConfig(num_hidden_layers=layers, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=4096, norm_topk_prob=True, **SHAPES[shape][0])
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def timed_generate(model, prompt, new_tokens: int, runs: int, compiled: bool, handle=None):
    """Per-token decode ms (median gap), time to first token, tokens and (offloaded: `handle`) the
    decode hit rate; the last of `runs` runs.
    Compiled: transformers' own route, decode steps under torch.compile(mode="reduce-overhead",
    fullgraph=True), the prefill eager."""
    from transformers import CompileConfig

    how = (dict(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")) if compiled
           else dict(disable_compile=True))
    for _ in range(runs):
        stamps = Stamps(handle)
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                cache_implementation="static", streamer=stamps, **how)
        torch.cuda.synchronize()
    # times: the prompt, the first token (after the prefill), then one per decode step. The gap to
    # the second token also holds the read of the counters at the first one, so it is left out.
    gaps = [b - a for a, b in zip(stamps.times[2:], stamps.times[3:])]
    return 1e3 * statistics.median(gaps), 1e3 * (stamps.times[1] - start), tokens, stamps.hit_rate()


def paired_runs(resident, model, handle, prompt, new_tokens: int, rounds: int) -> dict:
    """`rounds` compiled runs of the offloaded model, each beside one of the resident model, in ABBA
    order (which of the two goes first alternates) so that neither always runs warmer: the medians
    of both, the median ratio of the pairs and its spread, and the offloaded runs' time to first
    token and mean decode hit rate."""
    base, times, ttfts, hits = [], [], [], []
    for i in range(rounds):
        for offloaded in ((False, True) if i % 2 == 0 else (True, False)):
            if offloaded:
                ms, ttft, _, hit_rate = timed_generate(model, prompt, new_tokens, 1, True, handle)
                times.append(ms)
                ttfts.append(ttft)
                hits.append(hit_rate)
            else:
                base.append(timed_generate(resident, prompt, new_tokens, 1, True)[0])
    ratios = [ms / b for ms, b in zip(times, base)]
    row = dict(ms_per_token=round(statistics.median(times), 3), tokens_per_s=round(1e3 / statistics.median(times), 1),
               ttft_ms=round(statistics.median(ttfts), 1), resident_paired_ms=round(statistics.median(base), 3),
               paired_vs_resident=round(statistics.median(ratios), 3),
               paired_spread=f"{min(ratios):.2f}-{max(ratios):.2f}", rounds=rounds)
    hits = [h for h in hits if h is not None]  # None: no decode step admitted anything new to count
    if hits:
        row["decode_hit_rate"] = round(statistics.mean(hits), 3)
    return row


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="MoE layers of the random model (default 8; "
                        "ignored with --model)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument("--new-tokens", type=int, default=48, help="generated tokens a run, at least 3 (default 48)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                        help="the random model's layer shape (default qwen3-30b-a3b; ignored with --model)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="a local transformers MoE checkpoint directory instead of a random model (e.g. written "
                             "by tools/train_routing_model.py --save-model DIR): its routing is learned")
    parser.add_argument("--prompt-file", default=None, metavar="FILE",
                        help="with --model: a text file whose first --prompt tokens are the prompt (default: random "
                             "token ids)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="pairs of compiled runs (resident, offloaded) timed for each cache share (default 7)")
    parser.add_argument("--caches", default=None,
                        help="cache shares timed, in this order, comma-separated in (0, 1] (1: every expert cached, "
                             "all hits); default 1,0.25 for qwen3-30b-a3b, 1,0.5,0.25 for trained and --model")
    args = parser.parse_args()
    if min(args.layers, args.prompt, args.rounds) < 1 or args.new_tokens < 3:
        parser.error("--layers, --prompt and --rounds must be positive and --new-tokens at least 3 (the rate is a "
                     "median gap between decode steps)")
    if args.prompt_file and not args.model:
        parser.error("--prompt-file goes with --model (a random model has no text to read)")
    for flag, path in (("--model", args.model), ("--prompt-file", args.prompt_file)):
        if path and not os.path.exists(path):
            parser.error(f"{flag} {path}: no such file or directory")
    try:
        args.shares = [float(x) for x in args.caches.split(",")] if args.caches else None
    except ValueError:
        parser.error(f"--caches {args.caches}: give shares in (0, 1], comma-separated, e.g. 1,0.5,0.25")
    if args.shares is not None and not all(0 < x <= 1 for x in args.shares):
        parser.error(f"--caches {args.caches}: give shares in (0, 1], comma-separated, e.g. 1,0.5,0.25")
    args.error = parser.error
    return args


def main():
    import freetoken_plugin
    from torch._dynamo.utils import counters

    args = parse_args()
    if args.model:
        config = read_config(args.model)
        L, E = moe_layers_and_experts(config)
        vocab = config.get_text_config().vocab_size
        what = f"the checkpoint {os.path.basename(os.path.normpath(args.model))} (learned routing)"
        shares = args.shares or [1.0, 0.5, 0.25]
        make = lambda device: load_checkpoint(args.model, device)
    else:
        L, fields = args.layers, SHAPES[args.shape][0]
        E, vocab = fields["num_experts"], fields["vocab_size"]
        what = f"a {L}-layer Qwen3-MoE model of the {args.shape} shape (random bf16 weights)"
        shares = args.shares or list(SHAPES[args.shape][1])
        # Built on the GPU (quickly, the resident model's weights: the same seed on the same device),
        # then moved where asked.
        make = lambda device: build_model(L, args.shape).to(device)
    small = [x for x in shares if int(x * L * E) < E]  # a pool streams a layer at a time
    if small and args.caches:
        args.error(f"--caches {small[0]:g}: a cache of {L} MoE layer{'s' if L != 1 else ''} needs at least "
                   f"one layer's experts, a share of {math.ceil(1000 / L) / 1000:g} or more")
    if small:  # the shape's default shares that so few layers cannot take
        print(f"[bench_compile] {L} layers: skipping the cache shares below one layer "
              f"({', '.join(f'{x:g}' for x in small)})", flush=True)
        shares = [x for x in shares if x not in small]
    if not torch.cuda.is_available():
        raise SystemExit("bench_compile.py times compiled decode in CUDA graphs: run it on a machine with a GPU")
    # Each offloaded model's pool is a new object the compiled code guards on: new cache entries per
    # share beside the resident model's (those of freed models still count), and under fullgraph=True
    # reaching dynamo's limit (8) fails the run. Two a share and a margin.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 + 2 * len(shares))
    if args.prompt_file:
        prompt = text_prompt(args.prompt_file, args.model, args.prompt).cuda()
    else:
        prompt = torch.randint(1, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    rows = []
    name = "compile_model" if args.model else "compile" if args.shape == "qwen3-30b-a3b" else f"compile_{args.shape}"
    meta = {"shape": args.model or args.shape, "layers": L, "experts": E, "prompt": args.prompt,
            "prompt_file": args.prompt_file, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "cache_shares": shares}

    def record(config, cache, mode, model, runs, handle=None):
        ms, ttft, tokens, hit_rate = timed_generate(model, prompt, args.new_tokens, runs, mode == "compiled", handle)
        rows.append(dict(model=config, cache=cache, mode=mode, ms_per_token=round(ms, 3),
                         tokens_per_s=round(1e3 / ms, 1), ttft_ms=round(ttft, 1)))
        if hit_rate is not None:
            rows[-1]["decode_hit_rate"] = round(hit_rate, 3)
        print(rows[-1], flush=True)
        return tokens

    # The resident model stays, compiled, beside each offloaded one (a model of its own, the same
    # weights, built once the previous one is gone), and the two are timed in alternation: a decode
    # step of these models is mostly host work (generate's Python), whose speed drifts by tens of
    # percent within a process, so only runs side by side compare.
    resident = make("cuda")
    want = record("resident", "-", "eager", resident, 2)
    meta["resident_compiled_tokens_equal_eager"] = torch.equal(record("resident", "-", "compiled", resident, 3), want)
    resident_ms = rows[-1]["ms_per_token"]
    rows[-1]["vs_resident_compiled"] = 1.0
    rows[0]["vs_resident_compiled"] = round(rows[0]["ms_per_token"] / resident_ms, 3)
    for share in shares:
        torch.cuda.empty_cache()
        # On the host until offloaded (a random model's GPU copy freed first), so the pool never
        # sits beside a second full copy of the experts on the GPU.
        model = make("cpu")
        torch.cuda.empty_cache()
        counters.clear()
        handle = freetoken_plugin.offload_experts(model, cache_slots=int(share * L * E), device="cuda",
                                                  progress=False)
        if share == 1.0:
            admit_every_expert(handle.runtime)
        tokens = record("offloaded", f"{share:.0%}", "eager", model, 2, handle)
        rows[-1]["vs_resident_compiled"] = round(rows[-1]["ms_per_token"] / resident_ms, 3)
        # Compiles and captures; the timed runs are the pairs.
        compiled_tokens = timed_generate(model, prompt, args.new_tokens, 2, True, handle)[2]
        row = dict(model="offloaded", cache=f"{share:.0%}", mode="compiled",
                   **paired_runs(resident, model, handle, prompt, args.new_tokens, args.rounds),
                   tokens_equal_eager=bool(torch.equal(compiled_tokens, tokens)),
                   cudagraph_skips=counters["inductor"]["cudagraph_skips"])
        rows.append(row)
        print(row, flush=True)
        write_report(name, rows, meta)  # after each share: a later failure keeps what was measured
        del model, handle
        gc.collect()
    print_table(f"decode of {what}, bf16, static cache. Compiled offloaded rows: medians over --rounds {args.rounds} "
                "pairs of runs beside the resident compiled model (resident_paired_ms), paired_vs_resident the median "
                "ratio of the pairs (not the ratio of the two medians); decode_hit_rate: the mean over those runs of "
                "one prompt. vs_resident_compiled: against the resident compiled run before the pairs (eager rows). "
                "Goal: "
                "offloaded compiled at >= 85 % hits within 1.15x of resident compiled", rows,
                ["model", "cache", "mode", "ms_per_token", "tokens_per_s", "ttft_ms", "vs_resident_compiled",
                 "resident_paired_ms", "paired_vs_resident", "paired_spread", "tokens_equal_eager", "cudagraph_skips",
                 "decode_hit_rate"])


if __name__ == "__main__":
    main()
