"""FP8 experts through the plugin: offload_experts(quantize="fp8") equals the model whose
experts were quantized and dequantized the same way; experts that transformers' FP8 quantizer made
(FP8Experts) are taken as they are; the pool shows its format; save_pretrained writes what runs."""
import copy
import inspect
import re

import pytest
import torch

import freetoken_plugin
from freetoken_plugin.layouts import UnsupportedExperts, read_layout
from freetoken_plugin.offload import find_experts
from freetoken_plugin.tiny import random_weights, tiny_config, tiny_model
from ft_ops import formats
from helpers import require, with_rounded_experts

E = 8


def generate(model, prompt, steps=6):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)


def quantized_reference(model):
    """A copy of `model` whose experts hold their block-FP8 quantization, dequantized (float32)."""
    return with_rounded_experts(model, lambda w13: formats.dequantize_fp8(*formats.quantize_fp8(w13, parts=2), parts=2),
                                lambda w2: formats.dequantize_fp8(*formats.quantize_fp8(w2)))


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_quantize_fp8_equals_quantize_then_dequantize(arch):
    require("cpu", "expert_gemm")
    model = tiny_model(arch, experts=E)
    ref = quantized_reference(model)
    prompt = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(2))
    want = generate(ref, prompt)
    dense_bytes = freetoken_plugin.offload_experts(copy.deepcopy(model), cache_slots=2 * E, device="cpu",
                                                   progress=False).stats()["pool"]["expert_bytes"]
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="fp8")
    pool = handle.stats()["pool"]
    assert pool["format"] == "fp8" and handle.runtime.host.w13.dtype == torch.float8_e4m3fn
    assert pool["expert_bytes"] < dense_bytes / 3  # float32 weights: 4 bytes -> 1, plus scales
    assert torch.equal(generate(model, prompt), want)
    got, expected = logits(model, want), logits(ref, want)
    assert float((got - expected).norm() / expected.norm()) < 1e-5


def qwen3_moe_of_intermediate(inter: int):
    """The tiny Qwen3-MoE with expert intermediate size `inter`."""
    import transformers as tf

    config = tiny_config("qwen3_moe", experts=E)
    config.moe_intermediate_size = inter
    torch.manual_seed(0)
    return random_weights(tf.AutoModelForCausalLM.from_config(config))


def with_transformers_fp8_experts(model, parts: int = 2):
    """`model` with each experts module replaced by transformers' FP8Experts holding its block-FP8
    quantization (parts 2: gate and up blocked apart; 1: one grid over the fused rows, as
    transformers reads it, its scale rows past the grid's 1); returns the gate_up codes of each layer."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers.integrations.moe import use_experts_implementation

    cls = use_experts_implementation(experts_class=fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    quantized = []
    for name, module in find_experts(model):
        new = cls(config=model.config, block_size=(128, 128), activation_scheme="dynamic")
        q13, s13 = formats.quantize_fp8(module.gate_up_proj.detach(), parts=parts)
        q2, s2 = formats.quantize_fp8(module.down_proj.detach())
        with torch.no_grad():
            new.gate_up_proj_scale_inv.fill_(1.0)
            for n, t in (("gate_up_proj", q13), ("gate_up_proj_scale_inv", s13), ("down_proj", q2),
                         ("down_proj_scale_inv", s2)):
                getattr(new, n)[:, :t.shape[1]].copy_(t)
        parent, _, leaf = name.rpartition(".")
        model.get_submodule(parent).register_module(leaf, new)
        quantized.append(q13)
    return quantized


def test_transformers_fp8_experts_are_taken_as_they_are():
    """Experts that transformers' FP8 quantizer built (FP8Experts: float8_e4m3fn gate_up_proj with
    gate_up_proj_scale_inv) go to the pool byte for byte, and the model computes with them. At an
    intermediate size of 128 the module's one grid over the fused rows is gate and up blocked apart."""
    require("cpu", "expert_gemm")
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    model = qwen3_moe_of_intermediate(128)
    ref = quantized_reference(model)
    quantized = with_transformers_fp8_experts(model)
    module = find_experts(model)[0][1]
    as_transformers_reads = fp8._dequantize_fp8_weight(module.gate_up_proj, module.gate_up_proj_scale_inv,
                                                       [128, 128], torch.float32)
    assert torch.equal(as_transformers_reads, formats.dequantize_fp8(module.gate_up_proj, module.gate_up_proj_scale_inv,
                                                                     parts=2))
    prompt = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    want = generate(ref, prompt)
    # quantize="int4" would round them a second time: refused, the model left as it was (offloaded next).
    with pytest.raises(ValueError, match="quantize='int4': these experts are FP8 already .* leave quantize out"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4")
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    host = handle.runtime.host
    assert handle.stats()["pool"]["format"] == "fp8"
    assert all(torch.equal(host.w13[l].view(torch.uint8), q.view(torch.uint8)) for l, q in enumerate(quantized))
    assert torch.equal(generate(model, prompt), want)


@pytest.mark.parametrize("inter", [100, 32, 192])
def test_transformers_fp8_experts_whose_blocks_cross_gate_and_up_are_refused(inter):
    """FP8Experts scales fused gate_up row r by scale row r // 128: where I is not a multiple of 128
    a block holds gate and up rows, even where the grid has the shape of gate and up blocked apart
    (I = 100, and I = 32 with transformers' 2-row floor). Refused in one line; the model is left as
    it was."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    model = qwen3_moe_of_intermediate(inter)
    with_transformers_fp8_experts(model, parts=1)
    before = {n: (p.data_ptr(), p.clone()) for n, p in model.named_parameters()}
    modules = [m for _, m in find_experts(model)]
    message = (f"FP8 experts of intermediate size {inter}, not a multiple of 128: transformers' FP8Experts scales "
               "the fused gate_up rows as one grid")
    with pytest.raises(UnsupportedExperts, match=re.escape(message)):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False)
    assert [m for _, m in find_experts(model)] == modules, "the model is left as it was"
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n].data_ptr() == ptr and torch.equal(after[n], t) for n, (ptr, t) in before.items())


@pytest.mark.parametrize("config", [
    {},
    {"swiglu_alpha": 1.702, "swiglu_limit": 0.7},  # the gpt-oss-style clamped gate (MiniMaxM3VL)
    {"swiglu_limit": 0.7},  # the clamp before the activation
    {"swiglu_limit": 0.7, "limit_after_act": True},  # after it (transformers 5.25's Step3p7)
    {"mlp_gate_softcap": 0.9, "mlp_up_softcap": 1.3},
], ids=["plain", "swiglu_alpha", "limit", "limit_after_act", "softcaps"])
def test_fp8_experts_function_is_read_as_the_module_computes_it(config):
    """Every function transformers' FP8Experts._apply_gate chooses from its config is read as the
    module computes it (compared on gate/up values well past every clamp and softcap)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from freetoken_plugin.layouts import read_activation
    from ft_ops.testing.reference import activation_fn

    model_config = tiny_model("qwen3_moe", experts=E).config
    for key, value in config.items():
        setattr(model_config, key, value)
    module = fp8.FP8Experts(config=model_config, block_size=(128, 128))
    act = read_activation(module)
    gate_up = torch.randn(64, 2 * 16, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(activation_fn(gate, up, act), module._apply_gate(gate_up), rtol=1e-5, atol=1e-6)


def test_fp4_experts_of_transformers_fp8_quantizer_are_sent_to_load_model():
    """transformers' FP8Experts holding DeepSeek-V4's FP4-packed experts (int8, expert_dtype 'fp4')
    are refused with the way that reads them: load_model from the checkpoint."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from freetoken_plugin.layouts import UnsupportedExperts, read_layout

    if "expert_dtype" not in inspect.signature(fp8.FP8Experts.__init__).parameters:  # (transformers 5.17's)
        pytest.skip("this transformers' FP8Experts holds no FP4-packed experts")
    module = fp8.FP8Experts(config=tiny_model("qwen3_moe", experts=E).config, expert_dtype="fp4")
    if module.gate_up_proj.dtype != torch.int8:
        pytest.skip("this transformers' FP8Experts holds no FP4-packed experts")
    with pytest.raises(UnsupportedExperts, match=r"FP4-packed experts .* freetoken_plugin.load_model\(path\) reads"):
        read_layout(module)


def test_quantize_refuses_an_unknown_format():
    model = tiny_model("qwen3_moe", experts=E)
    with pytest.raises(ValueError, match="quantize='nf4': freetoken quantizes experts to 'fp8'"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="nf4")
    assert find_experts(model)[0][1].gate_up_proj.numel() > 0, "the model is left as it was"


def test_quantize_refuses_non_finite_expert_weights():
    """An inf or NaN expert weight would turn its whole 128 x 128 block into NaN: refused, and the
    model is left as it was (its forward gives the same logits)."""
    model = tiny_model("qwen3_moe", experts=E)
    with torch.no_grad():
        name = find_experts(model)[-1][0]
        find_experts(model)[-1][1].down_proj[1, 0, 0] = float("inf")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"expert 1 of {re.escape(name)} holds inf or NaN in its down weights"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="fp8")
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():  # the same weights, the inf included
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="inf or NaN"):
        formats.quantize_fp8(torch.tensor([[1.0, float("nan")]]))


def test_quantize_refuses_a_block_whose_scale_overflows():
    """A block whose largest magnitude is below 448 / FLT_MAX: the rule's scale 448 / amax is inf,
    which would make the block's zeros NaN (a stranger's check found the model computing NaN).
    Refused, naming the expert and the projection, and the model is left as it was; a block just
    above the edge quantizes to finite values."""
    model = tiny_model("qwen3_moe", experts=E)
    with torch.no_grad():
        name, module = find_experts(model)[0]
        module.gate_up_proj[2].zero_()
        module.gate_up_proj[2, 0, 0] = 1e-37  # a normal float32
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"expert 2 of {re.escape(name)}, gate/up weights: a 128 x 128 block's "
                                         "largest magnitude is 1.0e-37"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="fp8")
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)
    q, s = formats.quantize_fp8(torch.tensor([[0.0, 1e-35]]))
    assert torch.isfinite(formats.dequantize_fp8(q, s)).all()


def test_save_pretrained_writes_the_dequantized_experts(tmp_path):
    require("cpu", "expert_gemm")
    import transformers as tf

    model = tiny_model("qwen3_moe", experts=E)
    ref = quantized_reference(model)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="fp8")
    model.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (_, a), (_, b) in zip(find_experts(loaded), find_experts(ref)):
        assert torch.equal(a.gate_up_proj, b.gate_up_proj) and torch.equal(a.down_proj, b.down_proj)
