"""Replaying a routing trace through the real runtime and kernels (`freetoken replay`).

Each sequence's prompt goes through every layer as one call (streamed or admitted, as the runtime
decides), then each decode step calls every layer with that token's routed ids. The experts are
random weights of the trace's shape (or a shape given here, for synthetic traces of full-size
models); routing weights are uniform. What is reported comes from the runtime's own counters:
hit rate, rows and bytes over the link, CPU rows, and time per decode token.
"""
import time
from typing import Optional, Union

import torch

from . import ops
from .moe import OffloadedExperts, OffloadRuntime
from .policies import DEFAULT_EVICTION
from .rates import Rates
from .slot_pool import HostPool
from .traces import Trace


def random_host_pool(layers: int, experts: int, hidden: int, inter: int, dtype: torch.dtype, pin: bool,
                     seed: int = 0) -> HostPool:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.empty(layers, experts, 2 * inter, hidden, dtype=dtype, pin_memory=pin)
    w2 = torch.empty(layers, experts, hidden, inter, dtype=dtype, pin_memory=pin)
    for layer in range(layers):  # layer by layer: no full-size float32 temporary
        w13[layer].copy_(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5)
        w2[layer].copy_(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5)
    return HostPool(w13, w2)


def replay(trace: Trace, cache_slots: int, fetch_fraction: Union[float, str] = 1.0, device: str = "cpu",
           hidden: Optional[int] = None, intermediate: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
           host: Optional[HostPool] = None, cuda_graph: bool = True, stream_prefill: bool = True,
           eviction: str = DEFAULT_EVICTION, all_resident: bool = False, rates: Optional[Rates] = Rates()) -> dict:
    """Runs every sequence of `trace`; returns the counters per decode token and ms per token.
    On CUDA with cuda_graph, each decode step (admission, copies, GEMMs of every layer, and the CPU
    share of misses left to the CPU) is one CUDA graph replayed with the next token's routing, as
    compiled decode runs it. all_resident: every expert is admitted before the first sequence (the
    fully resident reference; needs cache_slots >= layers x experts). rates: what decides between
    streaming a prompt's layers and admitting its experts; fixed by default (ft_ops.rates.Rates, a
    little below an H200's), so that the hit rates are the trace's and the cache's, not the load of
    the machine that replays it; None measures this machine's."""
    if all_resident and cache_slots < trace.layers * trace.experts:
        raise ValueError(f"all_resident needs a cache of every expert ({trace.layers * trace.experts} slots), "
                         f"got {cache_slots}")
    hidden = hidden or trace.hidden
    intermediate = intermediate or trace.intermediate
    if not hidden or not intermediate:
        raise ValueError("the trace does not record the expert shape: pass hidden and intermediate")
    if cache_slots < trace.top_k:
        raise ValueError(f"a cache of {cache_slots} slots is below one layer call's {trace.top_k} routed experts")
    dev = torch.device(device)
    if host is None:
        host = random_host_pool(trace.layers, trace.experts, hidden, intermediate, dtype, pin=dev.type == "cuda")
    stream = stream_prefill and cache_slots >= trace.experts
    runtime = OffloadRuntime(host, cache_slots, dev, fetch_fraction=fetch_fraction, stream_prefill=stream,
                             eviction=eviction, top_k=trace.top_k, rates=rates)
    layers = [OffloadedExperts(runtime, layer) for layer in range(trace.layers)]
    gen = torch.Generator().manual_seed(0)
    K = trace.top_k
    weights = torch.full((1, K), 1.0 / K, dtype=dtype, device=dev)
    x = (torch.randn(1, hidden, generator=gen) * 0.5).to(dtype).to(dev)
    use_graph = cuda_graph and dev.type == "cuda"
    static_ids = torch.zeros(trace.layers, 1, K, dtype=torch.int64, device=dev)
    if all_resident:
        pool = runtime.pool
        every = torch.arange(trace.experts, device=dev)
        for layer in range(trace.layers):
            plan = ops.dedup_and_admit(*pool.state, layer, every)
            rows = host.device_layer_rows(layer, dev) if dev.type == "cuda" else host.layer_rows(layer)
            ops.copy_experts(pool.banks, rows, *plan[1:])

    def step():
        for layer, module in enumerate(layers):
            module(x, static_ids[layer], weights)

    decode_seconds, decode_tokens = 0.0, 0
    graph = None
    keys = ("calls", "distinct", "copied", "cpu_pairs", "cpu_experts")
    admit = dict.fromkeys(keys, 0)  # decode steps only (prompts that admit are left out)
    # Decode steps that stream their layer instead (every expert routed, e.g. top-k = experts).
    decode_stream = dict.fromkeys(("calls", "distinct", "copied"), 0)
    streamed = 0  # the prompts' layers that streamed
    worker_jobs, worker_seconds = 0, 0.0  # the CPU share's worker over the decode steps
    row_threads = dict(split_calls=0, chunks=0, worker_chunks=0, wakes=0)  # its row threads, likewise
    for i in range(len(trace.sequences)):
        ids = trace.sequences[i].to(dev)
        prompt = trace.prompt_lengths[i]
        xs = (torch.randn(prompt, hidden, generator=gen) * 0.5).to(dtype).to(dev)
        w = torch.full((prompt, K), 1.0 / K, dtype=dtype, device=dev)
        prompt_before = runtime.stats()["stream"]["calls"]
        for layer, module in enumerate(layers):
            module(xs, ids[:prompt, layer], w)
        streamed += runtime.stats()["stream"]["calls"] - prompt_before
        steps = ids[prompt:]
        first = 0
        if i == 0 and len(steps):
            # The first decode step runs outside the measurement: the warm-up (and, with graphs,
            # the capture's warm-up) of the first sequence.
            static_ids.copy_(steps[0].unsqueeze(1))
            if use_graph:
                graph = capture_graph(step)
            else:
                step()
            first = 1
        _sync(dev)
        before = runtime.stats()["admit"]
        stream_before = runtime.stats()["stream"]
        worker_before = _worker_counters(runtime)
        threads_before = _row_thread_counters(runtime)
        t0 = time.perf_counter()
        for t in range(first, steps.shape[0]):
            static_ids.copy_(steps[t].unsqueeze(1))
            if graph is not None:
                graph.replay()
            else:
                step()
        _sync(dev)
        decode_seconds += time.perf_counter() - t0
        decode_tokens += steps.shape[0] - first
        after = runtime.stats()["admit"]
        for k in keys:
            admit[k] += after[k] - before[k]
        stream_after = runtime.stats()["stream"]
        for k in decode_stream:
            decode_stream[k] += stream_after[k] - stream_before[k]
        worker_after = _worker_counters(runtime)
        worker_jobs += worker_after[0] - worker_before[0]
        worker_seconds += worker_after[1] - worker_before[1]
        threads_after = _row_thread_counters(runtime)
        for k in row_threads:
            row_threads[k] += threads_after[k] - threads_before[k]
    per_token = max(1, decode_tokens)
    copied = admit["copied"] + decode_stream["copied"]
    misses = copied + admit["cpu_experts"]
    distinct = admit["distinct"] + decode_stream["distinct"]
    return dict(
        slots=cache_slots, cache_share=round(cache_slots / (trace.layers * trace.experts), 4),
        fetch_fraction=fetch_fraction, decode_tokens=decode_tokens,
        hit_rate=round(1 - misses / distinct, 4) if distinct else None,
        copied_rows_per_token=round(copied / per_token, 2),
        MB_over_link_per_token=round(copied * host.shape.expert_bytes / per_token / 1e6, 3),
        cpu_rows_per_token=round(admit["cpu_pairs"] / per_token, 2),
        # What the CPU share's worker spent computing jobs (not waiting for them), a token and a job.
        cpu_worker_ms_per_token=round(worker_seconds * 1e3 / per_token, 3),
        cpu_worker_us_per_job=round(worker_seconds * 1e6 / worker_jobs, 1) if worker_jobs else None,
        # How the worker's row loops spread over its helper threads: the share of their chunks that
        # helpers ran (the worker ran the rest), and how often a loop found the helpers asleep.
        cpu_helper_chunk_share=(round(1 - row_threads["worker_chunks"] / row_threads["chunks"], 3)
                                if row_threads["chunks"] else None),
        cpu_wakes_per_job=round(row_threads["wakes"] / worker_jobs, 3) if worker_jobs else None,
        ms_per_token=round(decode_seconds * 1e3 / decode_tokens, 3) if decode_tokens else None,
        streamed_prompt_layers=streamed,
        streamed_decode_layers=decode_stream["calls"],
        rates=runtime.stats()["pool"]["rates"],  # "given" (fixed) or "measured": what decided the prompts
        cuda_graph=graph is not None, device=str(dev), expert_bytes=host.shape.expert_bytes,
        cpu_split=runtime.stats().get("cpu_split"),  # fetch_fraction="auto": the measured costs
    )


def _row_thread_counters(runtime) -> dict:
    """The CPU share's row thread counters (CpuShare.row_thread_counters); zeros without one."""
    share = runtime.admitter.cpu_share
    if share is None:
        return dict(split_calls=0, chunks=0, worker_chunks=0, wakes=0)
    return share.row_thread_counters()


def _worker_counters(runtime) -> tuple:
    """(jobs, seconds computing) of the runtime's CPU share worker; zeros without one."""
    share = runtime.admitter.cpu_share
    return share.worker_counters() if share is not None else (0, 0.0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def capture_graph(step) -> torch.cuda.CUDAGraph:
    """Runs `step` once on a side stream (first-use allocations stay out of the graph), then
    captures it: replays run it on whatever its static inputs hold."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.synchronize()
    return graph
