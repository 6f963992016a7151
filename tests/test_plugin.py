"""The transformers plugin: greedy generation of offloaded tiny models of six MoE architectures
equals the unmodified model's (float32 on the CPU, bf16 on the GPU), gradients are refused, and what
an offloaded model keeps (its class, backend, progress lines, save_pretrained). Arguments and
failures: test_plugin_arguments.py; the probe: test_plugin_probe.py; eviction:
test_plugin_eviction.py; copies, threads and copies of the model: test_plugin_lifecycle.py."""
import copy

import pytest
import torch

import freetoken_plugin
from freetoken_plugin.offload import find_experts
from freetoken_plugin.tiny import ARCHES, tiny_model
from helpers import greedy_tokens, require

E = 8


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("slots", ["E", "2E", "all"])
def test_greedy_tokens_equal_the_unmodified_model_cpu(arch, slots):
    require("cpu", "expert_gemm")
    model = tiny_model(arch)
    layers = len(find_experts(model))
    cache = {"E": E, "2E": 2 * E, "all": layers * E}[slots]
    prompt = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    want = greedy_tokens(model, prompt)
    handle = freetoken_plugin.offload_experts(model, cache_slots=cache, device="cpu", progress=False)
    assert handle.slots == cache
    assert all(m.gate_up_proj.numel() == 0 for _, m in find_experts(model)), "module copies are freed"
    got = greedy_tokens(model, prompt)
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
    want = greedy_tokens(base, prompt)
    for offload_in_inference_mode in (True, False):
        model = copy.deepcopy(base).to(device)
        with torch.inference_mode(offload_in_inference_mode):
            freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False,
                                             fetch_fraction=fetch_fraction)
        with torch.inference_mode():
            assert torch.equal(model.generate(prompt.to(device), max_new_tokens=6, do_sample=False,
                                              min_new_tokens=6).cpu(), want)
        assert torch.equal(greedy_tokens(model, prompt.to(device)).cpu(), want)


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
    want = greedy_tokens(model, prompt, steps)
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
    got = greedy_tokens(model, prompt, steps)
    for b in range(batch):  # identical up to the sequence's first near tie
        n = p + (steps if firm[b].all() else int((~firm[b]).nonzero()[0]))
        assert torch.equal(got[b, :n], want[b, :n]), f"sequence {b}: tokens differ before its first near tie"


def test_autocast_is_named_once_since_it_does_not_reach_the_experts():
    """Under torch.autocast the rest of the model computes in autocast's dtype and the offloaded
    experts in their own, so the outputs differ from the original model's: one warning says so."""
    import warnings

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    ids = torch.tensor([[1, 2, 3]])
    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(ids)
    assert not [w for w in before if "autocast" in str(w.message)], "a warning without autocast"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match=r"^torch.autocast does not reach the offloaded experts: they compute "
                                             r"in torch.float32 \(the dtype they were offloaded in\)") as caught:
            model(ids)
            model(ids)
    assert sum("autocast" in str(w.message) for w in caught) == 1
    assert caught[0].filename == __file__, "attributed to the caller's line"


def test_register_is_idempotent_and_the_backend_is_listed():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    freetoken_plugin.register()
    freetoken_plugin.register()
    assert "freetoken" in ALL_EXPERTS_FUNCTIONS.valid_keys()


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral"])
def test_save_pretrained_writes_the_experts_from_the_host_pool(arch, tmp_path):
    """An offloaded model's state_dict and save_pretrained hold its real experts (gpt-oss: transposed,
    interleaved, with biases; mixtral: saved per expert), so the checkpoint loads back equal, with
    transformers and with load_model."""
    import transformers as tf

    model = tiny_model(arch)
    want_state = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(6))
    want = greedy_tokens(model, prompt)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    got_state = model.state_dict()
    assert got_state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert torch.equal(got_state[k], v), k
    model.save_pretrained(tmp_path)
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for k, v in again.state_dict().items():
        assert torch.equal(v, want_state[k]), k
    assert torch.equal(greedy_tokens(again, prompt), want)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=2 * E, device="cpu", progress=False)
    assert torch.equal(greedy_tokens(loaded, prompt), want)


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


def test_routed_per_token_reads_the_config():
    from types import SimpleNamespace

    from freetoken_plugin.offload import routed_per_token

    assert routed_per_token(SimpleNamespace(num_experts_per_tok=8)) == 8
    assert routed_per_token(SimpleNamespace(moe_topk=6)) == 6
    assert routed_per_token(SimpleNamespace(text_config=SimpleNamespace(num_experts_per_tok=4))) == 4
    assert routed_per_token(SimpleNamespace(hidden_size=64)) is None


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
