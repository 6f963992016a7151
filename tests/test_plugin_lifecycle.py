"""An offloaded model over its life: when a streamed pass starts its copies (and when none is
opened), deep copies with their own runtimes, pickling, deletion, threads and the model's lock."""
import copy
import functools

import pytest
import torch

import freetoken_plugin
from freetoken_plugin.bench_e2e import cache_argument
from freetoken_plugin.offload import find_experts
from freetoken_plugin.tiny import tiny_model
from ft_ops.policies import POLICIES
from ft_ops.rates import Rates
from helpers import greedy_tokens, require

E = 8


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_a_streamed_forward_starts_its_first_copies_before_the_embedding(arch, monkeypatch):
    """The model's forward: a prompt that will stream queues the first layers' copies
    before the embedding runs; a decode step does not; tokens stay the unmodified model's."""
    require("cpu", "expert_gemm")
    model = tiny_model(arch)
    prompt = torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    want = greedy_tokens(model, prompt, steps=3)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    runtime = handle.runtime
    calls, seen = [], []
    model.get_input_embeddings().register_forward_pre_hook(lambda m, a: seen.append(len(calls)))
    real_prefetch = runtime.streamer.prefetch

    def recording_prefetch():
        real_prefetch()
        calls.append(sorted(runtime.streamer.in_flight))
    monkeypatch.setattr(runtime.streamer, "prefetch", recording_prefetch)
    got = greedy_tokens(model, prompt, steps=3)
    assert torch.equal(got, want)
    assert calls == [[0, 1]], "one prefetch, for the prompt, of the first two layers"
    assert seen[0] == 1, "the copies were queued before the embedding ran"
    assert freetoken_plugin.stats(model)["stream"]["calls"] == len(find_experts(model))


def test_generate_starts_the_copies_before_its_own_work(monkeypatch):
    """greedy_tokens() (wrapped on the instance) queues a streamed prompt's first copies when it is
    called, before its first forward; the forward's pre-hook keeps that pass; a second turn whose
    new tokens do not stream, and a decode step, start nothing; tokens stay the model's."""
    from transformers import DynamicCache

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    want = greedy_tokens(model, prompt, steps=3)
    order = []
    model.register_forward_pre_hook(lambda m, a: order.append("forward"))  # before the plugin's hook
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    real_prefetch = handle.runtime.streamer.prefetch

    def recording_prefetch():
        real_prefetch()
        order.append("prefetch")
    monkeypatch.setattr(handle.runtime.streamer, "prefetch", recording_prefetch)
    assert torch.equal(greedy_tokens(model, prompt, steps=3), want)
    assert order[:2] == ["prefetch", "forward"] and order.count("prefetch") == 1
    assert model.generate.__name__ == "generate" and callable(model.generate.__wrapped__)
    # A second turn of 2 tokens on the history in the cache: too short to stream.
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        name = cache_argument(model)  # `cache` in transformers after 5.17, `past_key_values` before
        model(prompt, use_cache=True, **{name: cache})
        order.clear()
        model.generate(torch.cat([prompt, prompt[:, :2]], 1), max_new_tokens=1, do_sample=False, **{name: cache})
    assert "prefetch" not in order


def test_a_deep_copy_starts_its_own_runtimes_copies(monkeypatch):
    """generate and the pre-hook read the runtime from the model they run on: a deep copy's
    prompt opens a pass in the copy's runtime, and the original's stays closed."""
    import copy

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(4))
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    twin = copy.deepcopy(model)
    opened = []
    for name, m in (("model", model), ("twin", twin)):
        real = m._freetoken_handle.runtime.streamer.prefetch
        monkeypatch.setattr(m._freetoken_handle.runtime.streamer, "prefetch",
                            lambda real=real, name=name: (opened.append(name), real()))
    assert torch.equal(greedy_tokens(twin, prompt, steps=2), greedy_tokens(model, prompt, steps=2))
    assert opened == ["twin", "model"]


def test_no_pass_is_opened_for_a_compiled_model_or_kept_after_invalidate(monkeypatch):
    """model.compile() (its layers admit): generate opens no pass. A pass that generate opened and
    no forward used is dropped, not used, once the pool is invalidated."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(5))
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    runtime = handle.runtime
    calls = []
    real_prefetch = runtime.streamer.prefetch
    monkeypatch.setattr(runtime.streamer, "prefetch", lambda: (calls.append("prefetch"), real_prefetch()))
    real_finish = runtime.streamer.finish
    monkeypatch.setattr(runtime.streamer, "finish", lambda: (calls.append("finish"), real_finish()))
    runtime.begin_forward(24, 2)  # as greedy_tokens() does before it raises
    assert runtime.streamer.opened_and_unused()
    runtime.pool.invalidate()
    assert not runtime.streamer.opened_and_unused()
    runtime.begin_forward(24, 2)  # the next prompt: a fresh pass
    assert calls == ["prefetch", "finish", "prefetch"]
    runtime.streamer.finish()
    model.compile(backend="eager")
    from freetoken_plugin.offload import _forward_is_compiled

    assert _forward_is_compiled(model)


@pytest.mark.slow  # torch.compile of a whole model (10-15 s): in the slow run, which CI also runs
def test_a_compiled_forward_opens_no_streamed_pass():
    """model.forward = torch.compile(model.forward): its pre-hooks run eagerly, but its layers
    admit, so the hook must not queue layer copies beside them."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E + 4, device="cpu", progress=False)
    assert handle.runtime.should_stream(64, 2)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward)
    with torch.no_grad():
        model(torch.randint(1, 512, (1, 64)))
    assert not handle.runtime.streamer.in_flight and not handle.runtime._streaming
    # One admission per MoE layer moved the clock; a layer copy queued by the hook would add one.
    start = 0 if handle.runtime.pool.policy == POLICIES["lru"] else 1  # Opportunity's and hit density's start at 1
    assert int(handle.runtime.pool.clock) == start + len(find_experts(model))
    torch._dynamo.reset()


def test_one_model_in_several_threads_computes_each_threads_tokens():
    """A chat server's request threads share one model: its forwards and generate calls take turns
    through the runtime's forward lock (two threads used to evict each other's experts between an
    admission and its GEMM, or interleave two streamed passes: wrong tokens, or a raise)."""
    import threading

    require("cpu", "expert_gemm")
    reference = tiny_model("qwen3_moe")
    model = copy.deepcopy(reference)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (1, n), generator=gen) for n in (1, 3, 40, 90)]
    want = [greedy_tokens(reference, p, 8) for p in prompts]
    with torch.no_grad():
        # The threads must compute what the model computes alone, bit for bit; against the resident
        # reference, ATen's GEMM kernels of this CPU may sum a prompt's products in another order.
        want_logits = model(prompts[2]).logits
        reference_logits = reference(prompts[2]).logits
    assert float((want_logits - reference_logits).norm() / reference_logits.norm()) < 1e-5
    got, errors = {}, []

    def run(i):
        try:
            for _ in range(3):
                got[i] = greedy_tokens(model, prompts[i], 8)
                with torch.no_grad():
                    got[("logits", i)] = model(prompts[2]).logits
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(torch.equal(got[i], want[i]) for i in range(len(prompts)))
    assert all(torch.equal(got[("logits", i)], want_logits) for i in range(len(prompts)))
    lock = model._freetoken_handle.runtime.forward_lock
    assert copy.deepcopy(lock) is not lock


def test_pickling_is_refused_by_name_and_a_deep_copy_saves_from_its_own_pool():
    import pickle

    require("cpu", "expert_gemm")
    reference = tiny_model("qwen3_moe")
    model = copy.deepcopy(reference)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    with pytest.raises(TypeError, match=r"^an offloaded model cannot be pickled .* save it with "
                                        r"model.save_pretrained\(path\)"):
        pickle.dumps(model)
    twin = copy.deepcopy(model)
    pool = twin._freetoken_handle.runtime.host
    hooks = [h for m in twin.modules() for h in m._state_dict_hooks.values() if hasattr(h, "host")]
    assert hooks and all(h.host is pool for h in hooks)  # a closure kept reading the original's pool
    state, want = twin.state_dict(), reference.state_dict()
    assert all(torch.equal(state[k], want[k]) for k in want)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_deleting_an_offloaded_model_frees_its_pools_at_once(arch):
    """`del model` frees the host and slot pools without waiting for the cyclic garbage collector:
    nothing the plugin sets on the model refers back to it strongly (a reload that checks the free
    host memory would otherwise still see the old pool). A deep copy's generate and handle are the
    copy's."""
    import gc
    import weakref

    require("cpu", "expert_gemm")
    model = tiny_model(arch)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    twin = copy.deepcopy(model)
    assert twin._freetoken_handle.model is twin and handle.model is model
    assert twin.generate.__self__ is twin and model.generate.__name__ == "generate"
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False),
                       twin.generate(ids, max_new_tokens=3, do_sample=False))
    pools = [weakref.ref(m._freetoken_handle.runtime.host) for m in (model, twin)]
    gc.disable()
    try:
        del model, twin
        assert pools[1]() is None, "a reference cycle kept the copy's pools"
        with pytest.raises(ReferenceError, match="was deleted"):
            handle.model  # the handle keeps its runtime, not the model
        del handle
        assert pools[0]() is None, "a reference cycle kept the pools"
    finally:
        gc.enable()


@pytest.mark.parametrize("forward", ["the class's", "set on the instance"])
def test_every_call_of_the_model_holds_the_lock(forward):
    """The lock is taken around the model's call, not in its forward: a forward set on the
    instance (accelerate's hooks, `model.forward = torch.compile(model.forward)`) is covered too."""
    import threading

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    if forward == "set on the instance":  # as accelerate's hooks do
        model.forward = functools.partial(type(model).forward, model)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    lock = model._freetoken_handle.runtime.forward_lock
    done = threading.Event()
    lock.acquire()
    worker = threading.Thread(target=lambda: (model(torch.tensor([[1, 2, 3]])), done.set()), daemon=True)
    worker.start()
    try:
        assert not done.wait(0.5), "the call ran while another thread held the lock"
    finally:
        lock.release()
    worker.join(30)
    assert done.is_set()


@pytest.mark.parametrize("call", ["model.model", "model.forward"])
def test_a_call_without_the_lock_waits_at_its_experts(call):
    """A submodule called directly and `model.forward` take no lock for their forward, but each
    experts call takes it: such a call never runs inside another thread's forward (it used to
    evict that forward's experts between an admission and its GEMM, or overwrite its streamed
    region: wrong tokens in both threads, or a raise), and computes what it computes alone."""
    import threading

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    prompt = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(4))  # streamed
    run = (lambda: model.model(prompt).last_hidden_state) if call == "model.model" else (
        lambda: model.forward(prompt).logits)
    with torch.no_grad():
        want = run()
    experts = find_experts(model)[0][1]
    reached, done, box = threading.Event(), threading.Event(), []
    experts.register_forward_hook(lambda *args: reached.set())
    lock = model._freetoken_handle.runtime.forward_lock

    def worker():
        with torch.no_grad():
            box.append(run())
        done.set()

    lock.acquire()  # another thread's forward, under way
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        assert not reached.wait(0.5), f"{call}: an experts call ran inside another thread's forward"
    finally:
        lock.release()
    thread.join(30)
    assert done.is_set() and torch.equal(box[0], want)


def test_a_forward_between_the_layers_of_a_streamed_call_leaves_both_exact():
    """A forward that runs between two layers of a call that took no lock (re-entered here from
    the call's own thread, as another thread's would run there) closes that call's streamed pass;
    the call's next layer opens another, so both compute what they compute alone, and the pool
    serves the next call exactly."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    # A link far faster than the GEMMs: every prompt-sized call streams, whatever this machine measures.
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False,
                                     rates=Rates(link_bytes_per_s=1e30, gemm_flops_per_s=1.0))
    gen = torch.Generator().manual_seed(5)
    prompt, other = torch.randint(1, 512, (1, 40), generator=gen), torch.randint(1, 512, (1, 30), generator=gen)
    with torch.no_grad():
        want = model.model(prompt).last_hidden_state
    want_other = greedy_tokens(model, other, 4)
    experts = [m for _, m in find_experts(model)]
    between = []

    def another_forward(*args):
        if not between:  # once: the other forward's own calls pass this hook too
            between.append(None)
            between[0] = greedy_tokens(model, other, 4)

    handle = experts[0].register_forward_hook(another_forward)
    streamed = model._freetoken_handle.stats()["stream"]["calls"]
    with torch.no_grad():
        got = model.model(prompt).last_hidden_state
    handle.remove()
    assert model._freetoken_handle.stats()["stream"]["calls"] >= streamed + 6, "both calls streamed every layer"
    assert between and torch.equal(between[0], want_other)
    assert torch.equal(got, want)
    assert torch.equal(greedy_tokens(model, other, 4), want_other), "the pool's maps were left inconsistent"


@pytest.mark.parametrize("where", ["generate", "forward"])
def test_an_interrupted_generate_or_forward_leaves_the_lock_free(where):
    """A KeyboardInterrupt in a forward (torch runs its always-called hooks after an Exception
    only), inside generate or in a plain call of the model, leaves the forward lock free, so
    another thread's generate is not blocked for good."""
    import threading

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    calls = []

    def interrupt(module, args):  # stands for Ctrl-C arriving during a forward
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    hook = model.model.layers[1].register_forward_pre_hook(interrupt)
    prompt = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(KeyboardInterrupt):
        if where == "generate":
            greedy_tokens(model, prompt, 8)
        else:
            for _ in range(3):
                model(prompt)
    hook.remove()
    assert model._freetoken_handle.runtime.forward_lock.depth() == 0
    done = []
    worker = threading.Thread(target=lambda: done.append(greedy_tokens(model, prompt, 4)), daemon=True)
    worker.start()
    worker.join(30)
    assert done, "another thread's generate waited for a lock the interrupted one kept"


@pytest.mark.slow
def test_a_paged_generate_runs_its_forwards_in_transformers_thread():
    """Continuous batching runs the forwards in a thread of its own while generate waits: the bound
    generate must not hold the lock (it deadlocked)."""
    import threading

    require("cpu", "expert_gemm")
    reference = tiny_model("qwen3_moe")
    model = copy.deepcopy(reference)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])

    def run(m, box):
        try:
            with torch.no_grad():
                box.append(m.generate(prompt, max_new_tokens=4, do_sample=False, cache_implementation="paged"))
        except Exception as error:  # noqa: BLE001 - this transformers may not page on the CPU
            box.append(error)

    want = []
    worker = threading.Thread(target=run, args=(reference, want), daemon=True)
    worker.start()
    worker.join(120)
    if not want or isinstance(want[0], Exception):
        pytest.skip(f"paged generate does not run here: {want[0] if want else 'timeout'}")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    got = []
    worker = threading.Thread(target=run, args=(model, got), daemon=True)
    worker.start()
    worker.join(120)
    assert got, "the offloaded paged generate did not finish (a deadlock on the forward lock?)"
    assert not isinstance(got[0], Exception), got[0]
    assert torch.equal(got[0], want[0])


def test_a_deep_copy_with_a_cpu_share_opens_its_own_session():
    """A copied session number would post into the original's worker (colliding tickets: another
    model's result, then 'no open session' once the original is freed)."""
    require("cpu", "expert_gemm")
    reference = tiny_model("qwen3_moe")
    model = copy.deepcopy(reference)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, fetch_fraction=0.5)
    prompt = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(3))
    want = greedy_tokens(reference, prompt)
    assert torch.equal(greedy_tokens(model, prompt), want)
    twin = copy.deepcopy(model)
    share, twin_share = (m._freetoken_handle.runtime.admitter.cpu_share for m in (model, twin))
    assert twin_share.session != share.session
    del model, share
    import gc

    gc.collect()
    assert torch.equal(greedy_tokens(twin, prompt), want)
