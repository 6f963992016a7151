"""Decode (one token at a time) through a stack of offloaded Qwen3-30B-A3B-shaped MoE layers,
each step captured as one CUDA graph (admission, copies, GEMMs of every layer) and replayed with
the next token's routing.

Routing trace (seeded, synthetic): each layer ranks its experts by a fixed random permutation and
draws with Zipf weights 1/(rank+1)^1.1 (skew); at every step each of the top-8 picks repeats the
previous token's pick at that position with probability 0.5 (temporal locality), else it is drawn
afresh (no duplicates within a token). Cache sizes are shares of all L*E experts.
Writes decode.json."""
import argparse

import numpy as np
import torch

import ft_ops
from common import capture_graph, print_table, warm_gpu, write_report
from ft_ops.moe import OffloadedExperts, OffloadRuntime
from moe_setup import E, K, admit_every_expert, random_host_pool


def routing_trace(layers: int, steps: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    trace = np.zeros((steps, layers, K), dtype=np.int64)
    for layer in range(layers):
        order = rng.permutation(E)
        p = 1.0 / (np.arange(E) + 1) ** 1.1
        p /= p.sum()
        prev = None
        for step in range(steps):
            picks = []
            for k in range(K):
                if prev is not None and rng.random() < 0.5 and prev[k] not in picks:
                    picks.append(prev[k])
                    continue
                while True:
                    e = int(order[rng.choice(E, p=p)])
                    if e not in picks:
                        picks.append(e)
                        break
            trace[step, layer] = picks
            prev = picks
    return trace


def replay_ms(graph, static_ids, trace, steps: int, first: int = 20) -> float:
    """ms per step of `graph` replayed over trace[first:first + steps] (copied into static_ids)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for t in range(first, first + steps):
        static_ids.copy_(trace[t].unsqueeze(1))
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    layers, steps = args.layers, args.steps
    host = random_host_pool(layers)
    trace = torch.from_numpy(routing_trace(layers, steps + 20)).cuda()
    x = torch.randn(1, host.shape.hidden, device="cuda", dtype=torch.bfloat16)
    weights = torch.full((layers, 1, K), 1.0 / K, device="cuda", dtype=torch.bfloat16)
    static_ids = torch.zeros(layers, 1, K, dtype=torch.int64, device="cuda")
    rows = []
    for share in (0.10, 0.25, 0.50, 1.00):
        slots = max(K, int(share * layers * E))
        runtime = OffloadRuntime(host, slots, "cuda", stream_prefill=False)
        modules = [OffloadedExperts(runtime, l) for l in range(layers)]

        def step():
            for l, m in enumerate(modules):
                m(x, static_ids[l], weights[l])

        if share == 1.0:
            admit_every_expert(runtime)  # the measured steps are all hits
        graph = capture_graph(step)
        for t in range(20):  # warm the cache on the head of the trace
            static_ids.copy_(trace[t].unsqueeze(1))
            graph.replay()
        runtime.counters.counts.zero_()
        warm_gpu()
        ms = replay_ms(graph, static_ids, trace, steps)
        st = runtime.stats()["admit"]
        row = dict(cache_share=share, slots=slots, ms_per_token=round(ms, 3), hit_rate=round(st["hit_rate"], 3),
                   MB_over_link_per_token=round(st["bytes_over_link"] / steps / 1e6, 1))
        if share == 1.0:
            # The same GEMMs on fully resident weights: every expert already in its slot.
            layer_maps = runtime.pool.slot_of.clone()
            assert (layer_maps >= 0).all()
            resident_trace = torch.stack([layer_maps.gather(1, trace[t]) for t in range(len(trace))])
            resident_ids = torch.zeros_like(static_ids, dtype=torch.int32)

            def gemms_only():
                for l in range(layers):
                    ft_ops.expert_gemm(x, resident_ids[l], weights[l], runtime.pool.w13, runtime.pool.w2)

            base = replay_ms(capture_graph(gemms_only), resident_ids, resident_trace, steps)
            row["resident_gemms_ms"] = round(base, 3)
            row["admission_overhead"] = round(ms / base - 1, 3)
        rows.append(row)
        runtime = modules = graph = None  # free the pool before the next size
        torch.cuda.empty_cache()
    write_report("decode", rows, {"layers": layers, "steps": steps})
    print_table(f"decode, {layers} layers, CUDA-graph steps (goal at 100 %: admission overhead <= 0.20)", rows,
                ["cache_share", "slots", "ms_per_token", "hit_rate", "MB_over_link_per_token",
                 "resident_gemms_ms", "admission_overhead"])


if __name__ == "__main__":
    main()
