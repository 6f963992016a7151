"""The CPU share (ops cpu_share_submit / cpu_share_join, ft_ops/cpu_share.py): a call's pairs left
to the CPU are computed by the session's worker from the host pool and added on the producer's
device, equal to expert_gemm over the host layer; opcheck and torch.compile(fullgraph=True); on CUDA
no host sync, a non-default stream and CUDA-graph replays; the link / CPU split of
dedup_and_admit (fetch_fraction="auto") against a brute-force oracle; the errors."""
import random

import pytest
import torch

import ft_ops
from ft_ops.activations import SILU, Activation
from ft_ops.cpu_share import CpuShare
from ft_ops.testing import reference
from helpers import DEVICES, require
from test_expert_gemm import relative_error
from moe_helpers import E, H, K, L, layers_for, offloaded_stack, random_host_pool, random_routing, resident_stack

pytestmark = pytest.mark.parametrize("device", DEVICES)


def problem(tokens, gen, device, dtype, left=0.5):
    """hidden, slot_ids (-1: left to the CPU, a share `left` of the pairs), expert_ids, weights, out."""
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    slots = torch.randint(0, 3 * E, (tokens, K), generator=gen, dtype=torch.int32)
    slots[torch.rand(tokens, K, generator=gen) < left] = -1
    w = torch.softmax(torch.randn(tokens, K, generator=gen), -1).to(dtype)
    out = torch.randn(tokens, H, generator=gen).to(dtype)
    return [t.to(device) for t in (x, slots, experts, w, out)]


def want(host, layer, x, slots, experts, w, out, activation=SILU):
    """out + expert_gemm of the pairs at slot -1 over the host layer, rounded as the join rounds
    (the CPU's result in the hidden dtype, a float32 sum, one cast)."""
    cpu_ids = torch.where(slots.cpu() < 0, experts.cpu(), -1).int()
    s13 = host.w13_scale[layer] if host.w13_scale is not None else None
    s2 = host.w2_scale[layer] if host.w2_scale is not None else None
    ref = ft_ops.expert_gemm(x.cpu(), cpu_ids, w.cpu().float(), host.w13[layer], host.w2[layer], None, None,
                             activation, s13, s2)
    return (out.cpu().float() + ref.float()).to(out.dtype)


def test_each_layer_computes_its_own_function(device):
    """A session given one expert function per layer (Step3p7 clamps some layers only) computes
    each layer's pairs with that layer's function."""
    require(device, "cpu_share_submit")
    host = random_host_pool(device)
    functions = [SILU, Activation("gelu_tanh"), Activation("silu", limit=0.3, limit_after_act=True)]
    functions += [SILU] * (host.shape.layers - len(functions))
    share = CpuShare(host, functions, K, device, tokens=8)
    gen = torch.Generator().manual_seed(5)
    for layer in (1, 2, 0):
        x, slots, experts, w, out = problem(6, gen, device, torch.float32, left=1.0)
        got = share.join(out, share.submit(layer, x, slots, experts, w)).cpu()
        assert torch.equal(got, want(host, layer, x, slots, experts, w, out, functions[layer]))
        assert not torch.allclose(got, want(host, layer, x, slots, experts, w, out, Activation("gelu")))
    with pytest.raises(ValueError, match="one activation per MoE layer: 4 layers, got 2 activations"):
        CpuShare(host, functions[:2], K, device, tokens=8)


@pytest.fixture(params=[None, 5], ids=["threads-default", "threads-5"])
def torch_threads(request):
    """torch's thread count while the test runs: at 5 the session's worker has 2 row helpers
    (SpinPool: torch's count less two), which a 2-core machine's default never gives it."""
    before = torch.get_num_threads()
    if request.param is not None:
        torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "dense"), (torch.bfloat16, "dense"), (torch.bfloat16, "fp8"),
                                       (torch.bfloat16, "fp8_rows"), (torch.bfloat16, "mxfp4"),
                                       (torch.bfloat16, "int4")])
def test_a_job_equals_expert_gemm_on_the_host_layer(device, dtype, fmt, torch_threads):
    require(device, "cpu_share_submit")
    # MXFP4 and int4 group 32 values of a row: their intermediate size is 32 (H is already).
    host = random_host_pool(device, dtype=dtype, fmt=fmt, **(dict(inter=32) if fmt in ("mxfp4", "int4") else {}))
    assert host.shape.format == fmt
    share = CpuShare(host, SILU, K, device, tokens=8)
    gen = torch.Generator().manual_seed(1)
    for step, (layer, tokens) in enumerate([(0, 1), (3, 5), (1, 8), (0, 2)]):
        x, slots, experts, w, out = problem(tokens, gen, device, dtype)
        slots[0, 0] = -1  # at least one pair on the CPU
        stats = torch.zeros(6, dtype=torch.int64, device=device)
        before = share.seq.item()
        ticket = share.submit(layer, x, slots, experts, w, stats)
        got = share.join(out, ticket)
        assert got.device.type == device and got.dtype == dtype
        assert torch.equal(got.cpu(), want(host, layer, x, slots, experts, w, out))
        s13 = host.w13_scale[layer] if host.w13_scale is not None else None
        s2 = host.w2_scale[layer] if host.w2_scale is not None else None
        exact = reference.cpu_share(x, slots, experts, w, out, host.w13[layer], host.w2[layer], w13_scale=s13,
                                    w2_scale=s2)
        assert relative_error(got, exact) < {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        assert ticket.item() == before + 1 == share.seq.item()
        cpu = slots.cpu() < 0
        assert stats.tolist() == [0, 0, 0, 0, int(cpu.sum()), experts.cpu()[cpu].unique().numel()]
    assert share.worker_counters()[0] == 4 and share.last_error() == ""
    # The row threads' counters: the worker's pool has torch's threads less two (one on a machine
    # of two cores: no call is split), and only the decode row kernel (bf16 and quantized weights;
    # float32 keeps ATen's GEMMs) runs on it.
    c = share.row_thread_counters()
    assert 0 <= c["worker_chunks"] <= c["chunks"] and 0 <= c["wakes"] <= c["split_calls"]
    assert (c["split_calls"] > 0) == (torch.get_num_threads() > 3 and dtype == torch.bfloat16)


def test_a_call_without_cpu_pairs_posts_nothing(device):
    require(device, "cpu_share_submit")
    host = random_host_pool(device)
    share = CpuShare(host, SILU, K, device, tokens=4)
    x, slots, experts, w, out = problem(3, torch.Generator().manual_seed(2), device, torch.float32, left=0.0)
    ticket = share.submit(1, x, slots, experts, w)
    assert ticket.item() == 0 and share.seq.item() == 0
    got = share.join(out, ticket)
    assert torch.equal(got, out) and got.data_ptr() != out.data_ptr()
    assert share.worker_counters()[0] == 0


def test_opcheck_and_compile(device):
    require(device, "cpu_share_submit")
    host = random_host_pool(device)
    share = CpuShare(host, SILU, K, device, tokens=4)
    x, slots, experts, w, out = problem(2, torch.Generator().manual_seed(3), device, torch.float32, left=1.0)
    stats = torch.zeros(6, dtype=torch.int64, device=device)
    # What opcheck can check of ops with a side channel: the schema (seq and stats are the only
    # inputs written) and the fake kernels. Every run posts a job, so runs are not comparable value
    # by value.
    torch.library.opcheck(torch.ops.freetoken.cpu_share_submit.default,
                          (share.session, 0, x, slots, experts, w, share.seq, stats),
                          test_utils=("test_schema", "test_faketensor"))
    ticket = share.submit(0, x, slots, experts, w)
    torch.library.opcheck(torch.ops.freetoken.cpu_share_join.default, (share.session, out, ticket),
                          test_utils=("test_schema", "test_faketensor"))

    def step(x, slots, experts, w, out):
        ticket = ft_ops.ops.cpu_share_submit(share.session, 2, x, slots, experts, w, share.seq)
        return ft_ops.ops.cpu_share_join(share.session, out, ticket)
    compiled = torch.compile(step, fullgraph=True)
    for seed in range(3):
        args = problem(2, torch.Generator().manual_seed(10 + seed), device, torch.float32, left=0.6)
        assert torch.equal(compiled(*args).cpu(), want(host, 2, *args))


def test_errors(device):
    require(device, "cpu_share_submit")
    host = random_host_pool(device)
    share = CpuShare(host, SILU, K, device, tokens=2)
    x, slots, experts, w, out = problem(3, torch.Generator().manual_seed(4), device, torch.float32)
    with pytest.raises(RuntimeError, match="a call of 3 tokens .* holds 2 tokens"):
        share.submit(0, x, slots, experts, w)
    x, slots, experts, w = x[:2], slots[:2], experts[:2], w[:2]
    with pytest.raises(RuntimeError, match="layer 4 is out of range for 4 layers"):
        share.submit(L, x, slots, experts, w)
    with pytest.raises(RuntimeError, match="slot_ids must be int32"):
        share.submit(0, x, slots.long(), experts, w)
    with pytest.raises(RuntimeError, match="expert_ids must be int32 or int64"):
        share.submit(0, x, slots, experts.float(), w)
    with pytest.raises(RuntimeError, match="hidden must be"):
        share.submit(0, x.double(), slots, experts, w)
    with pytest.raises(RuntimeError, match="stats must be a contiguous int64 row"):
        share.submit(0, x, slots, experts, w, torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="tokens > 0"):
        CpuShare(host, SILU, K, device, tokens=0)
    share.close()
    with pytest.raises(RuntimeError, match="no open session"):
        share.submit(0, x, slots, experts, w)


def test_a_failing_job_fails_the_join_and_the_worker_goes_on(device):
    """The worker catches what its job raises: the join fails with the message (on CUDA it would
    stop the context, so this runs on the CPU), and the next job is served."""
    if device != "cpu":
        pytest.skip("a failing job traps the CUDA context; the protocol is the same on both devices")
    require(device, "cpu_share_submit")
    host = random_host_pool(device)
    share = CpuShare(host, SILU, K, device, tokens=4)
    args = problem(2, torch.Generator().manual_seed(5), device, torch.float32, left=1.0)
    x, slots, experts, w, out = args
    nan_free = share.join(out, share.submit(0, x, slots, experts, w))
    assert torch.equal(nan_free, want(host, 0, *args))
    # A job that raises in the worker: a hidden state in a dtype the host layer cannot multiply is
    # refused before posting, so make the worker's own kernel fail: an activation it rejects.
    broken = CpuShare(host, SILU, K, device, tokens=4)
    broken.close()  # its own worker must not serve the mailbox too: it would take the job and succeed
    object.__setattr__(broken, "session", ft_ops._C.cpu_share_open(
        broken.mailbox, host.w13, host.w2, None, None, None, None,
        [("silu", 1.0, -1.0, 0.0, 0.0, 0.0, False, True)] * host.shape.layers, 4, K, torch.float32))
    with pytest.raises(RuntimeError, match="worker failed on its job: .*limit"):
        broken.join(out, broken.submit(0, x, slots, experts, w))
    assert "limit" in broken.last_error()
    ft_ops._C.cpu_share_close(broken.session)
    assert torch.equal(share.join(out, share.submit(0, x, slots, experts, w)), want(host, 0, *args))


def test_no_host_sync_and_cuda_graph_replays(device):
    """Submit and join queue device work only; captured once in a CUDA graph, every replay posts a
    fresh job for the inputs it finds and adds its result."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    require(device, "cpu_share_submit")
    host = random_host_pool(device, dtype=torch.bfloat16)
    share = CpuShare(host, SILU, K, device, tokens=4)
    gen = torch.Generator().manual_seed(6)
    static = problem(3, gen, device, torch.bfloat16, left=1.0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        ticket = share.submit(1, *static[:4])
        share.join(static[4], ticket)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = share.join(static[4], share.submit(1, *static[:4]))
    for seed in range(4):
        fresh = problem(3, torch.Generator().manual_seed(100 + seed), device, torch.bfloat16, left=0.7)
        for s, f in zip(static, fresh):
            s.copy_(f)
        result.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        torch.cuda.current_stream().synchronize()
        assert torch.equal(result.cpu(), want(host, 1, *static))


def random_counters(rng, device):
    """An admission counters row with a random history (ft_ops/stats.py's columns), or None."""
    kind = rng.choice(["none", "short", "empty", "no-miss", "all-miss", "mixed", "mixed"])
    if kind == "none":
        return None
    if kind == "short":  # four counters: no CPU columns, so no re-copy term
        return torch.tensor([3, 24, 20, 9], dtype=torch.int64, device=device)
    distinct = 0 if kind == "empty" else rng.randint(1, 400)  # against a compulsory 64 (the tests' pools)
    misses = {"empty": 0, "no-miss": 0, "all-miss": distinct}.get(kind, rng.randint(0, distinct))
    cpu = rng.randint(0, misses)
    return torch.tensor([rng.randint(1, 50), distinct * 2, distinct, misses - cpu, 2 * cpu, cpu], dtype=torch.int64,
                        device=device)


def test_the_split_admits_the_count_of_least_time(device):
    """dedup_and_admit with CPU costs admits, per call, the miss count n of least
    max(n, cpu_call + (m - n) cpu_expert) + (m - n) recopy (ties: more fetched), recopy being the
    layer's hits per miss so far (at most 1) from its counters, on every device alike."""
    require(device, "dedup_and_admit")
    rng = random.Random(7)
    experts = 64
    shares = set()
    for trial in range(120):
        m = rng.randint(0, 40)
        cpu_expert = rng.choice([0.3, 0.5, 1.0, 1.7, 2.5, 6.0]) * rng.uniform(0.8, 1.2)
        cpu_call = rng.choice([0.0, 0.2, 1.0, 3.6])
        stats = random_counters(rng, device)
        recopy = reference.recopy_share(stats.cpu() if stats is not None else None, compulsory=experts / 1)
        shares.add(0.5 if 0.0 < recopy < 1.0 else recopy)
        slot_of = torch.full((1, experts), -1, dtype=torch.int32, device=device)
        owner_of = torch.full((experts,), -1, dtype=torch.int32, device=device)
        last_use = torch.zeros(experts, dtype=torch.int64, device=device)
        clock = torch.zeros(1, dtype=torch.int64, device=device)
        ids = torch.tensor(rng.sample(range(experts), m) if m else [0], device=device).reshape(1, -1)
        if m == 0:
            slot_of[0, 0] = owner_of[0] = 0  # one hit, no miss
        slot_ids, _, _, num = ft_ops.dedup_and_admit(slot_of, owner_of, last_use, clock, 0, ids, 1.0, 0, 0, stats, 0,
                                                     cpu_expert, cpu_call)
        admitted = int(num.item())
        want = reference.admitted_count(m, 1.0, cpu_expert, cpu_call, recopy)
        assert admitted == want, (m, cpu_expert, cpu_call, recopy)
        assert int((slot_ids < 0).sum()) == (m - admitted if m else 0)
        if recopy >= 1.0:
            assert admitted == m, "an expert that would be hit again is never left to the CPU"
    assert shares == {0.0, 0.5, 1.0}, "histories without, with some and with full re-copy cost"
    for cpu_expert, cpu_call in ((1.0, 0.0), (0.0, 1.0)):  # either cost (a call cost alone was ignored)
        with pytest.raises(RuntimeError, match="pass fetch_fraction=1.0"):
            ft_ops.dedup_and_admit(slot_of, owner_of, last_use, clock, 0, ids, 0.5, 0, 0, None, 0, cpu_expert, cpu_call)
    with pytest.raises(RuntimeError, match="finite and >= 0"):
        ft_ops.dedup_and_admit(slot_of, owner_of, last_use, clock, 0, ids, 1.0, 0, 0, None, 0, -1.0, 0.0)


def test_auto_split_runtime_equals_the_resident_stack(device):
    """fetch_fraction="auto" measures the split's costs at start and gives the resident stack's
    outputs whatever the split, with CPU pairs counted."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = ft_ops.moe.OffloadRuntime(host, 3, device, fetch_fraction="auto", top_k=K, stream_prefill=False)
    split = runtime.admitter.split
    assert split.link_expert_s > 0 and split.cpu_expert_s > 0 and split.cpu_call_s >= 0
    assert set(runtime.stats()["cpu_split"]) == {"link_us_per_expert", "cpu_us_per_expert", "cpu_us_per_call"}
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(8)
    for tokens in [1, 4, 2, 1]:
        routing = random_routing(tokens, gen)
        x = torch.randn(tokens, H, generator=gen)
        got = offloaded_stack(modules, x.to(device), routing)
        for g, w in zip(got, resident_stack(host, x, routing)):
            assert float((g.double().cpu() - w.double()).norm() / w.double().norm()) < 1e-5
    stats = runtime.stats()["admit"]
    assert stats["cpu_pairs"] > 0 and stats["copied"] > 0
    with pytest.raises(ValueError, match="needs the experts routed per token"):
        ft_ops.moe.OffloadRuntime(host, 3, device, fetch_fraction="auto", stream_prefill=False)
    with pytest.raises(ValueError, match="keep collect_stats=True"):
        ft_ops.moe.OffloadRuntime(host, 3, device, fetch_fraction="auto", top_k=K, collect_stats=False)
    with pytest.raises(ValueError, match=r"in \[0, 1\] or 'auto'"):
        ft_ops.moe.OffloadRuntime(host, 3, device, fetch_fraction="half", stream_prefill=False)


def test_the_split_leaves_the_cpu_only_experts_that_do_not_come_back(device, monkeypatch):
    """With a CPU twice as fast as the link: a cold cache is filled over the link (its first misses
    say nothing about reuse, nor do an admitted prompt's); routing that keeps missing (each layer cycles through experts that
    the pool cannot hold) leaves misses to the CPU; once the same experts keep coming back, each
    layer's hits per miss grow, a re-copy costs more than the CPU saves, and the split admits
    everything. Outputs equal the resident stack throughout."""
    require(device, "expert_gemm")
    from ft_ops import admission, rates

    monkeypatch.setattr(admission, "measure_cpu_split", lambda *a, **k: rates.CpuSplit(
        link_expert_s=2e-4, cpu_expert_s=1e-4, cpu_call_s=0.0))
    host = random_host_pool(device)
    slots = L * K  # one token's pairs: a layer's share of the pool is K slots
    runtime = ft_ops.moe.OffloadRuntime(host, slots, device, fetch_fraction="auto", top_k=K, stream_prefill=False)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(12)
    weights = torch.softmax(torch.randn(1, K, generator=gen), -1)

    def step(experts):
        routing = [(torch.tensor([experts]), weights) for _ in range(L)]
        x = torch.randn(1, H, generator=gen)
        got = offloaded_stack(modules, x.to(device), routing)
        for g, w in zip(got, resident_stack(host, x, routing)):
            assert float((g.double().cpu() - w.double()).norm() / w.double().norm()) < 1e-5
        return runtime.stats()["admit"]["cpu_pairs"]

    # A prompt admitted rather than streamed (longer calls are never split) misses every expert of
    # every layer; its misses must not count as the decode calls' misses in the split's counters.
    prompt = random_routing(E, gen)
    x = torch.randn(E, H, generator=gen)
    for g, w in zip(offloaded_stack(modules, x.to(device), prompt), resident_stack(host, x, prompt)):
        assert float((g.double().cpu() - w.double()).norm() / w.double().norm()) < 1e-5
    assert runtime.stats()["admit"]["distinct"] > 0 and runtime.stats()["admit"]["cpu_pairs"] == 0
    assert step([0, 1]) == 0, "a cold cache is filled over the link, a prompt before it or not"
    cycling = [step([2 * t, 2 * t + 1]) for t in range(1, 4)]
    assert cycling[-1] > 0, "misses that never come back in time go partly to the CPU"
    reused = [step([6, 7]) for _ in range(12)]
    assert reused[-1] == reused[-5], "experts that come back are admitted, not left to the CPU again"
    assert bool((runtime.pool.slot_of.cpu()[:, 6:8] >= 0).all()), "every layer's two experts are resident"


def test_a_call_in_chunks_counts_each_cpu_expert_once(device):
    """A call longer than the CPU share's mailbox is posted in chunks; an expert routed in several
    chunks is one CPU expert of the call in the counters (the hit rate stays in [0, 1])."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = ft_ops.moe.OffloadRuntime(host, K, device, fetch_fraction=0.0, top_k=K, stream_prefill=False,
                                        cpu_share_tokens=3)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(13)
    routing = random_routing(10, gen)  # 10 tokens: four chunks of at most 3
    x = torch.randn(10, H, generator=gen)
    for g, w in zip(offloaded_stack(modules, x.to(device), routing), resident_stack(host, x, routing)):
        assert float((g.double().cpu() - w.double()).norm() / w.double().norm()) < 1e-5
    admit = runtime.stats()["admit"]
    distinct = sum(len(set(ids.flatten().tolist())) for ids, _ in routing)
    assert admit["copied"] == 0 and admit["cpu_pairs"] == 10 * K * L
    assert admit["cpu_experts"] == distinct == admit["distinct"] and admit["hit_rate"] == 0.0


def test_a_decode_step_with_cpu_pairs_replays_in_a_cuda_graph(device):
    """A decode step through every layer (admission, copies, GEMMs, the CPU share) captured once
    and replayed with the next tokens' routing equals the resident stack: the CPU share runs inside
    the graph."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    require(device, "expert_gemm")
    host = random_host_pool(device, dtype=torch.bfloat16)
    runtime = ft_ops.moe.OffloadRuntime(host, 2 * E, device, fetch_fraction=0.5, top_k=K, stream_prefill=False)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, H, generator=gen).to(torch.bfloat16).to(device)
    static = [(torch.zeros(1, K, dtype=torch.int64, device=device), torch.zeros(1, K, device=device))
              for _ in range(L)]

    def load(routing):
        for (si, sw), (ids, w) in zip(static, routing):
            si.copy_(ids)
            sw.copy_(w)

    def step():
        h, outs = x, []
        for module, (ids, w) in zip(modules, static):
            y = module(h, ids, w.to(torch.bfloat16))
            outs.append(y)
            h = h + y
        return outs

    load(random_routing(1, gen))
    step()  # warm-up: workspaces, the worker awake
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(5):
        routing = random_routing(1, gen)
        load(routing)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        inputs, h = [], x.cpu()
        for y in outs:
            inputs.append(h)
            h = h + y.cpu()
        for g, w in zip(outs, resident_stack(host, x.cpu(), [(i.cpu(), w.cpu().to(torch.bfloat16)) for i, w in routing],
                                             inputs=inputs)):
            assert float((g.double().cpu() - w.double()).norm() / w.double().norm()) < 2e-2
    assert runtime.stats()["admit"]["cpu_pairs"] > 0


def test_a_call_longer_than_the_mailbox_goes_in_chunks(device):
    """A call of more tokens than the mailbox holds (a prompt on the admission path) is served in
    mailbox-sized chunks and equals the resident stack."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = ft_ops.moe.OffloadRuntime(host, 2 * E, device, fetch_fraction=0.5, top_k=K, stream_prefill=False,
                                        cpu_share_tokens=3)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(12)
    routing = random_routing(8, gen)
    x = torch.randn(8, H, generator=gen)
    for g, w in zip(offloaded_stack(modules, x.to(device), routing), resident_stack(host, x, routing)):
        assert float((g.double().cpu() - w.double()).norm() / w.double().norm()) < 1e-5
    assert runtime.admitter.cpu_share.worker_counters()[0] >= 2 * L  # several jobs per layer


def test_the_measured_split_decides_decode_sized_calls_only(device):
    """fetch_fraction="auto": a prompt-sized call (routed ids >= experts) fetches every miss (the
    CPU costs are those of one-token calls); a decode-sized call may leave some to the CPU."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = ft_ops.moe.OffloadRuntime(host, L * E, device, fetch_fraction="auto", top_k=K, stream_prefill=False)
    admitter = runtime.admitter
    assert admitter.splits(K) and not admitter.splits(E)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(13)
    routing = random_routing(E, gen)  # E tokens x K ids: prompt-sized
    offloaded_stack(modules, torch.randn(E, H, generator=gen).to(device), routing)
    assert runtime.stats()["admit"]["cpu_pairs"] == 0
    with pytest.raises(ValueError, match="started for 2"):
        admitter._cpu_share(K + 1)


@pytest.mark.parametrize("slots", [2048, 9000])
def test_the_split_on_larger_pools(device, slots):
    """The split with counters on pools served by the other admission kernels (the level kernel's
    and, above 8,192 slots, the scan kernel's), with calls that admit nothing among them: the
    reference's count every call, and the counters grow by the call's own figures only."""
    require(device, "dedup_and_admit")
    rng = random.Random(slots)
    layers, experts = 4, 64
    slot_of = torch.full((layers, experts), -1, dtype=torch.int32, device=device)
    owner_of = torch.full((slots,), -1, dtype=torch.int32, device=device)
    last_use = torch.zeros(slots, dtype=torch.int64, device=device)
    clock = torch.zeros(1, dtype=torch.int64, device=device)
    compulsory = slots / layers
    for trial in range(24):
        m = rng.choice([0, 1, 3, 12, 40])
        ids = torch.tensor(rng.sample(range(experts), max(m, 1)), device=device).reshape(1, -1)
        distinct = rng.randint(0, 3 * slots)
        admitted = rng.randint(0, distinct)
        cpu = rng.randint(0, distinct - admitted)
        stats = torch.tensor([1, distinct, distinct, admitted, cpu, cpu], dtype=torch.int64, device=device)
        before = stats.cpu().clone()
        misses = int((slot_of[0, ids.flatten()] < 0).sum())
        recopy = reference.recopy_share(before, compulsory)
        cpu_expert, cpu_call = rng.choice([(0.3, 0.2), (0.9, 1.5), (2.0, 0.0)])
        num = ft_ops.dedup_and_admit(slot_of, owner_of, last_use, clock, 0, ids, 1.0, 0, 0, stats, 0, cpu_expert,
                                     cpu_call)[3]
        want = reference.admitted_count(misses, 1.0, cpu_expert, cpu_call, recopy)
        assert int(num.item()) == want, (slots, trial, misses, recopy)
        grew = (stats.cpu() - before).tolist()
        assert grew[:4] == [1, ids.numel(), ids.numel(), want] and grew[4:] == [0, 0]


def test_ties_of_the_split_fall_alike_on_both_devices(device):
    """Costs where the fetched count sits on a tie of max(F, c + (m - F) e) (the products rounded
    alone on both devices, not fused): the CUDA kernel admits what the CPU kernel admits."""
    if device != "cuda":
        pytest.skip("compares the CUDA kernel with the CPU one")
    require(device, "dedup_and_admit")
    cases = [(4, 0.6, 0.2, None), (35, 0.7, 0.3, None), (10, 1.0, 0.0, None), (7, 0.5, 0.5, None),
             (12, 0.1, 0.1, None), (8, 0.4, 0.6, (30, 16, 8)), (20, 0.3, 0.3, (40, 20, 10)), (6, 0.25, 0.5, (20, 9, 3))]
    for m, cpu_expert, cpu_call, history in cases:
        counts = []
        for dev in ("cpu", "cuda"):
            stats = None
            if history is not None:  # distinct, admitted, cpu experts: re-copy shares 3/8, 5/11 and 1
                distinct, admitted, cpu = history  # (8 layers of a 64-slot pool: 8 compulsory misses)
                stats = torch.tensor([1, distinct, distinct, admitted, cpu, cpu], dtype=torch.int64, device=dev)
            slot_of = torch.full((8, 64), -1, dtype=torch.int32, device=dev)
            owner_of = torch.full((64,), -1, dtype=torch.int32, device=dev)
            last_use = torch.zeros(64, dtype=torch.int64, device=dev)
            clock = torch.zeros(1, dtype=torch.int64, device=dev)
            ids = torch.arange(m, device=dev).reshape(1, m)
            num = ft_ops.dedup_and_admit(slot_of, owner_of, last_use, clock, 0, ids, 1.0, 0, 0, stats, 0, cpu_expert,
                                         cpu_call)[3]
            counts.append(int(num.item()))
        assert counts[0] == counts[1], (m, cpu_expert, cpu_call, history, counts)


def test_long_calls_strided_hidden_and_int32_ids_on_the_device(device):
    """A call of more than 32,768 hidden values (the payload written by many blocks, then posted),
    hidden rows with a stride, int32 expert ids."""
    if device != "cuda":
        pytest.skip("the two-launch path is the CUDA kernel's")
    require(device, "cpu_share_submit")
    hidden = 4096
    host = random_host_pool(device, dtype=torch.bfloat16, hidden=hidden, inter=32)
    share = CpuShare(host, SILU, K, device, tokens=16)
    gen = torch.Generator().manual_seed(14)
    wide = torch.randn(16, 2 * hidden, generator=gen).to(torch.bfloat16).to(device)
    x = wide[:, :hidden]  # rows 2 x hidden apart
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(16)]).int().to(device)
    slots = torch.where(torch.rand(16, K, generator=gen) < 0.5, -1, 3).int().to(device)
    w = torch.softmax(torch.randn(16, K, generator=gen), -1).to(device)
    out = torch.randn(16, hidden, generator=gen).to(torch.bfloat16).to(device)
    got = share.join(out, share.submit(0, x, slots, experts, w))
    cpu_ids = torch.where(slots.cpu() < 0, experts.cpu(), -1).int()
    ref = ft_ops.expert_gemm(x.cpu().contiguous(), cpu_ids, w.cpu(), host.w13[0], host.w2[0], None, None, SILU)
    assert torch.equal(got.cpu(), (out.cpu().float() + ref.float()).to(torch.bfloat16))


def test_many_replays_mixing_empty_and_real_jobs(device):
    """300 replays of one captured call, about a third of them with no CPU pair (no job posted):
    every replay's result is the reference, and seq counts the jobs posted."""
    if device != "cuda":
        pytest.skip("CUDA graphs")
    require(device, "cpu_share_submit")
    host = random_host_pool(device)
    share = CpuShare(host, SILU, K, device, tokens=2)
    static = problem(2, torch.Generator().manual_seed(15), device, torch.float32, left=1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = share.join(static[4], share.submit(3, *static[:4]))
    rng = random.Random(16)
    posted = 0
    for i in range(300):
        fresh = problem(2, torch.Generator().manual_seed(1000 + i), device, torch.float32,
                        left=0.0 if rng.random() < 0.35 else 0.5)
        for s, f in zip(static, fresh):
            s.copy_(f)
        posted += int(bool((fresh[1] < 0).any()))
        graph.replay()
        torch.cuda.current_stream().synchronize()
        assert torch.equal(result.cpu(), want(host, 3, *static)), i
    assert share.seq.item() == posted


def test_reduce_overhead_compile_captures_the_cpu_share(device):
    """torch.compile(mode="reduce-overhead", fullgraph=True) of a call with a CPU share: CUDA graphs
    are not skipped, every call posts one job, results equal the reference."""
    if device != "cuda":
        pytest.skip("CUDA graph trees")
    require(device, "cpu_share_submit")
    from torch._dynamo.utils import counters

    host = random_host_pool(device)
    share = CpuShare(host, SILU, K, device, tokens=2)

    def step(x, slots, experts, w, out):
        ticket = ft_ops.ops.cpu_share_submit(share.session, 1, x, slots, experts, w, share.seq)
        return ft_ops.ops.cpu_share_join(share.session, out, ticket)
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    counters.clear()
    for i in range(6):
        args = problem(2, torch.Generator().manual_seed(200 + i), device, torch.float32, left=1.0)
        before = share.seq.item()
        got = compiled(*args).clone()
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want(host, 1, *args))
        assert share.seq.item() == before + 1
    assert not counters["inductor"].get("cudagraph_skips")


def test_a_join_checks_its_ticket_and_rows_on_the_cpu(device):
    """The mailbox holds one job: a join of an older ticket, a negative one, or with another call's
    rows is refused on the CPU (it returned the newer job's result, stale data, or rows past the
    job). A CUDA join reads the ticket on the device, where it cannot raise."""
    if device != "cpu":
        pytest.skip("checked by the CPU kernel")
    require("cpu", "cpu_share_submit")
    host = random_host_pool("cpu")
    share = CpuShare(host, SILU, K, "cpu", tokens=4)
    x, slots, experts, w, out = problem(2, torch.Generator().manual_seed(5), "cpu", torch.float32, left=1.0)
    first = share.submit(0, x, slots, experts, w)
    second = share.submit(1, x, slots, experts, w)
    with pytest.raises(RuntimeError, match=f"ticket {int(first)} is not the session's last job \\({int(second)}\\)"):
        share.join(out, first)
    with pytest.raises(RuntimeError, match="out has 3 rows but job .* has 2 tokens"):
        share.join(torch.zeros(3, H), second)
    with pytest.raises(RuntimeError, match="ticket -5 is negative"):
        share.join(out, torch.tensor([-5]))
    torch.testing.assert_close(share.join(out, second), want(host, 1, x, slots, experts, w, out))
    share.close()
