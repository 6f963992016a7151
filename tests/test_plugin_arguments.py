"""offload_experts' arguments and failures: bad arguments are explained in one line before any
work, a failure part way leaves the model exactly as it was, and a second offload, a cache larger
than the model or a part of an offloaded model are handled as docs/usage.md says."""

import pytest
import torch

import freetoken_plugin
from freetoken_plugin.layouts import UnsupportedExperts
from freetoken_plugin.offload import find_experts
from freetoken_plugin.tiny import tiny_model
from helpers import fail_while_switching, greedy_tokens, refuse_host_pool, require, snapshot

E = 8


def test_failure_part_way_leaves_the_model_unchanged(monkeypatch):
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    want = greedy_tokens(model, prompt)
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
    assert torch.equal(greedy_tokens(model, prompt), want)


def test_bad_arguments_are_explained():
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match=r"cache_slots must be positive, got -4; give at least one MoE layer's experts \(\d+ slots"):
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
    want_first, want_second = greedy_tokens(first, prompt), greedy_tokens(second, prompt)
    first.model.decoder_config = config  # a module may hold a config under another name
    freetoken_plugin.offload_experts(first, cache_slots=E, device="cpu", progress=False)
    assert first.config is not config and second.config is config
    assert first.model.decoder_config is first.config, "one copy for every holder of one config"
    assert config._experts_implementation == second.config._experts_implementation != "freetoken"
    assert torch.equal(greedy_tokens(second, prompt), want_second)
    assert torch.equal(greedy_tokens(first, prompt), want_first)
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
    want = greedy_tokens(model, prompt)
    freetoken_plugin.offload_experts(model, cache_slots=E, device="cpu", progress=False)
    assert all(m.config is configs[name] for name, m in model.named_modules() if "config" in vars(m))
    assert torch.equal(greedy_tokens(model, prompt), want)


def test_cache_sizes_of_numpy_and_torch_integers_are_taken():
    np = pytest.importorskip("numpy")
    model = tiny_model("olmoe")
    assert freetoken_plugin.offload_experts(model, cache_slots=np.int64(16), device="cpu", progress=False).slots == 16
    model = tiny_model("olmoe")
    assert freetoken_plugin.offload_experts(model, cache_slots=torch.tensor(12), device="cpu", progress=False).slots == 12


def test_cache_sizes_of_0_dim_float_tensors_follow_the_rules_of_floats(monkeypatch):
    """A 0-dim float tensor is the Python float it holds: a whole number is taken (cache_bytes was
    refused as "must be a number"), NaN, inf, a negative or a fraction of an expert refused as a
    float is; a bool tensor is refused as a bool is."""
    expert_bytes = 3 * 64 * 32 * 4  # olmoe's tiny expert in float32
    model = tiny_model("olmoe")
    handle = freetoken_plugin.offload_experts(model, cache_bytes=torch.tensor(float(E * expert_bytes)), device="cpu",
                                              progress=False)
    assert handle.slots == E
    model = tiny_model("olmoe")
    assert freetoken_plugin.offload_experts(model, cache_slots=torch.tensor(12.0), device="cpu", progress=False).slots == 12
    refuse_host_pool(monkeypatch)
    model = tiny_model("olmoe")
    for size, match in ((dict(cache_bytes=torch.tensor(float("nan"))), "cache_bytes must be a finite number, got nan"),
                        (dict(cache_bytes=torch.tensor(float("inf"))), "cache_bytes must be a finite number, got inf"),
                        (dict(cache_bytes=torch.tensor(-5.0)), "cache_bytes must be positive, got -5.0"),
                        (dict(cache_slots=torch.tensor(2.5)), "cache_slots is a number of experts, a whole number; got 2.5"),
                        (dict(cache_slots=torch.tensor(True)), r"cache_slots must be a number, got tensor\(True\)")):
        with pytest.raises(ValueError, match=match):
            freetoken_plugin.offload_experts(model, device="cpu", progress=False, **size)
    assert not hasattr(model, "_freetoken_handle")


def test_without_prefill_streaming_the_least_cache_is_one_expert():
    """stream_prefill=False serves a pool of any size, one expert included (exactly): the refusals
    below it ask for one expert, not a layer; with streaming they ask for a layer."""
    require("cpu", "expert_gemm")
    expert_bytes = 3 * 64 * 32 * 4
    for size in (dict(cache_slots=0), dict(cache_bytes=0)):
        with pytest.raises(ValueError, match=r"must be positive, got 0; give at least one expert \(1 slot, "):
            freetoken_plugin.offload_experts(tiny_model("olmoe"), device="cpu", progress=False, stream_prefill=False,
                                             **size)
    with pytest.raises(ValueError, match=rf"cache_bytes=100 holds no expert of 24.0 KiB \({expert_bytes} bytes\); "
                                         rf"give at least {expert_bytes} bytes \(one expert\)$"):
        freetoken_plugin.offload_experts(tiny_model("olmoe"), cache_bytes=100, device="cpu", progress=False,
                                         stream_prefill=False)
    with pytest.raises(ValueError, match=rf"give at least {E * expert_bytes} bytes \(one layer of {E} experts\)$"):
        freetoken_plugin.offload_experts(tiny_model("olmoe"), cache_bytes=100, device="cpu", progress=False)
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(6))
    want = greedy_tokens(tiny_model("olmoe"), prompt)
    for size in (dict(cache_slots=1), dict(cache_bytes=expert_bytes)):
        model = tiny_model("olmoe")
        handle = freetoken_plugin.offload_experts(model, device="cpu", progress=False, stream_prefill=False, **size)
        assert handle.slots == 1
        assert torch.equal(greedy_tokens(model, prompt), want)


def test_sizes_below_a_tenth_of_a_mib_are_told_in_kib():
    """FP8 experts of the tiny model (a few KiB each): the sizes a refusal gives were "0.0 MiB"."""
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=rf"below one layer of {E} experts, which prefill streaming needs: give at least "
                                         rf"{E} slots \(\d+\.\d KiB; {2 * E} slots, \d+\.\d KiB,") as error:
        freetoken_plugin.offload_experts(model, cache_slots=3, device="cpu", progress=False, quantize="fp8")
    assert "MiB" not in str(error.value)
    with pytest.raises(ValueError, match=rf"give at least one MoE layer's experts \({E} slots, \d+\.\d KiB\)"):
        freetoken_plugin.offload_experts(model, cache_slots=0, device="cpu", progress=False, quantize="fp8")


def test_more_experts_per_token_than_experts_is_refused_before_anything_changes(monkeypatch):
    """A config routing more experts per token than its blocks hold, refused by name as load_model
    refuses such a config.json (it failed at the first forward, "selected index k out of range")."""
    refuse_host_pool(monkeypatch)
    for arch in ("qwen3_moe", "mixtral"):
        model = tiny_model(arch, experts=4, top_k=6)
        params_before, _ = snapshot(model)
        with pytest.raises(ValueError, match=r"^\w+ForCausalLM's config routes 6 experts per token \(num_experts_per_tok\), "
                                             r"but its experts blocks hold 4 experts; a token takes at most 4 experts: "
                                             r"build the model from a config whose num_experts_per_tok is at most 4$"):
            freetoken_plugin.offload_experts(model, device="cpu", progress=False)
        assert not hasattr(model, "_freetoken_handle")
        assert all(p is params_before[n] for n, p in model.named_parameters())


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
    # A part of the offloaded model holds the same experts: refused, and named as the module it is.
    with pytest.raises(ValueError, match="^the experts of this module are already offloaded by freetoken;"):
        freetoken_plugin.offload_experts(model.model, device="cpu", progress=False)


def test_an_offloaded_inner_model_is_found_by_stats_and_named_by_a_second_offload():
    """A user may offload the inner model (model.model): stats(model) reads it, and offloading the
    outer model names the submodule that holds the offload."""
    model = tiny_model("olmoe")
    handle = freetoken_plugin.offload_experts(model.model, cache_slots=20, device="cpu", progress=False)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert freetoken_plugin.stats(model) == freetoken_plugin.stats(model.model) == freetoken_plugin.stats(handle)
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
    with pytest.raises(TypeError, match=r"^unknown option policy \(the eviction policy is eviction=\.\.\.\); the sizes"):
        freetoken_plugin.offload_experts(model, device="cpu", progress=False, policy="lru")
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
    # progress too (it once took any value: "x" printed progress, 0 hid it)
    with pytest.raises(TypeError, match="progress must be True or False, got 'x'"):
        freetoken_plugin.offload_experts(model, device="cpu", progress="x")
    with pytest.raises(TypeError, match="progress must be True or False, got 0"):
        freetoken_plugin.load_model("/no/such/checkpoint", device="cpu", progress=0)


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
    with pytest.raises(TypeError, match=r"was the model cast after offloading\?\): cast it back \(model.to\(torch.float32\)\)"
                                        r".*reload the model for the original's outputs"):
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


def test_stats_of_a_part_holding_the_offloaded_experts():
    """stats(model.model) of an offloaded causal LM reads the same counters as stats(model) (it said
    the model was not offloaded)."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    model(torch.randint(1, 512, (1, 5)))
    assert freetoken_plugin.stats(model.model) == freetoken_plugin.stats(model)
    with pytest.raises(ValueError, match="this module is not offloaded by freetoken and holds no experts"):
        freetoken_plugin.stats(model.lm_head)
