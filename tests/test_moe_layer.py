"""The MoE layer runtime: a stack of offloaded layers through mixed prefill and decode calls gives
the outputs of the same stack with every expert resident; streamed experts stay registered;
region reuse invalidates the previous owners; stream order on CUDA."""
import inspect
import math
import warnings

import pytest
import torch

from ft_ops import formats
from ft_ops.policies import STREAMED
from ft_ops.testing import reference
from ft_ops.rates import Rates, _fill_random, measure_rates
from ft_ops.slot_pool import ExpertShape, SlotPool
from ft_ops.moe import OffloadRuntime
from helpers import DEVICES, require
from moe_helpers import E, K, L, layers_for, offloaded_stack, random_host_pool, random_routing, resident_stack

pytestmark = pytest.mark.parametrize("device", DEVICES)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def relative(a, b):
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def registered_rows_mismatch(runtime, host) -> list:
    """Registered slots whose rows differ from their owner's host rows, and any break of the maps'
    bijection (a pair owning two slots, a slot its pair's map does not name: reference's check)."""
    owners = runtime.pool.owner_of.cpu()
    bad = list(reference.check_pool_invariants(runtime.pool.slot_of.cpu(), owners))
    for slot in (owners >= 0).nonzero().flatten().tolist():
        layer, e = divmod(int(owners[slot]), runtime.shape.experts)
        if not all(torch.equal(b[slot].cpu(), h[layer, e].cpu()) for b, h in zip(runtime.pool.banks, host.banks)):
            bad.append(slot)
    return bad


def make_runtime(host, slots, device, **kw):
    kw.setdefault("rates", Rates())  # fixed rates: which calls stream is part of what is tested
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # S = E warns that streaming is serialized
        return OffloadRuntime(host, slots, device, **kw)


@pytest.mark.parametrize("eviction", ["lru", "opportunity", "hitdensity", "duel"])
@pytest.mark.parametrize("slots", [E, 2 * E, 3 * E, L * E])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_match_the_resident_stack(device, slots, dtype, eviction):
    require(device, "expert_gemm")
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 is checked on CUDA; the CPU run covers float32")
    host = random_host_pool(device, dtype)
    runtime = make_runtime(host, slots, device, eviction=eviction)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(slots)
    # A prompt (streamed), then decode steps with skewed routing, another prompt, more decode.
    for step, tokens in enumerate([48, 1, 1, 2, 1, 40, 1, 3, 1, 1]):
        routing = random_routing(tokens, gen, hot=[1, 5])
        x = torch.randn(tokens, host.shape.hidden, generator=gen).to(dtype)
        streamed = runtime.should_stream(tokens, 2)
        assert streamed == (tokens >= 40), "prompt calls stream, decode calls admit"
        inputs = []
        got = offloaded_stack(modules, x.to(device), routing, inputs)
        want = resident_stack(host, x, routing, inputs=inputs)
        for layer, (g, w) in enumerate(zip(got, want)):
            assert relative(g, w) < TOL[dtype], f"step {step} layer {layer}"
        assert registered_rows_mismatch(runtime, host) == [], f"step {step}: a registered slot holds another row"
    stats = runtime.stats()
    assert stats["stream"]["calls"] == 2 * L
    assert stats["admit"]["calls"] == 8 * L
    if slots == L * E:
        # Every layer streamed home by the first prompt: nothing is sent again, decode only hits.
        assert stats["stream"]["copied"] == L * E and stats["admit"]["copied"] == 0
    else:
        assert stats["admit"]["copied"] > 0


def test_a_pool_that_holds_every_expert_streams_each_layer_home(device):
    """S = L E: decode steps first (their misses land in free slots, other layers' homes), then a
    prompt streams every layer into its home region, moving what decode admitted there; a second
    prompt sends nothing; every output equals the resident stack."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, L * E, device)
    assert runtime.streamer.home and runtime.streamer.regions == L
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(21)

    def step(tokens):
        routing = random_routing(tokens, gen)
        x = torch.randn(tokens, host.shape.hidden, generator=gen)
        inputs = []
        got = offloaded_stack(modules, x.to(device), routing, inputs)
        for g, w in zip(got, resident_stack(host, x, routing, inputs=inputs)):
            assert relative(g, w) < 1e-5
        assert registered_rows_mismatch(runtime, host) == []

    for tokens in [1, 2, 1]:
        step(tokens)
    seen = runtime.pool.slot_of.cpu().long()
    home = torch.arange(L * E).reshape(L, E)
    assert bool(((seen != home) & (seen >= 0)).any()), "decode admitted outside the homes"
    # What the prompt reads from the host: every row but those in place and those in a later
    # layer's home (not yet overwritten when their layer streams; they move device to device).
    later = seen >= (torch.arange(L).unsqueeze(1) + 1) * E
    want_sent = int((~((seen == home) | later)).sum())
    sent_before = runtime.stats()["stream"]["copied"]
    step(48)
    assert runtime.stats()["stream"]["copied"] - sent_before == want_sent
    assert bool(later.any()), "some rows moved home device to device"
    assert torch.equal(runtime.pool.slot_of.cpu(), torch.arange(L * E, dtype=torch.int32).reshape(L, E))
    sent = runtime.stats()["stream"]["copied"]
    step(40)
    stats = runtime.stats()
    assert stats["stream"]["copied"] == sent and stats["stream"]["calls"] == 2 * L


def check_prompts_and_decode_match_the_resident_stack(runtime, host, device, dtype, activation, seed):
    """Prompts that stream (70, 66 tokens), short calls that admit and decode steps, hidden size 128:
    every layer equals the resident stack on the same host weights and input."""
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(seed)
    for step, tokens in enumerate([70, 1, 2, 1, 66, 1, 3]):
        routing = random_routing(tokens, gen, hot=[1, 5])
        x = torch.randn(tokens, 128, generator=gen).to(dtype)
        inputs = []
        got = offloaded_stack(modules, x.to(device), routing, inputs)
        want = resident_stack(host, x, routing, activation=activation, inputs=inputs)
        for layer, (g, w) in enumerate(zip(got, want)):
            assert relative(g, w) < TOL[dtype], f"step {step} layer {layer}"


@pytest.mark.parametrize("fmt", ["fp8", "fp8_rows"])
@pytest.mark.parametrize("slots", [E, 2 * E, L * E])
def test_fp8_pool_matches_the_resident_stack(device, slots, fmt):
    """FP8 experts (a host pool with block or row scales, slots and copies in FP8) through prompts
    that stream (on CUDA: dequantized into a scratch bank, grouped GEMM), short calls that admit,
    decode steps with misses and CPU-served misses: every layer equals the resident stack on the
    same FP8 weights."""
    require(device, "expert_gemm")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    host = random_host_pool(device, dtype, bias=True, fmt=fmt, hidden=128, inter=64)
    assert host.shape.format == fmt and host.w13.dtype == torch.float8_e4m3fn
    runtime = make_runtime(host, slots, device, fetch_fraction=0.5 if slots == 2 * E else 1.0)
    assert runtime.pool.w13.dtype == torch.float8_e4m3fn and runtime.pool.w13_scale is not None
    check_prompts_and_decode_match_the_resident_stack(runtime, host, device, dtype, "silu", seed=slots + 1)
    stats = runtime.stats()
    assert stats["pool"]["format"] == fmt
    assert stats["stream"]["calls"] > 0
    if slots == L * E:  # the first prompt streamed every expert home: decode only hits
        assert stats["stream"]["copied"] == L * E and stats["admit"]["copied"] == 0
    else:
        assert stats["admit"]["copied"] > 0


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp8_rows"])
@pytest.mark.parametrize("slots", [E, 2 * E])
def test_ungated_pool_matches_the_resident_stack(device, fmt, slots):
    """Ungated experts (w13 the up rows alone: pools, slots and copies of I rows) with RELU2,
    through prompts that stream (on CUDA, bf16: the grouped path; FP8: dequantized with one
    projection a row block), admissions, decode with misses and CPU-served misses."""
    require(device, "expert_gemm")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    host = random_host_pool(device, dtype, bias=True, fmt=fmt, hidden=128, inter=64, gated=False)
    assert not host.shape.gated and host.w13.shape[2] == 64
    assert host.shape.expert_bytes < random_host_pool(device, dtype, bias=True, fmt=fmt, hidden=128,
                                                      inter=64).shape.expert_bytes
    with pytest.raises(ValueError, match="is gated but the host pool holds ungated experts"):
        make_runtime(host, slots, device)
    runtime = make_runtime(host, slots, device, activation="relu2", fetch_fraction=0.5 if slots == 2 * E else 1.0)
    check_prompts_and_decode_match_the_resident_stack(runtime, host, device, dtype, "relu2", seed=slots + 3)
    stats = runtime.stats()
    assert stats["stream"]["calls"] > 0 and stats["admit"]["copied"] > 0


@pytest.mark.parametrize("stream", [True, False])
def test_each_layer_computes_its_own_function(device, stream):
    """One expert function per layer (Step3p7 clamps some layers only): streamed prompts, admitted
    decode and the CPU's misses each give the resident stack computed with each layer's function."""
    from ft_ops.activations import SILU, Activation

    require(device, "expert_gemm")
    host = random_host_pool(device)
    functions = [Activation("gelu_tanh"), SILU, Activation("silu", limit=0.3, limit_after_act=True), SILU][:L]
    runtime = make_runtime(host, 2 * E, device, activation=functions, fetch_fraction=0.5, stream_prefill=stream)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(11)
    for tokens in (48, 1, 3):
        routing = random_routing(tokens, gen)
        x = torch.randn(tokens, host.shape.hidden, generator=gen)
        inputs = []
        got = offloaded_stack(modules, x.to(device), routing, inputs)
        for layer, (g, w) in enumerate(zip(got, resident_stack(host, x, routing, functions, inputs))):
            assert relative(g, w) < 1e-5, f"{tokens} tokens, layer {layer} ({functions[layer]})"
    stats = runtime.stats()
    assert stats["admit"]["cpu_pairs"] > 0 and (stats["stream"]["calls"] > 0) == stream
    with pytest.raises(ValueError, match=f"one activation per MoE layer: {L} layers, got 2 activations"):
        make_runtime(host, 2 * E, device, activation=functions[:2])
    with pytest.raises(TypeError, match="one of them per MoE layer, got None"):
        make_runtime(host, 2 * E, device, activation=None)


def test_cpu_misses_and_fetch_fraction(device):
    """fetch_fraction < 1 leaves misses to the CPU path, and a pool smaller than a call's unique
    experts does too; both still give the resident stack's outputs."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    gen = torch.Generator().manual_seed(7)
    for slots, fraction in [(2 * E, 0.5), (3, 1.0)]:
        runtime = make_runtime(host, slots, device, fetch_fraction=fraction, stream_prefill=False)
        modules = layers_for(runtime)
        for tokens in [4, 1, 2]:
            routing = random_routing(tokens, gen)
            x = torch.randn(tokens, host.shape.hidden, generator=gen)
            for g, w in zip(offloaded_stack(modules, x.to(device), routing), resident_stack(host, x, routing)):
                assert relative(g, w) < 1e-5
        assert runtime.stats()["admit"]["cpu_pairs"] > 0


@pytest.mark.parametrize("slots,fraction", [(2 * E, 0.5), (3, 1.0), (2 * E, 1.0)])
def test_stats_are_counts_and_rates_in_zero_one(device, slots, fraction):
    """Every counter is recounted on the host from the routing: distinct experts per call, misses
    split into copied and CPU-served experts, and every rate is in [0, 1] (a CPU-served expert
    routed twice in a call counts once among the experts, twice among the pairs)."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, slots, device, fetch_fraction=fraction, stream_prefill=slots >= E)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(slots)
    distinct = prompts = 0
    for tokens in [1, 2, 4, 1, 48, 1, 3]:
        routing = random_routing(tokens, gen, hot=[2])
        streams = runtime.should_stream(tokens, 2)
        x = torch.randn(tokens, host.shape.hidden, generator=gen)
        offloaded_stack(modules, x.to(device), routing)
        if streams:
            prompts += 1
        else:
            distinct += sum(len(set(ids.flatten().tolist())) for ids, _ in routing)
    st = runtime.stats()
    admit, stream = st["admit"], st["stream"]
    assert admit["distinct"] == distinct
    assert stream["calls"] == prompts * L
    assert admit["cpu_experts"] <= admit["cpu_pairs"]
    misses = admit["copied"] + admit["cpu_experts"]
    assert 0 <= misses <= admit["distinct"]
    assert 0.0 <= admit["hit_rate"] <= 1.0
    assert admit["hit_rate"] == pytest.approx(1 - misses / distinct)
    if prompts:
        assert 0.0 <= stream["resident_rate"] <= 1.0
        assert stream["copied"] <= stream["calls"] * E
    if fraction < 1.0 or slots < E:
        assert admit["cpu_experts"] > 0
    assert st["pool"]["rates"] == "given"  # make_runtime passes fixed rates


def test_stats_say_where_the_rates_come_from(device):
    """Measured where prefill streaming uses them; H200-like defaults, said to be so, where not."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        streaming = OffloadRuntime(host, 2 * E, device)
    assert streaming.stats()["pool"]["rates"] == "measured"
    assert OffloadRuntime(host, 3, device, stream_prefill=False).stats()["pool"]["rates"] == "default"


def test_stale_hit_through_the_module(device):
    """Decode loads layer-0 experts; a prefill streams later layers over every slot; layer 0 routed
    to the same experts again must reload them, and the output must be layer 0's."""
    require(device, "expert_gemm")
    host = random_host_pool(device, layers=3)
    runtime = make_runtime(host, E, device)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([[1, 4]])
    w = torch.tensor([[0.6, 0.4]])
    x = torch.randn(1, host.shape.hidden, generator=gen)
    first = modules[0](x.to(device), ids.to(device), w.to(device))
    prompt = random_routing(48, gen, layers=3)
    xs = torch.randn(48, host.shape.hidden, generator=gen)
    offloaded_stack(modules[1:], xs.to(device), prompt[1:])  # streams layers 1, 2 over all E slots
    assert (runtime.pool.slot_of[0] == -1).all()
    again = modules[0](x.to(device), ids.to(device), w.to(device))
    assert relative(again, first) < 1e-6
    assert relative(again, resident_stack(host, x, [(ids, w)])[0]) < 1e-5


def test_region_reuse_and_decode_hits_after_prefill(device):
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 2 * E, device)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(4)
    routing = random_routing(64, gen)
    offloaded_stack(modules, torch.randn(64, host.shape.hidden, generator=gen).to(device), routing)
    slot_of = runtime.pool.slot_of.cpu()
    # Regions alternate: layer l lives in region l % 2; layers 0 and 1 were overwritten by 2 and 3.
    assert (slot_of[0] == -1).all() and (slot_of[1] == -1).all()
    assert slot_of[2].tolist() == list(range(E)) and slot_of[3].tolist() == list(range(E, 2 * E))
    before = runtime.stats()["admit"]["copied"]
    ids = torch.tensor([[0, 7]], device=device)
    modules[3](torch.randn(1, host.shape.hidden).to(device), ids, torch.ones(1, 2, device=device))
    assert runtime.stats()["admit"]["copied"] == before, "a decode after the prefill must hit"


@pytest.mark.parametrize("eviction", ["lru", "opportunity", "hitdensity", "duel"])
def test_a_prompt_between_decode_turns_evicts_by_the_policy(device, eviction):
    """Decode rows outside the regions survive a second prompt (skip_resident). Under LRU that
    prompt stamps them recent but its last layers more recent still, so the next miss takes the
    decode rows; under Opportunity and hit density streamed rows go first, so the decode rows stay."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 3 * E, device, skip_resident=True, eviction=eviction)
    # Prompts here keep nothing, so the slots outside the regions hold decode rows only
    # (keeping is tested on its own).
    runtime.streamer._keep = lambda layer, top_k_index: None
    assert int(runtime.pool.clock) == (0 if eviction == "lru" else 1)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(5)
    x1 = torch.randn(1, host.shape.hidden, device=device)
    w = torch.full((1, K), 0.5, device=device)

    def prompt():
        offloaded_stack(modules, torch.randn(48, host.shape.hidden, generator=gen).to(device),
                        random_routing(48, gen))

    def token(*ids_per_layer):
        for module, ids in zip(modules, ids_per_layer):
            if ids is not None:
                module(x1, torch.tensor([ids], device=device), w)

    prompt()
    token([0, 1], [0, 1], None, None)  # layers 0, 1 load experts 0, 1 outside the regions
    prompt()
    resident = runtime.pool.slot_of[:2, :2].cpu()
    assert (resident >= 2 * E).all(), "the decode rows stayed outside the regions"
    if eviction != "lru":
        streamed = runtime.pool.last_use[:2 * E].cpu()
        assert (streamed == 1).all(), "streamed rows carry the STREAMED stamp"
    token([2, 3], [2, 3], [0, 1], [0, 1])  # fills the last free slots
    token([4, 5], None, None, None)  # two misses, no free slot
    kept = (runtime.pool.slot_of[0, :2].cpu() >= 0).all()
    assert bool(kept) == (eviction != "lru")


def test_a_prompt_never_keeps_an_expert_that_decode_left_outside_the_regions(device):
    """3E slots (2E in the regions, E outside): decode admits every expert of layers 0 and 1 (the
    region slots) and experts 0-3 of layer 2 (outside); a prompt routed mostly to those four keeps
    other experts of layer 2 in the free slots, never a second copy of one already resident, and
    the kept rows are stamped as streamed (first victims under hit density)."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 3 * E, device)  # hit density
    modules = layers_for(runtime)
    w = torch.full((1, K), 0.5, device=device)
    x1 = torch.randn(1, host.shape.hidden, device=device)
    for layer, experts in ((0, range(E)), (1, range(E)), (2, range(4))):
        for pair in range(0, len(experts), K):
            modules[layer](x1, torch.tensor([list(experts)[pair:pair + K]], device=device), w)
    outside_before = runtime.pool.slot_of[2, :4].cpu()
    assert (outside_before >= 2 * E).all(), "layer 2's experts 0-3 sit outside the regions"
    gen = torch.Generator().manual_seed(3)
    tokens = 48
    routing = random_routing(tokens, gen, hot=[0, 1, 2, 3])
    x = torch.randn(tokens, host.shape.hidden, generator=gen)
    inputs = []
    got = offloaded_stack(modules, x.to(device), routing, inputs)
    for layer, (g, ww) in enumerate(zip(got, resident_stack(host, x, routing, inputs=inputs))):
        assert relative(g, ww) < TOL[torch.float32], f"layer {layer}"
    assert registered_rows_mismatch(runtime, host) == [], "a pair owns two slots, or a row is not its owner's"
    assert torch.equal(runtime.pool.slot_of[2, :4].cpu(), outside_before), "the resident experts stayed put"
    kept = [int(s) for s in runtime.pool.slot_of.cpu().flatten() if s >= 2 * E and s not in outside_before.tolist()]
    assert kept, "the prompt kept some experts in the free slots"
    assert runtime.pool.last_use.cpu()[kept].eq(STREAMED).all()


def test_without_skip_resident_every_prompt_sends_every_layer_whole(device):
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 3 * E, device, skip_resident=False)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        runtime.counters.reset()
        routing = random_routing(48, gen)
        offloaded_stack(modules, torch.randn(48, host.shape.hidden, generator=gen).to(device), routing)
        assert runtime.stats()["stream"]["copied"] == L * E
    assert registered_rows_mismatch(runtime, host) == []


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_prompt_keeps_its_hottest_experts_and_the_next_sends_only_what_is_missing(device, prefetch):
    """A prompt fills the free slots outside the regions with each layer's most-routed experts
    (spread evenly, moved from the region: the link is not used for them); the next prompt copies
    every resident row within the pool, so only the missing rows cross the link, and keeps nothing
    when no slot is free (it never evicts). Outputs are the resident stack's throughout. With
    begin_forward (the plugin's hook) the first layers' copies are queued before layer 0 runs."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 3 * E, device)  # 2E in the regions, E outside
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(8)

    def prompt(tokens=48):
        routing = random_routing(tokens, gen)
        x = torch.randn(tokens, host.shape.hidden, generator=gen)
        if prefetch:
            runtime.begin_forward(tokens, K)
            assert sorted(runtime.streamer.in_flight) == [0, 1], "the first two layers are on their way"
        inputs = []
        got = offloaded_stack(modules, x.to(device), routing, inputs)
        want = resident_stack(host, x, routing, inputs=inputs)
        for layer, (g, ww) in enumerate(zip(got, want)):
            assert relative(g, ww) < TOL[torch.float32], f"layer {layer}"
        return routing

    routing = prompt()
    assert runtime.stats()["stream"]["copied"] == L * E
    slot_of = runtime.pool.slot_of.cpu()
    outside = slot_of >= 2 * E
    assert outside.sum(dim=1).tolist() == [E // L] * L, "the E free slots outside, spread over the layers"
    for layer, (ids, _) in enumerate(routing):
        counts = torch.bincount(ids.reshape(-1).cpu(), minlength=E)
        assert counts[outside[layer]].min() >= counts[~outside[layer]].max(), f"layer {layer} kept its hottest"
    assert registered_rows_mismatch(runtime, host) == []
    runtime.counters.reset()
    prompt()
    assert runtime.stats()["stream"]["copied"] == L * E - E, "resident rows crossed the link again"
    assert torch.equal(runtime.pool.slot_of.cpu()[outside], slot_of[outside]), "a full pool keeps nothing more"
    runtime.counters.reset()
    x1 = torch.randn(1, host.shape.hidden, device=device)
    w = torch.full((1, K), 0.5, device=device)
    for layer, module in enumerate(modules[:2]):
        kept = outside[layer].nonzero().flatten()[:K]
        module(x1, kept.view(1, -1).to(device), w)
    assert runtime.stats()["admit"]["copied"] == 0, "decode after the prompt hits the kept experts"


def test_a_prompt_after_one_that_raised_part_way_starts_a_fresh_pass(device, monkeypatch):
    """A forward that raises after layer 2's copy queued layer 3 leaves its pass open; the next
    prompt (through the runtime, without the plugin's hook) must not use that stale copy."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 2 * E, device)
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(9)
    real = runtime._streamed_gemm

    def failing(layer, *args):
        if layer == 2:
            raise RuntimeError("out of memory, say")
        return real(layer, *args)

    monkeypatch.setattr(runtime, "_streamed_gemm", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        offloaded_stack(modules, torch.randn(48, host.shape.hidden, generator=gen).to(device), random_routing(48, gen))
    monkeypatch.setattr(runtime, "_streamed_gemm", real)
    routing = random_routing(48, gen)
    x = torch.randn(48, host.shape.hidden, generator=gen)
    inputs = []
    got = offloaded_stack(modules, x.to(device), routing, inputs)
    want = resident_stack(host, x, routing, inputs=inputs)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert relative(g, w) < TOL[torch.float32], f"layer {layer}"


def test_pool_size_errors_and_warning(device):
    require(device, "expert_gemm")
    host = random_host_pool(device)
    with pytest.raises(ValueError, match=f"use at least {E} slots"):
        OffloadRuntime(host, E - 1, device)
    # A pool of one layer's slots serializes streaming: worth a warning on CUDA, where two layers'
    # slots let copies overlap compute, attributed to the caller's line; never on the CPU, whose
    # copies run before the compute anyway.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        OffloadRuntime(host, E + 2, device)
    notes = [(w.filename, w.lineno) for w in caught if f"{2 * E} slots let the next layer stream" in str(w.message)]
    assert notes == ([] if device == "cpu" else [(__file__, line)]), [str(w.message) for w in caught]
    OffloadRuntime(host, 3, device, stream_prefill=False)  # admission only: any size works


def test_copy_never_starts_before_the_region_is_released(device):
    """On CUDA, read the recorded events: the copy of layer l+2 into a region starts after the
    release of layer l (the previous owner of that region)."""
    require(device, "expert_gemm")
    if device != "cuda":
        pytest.skip("stream order exists on CUDA only")
    host = random_host_pool(device, layers=6)
    runtime = make_runtime(host, 2 * E, device)
    runtime.streamer.record_events = True
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(5)
    routing = random_routing(256, gen, layers=6)
    offloaded_stack(modules, torch.randn(256, host.shape.hidden, generator=gen).to(device), routing)
    torch.cuda.synchronize()
    log = runtime.streamer.event_log
    release = {layer: e for kind, layer, _, e in log if kind == "release"}
    copy_start = {layer: e for kind, layer, _, e in log if kind == "copy_start"}
    ready = {layer: e for kind, layer, _, e in log if kind == "copy_ready"}
    compute = {layer: e for kind, layer, _, e in log if kind == "compute_start"}
    for layer in range(2, 6):
        assert release[layer - 2].elapsed_time(copy_start[layer]) >= 0, f"copy of {layer} began before release of {layer - 2}"
    for layer in range(6):
        assert ready[layer].elapsed_time(compute[layer]) >= 0, f"compute of {layer} began before its copy was ready"


@pytest.mark.parametrize("eviction", ["lru", "opportunity", "hitdensity", "duel"])
def test_captured_decode_step_replays_with_changing_routing(device, eviction):
    """One decode step through every layer (admission, copies, GEMMs, counters) captured in a CUDA
    graph and replayed with new routing; a pool of 1.5 layers forces misses that evict and reload.
    Outputs and pool state (the eviction policy's included) follow an eager twin step by step."""
    require(device, "expert_gemm")
    if device != "cuda":
        pytest.skip("CUDA graphs exist on CUDA only")
    host = random_host_pool(device)
    slots = E + E // 2
    graphed, eager = (make_runtime(host, slots, device, stream_prefill=False, eviction=eviction)
                      for _ in range(2))
    g_mods, e_mods = layers_for(graphed), layers_for(eager)
    x = torch.zeros(1, host.shape.hidden, device=device)
    ids = torch.zeros(L, 1, 2, dtype=torch.int64, device=device)
    w = torch.zeros(L, 1, 2, device=device)
    outs = []

    def step():
        outs.clear()
        h = x
        for layer, module in enumerate(g_mods):
            y = module(h, ids[layer], w[layer])
            outs.append(y)
            h = h + y

    def pool_state(runtime):  # the maps, stamps, clock, the policy's learned state and Duel's shadows
        policy = [runtime.pool.policy_state] if runtime.pool.policy_state is not None else []
        shadows = runtime.pool.shadows
        shadows = (*shadows.tensors, shadows.unadmittable) if shadows is not None else ()
        return [*runtime.pool.state, *policy, *shadows]

    # Warm up, then put the state back and capture on it. The copies are taken before the side
    # stream waits on this one: taken after, the warm-up could run before them (the graphed pool
    # then started one step ahead of its eager twin).
    saved = [t.clone() for t in pool_state(graphed)] + [graphed.counters.counts.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    for t, s in zip(pool_state(graphed) + [graphed.counters.counts], saved):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    torch.cuda.synchronize()
    gen = torch.Generator().manual_seed(11)
    for t in range(30):
        routing = random_routing(1, gen)
        x.copy_(torch.randn(1, host.shape.hidden, generator=gen))
        for layer, (i, ww) in enumerate(routing):
            ids[layer].copy_(i)
            w[layer].copy_(ww)
        graph.replay()
        want = offloaded_stack(e_mods, x.clone(), [(i.to(device), ww.to(device)) for i, ww in routing])
        torch.cuda.synchronize()
        for layer in range(L):
            assert relative(outs[layer], want[layer]) < 1e-5, f"replay {t} layer {layer}"
        for a, b in zip(pool_state(graphed), pool_state(eager)):
            assert torch.equal(a, b), f"pool state diverged at replay {t}"
    assert graphed.stats()["admit"]["copied"] > L * E // 2, "the routing must have caused reloads"


def test_rates_are_measured_on_an_empty_pool(device):
    """Without rates=, a streaming runtime measures its link and GEMM rates on its own empty pool:
    positive and finite, no expert registered by the measurement, and a pool that holds experts
    is refused (the measurement overwrites bank rows)."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = OffloadRuntime(host, 2 * E, device)
    for rate in (runtime.rates.link_bytes_per_s, runtime.rates.gemm_flops_per_s):
        assert math.isfinite(rate) and rate > 0
    assert (runtime.pool.slot_of == -1).all() and (runtime.pool.owner_of == -1).all()
    assert runtime.counters.counts.sum() == 0
    few, many = runtime.should_stream(1, 2), runtime.should_stream(10_000, 2)
    assert not few and many, "one token admits, a long prompt streams"
    modules = layers_for(runtime)
    modules[0](torch.randn(1, host.shape.hidden).to(device), torch.tensor([[0, 1]], device=device),
               torch.ones(1, 2, device=device))
    with pytest.raises(RuntimeError, match="empty pool"):
        measure_rates(runtime.pool, host, "silu")


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp8_rows", "mxfp4"])
def test_the_rate_measurement_fills_its_slots_in_place_with_finite_experts(device, fmt):
    """measure_rates' random experts: every value finite at about cols^-1/2, only the first n slots
    written, and no temporaries the size of the experts (quantizing random floats took 4.4 GB for
    eight GPT-OSS-120B-wide experts)."""
    require(device, "expert_gemm")
    hidden, inter, n = (256, 128, 3)
    pool = SlotPool(ExpertShape(2, 4, hidden, inter, torch.bfloat16, True, fmt), 6, device)
    for bank in (pool.w13, pool.w2):
        bank.view(torch.uint8).fill_(0x7F)  # an e4m3 NaN; 2^0 scales and 0x7F e2m1 pairs elsewhere
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    _fill_random(pool, n)
    if device == "cuda":
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - before < (1 << 20)
    for bank, scale, parts, cols in ((pool.w13, pool.w13_scale, 2, hidden), (pool.w2, pool.w2_scale, 1, inter)):
        if fmt in formats.FP8_FORMATS:
            w = formats.dequantize_fp8(bank[:n], scale[:n], parts, torch.float32)
        elif fmt == "mxfp4":
            w = formats.dequantize_mxfp4(bank[:n], scale[:n], torch.float32)
        else:
            w = bank[:n].float()
        assert torch.isfinite(w).all()
        assert cols ** -0.5 / 16 < float(w.abs().mean()) < cols ** -0.5 * 2
        assert (bank[n:].view(torch.uint8) == 0x7F).all(), "only the first n slots are written"


def test_calls_with_fewer_pairs_than_experts_never_stream(device):
    """Whatever the rates say (a noisy measurement, say), a call that routes fewer pairs than the
    layer has experts admits; with rates that favour streaming, a long prompt streams."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 2 * E, device, rates=Rates(link_bytes_per_s=1e30, gemm_flops_per_s=1.0))
    assert not any(runtime.should_stream(tokens, 2) for tokens in range(1, E // 2))
    assert runtime.should_stream(E // 2, 2) and runtime.should_stream(64, 2)


def test_a_call_of_as_many_pairs_as_experts_counts_as_prompt_sized(device):
    """The decode counters (which the CPU split reads) take calls of fewer routed pairs than the
    layer has experts; a call of exactly E pairs goes to the other admission counters."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 3 * E, device, stream_prefill=False)
    module = layers_for(runtime)[0]
    for pairs in (E, E - K):
        ids = torch.arange(pairs, device=device).reshape(pairs // K, K)
        module(torch.randn(pairs // K, host.shape.hidden, device=device), ids,
               torch.full((pairs // K, K), 1.0 / K, device=device))
    assert int(runtime.counters.admission_counters(0, False)[0]) == 1  # the E-pair call
    assert int(runtime.counters.admission_counters(0, True)[0]) == 1   # the E - K one


def test_the_choice_counts_what_the_cache_already_holds(device):
    """A pass sends only experts that are not resident: with rates where a 4-token call's untouched
    experts cost more to stream than its compute hides on an empty cache, but not once a quarter of
    the model sits outside the regions, it admits first and streams after a pass has found that
    quarter resident; the share is the host's copy from that pass, never a device read, and an
    invalidated pool counts as empty. Every MoE layer of a forward follows the choice made at its
    first."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 3 * E, device, rates=Rates(link_bytes_per_s=0.55, gemm_flops_per_s=1.0))
    assert not runtime.should_stream(4, 2)
    modules = layers_for(runtime)
    x = torch.randn(1, host.shape.hidden).to(device)
    for layer in range(L):  # decode admits every expert of every layer
        for e in range(0, E, 2):
            modules[layer](x, torch.tensor([[e, e + 1]], device=device), torch.ones(1, 2, device=device))
    assert not runtime.should_stream(4, 2)  # no pass has looked at the pool since
    gen = torch.Generator().manual_seed(4)
    offloaded_stack(modules, torch.randn(64, host.shape.hidden, generator=gen).to(device), random_routing(64, gen))
    assert runtime.streamer.resident_share() == 0.25  # 8 slots outside the two regions, 32 pairs
    assert runtime.should_stream(4, 2)
    calls = runtime.stats()["stream"]["calls"]
    offloaded_stack(modules, torch.randn(4, host.shape.hidden, generator=gen).to(device), random_routing(4, gen))
    assert runtime.stats()["stream"]["calls"] == calls + L
    runtime.pool.invalidate()
    assert runtime.streamer.resident_share() == 0.0 and not runtime.should_stream(4, 2)


def test_a_prompt_opened_by_generate_keeps_its_choice(device):
    """generate() decides and opens the prompt's pass, then the forward's pre-hook calls
    begin_forward again: the open, unused pass stands and nothing is decided twice (its prefetch
    changed the pool, so a second decision could differ and leave the copies unused)."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 2 * E, device, rates=Rates(link_bytes_per_s=1e30, gemm_flops_per_s=1.0))
    decided = []
    should_stream = runtime.should_stream
    runtime.should_stream = lambda tokens, top_k: decided.append(tokens) or should_stream(tokens, top_k)
    runtime.begin_forward(64, 2)  # generate()
    in_flight = sorted(runtime.streamer.in_flight)
    runtime.begin_forward(64, 2)  # the forward's pre-hook
    assert decided == [64] and sorted(runtime.streamer.in_flight) == in_flight == [0, 1]
    calls = runtime.stats()["stream"]["calls"]
    gen = torch.Generator().manual_seed(5)
    offloaded_stack(layers_for(runtime), torch.randn(64, host.shape.hidden, generator=gen).to(device),
                    random_routing(64, gen))
    assert runtime.stats()["stream"]["calls"] == calls + L and decided == [64]


def test_a_choice_made_ahead_holds_for_experts_called_once_per_route(device):
    """Families whose experts compute one row per route (Llama 4, MuseSpark, Ergo) call them with
    (tokens * top_k, 1) where the model's hook decided for (tokens, top_k): the same routed pairs,
    so the choice made ahead holds and its prefetched copies are used."""
    require(device, "expert_gemm")
    host = random_host_pool(device)
    runtime = make_runtime(host, 2 * E, device, rates=Rates(link_bytes_per_s=1e30, gemm_flops_per_s=1.0))
    decided = []
    should_stream = runtime.should_stream
    runtime.should_stream = lambda tokens, top_k: decided.append((tokens, top_k)) or should_stream(tokens, top_k)
    runtime.begin_forward(32, 2)
    gen = torch.Generator().manual_seed(6)
    routing = [(ids.reshape(64, 1), w.reshape(64, 1)) for ids, w in random_routing(32, gen)]
    offloaded_stack(layers_for(runtime), torch.randn(64, host.shape.hidden, generator=gen).to(device), routing)
    assert decided == [(32, 2)] and runtime.stats()["stream"]["calls"] == L


@pytest.mark.parametrize("depth", [1, 3])
def test_library_warnings_name_the_callers_line(device, depth):
    """ft_ops.user_warnings.warn skips every frame inside ft_ops (here code compiled as if it were
    an ft_ops file, called `depth` levels deep) and reports the first line outside it."""
    import os

    import ft_ops
    from ft_ops import user_warnings

    if device != "cpu":
        pytest.skip("the same on every device")
    inside = os.path.join(os.path.dirname(ft_ops.__file__), "library_code.py")
    scope = {"warn": user_warnings.warn}
    exec(compile("def level1():\n    warn('from inside')\n"
                 "def level2():\n    level1()\n"
                 "def level3():\n    level2()\n", inside, "exec"), scope)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        scope[f"level{depth}"]()
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
