"""torch.compile(OffloadedExperts, fullgraph=True) for decode shapes: outputs, pool state and
counters equal eager, and the compiled code runs the ops on the pool's own tensors (no copy of the
banks or maps per call: checked by reading the code inductor generates)."""
import contextlib
import re
import warnings

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from freetoken_plugin.bench_e2e import cache_argument
from ft_ops.moe import OffloadRuntime
from helpers import DEVICES, require
from moe_helpers import E, H, I, L, layers_for, random_host_pool, random_routing

pytestmark = pytest.mark.parametrize("device", DEVICES)
SLOTS = 12


def runtimes(device, eviction="hitdensity"):
    host = random_host_pool(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (OffloadRuntime(host, SLOTS, device, eviction=eviction),
                OffloadRuntime(host, SLOTS, device, eviction=eviction))


def pool_tensors(pool):
    """The maps, the policy state and, under "duel", the shadow caches' tensors."""
    shadows = (*pool.shadows.tensors, pool.shadows.unadmittable) if pool.shadows is not None else ()
    return (*pool.state, *([pool.policy_state] if pool.policy_state is not None else []), *shadows)


@pytest.mark.parametrize("eviction", ["hitdensity", "duel"])
def test_compiled_decode_matches_eager(device, eviction):
    require(device, "dedup_and_admit")
    torch._dynamo.reset()
    rt_c, rt_e = runtimes(device, eviction)
    compiled = torch.compile(layers_for(rt_c)[1], fullgraph=True)
    eager = layers_for(rt_e)[1]
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        ids, w = random_routing(1, gen, layers=1)[0]
        x = torch.randn(1, H, generator=gen)
        args = (x.to(device), ids.to(device), w.to(device))
        torch.testing.assert_close(compiled(*args), eager(*args), rtol=1e-5, atol=1e-6)
    for a, b in zip(pool_tensors(rt_c.pool), pool_tensors(rt_e.pool), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(rt_c.counters.counts, rt_e.counters.counts)
    if eviction == "duel":  # the shadows replayed every call, into the pool's own Duel words
        assert int(rt_c.pool.shadows.lru_counters[0]) == 5


@pytest.mark.parametrize("eviction", ["hitdensity", "duel"])
def test_compiled_code_uses_the_pool_in_place(device, eviction):
    require(device, "dedup_and_admit")
    torch._dynamo.reset()
    rt, _ = runtimes(device, eviction)
    module = torch.compile(layers_for(rt)[0], fullgraph=True)
    ids, w = random_routing(1, torch.Generator().manual_seed(1), layers=1)[0]
    x = torch.randn(1, H)
    _, codes = run_and_get_code(module, x.to(device), ids.to(device), w.to(device))
    code = "\n".join(codes)
    assert "torch.ops.freetoken.dedup_and_admit.default(arg" in code
    assert re.search(r"torch\.ops\.freetoken\.copy_experts\.default\(\[arg\d+_1, arg\d+_1\]", code), \
        "copy_experts must write the banks themselves (graph inputs), not copies"
    state = 2 * L * E + SLOTS + (12 if eviction == "duel" else 0)
    bank_or_map = [f"({SLOTS}, {2 * I}, {H})", f"({SLOTS}, {H}, {I})", f"({L}, {E})", f"({SLOTS}, )",
                   f"({state}, )", f"({2 * L * E + SLOTS}, )"]
    for line in code.splitlines():
        if "empty_strided" in line or "clone" in line:
            assert not any(shape in line for shape in bank_or_map), f"a bank or map is copied: {line.strip()}"


def offloaded_tiny_model(device, seed, new_tokens, **options):
    """A tiny Qwen3-MoE, its greedy tokens with a static cache (eager), then offloaded with a pool
    small enough that decode steps miss and evict (`options`: offload_experts' own); dynamo state
    and counters reset."""
    import freetoken_plugin
    from freetoken_plugin.tiny import tiny_model
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("qwen3_moe").to(device)
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(seed)).to(device)
    want = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          cache_implementation="static", disable_compile=True)
    freetoken_plugin.offload_experts(model, **{"cache_slots": 10, **options}, device=device, progress=False)
    return model, prompt, want


@pytest.mark.slow  # compiles a transformers model: ~30 s on a 2-core machine with a cold inductor cache
@pytest.mark.parametrize("eviction", ["hitdensity", "duel"])
def test_compiled_model_generates_with_a_static_cache(device, eviction):
    """A whole offloaded transformers model compiled with fullgraph=True and a static KV cache gives
    the eager model's greedy tokens, with a pool small enough that decode steps miss and evict.
    On CUDA it is the way transformers compiles generation: decode steps under
    torch.compile(mode="reduce-overhead"), the prefill eager (where the streamer overlaps copies with
    compute); no CUDA graph may be skipped (for a CPU input, a mutated input, anything) and the
    decode steps must be replayed from CUDA graphs."""
    require(device, "dedup_and_admit")
    import freetoken_plugin
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    steps = 12
    model, prompt, want = offloaded_tiny_model(device, seed=0, new_tokens=steps, eviction=eviction)
    kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, cache_implementation="static")
    assert torch.equal(model.generate(prompt, **kw, disable_compile=True), want), "eager offloaded tokens differ"
    if device == "cpu":  # the whole forward, prefill included, in one compiled graph
        model.forward = torch.compile(model.forward, fullgraph=True)
        compiled = dict(disable_compile=True)
    else:
        compiled = dict(compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    replays = _count_graph_replays() if device == "cuda" else contextlib.nullcontext()
    with replays:
        for _ in range(2):  # the second run replays what the first recorded
            assert torch.equal(model.generate(prompt, **kw, **compiled), want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    if device == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == 0, "a CUDA graph was skipped (see the log)"
        assert replays.count >= steps, f"decode steps replayed {replays.count} CUDA graphs for {steps} steps"
    stats = freetoken_plugin.stats(model)
    assert stats["admit"]["copied"] > 0, "the pool was meant to miss and reload experts"


def overlapping_inputs(example_inputs) -> list:
    """Pairs of tensor inputs of a graph whose storage extents overlap (views of one another; a
    strided view counts from its first to its last element)."""
    spans = []
    for i, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
            spans.append((t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
                          (last + 1) * t.element_size(), i))
    spans.sort()
    return [(a[3], b[3]) for k, a in enumerate(spans) for b in spans[k + 1:] if a[0] == b[0] and b[1] < a[2]]


@pytest.mark.parametrize("eviction", [pytest.param("hitdensity", marks=pytest.mark.slow), "duel"])
def test_a_compiled_steps_inputs_do_not_alias(device, eviction):
    """No two inputs of a compiled decode step overlap: the pool's state is one input, never beside
    views of itself. AOTAutograd merges aliased inputs into a synthetic base, and CUDA graph trees
    then skip the whole graph as one that mutates its inputs (Duel's shadows once held views of the
    pool's Duel words: its compiled decode ran without CUDA graphs, at 23-40 % of hit density's speed)."""
    require(device, "dedup_and_admit")
    model, prompt, _ = offloaded_tiny_model(device, seed=2, new_tokens=1, eviction=eviction)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(overlapping_inputs(example_inputs))
        return gm

    model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
    model.generate(prompt, max_new_tokens=2, do_sample=False, cache_implementation="static", disable_compile=True)
    assert len(graphs) == 2, "a prefill graph and a decode graph"
    assert graphs == [[], []], f"overlapping graph inputs: {graphs}"


class _count_graph_replays:
    """Counts torch.cuda.CUDAGraph.replay calls (what CUDA graph trees call to run a graph)."""

    def __enter__(self):
        self.count, self._orig = 0, torch.cuda.CUDAGraph.replay
        outer = self

        def replay(graph, *a, **k):
            outer.count += 1
            return outer._orig(graph, *a, **k)

        torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.replay = self._orig



@pytest.mark.slow  # as above
def test_whole_forward_compiles_with_an_early_initialized_static_cache(device):
    """The whole forward, prefill included, in compiled graphs (reduce-overhead on CUDA). The static
    cache is initialized before the first call: transformers initializes it lazily inside the first
    update otherwise, which its cache_utils says to avoid when the prefill is compiled (on torch 2.11
    that lazy path failed inside an attention kernel)."""
    require(device, "dedup_and_admit")
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    new = 8
    model, prompt, want = offloaded_tiny_model(device, seed=1, new_tokens=new)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, disable_compile=True)
    model.forward = torch.compile(model.forward, fullgraph=True, mode="reduce-overhead" if device == "cuda" else None)
    cfg = model.config
    for _ in range(2):
        cache = StaticCache(config=cfg, max_cache_len=prompt.shape[1] + new)
        cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                   dtype=model.dtype, device=prompt.device)
        assert torch.equal(model.generate(prompt, **{cache_argument(model): cache}, **kw), want)
    assert not counters["graph_break"], dict(counters["graph_break"])
    if device == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.slow  # compiles a transformers model
def test_a_forward_compiled_before_any_eager_call_on_a_pool_below_one_layer(device):
    """A pool of fewer slots than a layer's experts (stream_prefill=False) may leave a call's misses
    to the CPU share, whose worker cannot start inside a compiled forward: offload_experts starts it
    (it passes top_k), so the forward compiles on its first call. It had started at the first call
    that left pairs, which fullgraph refused, naming "run one eager call"."""
    require(device, "dedup_and_admit")
    from transformers import StaticCache

    new = 4
    model, prompt, want = offloaded_tiny_model(device, seed=2, new_tokens=new, cache_slots=4, stream_prefill=False)
    model.forward = torch.compile(model.forward, fullgraph=True)
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=prompt.shape[1] + new)
    cache.early_initialization(batch_size=1, num_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               dtype=model.dtype, device=prompt.device)
    got = model.generate(prompt, **{cache_argument(model): cache}, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, disable_compile=True)
    assert torch.equal(got, want)
