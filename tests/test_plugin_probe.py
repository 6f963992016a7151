"""How the plugin reads an experts block's function (activation, gate, shapes, dtype) and how the
probe checks it against the block's own forward: a misread function or an unsupported block is
refused, and the model is left as it was."""
import copy

import pytest
import torch

import freetoken_plugin
import ft_ops.activations
from freetoken_plugin.layouts import UnsupportedExperts
from freetoken_plugin.offload import find_experts
from freetoken_plugin.tiny import tiny_model
from helpers import greedy_tokens, require, snapshot

E = 8


def test_the_function_is_read_from_the_module_not_from_config_strings():
    """A config string changed after the model was built does not change what the model computes,
    so it does not change what is served; an act_fn object freetoken does not compute is refused
    before anything changes."""
    model = tiny_model("mixtral")
    for _, m in find_experts(model):
        m.config.hidden_act = "relu"  # the modules still hold SiLU
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(4))
    want = greedy_tokens(model, prompt)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    assert torch.equal(greedy_tokens(model, prompt), want)

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
    want = greedy_tokens(model, prompt)
    params_before, state_before = snapshot(model)
    monkeypatch.setattr(layouts, "read_activation", lambda module: ft_ops.activations.as_activation(wrong))
    name = type(find_experts(model)[0][1]).__name__
    with pytest.raises(UnsupportedExperts, match=f"{name}: the offloaded experts would differ from the module's own "
                                                 "forward by .* at (1|100)x input scale"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert find_experts(model)[0][1].gate_up_proj.numel() > 0, "the experts are still the module's"
    assert torch.equal(greedy_tokens(model, prompt), want)


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
    want = greedy_tokens(model, prompt)
    model = model.to(device)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device=device, progress=False,
                                              fetch_fraction=fetch_fraction)
    functions = [str(a) for a in handle.runtime.activations]
    assert functions[:2] == ["silu", "gelu_tanh"] and set(functions[2:]) <= {"silu"}
    assert torch.equal(greedy_tokens(model, prompt.to(device)).cpu(), want)


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
