"""What a long prompt between two decode runs costs the second run (issue 23's item 3: a prompt must
not flush the decode set), through the public API, at the Qwen3-30B-A3B shape (48 layers of 128
experts, bf16, random weights) with a 16 GiB cache. Decode routes by the synthetic routing
calibrated to the recorded fixture (as `freetoken bench`), so it has a decode set to keep.

For each eviction policy, from an emptied cache, in each of --rounds rounds (the two cases in
alternating order):
- without a prompt: a decode run fills the cache, then the next decode run (the trace's next steps)
  is measured;
- with a prompt: the same, with a streamed prompt of --prompt tokens between the two runs (timed,
  beside the link bound of the experts it copied; one untimed prompt runs before the first round).
Prints the second run's hit rate and eager tokens/s (the median over the rounds) in both cases and
their ratio (with the prompt against without), and how many of the first run's hottest pairs (a
quarter of the slots outside the streaming regions) were resident before the prompt and after it
(in the last round);
writes prompt_between_decodes.json to $OUT. The replayed routing replaces the router's choice in
decode steps only: the prompt routes by the model's random weights (a streamed pass copies whole
layers whatever they route; which experts it keeps in free slots follows that routing).

    python3 benchmarks/bench_prompt_between_decodes.py                  # 48 layers, 16 GiB, 8k prompt
    python3 benchmarks/bench_prompt_between_decodes.py --evictions lru,duel
    python3 benchmarks/bench_prompt_between_decodes.py --device cpu --layers 16 --hidden 256 --experts 32 \
        --top-k 4 --expert-intermediate 128 --cache-gib 0.025 --prompt 512 --decode-tokens 96   # CPU, ~30 s
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT, os.path.join(ROOT, "plugin")]

import freetoken_plugin  # noqa: E402
from common import print_table, write_report  # noqa: E402
from freetoken_plugin import bench_e2e  # noqa: E402
from ft_ops.policies import DEFAULT_EVICTION, POLICIES  # noqa: E402

SHORT_PROMPT = 4  # the decode runs' prompt: admits its experts (checked: never a streamed pass)


def decode_run(model, routers, routing, tokens: int, handle, device):
    """(hit rate, eager tokens/s) of one generate() of `tokens` tokens replaying `routing`'s steps."""
    hits = bench_e2e.DecodeHits(handle)
    feeder = bench_e2e.StepFeeder(routers, routing, hits.after_prompt)
    prompt = torch.randint(1, model.config.vocab_size, (1, SHORT_PROMPT),
                           generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       disable_compile=True, streamer=feeder)
    bench_e2e.sync(device)
    hits.run_ended()
    return hits.rate(), 1.0 / statistics.median(b - a for a, b in zip(feeder.times[2:], feeder.times[3:]))


def prompt_seconds(model, tokens: int, device) -> float:
    ids = torch.randint(1, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)
    bench_e2e.sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(ids).logits[:, -1].argmax(-1).tolist()
    bench_e2e.sync(device)
    return time.perf_counter() - t0


def hot_pairs(routing: torch.Tensor, count: int, experts: int) -> torch.Tensor:
    """The `count` (layer, expert) pairs that `routing` ([steps, layers, top_k]) routes most, as
    flat indices layer * experts + expert (the order of pool.slot_of's entries)."""
    steps, layers, top_k = routing.shape
    flat = (torch.arange(layers)[None, :, None] * experts + routing.cpu()).flatten()
    return torch.bincount(flat, minlength=layers * experts).topk(count).indices


def measure(model, handle, routers, routing, args, device, link) -> dict:
    """One policy's row: the second decode run without and with a prompt before it (args.rounds
    rounds, the cases in alternating order), and how many of the first run's hottest pairs the
    prompt left resident."""
    steps = args.decode_tokens + 4
    first, second = routing[:steps], routing[steps:2 * steps]
    pool, regions = handle.runtime.pool, handle.runtime.streamer.regions * args.experts
    outside = handle.slots - regions
    hot = hot_pairs(first[:args.decode_tokens], max(1, outside // 4), args.experts)
    row = dict(hot_pairs=len(hot))
    rates, speeds = {"without": [], "with": []}, {"without": [], "with": []}
    prompts, bounds = [], []

    def hot_resident() -> int:
        return int((pool.slot_of.view(-1).cpu()[hot] >= 0).sum())

    for round_ in range(args.rounds):
        for case in (("without", "with") if round_ % 2 == 0 else ("with", "without")):
            pool.invalidate()
            decode_run(model, routers, first, args.decode_tokens, handle, device)
            if case == "with":
                row["hot_before_prompt"] = hot_resident()
                streamed = handle.stats()["stream"]
                prompts.append(prompt_seconds(model, args.prompt, device))
                after = handle.stats()["stream"]
                row["hot_after_prompt"] = hot_resident()
                if after["calls"] == streamed["calls"]:
                    raise SystemExit(f"the {args.prompt}-token prompt was not streamed; give a longer --prompt")
                if link is not None:
                    bounds.append((after["copied"] - streamed["copied"]) * handle.runtime.shape.expert_bytes / link)
            rate, tok_s = decode_run(model, routers, second, args.decode_tokens, handle, device)
            rates[case].append(rate)
            speeds[case].append(tok_s)
    for case in ("without", "with"):
        row[f"hit_rate_{case}"] = statistics.median(rates[case])
        row[f"tok_s_{case}"] = round(statistics.median(speeds[case]), 1)
    row["prompt_s"] = round(statistics.median(prompts), 3)
    if bounds:
        row["prompt_link_bound_s"] = round(statistics.median(bounds), 3)
    row["hit_rate_ratio"] = round(row["hit_rate_with"] / row["hit_rate_without"], 3) if row["hit_rate_without"] else None
    row["tok_s_ratio"] = round(row["tok_s_with"] / row["tok_s_without"], 3)
    return row


def argument_problem(args) -> str:
    """Why the arguments cannot run (one line), or "": checked before any model is built."""
    unknown = [e for e in args.evictions.split(",") if e not in POLICIES]
    if unknown:
        return f"--evictions: unknown {unknown}; choose from {', '.join(sorted(POLICIES))}"
    if args.decode_tokens < 3:
        return f"--decode-tokens {args.decode_tokens}: give at least 3 (tokens/s is timed from the third token on)"
    if min(args.prompt, args.rounds, args.layers, args.experts, args.top_k) < 1 or not args.cache_gib > 0:
        return "--prompt, --rounds, --layers, --experts, --top-k and --cache-gib must be positive"
    if SHORT_PROMPT * args.top_k >= args.experts:
        return (f"--top-k {args.top_k} of --experts {args.experts}: the decode runs' {SHORT_PROMPT}-token prompt "
                "could stream; give more experts or a smaller top-k")
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-intermediate", type=int, default=768)
    parser.add_argument("--cache-gib", type=float, default=16.0)
    parser.add_argument("--prompt", type=int, default=8192, help="tokens of the prompt between the runs (default 8192)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens of each decode run (default 64)")
    parser.add_argument("--evictions", default=DEFAULT_EVICTION, help="eviction policies, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the two cases (default 2)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)
    # bench_e2e's model sizes its positions by these.
    args.prompts, args.turn = str(args.prompt), "1,1"
    device = torch.device(args.device)
    routing = bench_e2e.calibrated_decode_routing(args, 2 * (args.decode_tokens + 4))
    link = bench_e2e.link_bytes_per_s(device)
    rows = []
    for eviction in args.evictions.split(","):
        model = bench_e2e.build_model(args, device)
        try:
            handle = freetoken_plugin.offload_experts(model, cache_bytes=int(args.cache_gib * 2**30), device=device,
                                                      eviction=eviction, progress=False)
        except ValueError as e:  # a cache too small for streaming, ...
            raise SystemExit(f"--cache-gib {args.cache_gib:g}: {e}") from None
        streamer = handle.runtime.streamer
        if streamer is None or handle.slots <= streamer.regions * args.experts:
            raise SystemExit(f"--cache-gib {args.cache_gib:g} gives {handle.slots} slots, none outside the streaming "
                             "regions (or the whole model): nothing for a prompt to flush; give a cache between "
                             "three layers' experts and the model's")
        if not handle.runtime.should_stream(args.prompt, args.top_k):
            raise SystemExit(f"a {args.prompt}-token prompt would not stream on this machine; give a longer --prompt")
        routers = bench_e2e.install_replay_routers(model)
        if eviction == args.evictions.split(",")[0]:
            prompt_seconds(model, args.prompt, device)  # one-time set-up of the prompt's shapes, untimed
        row = dict(eviction=eviction, slots=handle.slots, region_slots=handle.runtime.streamer.regions * args.experts)
        row.update(measure(model, handle, routers, routing, args, device, link))
        print(f"[bench] {row}", flush=True)
        rows.append(row)
        # The streamer too: it holds the pool, and two 16 GiB pools beside the next model do not fit an H100.
        del model, handle, routers, streamer
        bench_e2e.free()
    path = write_report("prompt_between_decodes", rows, dict(settings=vars(args)))
    print_table(f"the second decode run, without and with a {args.prompt}-token prompt before it "
                f"({args.layers} layers, {args.cache_gib:g} GiB)", rows,
                ["eviction", "slots", "region_slots", "hot_pairs", "hot_before_prompt", "hot_after_prompt", "hit_rate_without", "hit_rate_with", "hit_rate_ratio",
                 "tok_s_without", "tok_s_with", "tok_s_ratio", "prompt_s", "prompt_link_bound_s"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
