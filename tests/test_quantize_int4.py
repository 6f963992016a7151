"""quantize="int4": a float model's experts quantized to symmetric int4 (a float scale per group of a
row) as the host pool fills, through offload_experts and load_model. The offloaded model equals the
model whose experts were quantized and dequantized by formats.quantize_int4; the group is the
largest of 128, 64, 32 dividing the sizes unless named; what int4 cannot hold is refused in one line
before the pool exists, and the model is left as it was."""
import re

import pytest
import torch

import freetoken_plugin
from freetoken_plugin.cli import main
from freetoken_plugin.offload import find_experts, quantized_format
from freetoken_plugin.tiny import tiny_model
from ft_ops import formats
from helpers import require, with_rounded_experts

E = 8


def generate(model, prompt, steps=6):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)


def int4_reference(model, group: int):
    """A copy of `model` whose experts hold their int4 quantization (groups of `group`), dequantized."""
    def rounded(w):
        return formats.dequantize_int4(*formats.quantize_int4(w, group), w.dtype)
    return with_rounded_experts(model, rounded, rounded)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_quantize_int4_equals_quantize_then_dequantize(arch):
    """Tokens and logits of the offloaded model equal those of the model whose experts were
    quantized and dequantized (GPT-OSS: interleaved, transposed gate/up and biases)."""
    require("cpu", "expert_gemm")
    model = tiny_model(arch, experts=E)
    ref = int4_reference(model, 32)  # hidden 64, intermediate 32: groups of 32
    prompt = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    want = generate(ref, prompt)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4")
    pool = handle.stats()["pool"]
    assert pool["format"] == "int4" and pool["int4_group"] == 32
    host = handle.runtime.host
    assert host.w13.dtype == torch.uint8 and host.w13_scale.dtype == torch.float32
    # float32 weights of 4 bytes become half a byte, plus a float32 scale per 32 values
    assert pool["expert_bytes"] <= 0.625 * 3 * 32 * 64 + (4 * (2 * 32 + 64) if host.b13 is not None else 0)
    assert torch.equal(generate(model, prompt), want)
    with torch.no_grad():
        got, expected = model(want).logits.float(), ref(want).logits.float()
    assert float((got - expected).norm() / expected.norm()) < 1e-5


def test_the_group_is_the_largest_that_divides_or_the_one_named():
    assert quantized_format("int4", 2048, 768, True) == (formats.INT4, 128)  # Qwen3-30B-A3B
    assert quantized_format("int4", 2880, 2880, True) == (formats.INT4, 64)  # GPT-OSS
    assert quantized_format("int4", 64, 32, True) == (formats.INT4, 32)
    assert quantized_format("int4-g32", 2048, 768, True) == (formats.INT4, 32)
    assert quantized_format("fp8", 40, 24, False) == (formats.FP8, 0)
    assert quantized_format(None, 40, 24, False) == (formats.DENSE, 0)
    with pytest.raises(ValueError, match=r"quantize='int4-g128': groups of 128 values do not divide the hidden and "
                                         r"intermediate sizes \(64 and 32\); use quantize='int4-g32'$"):
        quantized_format("int4-g128", 64, 32, True)
    with pytest.raises(ValueError, match=r"use quantize='int4-g64' or quantize='int4-g32'$"):
        quantized_format("int4-g128", 64, 64, True)
    with pytest.raises(ValueError, match=r"no int4 group of 32, 64 or 128 values divides .* \(40 and 24\); "
                                         r"use quantize='fp8'"):
        quantized_format("int4", 40, 24, True)
    with pytest.raises(ValueError, match="int4 experts must be gated .* use quantize='fp8'"):
        quantized_format("int4", 64, 32, False)
    # The command line's spelling where it asks (generate's --quantize, bench's --formats).
    with pytest.raises(ValueError, match=r"^--quantize int4: no int4 group .* \(40 and 24\); use --quantize fp8$"):
        quantized_format("int4", 40, 24, True, argument="--quantize")
    with pytest.raises(ValueError, match=r"^--quantize int4-g128: groups of 128 .*; use --quantize int4-g32$"):
        quantized_format("int4-g128", 64, 32, True, argument="--quantize")
    with pytest.raises(ValueError, match=r"^--quantize int4: int4 experts must be gated .*; use --quantize fp8$"):
        quantized_format("int4", 64, 32, False, argument="--quantize")
    for bad in ("int4-g48", "INT4", "int8", "4bit"):
        with pytest.raises(ValueError, match=re.escape(f"quantize={bad!r}: freetoken quantizes experts to 'fp8'")):
            quantized_format(bad, 2048, 768, True)


def test_a_group_named_takes_effect_and_the_stats_show_it():
    require("cpu", "expert_gemm")
    model = tiny_model("mixtral", experts=E)  # hidden 64, intermediate 96: groups of 32 only
    ref = int4_reference(model, 32)
    prompt = torch.randint(1, 512, (1, 8), generator=torch.Generator().manual_seed(4))
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False,
                                              quantize="int4-g32")
    assert handle.stats()["pool"]["int4_group"] == 32
    assert torch.equal(generate(model, prompt), generate(ref, prompt))


def test_refusals_leave_the_model_as_it_was():
    """Non-finite weights (named by expert and projection), weights beyond a float16 scale's reach and
    a group that does not divide the sizes are refused before the pool exists; the model keeps its
    weights (the same tensors) and can be offloaded after."""
    model = tiny_model("qwen3_moe", experts=E)
    name, module = find_experts(model)[-1]
    params = dict(model.named_parameters())
    with torch.no_grad():
        module.down_proj[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=f"quantize='int4-g32': expert 1 of {re.escape(name)} holds inf or NaN in its down "
                                         "weights, which int4 cannot represent"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4")
    with torch.no_grad():
        module.down_proj[1, 0, 0] = 1e6  # beyond 7.5 x 65504
    with pytest.raises(ValueError, match=f"expert 1 of {re.escape(name)}, down weights: a weight of magnitude 1e\\+06 "
                                         r"is beyond what int4 with a float16 scale reaches"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4")
    with pytest.raises(ValueError, match="quantize='int4-g64': groups of 64 values do not divide"):
        freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4-g64")
    assert all(p is params[n] for n, p in model.named_parameters())
    with torch.no_grad():
        module.down_proj[1, 0, 0] = 0.5
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4")


def test_load_model_quantizes_as_offload_experts_does_and_generate_takes_it(tmp_path, capsys):
    """load_model(path, quantize="int4") fills the same pool, byte for byte, as offload_experts on the
    loaded model, one float layer at a time; `freetoken generate --quantize int4` prints its tokens
    and refuses a group the sizes do not take as a bad argument."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe", experts=E)
    model.save_pretrained(tmp_path)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4")
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=2 * E, device="cpu", progress=False,
                                         quantize="int4")
    a, b = handle.runtime.host, loaded._freetoken_handle.runtime.host
    assert b.shape == a.shape and b.shape.group == 32
    for bank in ("w13", "w2", "w13_scale", "w2_scale"):
        assert torch.equal(getattr(a, bank), getattr(b, bank)), bank
    prompt = torch.tensor([[1, 2, 3]])
    want = generate(model, prompt, 4)[0, 3:]
    assert torch.equal(generate(loaded, prompt, 4)[0, 3:], want)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--new-tokens", "4",
                 "--device", "cpu", "--quantize", "int4"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(str(int(t)) for t in want)
    # A group the checkpoint's sizes refuse is a bad argument (status 2), known from config.json.
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--new-tokens", "4",
                 "--device", "cpu", "--quantize", "int4-g64"]) == 2
    err = capsys.readouterr().err
    assert "--quantize int4-g64: groups of 64 values do not divide" in err and "use --quantize int4-g32" in err
    assert "quantize=" not in err
    with pytest.raises(ValueError, match="quantize='int2': load_model quantizes a float checkpoint's experts"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=2 * E, device="cpu", progress=False, quantize="int2")


def test_generate_names_its_own_flag_for_sizes_int4_cannot_take(tmp_path, capsys):
    """`freetoken generate --quantize int4` on sizes no int4 group divides (hidden 40): exit 2, the
    way out in the command line's words (it said "use quantize='fp8'")."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=40, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, intermediate_size=48, moe_intermediate_size=24,
                               num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=64, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    capsys.readouterr()  # (save_pretrained's progress bar)
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--device", "cpu",
                 "--quantize", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken: error: --quantize int4: no int4 group of 32, 64 or 128 values divides the "
                          "hidden and intermediate sizes (40 and 24)") and err.endswith("; use --quantize fp8"), err
    assert "\n" not in err


def test_quantize_int4_leaves_its_float32_input_as_it_was():
    """quantize_int4 works in place on a float32 copy: a float32 weight (a view of a model's
    parameter, as offload_experts passes it) must not be that copy."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    before = w.clone()
    codes, scales = formats.quantize_int4(w, 32)
    assert torch.equal(w, before)
    assert torch.equal(formats.dequantize_int4(codes, scales, torch.float32),
                       formats.dequantize_int4(*formats.quantize_int4(before, 32), torch.float32))


def test_save_pretrained_writes_the_dequantized_experts(tmp_path):
    require("cpu", "expert_gemm")
    import transformers as tf

    model = tiny_model("gpt_oss", experts=E)  # transposed, interleaved gate/up and biases
    ref = int4_reference(model, 32)
    freetoken_plugin.offload_experts(model, cache_slots=2 * E, device="cpu", progress=False, quantize="int4")
    model.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (_, a), (_, b) in zip(find_experts(loaded), find_experts(ref)):
        assert torch.equal(a.gate_up_proj, b.gate_up_proj) and torch.equal(a.down_proj, b.down_proj)
        assert torch.equal(a.gate_up_proj_bias, b.gate_up_proj_bias)
