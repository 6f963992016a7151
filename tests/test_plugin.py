"""The transformers plugin: greedy generation of offloaded tiny models of six MoE architectures
equals the unmodified model's; failures leave the model as it was; bad arguments are explained."""
import copy
import functools

import pytest
import torch

import freetoken_plugin
import ft_ops.activations
from ft_ops.policies import POLICIES
from freetoken_plugin.bench_e2e import cache_argument
from freetoken_plugin.layouts import UnsupportedExperts
from freetoken_plugin.offload import find_experts
from freetoken_plugin.tiny import ARCHES, tiny_model
from helpers import fail_while_switching, require

E = 8


def generate(model, prompt, steps=6):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("slots", ["E", "2E", "all"])
def test_greedy_tokens_equal_the_unmodified_model_cpu(arch, slots):
    require("cpu", "expert_gemm")
    model = tiny_model(arch)
    layers = len(find_experts(model))
    cache = {"E": E, "2E": 2 * E, "all": layers * E}[slots]
    prompt = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    want = generate(model, prompt)
    handle = freetoken_plugin.offload_experts(model, cache_slots=cache, device="cpu", progress=False)
    assert handle.slots == cache
    assert all(m.gate_up_proj.numel() == 0 for _, m in find_experts(model)), "module copies are freed"
    got = generate(model, prompt)
    assert torch.equal(got, want)
    stats = freetoken_plugin.stats(model)
    assert stats["admit"]["calls"] > 0 and stats["stream"]["calls"] + stats["admit"]["calls"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fetch_fraction", [1.0, 0.5])
def test_inference_mode_in_and_out(device, fetch_fraction):
    """Offloaded inside torch.inference_mode(), the model generates the unmodified model's tokens in
    inference mode and then outside it (the pool's state is updated in place by both); offloaded
    outside, the same. Both used to fail: the state made in inference mode could not be updated
    outside it, and the CPU kernel's worker threads wrote inference tensors outside it."""
    require(device, "expert_gemm")
    base = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    want = generate(base, prompt)
    for offload_in_inference_mode in (True, False):
        model = copy.deepcopy(base).to(device)
        with torch.inference_mode(offload_in_inference_mode):
            freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False,
                                             fetch_fraction=fetch_fraction)
        with torch.inference_mode():
            assert torch.equal(model.generate(prompt.to(device), max_new_tokens=6, do_sample=False,
                                              min_new_tokens=6).cpu(), want)
        assert torch.equal(generate(model, prompt.to(device)).cpu(), want)


def test_gradients_are_refused_with_a_message():
    """A forward in grad mode works; its backward says the offloaded experts have no gradient
    (torch's fallback used to backpropagate through them silently wrong, or fail in an index op)."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    logits = model(torch.randint(1, 512, (1, 12))).logits
    assert logits.requires_grad
    with pytest.raises(RuntimeError, match=r"^freetoken::expert_gemm has no gradient: offloaded experts are for "
                                           r"inference \(run the model under torch.no_grad\(\)"):
        logits.sum().backward()


def test_a_compiled_backward_wanting_only_the_routing_weights_is_refused():
    """The refusal has a side effect: a compiled backward keeps it where nothing reads the hidden
    state's gradient (it used to be dropped, and the router got no gradient, silently)."""
    require("cpu", "expert_gemm")
    import ft_ops

    gen = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 16, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    slots = torch.randint(0, 4, (3, 2), dtype=torch.int32, generator=gen)
    weights = torch.rand(3, 2, generator=gen).requires_grad_()
    gemm = torch.compile(lambda x, w: ft_ops.expert_gemm(x, slots, w, w13, w2), backend="aot_eager")
    with pytest.raises(RuntimeError, match="freetoken::expert_gemm has no gradient"):
        gemm(torch.randn(3, 16, generator=gen), weights).sum().backward()


@pytest.mark.slow
def test_a_model_compiled_in_grad_mode_runs_forward_and_refuses_backward():
    """torch.compile traces the backward of a forward in grad mode: the refusal is an op of that
    backward, so the forward compiles and runs, and only a backward fails."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=3 * E, device="cpu", progress=False)
    ids = torch.randint(1, 512, (1, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    compiled = torch.compile(model)
    logits = compiled(ids).logits
    torch.testing.assert_close(logits.detach(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="freetoken::expert_gemm has no gradient"):
        logits.sum().backward()


def relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_on_cuda_matches_logits_and_tokens(arch):
    """bf16 on the GPU against the unmodified bf16 model and the float32 truth (the same weights):
    the offloaded logits are at least as close to float32 as the unmodified bf16 model's (rounding
    points differ: the kernels keep float32 intermediates), and greedy tokens equal the unmodified
    model's on every step where it is no near tie (top-2 logits closer than the logit difference
    measured there, where a rounding difference may flip the choice)."""
    require("cuda", "expert_gemm")
    steps, batch = 10, 4
    model = tiny_model(arch, dtype=torch.bfloat16).cuda()
    truth = copy.deepcopy(model).float()  # the same (bf16-representable) weights in float32
    prompt = torch.randint(1, 512, (batch, 24), generator=torch.Generator().manual_seed(2)).cuda()
    want = generate(model, prompt, steps)
    p = prompt.shape[1]
    with torch.no_grad():  # teacher-forced on the reference tokens: the logits of every step
        truth_logits = truth(want).logits.float()[:, p - 1:-1]
        want_logits = model(want).logits.float()[:, p - 1:-1]
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, progress=False)
    with torch.no_grad():
        got_logits = model(want).logits.float()[:, p - 1:-1]
    err_ours, err_ref = relative(got_logits, truth_logits), relative(want_logits, truth_logits)
    assert err_ours <= 1.25 * err_ref + 1e-3, \
        f"offloaded bf16 is {err_ours:.2e} from float32, the unmodified bf16 model {err_ref:.2e}"
    top2 = want_logits.topk(2, dim=-1).values
    firm = (top2[..., 0] - top2[..., 1]) > 2 * (got_logits - want_logits).abs().amax(dim=-1)
    assert firm.sum() >= batch * steps // 4, f"only {int(firm.sum())} firm steps: pick another seed"
    assert torch.equal(got_logits.argmax(-1)[firm], want[:, p:][firm])
    got = generate(model, prompt, steps)
    for b in range(batch):  # identical up to the sequence's first near tie
        n = p + (steps if firm[b].all() else int((~firm[b]).nonzero()[0]))
        assert torch.equal(got[b, :n], want[b, :n]), f"sequence {b}: tokens differ before its first near tie"


def snapshot(model):
    return {n: p for n, p in model.named_parameters()}, copy.deepcopy(model.state_dict())


def test_failure_part_way_leaves_the_model_unchanged(monkeypatch):
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    want = generate(model, prompt)
    params_before, state_before = snapshot(model)
    impl_before = model.config._experts_implementation
    configs_before = {name: m.config for name, m in model.named_modules() if "config" in vars(m)}
    calls = fail_while_switching(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert calls["n"] == 3
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is params_before[n] for n in params_before), "a parameter was replaced"
    for k, v in model.state_dict().items():
        assert torch.equal(v, state_before[k])
    assert model.config._experts_implementation == impl_before
    assert all(m.config is configs_before[name] for name, m in model.named_modules() if "config" in vars(m))
    assert all(not hasattr(m, "_freetoken_experts") for _, m in find_experts(model))
    assert all(not m._state_dict_hooks for _, m in find_experts(model)), "a state_dict hook was left"
    assert torch.equal(generate(model, prompt), want)


def test_bad_arguments_are_explained():
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="cache_slots must be positive, got -4"):
        freetoken_plugin.offload_experts(model, cache_slots=-4, device="cpu", progress=False)
    with pytest.raises(ValueError, match="cache_bytes must be positive"):
        freetoken_plugin.offload_experts(model, cache_bytes=-1, device="cpu", progress=False)
    with pytest.raises(ValueError, match=f"below one layer of {E} experts.*at least {E} slots"):
        freetoken_plugin.offload_experts(model, cache_slots=E - 1, device="cpu", progress=False)
    with pytest.raises(ValueError, match="whole number; got 2.5"):
        freetoken_plugin.offload_experts(model, cache_slots=2.5, device="cpu", progress=False)
    with pytest.raises(ValueError, match="cache_bytes=100 holds no expert"):
        freetoken_plugin.offload_experts(model, cache_bytes=100, device="cpu", progress=False)
    with pytest.raises(ValueError, match="cpu_share_tokens must be a positive whole number"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, cpu_share_tokens=-1)
    with pytest.raises(ValueError, match=r"cpu_share_tokens must be .*\(an int\), got 2.0"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, cpu_share_tokens=2.0)
    import numpy as np

    with pytest.raises(ValueError, match="fetch_fraction must be a share of the misses"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, fetch_fraction=np.array([0.5, 0.2]))
    with pytest.raises(TypeError, match="collect_stats must be True or False, got 0"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, fetch_fraction="auto", collect_stats=0)
    with pytest.raises(ValueError, match="keep collect_stats=True"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, fetch_fraction="auto",
                                         collect_stats=False)
    with pytest.raises(ValueError, match="not both"):
        freetoken_plugin.offload_experts(model, cache_slots=E, cache_bytes=10 ** 9, device="cpu", progress=False)
    import transformers as tf

    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="has no experts module.*Mixture-of-Experts"):
        freetoken_plugin.offload_experts(dense, device="cpu", progress=False)
    with pytest.raises(ValueError, match="not offloaded by freetoken"):
        freetoken_plugin.stats(dense)


def test_a_model_sharing_its_config_object_is_left_alone():
    """Two models built from one config object share it: offloading one must not switch the
    other's experts to the backend (transformers selects the implementation through the config)."""
    import transformers as tf
    from freetoken_plugin.tiny import tiny_config

    config = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    first, second = (tf.AutoModelForCausalLM.from_config(config).eval() for _ in range(2))
    assert first.config is second.config
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(4))
    want_first, want_second = generate(first, prompt), generate(second, prompt)
    first.model.decoder_config = config  # a module may hold a config under another name
    freetoken_plugin.offload_experts(first, cache_slots=E, device="cpu", progress=False)
    assert first.config is not config and second.config is config
    assert first.model.decoder_config is first.config, "one copy for every holder of one config"
    assert config._experts_implementation == second.config._experts_implementation != "freetoken"
    assert torch.equal(generate(second, prompt), want_second)
    assert torch.equal(generate(first, prompt), want_first)
    third = tf.AutoModelForCausalLM.from_config(config)  # a model built later from that config
    assert third.config._experts_implementation != "freetoken"


def test_a_config_that_cannot_be_copied_is_switched_in_place():
    """A config attribute that does not deep-copy: the model keeps its config objects (switched in
    place, as before the copies) and still offloads; no module is left holding a copy."""
    import threading

    model = tiny_model("qwen3_moe")
    model.config.lock = threading.Lock()
    configs = {name: m.config for name, m in model.named_modules() if "config" in vars(m)}
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(5))
    want = generate(model, prompt)
    freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert all(m.config is configs[name] for name, m in model.named_modules() if "config" in vars(m))
    assert torch.equal(generate(model, prompt), want)


def test_cache_sizes_of_numpy_and_torch_integers_are_taken():
    np = pytest.importorskip("numpy")
    model = tiny_model("olmoe")
    assert freetoken_plugin.offload_experts(model, cache_slots=np.int64(16), device="cpu", progress=False).slots == 16
    model = tiny_model("olmoe")
    assert freetoken_plugin.offload_experts(model, cache_slots=torch.tensor(12), device="cpu", progress=False).slots == 12


def test_cache_sizes_and_devices_of_the_wrong_kind_are_explained():
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match=r"cache_bytes must be a number, got '16GiB' \(bytes as an int"):
        freetoken_plugin.offload_experts(model, cache_bytes="16GiB", device="cpu", progress=False)
    with pytest.raises(ValueError, match="cache_slots must be a number, got '8'"):
        freetoken_plugin.offload_experts(model, cache_slots="8", device="cpu", progress=False)
    with pytest.raises(ValueError, match="device='banana' is not a device: freetoken runs experts on 'cuda'"):
        freetoken_plugin.offload_experts(model, device="banana", progress=False)
    with pytest.raises(ValueError, match="device='meta': freetoken runs experts on 'cuda' or 'cpu'"):
        freetoken_plugin.offload_experts(model, device="meta", progress=False)
    assert not hasattr(model, "_freetoken_handle")


def test_cache_bytes_sizes_the_pool_and_second_offload_is_refused():
    model = tiny_model("olmoe")
    expert_bytes = 3 * 64 * 32 * 4
    handle = freetoken_plugin.offload_experts(model, cache_bytes=20 * expert_bytes + 5, device="cpu", progress=False)
    assert handle.slots == 20
    with pytest.raises(ValueError, match="already offloaded"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)


def test_an_offloaded_inner_model_is_found_by_stats_and_named_by_a_second_offload():
    """A user may offload the inner model (model.model): stats(model) reads it, and offloading the
    outer model names the submodule that holds the offload."""
    model = tiny_model("olmoe")
    freetoken_plugin.offload_experts(model.model, cache_slots=20, device="cpu", progress=False)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert freetoken_plugin.stats(model) == freetoken_plugin.stats(model.model)
    with pytest.raises(ValueError, match="already offloaded by freetoken \\(its submodule 'model'\\)"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)
    with pytest.raises(TypeError, match="stats takes a model offloaded by freetoken"):
        freetoken_plugin.stats("model")


def test_a_cache_larger_than_the_model_takes_every_expert_and_says_so(capsys):
    model = tiny_model("olmoe")
    every = sum(m.gate_up_proj.shape[0] for _, m in find_experts(model))
    handle = freetoken_plugin.offload_experts(model, cache_slots=10**6, device="cpu", progress=True)
    assert handle.slots == every
    assert f"cache_slots=1000000 holds more than the model's {every} experts" in capsys.readouterr().err


def test_the_function_is_read_from_the_module_not_from_config_strings():
    """A config string changed after the model was built does not change what the model computes,
    so it does not change what is served; an act_fn object freetoken does not compute is refused
    before anything changes."""
    model = tiny_model("mixtral")
    for _, m in find_experts(model):
        m.config.hidden_act = "relu"  # the modules still hold SiLU
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(4))
    want = generate(model, prompt)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    assert torch.equal(generate(model, prompt), want)

    model = tiny_model("mixtral")
    for _, m in find_experts(model):
        m.act_fn = torch.nn.ReLU()
    params_before, _ = snapshot(model)
    with pytest.raises(UnsupportedExperts, match="MixtralExperts computes act_fn\\(gate\\) \\* up with act_fn ReLU"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)
    assert all(p is params_before[n] for n, p in model.named_parameters())


def test_an_unknown_apply_gate_override_is_refused(monkeypatch):
    model = tiny_model("qwen3_moe")
    experts_class = type(find_experts(model)[0][1])
    monkeypatch.setattr(experts_class, "_apply_gate", lambda self, gate_up: gate_up.chunk(2, -1)[1])
    with pytest.raises(UnsupportedExperts, match="Qwen3MoeExperts overrides _apply_gate .* does not know"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)


def test_a_gate_replaced_on_one_block_is_refused():
    """The expert function is read from the class; a block whose _apply_gate was replaced on the
    instance (a middle one, which the probe of the first and last blocks does not run) is refused,
    and the model is left as it was."""
    import types

    model = tiny_model("qwen3_moe")
    block = find_experts(model)[1][1]
    relu_gate = lambda self, gate_up: torch.relu(gate_up.chunk(2, -1)[0]) * gate_up.chunk(2, -1)[1]  # noqa: E731
    block._apply_gate = types.MethodType(relu_gate, block)
    params_before, _ = snapshot(model)
    with pytest.raises(UnsupportedExperts, match="this Qwen3MoeExperts has its own _apply_gate \\(set on the instance"):
        freetoken_plugin.offload_experts(model, device="cpu", cache_slots=16, progress=False)
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert find_experts(model)[0][1].gate_up_proj.numel() > 0, "the experts are still the module's"


@pytest.mark.parametrize("arch,wrong", [("gpt_oss", "silu"), ("qwen3_moe", "swigluoai"), ("mixtral", "gelu_tanh")])
def test_a_misread_function_is_caught_by_the_probe_and_the_model_is_unchanged(monkeypatch, arch, wrong):
    """Verify, do not guess: if the reader returned another function (here forced), the probe of one
    experts block at normal and at 100x scale refuses the conversion, naming the class and the
    difference, and the model keeps its weights and its tokens."""
    import freetoken_plugin.layouts as layouts

    model = tiny_model(arch)
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(5))
    want = generate(model, prompt)
    params_before, state_before = snapshot(model)
    monkeypatch.setattr(layouts, "read_activation", lambda module: ft_ops.activations.as_activation(wrong))
    name = type(find_experts(model)[0][1]).__name__
    with pytest.raises(UnsupportedExperts, match=f"{name}: the offloaded experts would differ from the module's own "
                                                 "forward by .* at (1|100)x input scale"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert find_experts(model)[0][1].gate_up_proj.numel() > 0, "the experts are still the module's"
    assert torch.equal(generate(model, prompt), want)


def test_register_is_idempotent_and_the_backend_is_listed():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    freetoken_plugin.register()
    freetoken_plugin.register()
    assert "freetoken" in ALL_EXPERTS_FUNCTIONS.valid_keys()


def test_cuda_without_cuda_fails_at_once_before_the_host_pool(monkeypatch):
    """device='cuda' where CUDA is unavailable: one line, before any host memory is allocated."""
    import freetoken_plugin.offload as offload_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(offload_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"^device='cuda' was asked for, but CUDA is not available \(.*\); "
                                         r"pass device='cpu'") as err:
        freetoken_plugin.offload_experts(model, device="cuda", progress=False)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="device='cuda:0' was asked for, but CUDA is not available"):
        freetoken_plugin.load_model("/no/such/checkpoint", device="cuda:0", progress=False)


def test_unknown_options_and_policies_fail_before_the_host_pool(monkeypatch):
    import freetoken_plugin.offload as offload_mod

    monkeypatch.setattr(offload_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))
    model = tiny_model("qwen3_moe")
    with pytest.raises(TypeError, match=r"^unknown option fetch_fractoin; the sizes are cache_slots or cache_bytes, and the "
                                        r"runtime takes .*fetch_fraction"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, fetch_fractoin=0.5)
    with pytest.raises(ValueError, match=r"unknown eviction policy 'lfu'; expected one of \['duel', 'hitdensity', 'lru', 'opportunity'\]"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, eviction="lfu")
    with pytest.raises(ValueError, match="unknown eviction policy 'lfu'"):
        freetoken_plugin.load_model("/no/such/checkpoint", device="cpu", progress=False, eviction="lfu")
    for bad, error, match in ((dict(fetch_fraction=2), ValueError, r"fetch_fraction must be a share .* got 2$"),
                              (dict(fetch_fraction="half"), ValueError, "fetch_fraction must be"),
                              (dict(rates="x"), TypeError, r"rates must be an ft_ops\.rates\.Rates.*got str"),
                              (dict(stream_prefill="no"), TypeError, "stream_prefill must be True or False")):
        with pytest.raises(error, match=match):
            freetoken_plugin.offload_experts(model, device="cpu", progress=False, **bad)
        with pytest.raises(error, match=match):
            freetoken_plugin.load_model("/no/such/checkpoint", device="cpu", progress=False, **bad)


@pytest.mark.parametrize("options", [{}, {"eviction": None}], ids=["unset", "None"])
def test_pools_evict_by_duel_unless_told_otherwise(options):
    require("cpu", "expert_gemm")
    handle = freetoken_plugin.offload_experts(tiny_model("qwen3_moe"), cache_slots=2 * E + 2, device="cpu",
                                              progress=False, **options)
    pool = handle.runtime.pool
    assert pool.policy == POLICIES["duel"] and pool.policy_state is not None and pool.shadows is not None


@pytest.mark.parametrize("eviction", ["opportunity", "duel"])
def test_every_policy_generates_the_same_tokens(eviction):
    """Eviction decides what stays resident, never what is computed. Under "duel" the shadow caches
    replay every admission call (their counters move with the pool's)."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    want = generate(model, prompt)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E + 2, device="cpu", progress=False,
                                              eviction=eviction)
    assert torch.equal(generate(model, prompt), want)
    pool = handle.runtime.pool
    stats = freetoken_plugin.stats(model)
    assert stats["pool"]["eviction"] == eviction
    if eviction == "duel":
        assert int(pool.shadows.lru_counters[0]) == int(pool.shadows.density_counters[0]) > 0
        # The last admission call saw every shadow replay but its own (which follows it).
        assert int(pool.policy_state[-3]) == int(pool.shadows.lru_counters[0]) - 1
        duel = stats["duel"]
        assert duel["shadow_calls"] == int(pool.shadows.lru_counters[0])
        assert duel["next_keys"] == ("lru" if duel["score"] > 0 else "hitdensity")
        assert 0 <= duel["lru_shadow_hit_rate"] <= 1 and 0 <= duel["hitdensity_shadow_hit_rate"] <= 1
    else:
        assert "duel" not in stats


def test_duel_shadow_hit_rates_count_no_miss_that_found_no_slot():
    """A call of more distinct experts than the pool has slots leaves some misses out in either
    shadow (no slot can take them): they are misses, not hits. A 40-token prompt admitted into an
    empty 3-slot pool hits nothing, in the pool and in both shadows; a reset forgets the count."""
    require("cpu", "expert_gemm")
    model = tiny_model("mixtral")
    handle = freetoken_plugin.offload_experts(model, cache_slots=3, device="cpu", progress=False, eviction="duel",
                                              stream_prefill=False)
    with torch.no_grad():
        model(torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(0)))
    stats = freetoken_plugin.stats(model)
    assert stats["admit"]["hit_rate"] == 0.0
    assert stats["duel"]["lru_shadow_hit_rate"] == stats["duel"]["hitdensity_shadow_hit_rate"] == 0.0
    assert int(handle.runtime.pool.shadows.unadmittable) > 0
    handle.runtime.pool.invalidate()
    assert int(handle.runtime.pool.shadows.unadmittable) == 0


def test_distinct_experts_counts_the_ids_in_range_without_a_sync():
    from ft_ops.shadow_caches import distinct_experts

    ids = torch.tensor([[3, 1], [3, 7], [-1, 8], [1, 0]])
    assert int(distinct_experts(ids, 8)) == 4  # 0, 1, 3, 7; -1 and 8 are outside [0, 8)
    assert int(distinct_experts(ids[:0], 8)) == 0


@pytest.mark.parametrize("options", [dict(cache_slots=1000), dict(cache_slots=2 * E + 2, fetch_fraction=0.0),
                                     dict(cache_slots=2 * E + 2, fetch_fraction=0.4 / E)],
                         ids=["every-expert", "admits-none", "admits-round-to-none"])
def test_a_duel_pool_that_never_evicts_keeps_no_shadows(options):
    """Nothing is ever evicted from a pool of every expert (more slots than experts), nor from one
    whose calls admit no miss (fetch_fraction 0, or below 0.5 / E: round(misses x fetch_fraction)
    of at most E misses is 0): no shadow launches, the score stays 0."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(4))
    want = generate(model, prompt)
    handle = freetoken_plugin.offload_experts(model, device="cpu", progress=False, eviction="duel", **options)
    assert torch.equal(generate(model, prompt), want)
    assert handle.runtime.pool.shadows is None
    assert freetoken_plugin.stats(model)["duel"] == dict(score=0.0, next_keys="hitdensity", shadow_calls=0,
                                                        lru_shadow_hit_rate=None, hitdensity_shadow_hit_rate=None)


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_save_pretrained_writes_the_experts_from_the_host_pool(arch, tmp_path):
    """An offloaded model's state_dict and save_pretrained hold its real experts (gpt-oss: transposed,
    interleaved, with biases; mixtral: saved per expert), so the checkpoint loads back equal, with
    transformers and with load_model."""
    import transformers as tf

    model = tiny_model(arch)
    want_state = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(6))
    want = generate(model, prompt)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    got_state = model.state_dict()
    assert got_state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert torch.equal(got_state[k], v), k
    model.save_pretrained(tmp_path)
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for k, v in again.state_dict().items():
        assert torch.equal(v, want_state[k]), k
    assert torch.equal(generate(again, prompt), want)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=2 * E, device="cpu", progress=False)
    assert torch.equal(generate(loaded, prompt), want)


def test_progress_is_one_line_per_step_off_a_terminal(capsys):
    """Off a terminal (a pipe, a log, pytest's capture) the progress is a closing line per step:
    no carriage returns, a final newline, and 'pinned' only for a pinned pool (never on the CPU)."""
    model = tiny_model("olmoe")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert len(lines) == 2 and all(line.startswith("[freetoken] ") for line in lines), lines
    assert "host pool" in lines[-1] and "pinned" not in err


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fetch_fraction", [1.0, 0.5])
def test_blocks_of_different_functions_each_compute_their_own(device, fetch_fraction):
    """Layers whose expert functions differ (Step3p7's per-layer swiglu_limits) are served with one
    function per layer, on the device and by the CPU share: the unmodified model's greedy tokens."""
    from transformers.activations import GELUTanh

    require(device, "expert_gemm")
    model = tiny_model("qwen3_moe")
    blocks = find_experts(model)
    blocks[1][1].act_fn = GELUTanh()
    prompt = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    want = generate(model, prompt)
    model = model.to(device)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False,
                                              fetch_fraction=fetch_fraction)
    functions = [str(a) for a in handle.runtime.activations]
    assert functions[:2] == ["silu", "gelu_tanh"] and set(functions[2:]) <= {"silu"}
    assert torch.equal(generate(model, prompt.to(device)).cpu(), want)


def test_blocks_of_different_shapes_are_refused_naming_both():
    model = tiny_model("qwen3_moe")
    blocks = find_experts(model)
    block = blocks[1][1]
    block.down_proj = torch.nn.Parameter(block.down_proj.data[:, :, :-2].contiguous())  # a narrower expert
    block.gate_up_proj = torch.nn.Parameter(block.gate_up_proj.data[:, :-4].contiguous())
    params_before, _ = snapshot(model)
    with pytest.raises(UnsupportedExperts, match=f"experts module {blocks[1][0]} \\(Qwen3MoeExperts: 8 experts of 64 x \\d+, "
                                                 "torch.float32, silu\\) differs from .*silu\\); one slot pool holds one "
                                                 "expert shape and layout"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)
    assert all(p is params_before[n] for n, p in model.named_parameters())


def test_a_shape_the_configured_implementation_cannot_run_is_checked_against_eager_code():
    """transformers' grouped_mm refuses float32 rows of 130 values (strides not a multiple of 16
    bytes), so such a model cannot run its own default experts implementation; the check then runs
    the class's eager code (the function it defines), and the offloaded model equals that model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=130, intermediate_size=64, moe_intermediate_size=260,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                            num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    eager = copy.deepcopy(model)
    for module in eager.modules():
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = eager(ids).logits
    freetoken_plugin.offload_experts(model, cache_slots=8, device="cpu", progress=False)
    with torch.no_grad():
        got = model(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_the_probe_allows_rounding_but_not_another_function():
    """float16, where 100x input overflows the module's own output (the probe steps down to 10x,
    still past every clamp), is served; float32 on a GPU with TF32 matmuls gets TF32's tolerance."""
    from freetoken_plugin import verify

    model = tiny_model("qwen3_moe").half()
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    assert verify.tolerance(torch.float32, torch.device("cpu")) == verify.TOLERANCE[torch.float32]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 matmuls allowed
    try:
        assert verify.tolerance(torch.float32, torch.device("cuda")) == verify.TF32_TOLERANCE
        assert verify.tolerance(torch.float32, torch.device("cpu")) == verify.TOLERANCE[torch.float32]
        assert verify.tolerance(torch.bfloat16, torch.device("cuda")) == verify.TOLERANCE[torch.bfloat16]
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_subclass_that_keeps_its_parents_gate_is_read_as_its_parent():
    from ft_ops.activations import SWIGLUOAI
    from freetoken_plugin.layouts import read_activation

    block = find_experts(tiny_model("gpt_oss"))[0][1]
    block.__class__ = type("MyGptOssExperts", (type(block),), {})
    assert read_activation(block) == SWIGLUOAI
    block.__class__ = type("MyOtherExperts", (type(block),), {"_apply_gate": lambda self, x: x.chunk(2, -1)[0]})
    with pytest.raises(UnsupportedExperts, match="MyOtherExperts overrides _apply_gate .*MyOtherExperts\\), and "
                                                 "freetoken does not know"):
        read_activation(block)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_a_streamed_forward_starts_its_first_copies_before_the_embedding(arch, monkeypatch):
    """The model's forward: a prompt that will stream queues the first layers' copies
    before the embedding runs; a decode step does not; tokens stay the unmodified model's."""
    require("cpu", "expert_gemm")
    model = tiny_model(arch)
    prompt = torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(2))
    want = generate(model, prompt, steps=3)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    runtime = handle.runtime
    calls, seen = [], []
    model.get_input_embeddings().register_forward_pre_hook(lambda m, a: seen.append(len(calls)))
    real_prefetch = runtime.streamer.prefetch

    def recording_prefetch():
        real_prefetch()
        calls.append(sorted(runtime.streamer.in_flight))
    monkeypatch.setattr(runtime.streamer, "prefetch", recording_prefetch)
    got = generate(model, prompt, steps=3)
    assert torch.equal(got, want)
    assert calls == [[0, 1]], "one prefetch, for the prompt, of the first two layers"
    assert seen[0] == 1, "the copies were queued before the embedding ran"
    assert freetoken_plugin.stats(model)["stream"]["calls"] == len(find_experts(model))


def test_generate_starts_the_copies_before_its_own_work(monkeypatch):
    """generate() (wrapped on the instance) queues a streamed prompt's first copies when it is
    called, before its first forward; the forward's pre-hook keeps that pass; a second turn whose
    new tokens do not stream, and a decode step, start nothing; tokens stay the model's."""
    from transformers import DynamicCache

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    want = generate(model, prompt, steps=3)
    order = []
    model.register_forward_pre_hook(lambda m, a: order.append("forward"))  # before the plugin's hook
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    real_prefetch = handle.runtime.streamer.prefetch

    def recording_prefetch():
        real_prefetch()
        order.append("prefetch")
    monkeypatch.setattr(handle.runtime.streamer, "prefetch", recording_prefetch)
    assert torch.equal(generate(model, prompt, steps=3), want)
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


def test_new_tokens_of_a_generate_call():
    from types import SimpleNamespace

    from freetoken_plugin.offload import _new_tokens

    class Cache:
        def get_seq_length(self):
            return 10

    ids = torch.ones(2, 16, dtype=torch.long)
    assert _new_tokens((ids,), {}) == 32
    assert _new_tokens((), dict(inputs=ids)) == 32
    assert _new_tokens((), dict(input_ids=ids, past_key_values=Cache())) == 12
    assert _new_tokens((), dict(input_ids=ids, cache=Cache())) == 12
    assert _new_tokens((), dict(input_ids=ids, cache_params=Cache())) == 12
    # Only the new tokens passed, with a mask over the history too: all of them run.
    assert _new_tokens((), dict(input_ids=ids, cache=Cache(), attention_mask=torch.ones(2, 26))) == 32
    assert _new_tokens((), dict(inputs_embeds=torch.ones(1, 5, 8))) == 5
    assert _new_tokens((), dict(input_ids=ids, past_key_values=object())) == 0  # an unknown cache
    assert _new_tokens((), {}) == 0
    model = SimpleNamespace(generation_config=SimpleNamespace(prefill_chunk_size=4, cache_implementation=None))
    assert _new_tokens((ids,), {}, model) == 8  # one chunk of a chunked prefill
    assert _new_tokens((ids,), dict(prefill_chunk_size=None), model) == 32
    assert _new_tokens((ids,), dict(cache_implementation="paged"), model) == 0  # continuous batching


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
    assert torch.equal(generate(twin, prompt, steps=2), generate(model, prompt, steps=2))
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
    runtime.begin_forward(24, 2)  # as generate() does before it raises
    assert runtime.streamer.opened_and_unused()
    runtime.pool.invalidate()
    assert not runtime.streamer.opened_and_unused()
    runtime.begin_forward(24, 2)  # the next prompt: a fresh pass
    assert calls == ["prefetch", "finish", "prefetch"]
    runtime.streamer.finish()
    model.compile(backend="eager")
    from freetoken_plugin.offload import _forward_is_compiled

    assert _forward_is_compiled(model)


def test_routed_per_token_reads_the_config():
    from types import SimpleNamespace

    from freetoken_plugin.offload import routed_per_token

    assert routed_per_token(SimpleNamespace(num_experts_per_tok=8)) == 8
    assert routed_per_token(SimpleNamespace(moe_topk=6)) == 6
    assert routed_per_token(SimpleNamespace(text_config=SimpleNamespace(num_experts_per_tok=4))) == 4
    assert routed_per_token(SimpleNamespace(hidden_size=64)) is None


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


def test_api_mistakes_are_named_in_one_line(tmp_path):
    """From a stranger's check: each mistake says what was wrong and what would work."""
    import transformers as tf

    from freetoken_plugin.tiny import tiny_config

    require("cpu", "expert_gemm")
    with pytest.raises(TypeError, match=r"takes a loaded transformers model .* got str; for a checkpoint directory "
                                        r"use freetoken_plugin.load_model\(path\)"):
        freetoken_plugin.offload_experts("Qwen/Qwen3-30B-A3B", cache_slots=8)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cache_slots must be a finite number"):
            freetoken_plugin.offload_experts(tiny_model("qwen3_moe"), cache_slots=bad, device="cpu")
    with pytest.raises(TypeError, match="unknown option cache_size; the sizes are cache_slots or cache_bytes"):
        freetoken_plugin.offload_experts(tiny_model("qwen3_moe"), cache_size=8)
    with torch.device("meta"):
        on_meta = tf.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    with pytest.raises(ValueError, match="on the meta device .* load the model's weights first"):
        freetoken_plugin.offload_experts(on_meta, cache_slots=3 * E, device="cpu")
    mixed = tiny_model("qwen3_moe")
    mixed.model.layers[1].to(torch.bfloat16)
    with pytest.raises(UnsupportedExperts, match=r"cast the model to one dtype first"):
        freetoken_plugin.offload_experts(mixed, cache_slots=3 * E, device="cpu", progress=False)
    with pytest.raises(Exception, match=r"does not exist; .* shards\)$"):  # a path, not a hub id: no hf hint
        freetoken_plugin.load_model(str(tmp_path / "nowhere"))
    with pytest.raises(Exception, match=r"hf download Qwen/Qwen3-30B-A3B"):
        freetoken_plugin.load_model("Qwen/Qwen3-30B-A3B")
    with pytest.raises(TypeError, match="dtype must be torch.bfloat16, torch.float16 or torch.float32"):
        freetoken_plugin.load_model(str(tmp_path), dtype="bf16")
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "ck")
    loaded = freetoken_plugin.load_model(str(tmp_path / "ck"), dtype="float32", device="cpu", progress=False)
    assert loaded.dtype == torch.float32  # dtype names are taken, as transformers takes them
    # Cast after offloading: refused at the cast, the model left as it was (the experts in the host
    # pool cannot follow: state_dict and save_pretrained mixed dtypes); a submodule's cast, which
    # the model's own _apply does not see, at the next forward (it raised a kernel's dtype check).
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=3 * E, device="cpu", progress=False)
    want = model(torch.tensor([[1, 2, 3]])).logits
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float64)):
        with pytest.raises(TypeError, match=r"cannot cast an offloaded model to torch.(bfloat16|float16|float64): the "
                                            r"offloaded experts compute in torch.float32, the dtype they were offloaded "
                                            r"in; the host pool keeps it.*before offload_experts"):
            cast(model)
    model.float().to("cpu")  # no dtype change: taken
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model(torch.tensor([[1, 2, 3]])).logits, want)
    model.model.to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"was the model cast after offloading\?\): cast it back \(model.to\(torch.float32\)\)"):
        model(torch.tensor([[1, 2, 3]]))
    # FP8 experts follow a cast, but biases (GPT-OSS's) stay in the offload dtype: refused alike (a
    # kernel's "b13 must be BFloat16" before), while a model without them follows it.
    for arch, follows in (("gpt_oss", False), ("mixtral", True)):
        model = tiny_model(arch)
        freetoken_plugin.offload_experts(model, cache_slots=3 * E, device="cpu", progress=False, quantize="fp8")
        if follows:
            model.to(torch.bfloat16)
            assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16
        else:
            with pytest.raises(TypeError, match=r"to torch.bfloat16: the offloaded fp8 experts' biases are in torch.float32"):
                model.to(torch.bfloat16)
            model.model.to(torch.bfloat16)
            with pytest.raises(TypeError, match=r"the offloaded fp8 experts' biases are in torch.float32, .* cast it back"):
                model(torch.tensor([[1, 2, 3]]))


def test_an_offloaded_models_experts_keep_their_backend_and_weights():
    """transformers' set_experts_implementation would run its own implementation on the freed
    weights (an IndexError deep inside it), and load_state_dict would fail per tensor on their empty
    parameters: both are refused in one line that says what works; the model keeps working."""
    model = tiny_model("qwen3_moe")
    ids = torch.tensor([[1, 2, 3]])
    want = model(ids).logits
    state = model.state_dict()
    freetoken_plugin.offload_experts(model, cache_slots=3 * E, device="cpu", progress=False)
    with pytest.raises(RuntimeError, match=r"set_experts_implementation\('eager'\): .* load the model again, without offload_experts"):
        model.set_experts_implementation("eager")
    with pytest.raises(RuntimeError, match=r"set_experts_implementation\(\{'': 'eager'\}\)"):
        model.set_experts_implementation({"": "eager"})  # per sub-config, as transformers takes it too
    model.set_experts_implementation("freetoken")  # the one it has: nothing to do
    with pytest.raises(RuntimeError, match=r"load_state_dict: model\.layers\.0\.mlp\.experts\.gate_up_proj belongs to offloaded "
                                           r"experts .* before offload_experts"):
        model.load_state_dict(state)
    # A refused load changes nothing: torch copies each module's tensors as it walks the model, so
    # the refusal comes before the first of them (another model's weights, through the model or a
    # module above the experts).
    other = tiny_model("qwen3_moe", seed=1).state_dict()
    for target, prefix in ((model, ""), (model.model, "model."), (model.model.layers[1], "model.layers.1.")):
        part = {k[len(prefix):]: v for k, v in other.items() if k.startswith(prefix)}
        with pytest.raises(RuntimeError, match=r"load_state_dict: .*experts\.gate_up_proj belongs to offloaded"):
            target.load_state_dict(part)
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
    rest = {k: v for k, v in state.items() if ".experts." not in k}
    model.load_state_dict(rest, strict=False)  # the other weights load as usual
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)


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
    want = [generate(reference, p, 8) for p in prompts]
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
                got[i] = generate(model, prompts[i], 8)
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


def test_the_model_keeps_its_class_name_and_generate_keeps_its_model():
    """The offloaded model takes a same-named subclass of its class (isinstance holds); its
    generate, as a plain model's, keeps the model alive; a model built through that subclass is a
    plain model (it pickles, as an instance of the original class) and offloads once."""
    import pickle

    require("cpu", "expert_gemm")
    model = tiny_model("mixtral")
    base = type(model)
    want = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    assert isinstance(model, base) and type(model).__name__ == base.__name__ and model.can_generate()
    generate = model.generate
    del model
    assert torch.equal(generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False), want)
    built = type(generate.__self__)(generate.__self__.config)  # through the subclass, not offloaded
    assert type(pickle.loads(pickle.dumps(built))) is base
    freetoken_plugin.offload_experts(built, cache_slots=2 * E, device="cpu", progress=False)
    assert type(built).__mro__[1] is base, "one subclass, not a subclass of a subclass"


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
            generate(model, prompt, 8)
        else:
            for _ in range(3):
                model(prompt)
    hook.remove()
    assert model._freetoken_handle.runtime.forward_lock.depth() == 0
    done = []
    worker = threading.Thread(target=lambda: done.append(generate(model, prompt, 4)), daemon=True)
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
    want = generate(reference, prompt)
    assert torch.equal(generate(model, prompt), want)
    twin = copy.deepcopy(model)
    share, twin_share = (m._freetoken_handle.runtime.admitter.cpu_share for m in (model, twin))
    assert twin_share.session != share.session
    del model, share
    import gc

    gc.collect()
    assert torch.equal(generate(twin, prompt), want)


def test_stats_of_a_part_holding_the_offloaded_experts():
    """stats(model.model) of an offloaded causal LM reads the same counters as stats(model) (it said
    the model was not offloaded)."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    model(torch.randint(1, 512, (1, 5)))
    assert freetoken_plugin.stats(model.model) == freetoken_plugin.stats(model)
    with pytest.raises(ValueError, match="this model is not offloaded by freetoken"):
        freetoken_plugin.stats(model.lm_head)


def test_experts_of_another_dtype_than_the_model_are_refused_before_anything_changes():
    """A model whose experts hold another dtype than the rest (its hidden states reach the experts in
    the rest's dtype): freetoken computes experts in their own dtype, so it is refused at
    offload_experts with the casts that work, the model left as it was (a stranger's check: it was
    accepted, then every forward failed with a message about a cast after offloading)."""
    model = tiny_model("mixtral").to(torch.bfloat16)
    for _, module in find_experts(model):
        module.to(torch.float16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedExperts, match=r"the experts are torch.float16 but the rest of the model \(its "
                                                 r"embeddings\) torch.bfloat16.*model.to\(torch.float16\)"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False)
    after = model.state_dict()
    assert all(torch.equal(before[k], v) for k, v in after.items())
    assert find_experts(model)[0][1].gate_up_proj.numel() > 0, "the experts are still the module's"


def test_experts_of_another_dtype_quantized_to_fp8_follow_the_hidden_states():
    """FP8 experts compute in the hidden states' dtype: a model whose experts hold another dtype
    than the rest is served once quantize="fp8" makes them FP8."""
    model = tiny_model("mixtral").to(torch.bfloat16)
    for _, module in find_experts(model):
        module.to(torch.float16)
    freetoken_plugin.offload_experts(model, device="cpu", progress=False, quantize="fp8")
    out = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    with pytest.raises(TypeError, match=r"cannot cast an offloaded model to torch.float64: the offloaded fp8 experts "
                                        r"compute in the hidden states' dtype, which must be float32, bfloat16 or "
                                        r"float16; cast to one of those"):
        model.double()
    model.model.double()  # a dtype no kernel computes: named before any kernel sees it
    with pytest.raises(TypeError, match=r"fp8 experts compute in the hidden states' dtype, which must be float32, "
                                        r"bfloat16 or float16, but the hidden states are torch.float64 .*\(model.to\(torch.bfloat16\)\)"):
        model(torch.tensor([[1, 2, 3, 4]]))
