"""`freetoken bench`: one end-to-end benchmark of a Qwen3-30B-A3B-shaped transformers model (random
bf16 weights) through the public API, every strategy in one run:

  resident        the whole model on the GPU (eager, and decode compiled: CUDA graphs)
  accelerate      accelerate's offload: the experts on the CPU, moved to the GPU by hooks per forward
  cpu-experts     the experts computed on the CPU from the host pool, the rest on the GPU (the
                  llama.cpp --cpu-moe strategy: freetoken with fetch_fraction=0)
  freetoken       offload_experts at several cache sizes (eager, and decode compiled)

For each: time to first token at several prompt lengths (an empty cache for the offloaded ones),
a second turn (new tokens appended to a history already in the KV cache), and decode tokens/s
under routing calibrated to the recorded routing fixture (random weights route almost constantly;
the router's choice is replaced by the calibrated trace during decode). Prints two tables (every
measurement, then each row against its peers of the same run), writes JSON (and a plot where
matplotlib is installed) to --out.
"""
import functools
import gc
import inspect
import json
import math
import os
import re
import statistics
import time
from typing import Dict, List, Optional

import torch

from ft_ops.policies import DEFAULT_EVICTION, POLICIES
from ft_ops.slot_pool import ExpertShape

from . import host_memory
from .cli_routing import UsageError, cannot_write, comma_separated
from .offload import quantized_format

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "routing",
                       "byte_qwen3moe_8x32_top4.safetensors")


DECODE_PROMPT = 64  # the prompt of the decode runs, in tokens


def add_command(sub) -> None:
    bench = sub.add_parser("bench", help="end-to-end benchmark against resident, accelerate and CPU-expert peers")
    bench.add_argument("--layers", type=int, default=48, help="MoE layers of the model (default 48, Qwen3-30B-A3B)")
    bench.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    bench.add_argument("--experts", type=int, default=128, help="experts per layer (default 128)")
    bench.add_argument("--top-k", type=int, default=8, help="experts routed per token (default 8)")
    bench.add_argument("--expert-intermediate", type=int, default=768, help="expert intermediate size (default 768)")
    bench.add_argument("--prompts", default="2048,8192,32768", type=comma_separated,
                       help="prompt lengths for the time to first token (default 2048,8192,32768)")
    bench.add_argument("--peer-prompts", default="shortest", type=comma_separated,
                       help="prompt lengths timed for accelerate and cpu-experts, which take seconds a forward: "
                            "shortest (of --prompts; the default), all (every one of --prompts) or some of --prompts")
    bench.add_argument("--turn", default="8192,2048", type=comma_separated,
                       help="history,new tokens of the second turn (default 8192,2048)")
    bench.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed a strategy (default 64)")
    bench.add_argument("--cache-gib", default="8,16,32", type=comma_separated, help="freetoken cache sizes (GiB; default 8,16,32)")
    bench.add_argument("--formats", default="bf16", type=comma_separated,
                       help="freetoken's expert formats: bf16, fp8 (block-FP8 experts, "
                       "offload_experts(quantize='fp8')), int4 (quantize='int4'), comma-separated (default bf16)")
    bench.add_argument("--strategies", default="resident,accelerate,cpu-experts,freetoken", type=comma_separated,
                       help="comma-separated: resident, accelerate, cpu-experts, freetoken (default all four)")
    bench.add_argument("--fetch-fractions", default="1", type=comma_separated,
                       help="freetoken's decode split, comma-separated: 1 (every miss over the link), a share in "
                            "[0, 1], or auto (each call's misses divided between the link and the CPU by this "
                            "machine's measured costs; default 1)")
    bench.add_argument("--evictions", default=DEFAULT_EVICTION, type=comma_separated,
                       help="freetoken's eviction policies, comma-separated: lru, opportunity, hitdensity, duel (a row "
                            f"each; default {DEFAULT_EVICTION}, whose rows go unnamed)")
    bench.add_argument("--no-compile", action="store_true", help="eager decode only")
    bench.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda (or cpu; default cuda where there is one)")
    bench.add_argument("--out", default="out", help="directory for bench_e2e.json and the plot (default out)")
    bench.add_argument("--append", action="store_true",
                       help="add this run's rows to the bench_e2e.json already in --out (the same model shape, "
                            "--turn, --decode-tokens and device; "
                            "a strategy measured again replaces its row; a row of an earlier default eviction "
                            "takes its policy's name), then report them all: a table too "
                            "long for one process can be measured strategy by strategy")


def fetch_fractions(args) -> List:
    """--fetch-fractions as values: floats in [0, 1] and "auto" (argument_problem checked them)."""
    return [x if x == "auto" else float(x) for x in args.fetch_fractions.split(",")]


def peer_prompts(args) -> List[int]:
    """--peer-prompts as lengths (argument_problem checked them)."""
    prompts = [int(x) for x in args.prompts.split(",")]
    if args.peer_prompts == "shortest":
        return [min(prompts)]
    if args.peer_prompts == "all":
        return prompts
    return [int(x) for x in args.peer_prompts.split(",")]


def expert_bytes_of(args, fmt: str) -> int:
    """The bytes of one of the benchmark model's experts in --formats `fmt` (bf16, or what
    offload_experts(quantize=fmt) makes of them); a ValueError, in --formats' words, where the format
    cannot take them."""
    pool_format, group = quantized_format(None if fmt == "bf16" else fmt, args.hidden, args.expert_intermediate, True,
                                          argument="--formats")
    return ExpertShape(1, args.experts, args.hidden, args.expert_intermediate, torch.bfloat16, False, pool_format,
                       group=group).expert_bytes


def argument_problem(args) -> Optional[str]:
    if args.peer_prompts not in ("shortest", "all"):
        try:
            lengths = [int(x) for x in args.peer_prompts.split(",")]
        except ValueError:
            lengths = [0]
        if min(lengths) < 1:
            return (f"--peer-prompts {args.peer_prompts}: give shortest, all, or positive prompt lengths "
                    "(comma-separated, e.g. --peer-prompts 2048,8192)")
    try:
        prompts = [int(x) for x in args.prompts.split(",")]
        turn = [int(x) for x in args.turn.split(",")]
        caches = [float(x) for x in args.cache_gib.split(",")]
    except ValueError:
        return "--prompts, --turn and --cache-gib take comma-separated numbers"
    if len(turn) != 2:
        return f"--turn takes two lengths, HISTORY,NEW (e.g. --turn 8192,2048), got --turn {args.turn}"
    if min(prompts) < 1 or min(turn) < 1 or not all(math.isfinite(g) and g > 0 for g in caches):
        return (f"prompt lengths, the turn's two lengths and cache sizes must be positive, got --prompts {args.prompts} "
                f"--turn {args.turn} --cache-gib {args.cache_gib}")
    if args.peer_prompts not in ("shortest", "all"):
        other = sorted(set(int(x) for x in args.peer_prompts.split(",")) - set(prompts))
        if other:  # a peer's TTFT at a length no other row has compares with nothing
            return (f"--peer-prompts {args.peer_prompts}: {', '.join(map(str, other))} is not one of --prompts "
                    f"{args.prompts}; the peers are timed at lengths the other rows have")
    formats = set(args.formats.split(","))
    if not formats or formats - {"bf16", "fp8", "int4"}:
        return f"--formats {args.formats}: choose from bf16, fp8, int4 (comma-separated)"
    for x in args.fetch_fractions.split(","):
        try:
            ok = x == "auto" or 0.0 <= float(x) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            return f"--fetch-fractions: {x!r} is not a share in [0, 1] or auto"

    bad = set(args.evictions.split(",")) - set(POLICIES)
    if bad:
        return f"--evictions: unknown {sorted(bad)}; choose from {', '.join(sorted(POLICIES))}"
    unknown = set(args.strategies.split(",")) - {"resident", "accelerate", "cpu-experts", "freetoken"}
    if unknown:
        return f"--strategies: unknown {sorted(unknown)}; choose from resident, accelerate, cpu-experts, freetoken"
    if set(args.strategies.split(",")) == {"accelerate"} and not args.device.startswith("cuda"):
        return ("--strategies accelerate: accelerate's offload copies the experts to a GPU each forward, so it is "
                "measured on --device cuda only (on the CPU the experts already are in host memory)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out} is a file; give a directory for bench_e2e.json and the plot"
    if args.decode_tokens < 3:  # the rate is the median gap between tokens after the first two
        return f"--decode-tokens {args.decode_tokens}: give at least 3 (the decode rate is timed from the third token on)"
    for option in ("layers", "experts", "hidden", "expert_intermediate", "top_k"):
        if getattr(args, option) < 1:
            return f"--{option.replace('_', '-')} must be positive, got {getattr(args, option)}"
    if args.top_k > args.experts:
        return f"--top-k {args.top_k} routes more experts than a layer has (--experts {args.experts})"
    for option in ("hidden", "expert_intermediate"):
        if getattr(args, option) % 8:  # bf16 rows of 16-byte multiples: the grouped GEMMs' strides
            return (f"--{option.replace('_', '-')} {getattr(args, option)}: give a multiple of 8 (the grouped "
                    "GEMMs need rows of 16-byte multiples)")
    if "freetoken" in args.strategies.split(","):
        # A pool streams prompts through two regions of a layer's experts: it needs at least one.
        for fmt in formats:
            try:
                expert_bytes = expert_bytes_of(args, fmt)
            except ValueError as error:
                return str(error)
            small = [g for g in caches if int(g * 2**30) // expert_bytes < args.experts]
            if small:
                need = args.experts * expert_bytes / 2**30
                return (f"--cache-gib {small[0]:g} holds fewer than one layer's {args.experts} {fmt} experts "
                        f"({need:.3g} GiB), which prefill streaming needs; give at least {need:.3g}")
    # Every strategy holds the experts in host memory at some point (the host pool, the CPU's
    # copy, or the whole model on the CPU): refuse a model that cannot fit before building it.
    # On the CPU the model itself is in host memory too, so an offloading strategy holds its experts
    # twice while it fills the host pool, beside a slot cache that is host memory as well.
    layer_bytes = args.experts * 3 * args.hidden * args.expert_intermediate * 2  # bf16
    offloads = bool({"cpu-experts", "freetoken"} & set(args.strategies.split(",")))
    on_cpu = not args.device.startswith("cuda")
    copies = 2 if on_cpu and offloads else 1
    # (a cache holds at most every expert: offload_experts caps its slots there)
    cache = (min(int(max(caches) * 2**30), args.layers * layer_bytes)
             if on_cpu and "freetoken" in args.strategies.split(",") else 0)
    need = copies * args.layers * layer_bytes + cache
    available = host_memory.available_host_bytes()
    if available is not None and need > available:
        per_layer = copies * layer_bytes + (layer_bytes if cache else 0)  # the cache at its largest
        fit = max(1, int(0.8 * available // per_layer))
        held = "twice (the model and its host pool, while offloading)" if copies == 2 else "once"
        return (f"this run needs {need / 2**30:.1f} GiB of host memory ({args.layers} layers of "
                f"{layer_bytes / 2**30:.3g} GiB of experts, held {held}"
                f"{f', and a cache of {cache / 2**30:.3g} GiB' if cache else ''}) and this machine has "
                f"{available / 2**30:.1f} GiB available; pass fewer --layers (e.g. --layers {fit})")
    # Last, once every other argument is good (a refused run leaves no directory behind): found
    # now, not after every strategy has been measured.
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        return f"--out {args.out}: cannot create it ({e.strerror}); give a writable directory"
    why = cannot_write(args.out)
    if why:
        return f"--out {args.out} is not writable ({why}); give a writable directory"
    return None


# --- the model and its routing ---------------------------------------------------------------------

def longest_sequence(args) -> int:
    """The most positions a run uses: its longest prompt, the second turn, or a decode run (a
    64-token prompt and its tokens)."""
    history, new = (int(x) for x in args.turn.split(","))
    decoded = max(args.decode_tokens, SLOW_DECODE_TOKENS)
    return max(max(int(x) for x in args.prompts.split(",")), history + new, DECODE_PROMPT + decoded)


def build_model(args, device):
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=32768, hidden_size=args.hidden, num_hidden_layers=args.layers,
                               num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 512),
                               head_dim=64, moe_intermediate_size=args.expert_intermediate, num_experts=args.experts,
                               num_experts_per_tok=args.top_k, intermediate_size=3 * args.hidden,
                               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                               max_position_embeddings=longest_sequence(args) + 64,
                               bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


class ReplayRouter(torch.nn.Module):
    """A router that, for one-token calls (decode), returns the expert ids in its `ids` buffer (the
    calibrated trace's next step, written before each step) with equal weights; longer calls go to
    the model's own router. The buffer is a module buffer, so compiled decode replays read it."""

    def __init__(self, router: torch.nn.Module, top_k: int, device):
        super().__init__()
        self.router = router
        self.register_buffer("ids", torch.zeros(1, top_k, dtype=torch.long, device=device))

    def forward(self, hidden_states):
        logits, weights, ids = self.router(hidden_states)
        if hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0] != 1:
            return logits, weights, ids
        return logits, torch.full_like(weights, 1.0 / weights.shape[-1]), self.ids


def install_replay_routers(model, attribute: str = "gate") -> List[ReplayRouter]:
    """A ReplayRouter around every layer's router, `layer.mlp.<attribute>` (Qwen3-MoE's gate,
    GPT-OSS's router: both return (logits, weights, ids))."""
    routers = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, attribute)
        if isinstance(gate, ReplayRouter):  # installed by an earlier strategy's measurement
            gate = gate.router
        replay = ReplayRouter(gate, model.config.num_experts_per_tok, next(model.parameters()).device)
        setattr(layer.mlp, attribute, replay)
        routers.append(replay)
    return routers


# Generate runs of a strategy's decode measurement: eager (a warm-up and the timed run), then
# compiled (compiling and capturing, a warm-up, the timed run).
EAGER_DECODE_RUNS = 2
DECODE_RUNS = EAGER_DECODE_RUNS + 3


def calibrated_decode_routing(args, steps: int) -> torch.Tensor:
    """[steps, layers, top_k] ids drawn by ft_ops.synthetic_routing, calibrated to the fixture."""
    from ft_ops.synthetic_routing import calibrate
    from ft_ops.traces import Trace

    model, _ = calibrate(Trace.load(FIXTURE), tokens=200, iterations=4)
    print(f"[bench] decode routing: synthetic, repeat {model.repeat:.3f}, zipf {model.zipf:.3f} (calibrated to "
          "the recorded fixture)", flush=True)
    return model.draw(args.layers, args.experts, args.top_k, steps + 2, seed=1)


class StepFeeder:
    """A generate() streamer and stopping criterion in one: stamps each token's arrival and writes
    the next decode step's routing into every layer's ReplayRouter. The trace waits on the routers'
    device, and a step is written with one multi-tensor copy: a copy per layer from host memory cost
    about a millisecond of host time a token at 48 layers, which no real model pays."""

    def __init__(self, routers, routing: torch.Tensor, after_prompt=None):
        self.targets = [router.ids for router in routers]
        on_device = routing.to(self.targets[0].device, self.targets[0].dtype)
        self.steps = [list(step[:, None].unbind(0)) for step in on_device]  # [layers] of [1, top_k]
        self.step, self.times = 0, []
        # Called once the prompt's forward has given the first token, before the first decode step
        # (e.g. to read counters that should cover decode only; its host sync falls before the
        # timed gaps, which start at the second token).
        self.after_prompt = after_prompt

    def feed(self):
        torch._foreach_copy_(self.targets, self.steps[min(self.step, len(self.steps) - 1)])
        self.step += 1

    def put(self, value):  # streamer: called with the prompt, then with each new token
        if self.step == 1 and self.after_prompt is not None:
            self.after_prompt()
        self.times.append(time.perf_counter())
        self.feed()

    def end(self):
        pass


# --- measurements ------------------------------------------------------------------------------------

def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_to_first_token(model, tokens: int, device, reps: int = 2, warm_up: bool = True, before=None) -> float:
    """Seconds of a prefill of `tokens` tokens and its first token (median of reps, after one untimed
    run when warm_up: the first run of a length pays one-time set-up such as kernel selection);
    `before` runs before each (e.g. emptying the cache)."""
    ids = torch.randint(1, 32768, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)
    times = []
    for _ in range(reps + int(warm_up)):
        if before:
            before()
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[int(warm_up):])



def admission_counts(handle) -> tuple:
    """(distinct routed experts, hits) of an offloaded model's admissions so far."""
    admit = handle.stats().get("admit", {})
    distinct = admit.get("distinct", 0)
    return distinct, distinct - admit.get("copied", 0) - admit.get("cpu_experts", 0)


class DecodeHits:
    """The hit rate of an offloaded model's decode steps in the last generate() run (the timed one):
    the admission counters read after the run's prompt (StepFeeder's after_prompt) and at its end."""

    def __init__(self, handle):
        self.handle, self.start, self.distinct, self.hits = handle, None, 0, 0

    def after_prompt(self) -> None:
        self.start = admission_counts(self.handle)

    def run_ended(self) -> None:
        if self.start is not None:
            distinct, hits = admission_counts(self.handle)
            self.distinct, self.hits = distinct - self.start[0], hits - self.start[1]
            self.start = None

    def rate(self) -> Optional[float]:
        """The share of the decode steps' distinct routed experts that were resident."""
        return round(self.hits / self.distinct, 3) if self.distinct else None


def experts_copied(handle) -> int:
    """Experts an offloaded model has copied over the link so far (streamed and admitted)."""
    counts = handle.stats()
    return counts["stream"]["copied"] + counts["admit"]["copied"]


def cache_argument(model) -> str:
    """The name the model's forward gives its KV cache: `cache` in transformers releases after 5.17
    (where `past_key_values` only warns until it is removed), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

def second_turn(model, history: int, new: int, device, warm_up: bool = True, before=None, copied=None):
    """Seconds to the first token of a turn of `new` tokens appended to `history` tokens already in
    the KV cache (the first turn is not timed). With warm_up the whole exchange runs once untimed
    first, so that one-time set-up of these shapes is not in the figure. With `copied` (a callable
    giving the experts copied over the link so far, read outside the timed part), returns
    (seconds, experts the timed turn copied); else the seconds."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(history + new)
    first = torch.randint(1, 32768, (1, history), generator=gen).to(device)
    second = torch.randint(1, 32768, (1, new), generator=gen).to(device)
    elapsed, moved = 0.0, 0
    for _ in range(1 + int(warm_up)):
        if before:
            before()
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            kv = {cache_argument(model): cache}
            model(first, use_cache=True, **kv)
            sync(device)
            start = copied() if copied else 0
            t0 = time.perf_counter()
            logits = model(second, use_cache=True, **kv).logits[:, -1]
            logits.argmax(-1).tolist()  # the first token of the turn, on the host
        sync(device)
        elapsed = time.perf_counter() - t0
        moved = copied() - start if copied else 0
    return (elapsed, moved) if copied else elapsed


def run_routing(routing: torch.Tensor, run: int) -> torch.Tensor:
    """The steps of a strategy's `run`-th decode run: consecutive slices of one trace, so that every
    run decodes steps no earlier run saw (replaying the same steps, a run would find the cache
    holding exactly the experts they route to) and every strategy the same ones in the same order."""
    steps = routing.shape[0] // DECODE_RUNS
    return routing[run * steps:(run + 1) * steps]


def decode_rate(model, routers, routing, new_tokens: int, device, compiled: bool, runs: int = 2,
                hits: Optional[DecodeHits] = None, first_run: int = 0) -> float:
    """Decode tokens/s of the last of `runs` generate() runs (the compiled measurement adds one that
    compiles): the median gap between generated tokens, run i replaying run_routing(routing,
    first_run + i). With `hits`, that run's decode hit rate is kept there."""
    from transformers import CompileConfig

    how = (dict(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")) if compiled
           else dict(disable_compile=True))
    prompt = torch.randint(1, 32768, (1, DECODE_PROMPT), generator=torch.Generator().manual_seed(3)).to(device)
    runs = runs + 1 if compiled else runs  # the first compiled run compiles and captures
    for run in range(runs):
        after_prompt = hits.after_prompt if hits is not None else None
        feeder = StepFeeder(routers, run_routing(routing, first_run + run), after_prompt)
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           cache_implementation="static", streamer=feeder, **how)
        sync(device)
        if hits is not None:
            hits.run_ended()
    gaps = [b - a for a, b in zip(feeder.times[2:], feeder.times[3:])]
    return 1.0 / statistics.median(gaps)


def measure(name: str, model, args, device, routing, compiled_too: bool,
            prompts: Optional[List[int]] = None, slow: bool = False, link: Optional[float] = None,
            handle=None) -> List[Dict]:
    """One row per strategy (two with compiled decode). A slow strategy (seconds a forward: it moves
    or computes every expert each time) times one prompt once with no warm-up, and decodes
    SLOW_DECODE_TOKENS tokens once. An offloaded model (`handle`, with the link's rate `link`) also
    times its longest prompt with the cache as the previous run of that prompt left it (warm), and
    gives that prompt and the second turn their own link bounds: the experts they copied over the
    link (the share of the layers not resident already), at the link's rate; its cache is emptied
    before every other timed prompt."""
    empty = handle.runtime.pool.invalidate if handle is not None else None
    prompts = prompts if prompts is not None else [int(x) for x in args.prompts.split(",")]
    history, new = (int(x) for x in args.turn.split(","))
    row = dict(strategy=name, measured=time.strftime("%Y-%m-%d %H:%M"))  # --append joins runs: say when
    for tokens in prompts:
        row[f"ttft_{tokens}_s"] = round(time_to_first_token(model, tokens, device, reps=1 if slow else 2,
                                                                  warm_up=not slow, before=empty), 3)
        print(f"[bench] {name}: {tokens} tokens to the first token in {row[f'ttft_{tokens}_s']} s", flush=True)
    if handle is not None:
        copied = functools.partial(experts_copied, handle)
        # The link bound of what was copied (none without a link: on the CPU).
        bound = lambda experts: round(experts * handle.runtime.shape.expert_bytes / link, 3)
        tokens = max(prompts)
        time_to_first_token(model, tokens, device, reps=1, warm_up=False)  # leaves the cache as a run does
        start = copied()
        row[f"ttft_warm_{tokens}_s"] = round(time_to_first_token(model, tokens, device, reps=2, warm_up=False), 3)
        moved_warm = (copied() - start) / 2
        seconds, moved_turn = second_turn(model, history, new, device, warm_up=not slow, before=empty, copied=copied)
        row["turn2_s"] = round(seconds, 3)
        if link is not None:
            row["warm_link_bound_s"], row["turn2_link_bound_s"] = bound(moved_warm), bound(moved_turn)
    else:
        row["turn2_s"] = round(second_turn(model, history, new, device, warm_up=not slow, before=empty), 3)
    routers = install_replay_routers(model)
    hits = DecodeHits(handle) if handle is not None else None
    row["decode_tok_s"] = round(decode_rate(model, routers, routing, SLOW_DECODE_TOKENS if slow else args.decode_tokens,
                                            device, False, runs=1 if slow else EAGER_DECODE_RUNS, hits=hits), 1)
    if hits is not None:
        row["decode_hit_rate"] = hits.rate()
    rows = [row]
    if compiled_too:
        torch._dynamo.reset()
        compiled = dict(strategy=name + COMPILED)
        hits = DecodeHits(handle) if handle is not None else None
        skips = cuda_graph_skips()
        compiled["decode_tok_s"] = round(decode_rate(model, routers, routing, args.decode_tokens, device, True,
                                                     hits=hits, first_run=EAGER_DECODE_RUNS), 1)
        if hits is not None:
            compiled["decode_hit_rate"] = hits.rate()
        skipped = cuda_graph_skips() - skips
        if skipped or torch.device(device).type == "cuda":  # off CUDA there are no CUDA graphs to skip
            compiled["cuda_graphs_skipped"] = skipped
        if skipped:
            print(f"[bench] warning: {compiled['strategy']}: torch.compile skipped {skipped} CUDA graph(s) "
                  "(its log says why): this row's decode did not run from CUDA graphs alone", flush=True)
        rows.append(compiled)
    for r in rows:
        print(f"[bench] {r}", flush=True)
    return rows


def cuda_graph_skips() -> int:
    """How many graphs torch.compile's CUDA graph trees have refused so far in this process (each
    then runs without CUDA graphs: a mutated input, a CPU tensor, ...)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def link_bytes_per_s(device) -> Optional[float]:
    """The pinned host-to-device copy rate (one 512 MiB copy through the copy engine, median of 3):
    the link bound's rate. None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    nbytes = 512 << 20
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / statistics.median(times[1:])


def accelerate_offload(model, layers: int, device):
    """The model as accelerate offloads it when a device_map puts the experts on the CPU: the
    experts' weights stay in host memory and hooks copy them to the GPU at each forward. The experts
    move to the CPU first: dispatch_model keeps an offloaded module's weights where they already are,
    so a model built on the GPU would copy them device to device and offload nothing."""
    from accelerate import dispatch_model

    for i in range(layers):
        model.model.layers[i].mlp.experts.to("cpu")
    device_map = {"": device.index or 0}
    device_map.update({f"model.layers.{i}.mlp.experts": "cpu" for i in range(layers)})
    return dispatch_model(model, device_map=device_map)


def free() -> None:
    """Returns the memory of a strategy's model once its caller has dropped every reference to it
    (`del model`): its compiled graphs go too, and the caching allocators' free blocks."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()


# Strategies that move or compute every expert per token decode this many tokens (a few seconds
# a token at full size; the median gap needs only a few).
SLOW_DECODE_TOKENS = 6


# --- strategies --------------------------------------------------------------------------------------

def run(args) -> int:
    import freetoken_plugin

    device = torch.device(args.device)
    for option in ("prompts", "cache_gib", "formats", "strategies", "fetch_fractions", "evictions"):
        setattr(args, option, ",".join(dict.fromkeys(getattr(args, option).split(","))))  # each value once
    if args.append:
        problem = append_problem(args, _earlier_report(args))
        if problem:  # before anything is measured
            raise UsageError(problem)
    strategies = args.strategies.split(",")
    compiled = not args.no_compile and device.type == "cuda"
    if not args.no_compile and not compiled:
        print("[bench] compiled decode: measured on CUDA only (its CUDA graphs); eager decode here", flush=True)
    routing = calibrated_decode_routing(args, (args.decode_tokens + 8) * DECODE_RUNS)
    rows: List[Dict] = []
    if "resident" in strategies:
        model = build_model(args, device)
        rows += measure("resident", model, args, device, routing, compiled)
        del model  # before the next strategy builds its own: two 48-layer models do not fit beside a cache
        free()
    if "accelerate" in strategies and device.type != "cuda":
        print("[bench] accelerate: not measured on the CPU (its offload copies the experts to a GPU each forward)",
              flush=True)
    if "accelerate" in strategies and device.type == "cuda":
        model = accelerate_offload(build_model(args, device), args.layers, device)
        # Every forward moves each layer's experts over the link: by default only the shortest prompt.
        rows += measure("accelerate offload", model, args, device, routing, False, prompts=peer_prompts(args), slow=True)
        del model
        free()
    if "cpu-experts" in strategies:
        model = build_model(args, device)
        freetoken_plugin.offload_experts(model, cache_slots=args.top_k, device=device, fetch_fraction=0.0,
                                         stream_prefill=False, progress=False)
        # Compiled decode too: the CPU share runs inside the CUDA graphs.
        rows += measure("cpu-experts", model, args, device, routing, compiled, prompts=peer_prompts(args), slow=True)
        del model
        free()
    if "freetoken" in strategies:
        link = link_bytes_per_s(device)
        measured_pools = {}  # (format, slots, fetch fraction, eviction) -> the cache size that measured it
        for fmt, gib, fraction, eviction in ((f, float(x), fetch, e) for f in args.formats.split(",")
                                             for x in args.cache_gib.split(",") for fetch in fetch_fractions(args)
                                             for e in args.evictions.split(",")):
            # Sizes that give the same pool (those beyond the model's experts: all of them) are measured once.
            slots = min(int(gib * 2**30) // expert_bytes_of(args, fmt), args.layers * args.experts)
            key = (fmt, slots, fraction, eviction)
            if key in measured_pools:
                every = ", every expert of the model" if slots == args.layers * args.experts else ""
                print(f"[bench] freetoken {fmt} {gib:g} GiB: the same pool as {measured_pools[key]:g} GiB ({slots} "
                      f"slots{every}): not measured again", flush=True)
                continue
            measured_pools[key] = gib
            model = build_model(args, device)
            quantize = dict(quantize=fmt) if fmt != "bf16" else {}
            handle = freetoken_plugin.offload_experts(model, cache_bytes=int(gib * 2**30), device=device, progress=False,
                                                      fetch_fraction=fraction, eviction=eviction, **quantize)
            split = "" if fraction == 1.0 else " split auto" if fraction == "auto" else f" fetch {fraction:g}"
            policy = "" if eviction == DEFAULT_EVICTION else f" {eviction}"  # the default policy goes unnamed
            name = f"freetoken{'' if fmt == 'bf16' else ' ' + fmt} {gib:g} GiB ({handle.slots} slots){split}{policy}"
            measured = measure(name, model, args, device, routing, compiled, link=link, handle=handle)
            for row in measured:
                row["eviction"] = eviction  # the unnamed default's too: a report may join runs of other defaults
            rows += measured
            if link is not None:
                # From an empty cache a prompt moves every expert once: the link bound of its TTFT.
                rows[-1 - int(compiled)]["link_bound_s"] = round(handle.host_bytes / link, 3)
                rows[-1 - int(compiled)]["link_GBps"] = round(link / 1e9, 1)
            del model, handle
            free()
    if args.append:
        rows = appended(rows, args)
    report(rows, args, device)
    return 0


SHAPE_KEYS = ("layers", "experts", "top_k", "hidden", "expert_intermediate")
RUN_KEYS = ("turn", "decode_tokens")
COMPILED = " (compiled decode)"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _earlier_report(args) -> Optional[Dict]:
    path = os.path.join(args.out, "bench_e2e.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"--append: {path} is not a readable bench report ({e}); use another --out") from None
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        raise UsageError(f"--append: {path} is not a bench report (no rows); use another --out")
    return report


def append_problem(args, earlier: Optional[Dict]) -> Optional[str]:
    """Why `earlier`, the report in args.out, cannot take this run's rows (another model shape,
    other settings, another device), or None; checked before the run measures anything."""
    if earlier is None:
        return None
    path = os.path.join(args.out, "bench_e2e.json")
    other = [k for k in SHAPE_KEYS if earlier.get(k) != getattr(args, k)]
    if other:
        differ = ", ".join(f"{k} {earlier.get(k)} there, {getattr(args, k)} now" for k in other)
        return f"--append: {path} measured another model shape ({differ}); use another --out"
    # The peers' ratios compare rows of one setting: the same second turn and decode length.
    other = {k: earlier.get(k) for k in RUN_KEYS if earlier.get(k) != getattr(args, k)}
    if other:
        return (f"--append: {path} was measured with other settings ({other}); pass the same "
                f"{', '.join('--' + k.replace('_', '-') for k in other)}, or use another --out")
    device = device_name(torch.device(args.device))
    if earlier.get("device") not in (None, device):
        return f"--append: {path} was measured on {earlier['device']}, this run is on {device}; use another --out"
    return None


def appended(rows: List[Dict], args) -> List[Dict]:
    """The rows of the report in args.out followed by these (a row of the same strategy replaced),
    refusing a report of another model shape."""
    earlier = _earlier_report(args)
    if earlier is None:
        return rows
    problem = append_problem(args, earlier)
    if problem:
        raise SystemExit(problem)
    for r in earlier["rows"]:
        if not r["strategy"].startswith("freetoken"):
            continue
        base = r["strategy"].removesuffix(COMPILED)
        named = [p for p in POLICIES if base.endswith(" " + p)]
        # Reports from before rows recorded their policy: a freetoken row names its policy unless it
        # ran the default of then, Opportunity (the default until 2026-12-02).
        r.setdefault("eviction", named[0] if named else "opportunity")
        # Rows take the names they would have now: a row of an earlier default went unnamed (it is
        # not this run's row of today's default, which must not replace it), and a row that named
        # today's default was not a default row then (this run's unnamed row replaces it).
        suffix = COMPILED if r["strategy"].endswith(COMPILED) else ""
        if not named and r["eviction"] != DEFAULT_EVICTION:
            r["strategy"] = f"{base} {r['eviction']}{suffix}"
        elif named and named[0] == DEFAULT_EVICTION:
            r["strategy"] = base.removesuffix(" " + DEFAULT_EVICTION) + suffix
    # A strategy measured again replaces its rows (its compiled-decode row too: this run may have none).
    new = {r["strategy"] for r in rows}
    kept = [r for r in earlier["rows"] if r["strategy"] not in new and r["strategy"].removesuffix(COMPILED) not in new]
    return kept + rows


def fresh_prompts(row: Dict) -> List[int]:
    """The prompt lengths a row timed from an empty cache (keys ttft_<tokens>_s), ascending."""
    return sorted(int(m.group(1)) for m in (re.fullmatch(r"ttft_(\d+)_s", k) for k in row) if m)


def against_peers(rows: List[Dict], args) -> List[Dict]:
    """Each row against its peer in the same run: TTFT and decode against the resident model (a
    compiled-decode row against resident compiled decode), TTFT against the link bound at each
    prompt length (every expert once: the cache was emptied), the warm prompt and the second turn
    against their own link bounds (the experts they copied), the second turn against a fresh prompt
    of the same length."""
    new = int(args.turn.split(",")[1])
    resident = {r["strategy"]: r for r in rows if r["strategy"].startswith("resident")}
    out = []
    for r in rows:
        compiled = r["strategy"].endswith(COMPILED)
        peer = resident.get("resident" + COMPILED if compiled else "resident", {})
        row = dict(strategy=r["strategy"])
        ttft = fresh_prompts(r)
        if ttft:
            n = ttft[-1]
            row["prompt"] = n
            if f"ttft_{n}_s" in peer:
                row["ttft_x_resident"] = round(r[f"ttft_{n}_s"] / peer[f"ttft_{n}_s"], 2)
            if "link_bound_s" in r:
                for m in ttft:
                    row[f"over_bound_{m}"] = round(r[f"ttft_{m}_s"] / r["link_bound_s"], 3)
        warm = [k for k in r if k.startswith("ttft_warm_")]
        if warm and r.get("warm_link_bound_s"):
            row["warm_over_share_bound"] = round(r[warm[0]] / r["warm_link_bound_s"], 3)
        if r.get("turn2_link_bound_s"):
            row["turn2_over_share_bound"] = round(r["turn2_s"] / r["turn2_link_bound_s"], 3)
        if "turn2_s" in r and f"ttft_{new}_s" in r:
            row["turn2_over_fresh"] = round(r["turn2_s"] / r[f"ttft_{new}_s"], 3)
        if "decode_tok_s" in r and "decode_tok_s" in peer:
            row["decode_x_resident"] = round(r["decode_tok_s"] / peer["decode_tok_s"], 3)
        out.append(row)
    return out


def print_rows(rows: List[Dict], columns: List[str]) -> None:
    widths = [max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths))))
    for r in rows:
        print("  ".join(str(r.get(c, "-")).ljust(w) if i == 0 else str(r.get(c, "-")).rjust(w)
                        for i, (c, w) in enumerate(zip(columns, widths))))


def report(rows: List[Dict], args, device) -> None:
    os.makedirs(args.out, exist_ok=True)
    prompts = sorted({n for r in rows for n in fresh_prompts(r)})
    warm = sorted({k for r in rows for k in r if k.startswith("ttft_warm_")})
    columns = (["strategy"] + [f"ttft_{n}_s" for n in prompts] + ["turn2_s", "decode_tok_s"] +
               [k for k in ["decode_hit_rate", "eviction", "cuda_graphs_skipped", "link_bound_s", *warm,
                            "warm_link_bound_s", "turn2_link_bound_s"]
                if any(k in r for r in rows)])
    meta = dict(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                expert_intermediate=args.expert_intermediate, turn=args.turn, decode_tokens=args.decode_tokens,
                device=device_name(device), torch=torch.__version__)
    peers = against_peers(rows, args)
    with open(os.path.join(args.out, "bench_e2e.json"), "w") as f:
        json.dump(dict(**meta, rows=rows, against_peers=peers), f, indent=1)
    quantized = {f: any(f" {f} " in r["strategy"] for r in rows) for f in ("fp8", "int4")}
    bf16 = any(not any(f" {f} " in r["strategy"] for f in quantized) for r in rows)  # the peers are bf16 too
    formats = " and ".join(["bf16"] * bf16 + [f.upper() for f, present in quantized.items() if present])
    print(f"\n## end to end: {args.layers} layers x {args.experts} experts (top-{args.top_k}), {formats} experts, "
          f"{meta['device']}")
    print_rows(rows, columns)
    joined = " (rows of several runs: see each row's measured time)" if args.append else " of the same run"
    print(f"\n## against the peers{joined} (TTFT at the longest prompt each row has; over_bound_<n>: the "
          f"prompt of n tokens from an empty cache against moving every expert once; *_over_share_bound: a prompt "
          f"on the cache a run left, and the second turn, against moving the experts they copied; turn2_over_fresh "
          f"< 1: the second turn beats a fresh {args.turn.split(',')[1]}-token prompt)")
    print_rows(peers, ["strategy", "prompt", "ttft_x_resident", *[f"over_bound_{n}" for n in prompts],
                       "warm_over_share_bound", "turn2_over_share_bound", "turn2_over_fresh", "decode_x_resident"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ttft = [f"ttft_{n}_s" for n in prompts]
    for c in ttft:
        named = [r for r in rows if c in r]
        a.barh([f"{r['strategy']} ({c.split('_')[1]} tokens)" for r in named], [r[c] for r in named])
    named = [r for r in rows if "turn2_s" in r]
    a.barh([f"{r['strategy']} (second turn)" for r in named], [r["turn2_s"] for r in named])
    a.set_xlabel("time to first token (s)")
    decode = [r for r in rows if "decode_tok_s" in r]
    b.barh([r["strategy"] for r in decode], [r["decode_tok_s"] for r in decode])
    b.set_xlabel("decode tokens/s")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_e2e.png"), dpi=120)
