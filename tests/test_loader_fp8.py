"""load_model on block-FP8 checkpoints in Hugging Face's exact layout (quantization_config
{"quant_method": "fp8", "weight_block_size": [128, 128]}; every expert and linear weight
float8_e4m3fn with float32 weight_scale_inv [ceil(out/128), ceil(in/128)]), written here from a tiny
model: per-expert and fused expert layouts, dimensions that are not multiples of 128. The experts
stay FP8 from file to slot; the other FP8 linears are dequantized on load; greedy tokens equal the
same model with every FP8 weight dequantized, in float32."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import freetoken_plugin
from freetoken_plugin import CheckpointError
from freetoken_plugin.tiny import random_weights, tiny_config, tiny_model
from ft_ops import formats
from helpers import require

KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The tensors transformers' FP8 quantizer stores as FP8: expert weights and linear weights,
    not embeddings, norms, the router or the LM head."""
    if tensor.dim() != 2 and "experts" not in name:
        return False
    return not any(k in name for k in ("embed", "norm", "lm_head", "mlp.gate.weight", "router"))


def save_fp8_checkpoint(tensors, path) -> None:
    """`tensors` as the checkpoint's one shard, and config.json's quantization_config that of a
    block-FP8 checkpoint (as transformers' FP8 quantizer writes it)."""
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def write_fp8_checkpoint(model, path, fused: bool):
    """Saves `model` (save_pretrained writes per-expert tensors), then rewrites every quantizable
    weight as FP8 + weight_scale_inv; with `fused`, each layer's experts as gate_up_proj [E, 2I, H]
    + gate_up_proj_scale_inv and down_proj [E, H, I] + down_proj_scale_inv. Returns the model with
    those weights dequantized (the reference)."""
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out, dequantized = {}, {}
    experts = {}  # layer prefix -> {e: {proj: (q, s)}}
    for name, t in tensors.items():
        if not (name.endswith(".weight") and quantizable(name, t)):
            out[name] = t
            continue
        q, s = formats.quantize_fp8(t.float())
        dequantized[name] = formats.dequantize_fp8(q, s).to(t.dtype)
        if fused and ".experts." in name:
            prefix, rest = name.split(".experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(prefix + ".experts", {}).setdefault(int(e), {})[proj] = (q, s)
            continue
        out[name], out[name + "_scale_inv"] = q, s
    for prefix, by_e in experts.items():
        order = [by_e[e] for e in sorted(by_e)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"][0], p["up_proj"][0]]) for p in order])
        out[f"{prefix}.gate_up_proj_scale_inv"] = torch.stack([torch.cat([p["gate_proj"][1], p["up_proj"][1]]) for p in order])
        out[f"{prefix}.down_proj"] = torch.stack([p["down_proj"][0] for p in order])
        out[f"{prefix}.down_proj_scale_inv"] = torch.stack([p["down_proj"][1] for p in order])
    save_fp8_checkpoint(out, path)
    return put_reference_weights(model, dequantized)


def put_reference_weights(model, weights):
    """`model` with each weight of `weights` (checkpoint name -> what the stored tensors mean) put
    in its place: per-expert ones (gate_proj / up_proj / down_proj, or Mixtral's w1 / w3 / w2 under
    block_sparse_moe) into the fused experts' rows. The reference the loaded model must compute."""
    state = model.state_dict()
    with torch.no_grad():
        for name, value in weights.items():
            if ".experts." not in name:
                state[name].copy_(value)
                continue
            prefix, rest = name.split(".experts.")
            e, proj, _ = rest.split(".")
            module = model.get_submodule(prefix.replace(".block_sparse_moe", ".mlp") + ".experts")
            I = module.down_proj.shape[-1]
            rows = {"gate_proj": slice(0, I), "w1": slice(0, I), "up_proj": slice(I, 2 * I),
                    "w3": slice(I, 2 * I)}.get(proj)  # (else down_proj / w2)
            (module.down_proj[int(e)] if rows is None else module.gate_up_proj[int(e), rows]).copy_(value)
    return model


def assert_computes_the_reference(loaded, ref, seed: int) -> None:
    """The reference's greedy tokens of a 40-token prompt, and its logits within float32 rounding."""
    prompt = torch.randint(2, ref.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(seed))
    want = ref.generate(prompt, **KW)
    assert torch.equal(loaded.generate(prompt, **KW), want)
    with torch.no_grad():
        got, expected = loaded(want).logits, ref(want).logits
    assert float((got - expected).norm() / expected.norm()) < 1e-5


def random_qwen3_moe(hidden: int, dense: int, inter: int):
    """A 2-layer Qwen3-MoE (8 experts, top-2) in float32 with random weights large enough that
    greedy tokens depend on them."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=dense, moe_intermediate_size=inter,
                               num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=256, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return random_weights(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


@pytest.mark.parametrize("fused,hidden,inter", [(False, 64, 32), (False, 160, 192), (True, 64, 128), (True, 160, 192)],
                         ids=["per-expert-64-32", "per-expert-160-192", "fused-64-128", "fused-160-192"])
def test_fp8_checkpoint_generates_the_dequantized_models_tokens(tmp_path, fused, hidden, inter):
    """Per expert any sizes; fused where the scales' shape says how gate and up are blocked (I a
    multiple of 128, or 192: 4 row blocks apart against 3 across the boundary)."""
    require("cpu", "expert_gemm")
    model = random_qwen3_moe(hidden, dense=96, inter=inter)
    ref = write_fp8_checkpoint(model, tmp_path, fused)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "fp8" and host.w13.dtype == torch.float8_e4m3fn, "experts stay FP8 in host memory"
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32, "other linears are dequantized"
    assert_computes_the_reference(loaded, ref, seed=7)


def test_unsupported_quantizations_are_refused(tmp_path):
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "config.json")
    config = json.load(open(path))
    for quant, match in (({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"\[128, 128\] blocks"),
                         ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
                          "static activation"),
                         ({"quant_method": "fp8", "activation_scheme": "Static"}, "static activation"),
                         ({"quant_method": "fp8", "activation_scheme": None},
                          "activation_scheme is None; transformers and load_model read \"dynamic\""),
                         ({"quant_method": "fp8", "expert_dtype": "fp4"},
                          "says fp8, but no tensor of .* is FP8: remove the quantization_config"),
                         ({"quant_method": "fp8", "expert_dtype": None},
                          "expert_dtype is None; transformers reads \"fp8\" or \"fp4\""),
                         ({"quant_method": "awq"}, "quant_method='awq'"),
                         # A string is named as such (it was a list of its characters), an upper-case
                         # method by the spelling that works.
                         ({"quant_method": "fp8", "weight_block_size": "128"}, "weight_block_size '128'; "),
                         ({"quant_method": "FP8", "weight_block_size": [128, 128]},
                          "quant_method is 'FP8'; transformers and load_model read it in lower case: "
                          "\"quant_method\": \"fp8\"")):
        json.dump(dict(config, quantization_config=quant), open(path, "w"))
        with pytest.raises(CheckpointError, match=match):
            freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)


def test_a_config_without_weight_block_size_reads_128_blocks_as_transformers_does(tmp_path):
    """transformers' FP8 config defaults weight_block_size to [128, 128] and lower-cases
    activation_scheme; an explicit null block size (per-tensor scales) is refused."""
    require("cpu", "expert_gemm")
    write_fp8_checkpoint(tiny_model("qwen3_moe"), tmp_path, False)
    path = os.path.join(tmp_path, "config.json")
    config = json.load(open(path))
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    want = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False).generate(prompt, **KW)
    del config["quantization_config"]["weight_block_size"]
    config["quantization_config"]["activation_scheme"] = "Dynamic"  # transformers lower-cases it
    json.dump(config, open(path, "w"))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert loaded._freetoken_handle.runtime.host.shape.format == "fp8"
    assert torch.equal(loaded.generate(prompt, **KW), want)
    config["quantization_config"]["weight_block_size"] = None
    json.dump(config, open(path, "w"))
    with pytest.raises(CheckpointError, match="weight_block_size None"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


def one_layer_qwen3_moe(hidden: int, inter: int):
    """A 1-layer float32 Qwen3-MoE (4 experts, top-2) whose sizes are not whole 128-blocks."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=64, intermediate_size=96, moe_intermediate_size=inter,
                               num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=64, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_a_transposed_scale_grid_is_refused(tmp_path):
    """A weight_scale_inv whose grid is transposed ([3, 2] where [2, 3] is due) has the right number
    of scales but the wrong blocks: refused, for an expert and for another linear."""
    write_fp8_checkpoint(one_layer_qwen3_moe(hidden=300, inter=136), tmp_path, False)
    path = os.path.join(tmp_path, "model.safetensors")
    good = load_file(path)
    for name in ("model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv",
                 "model.layers.0.self_attn.q_proj.weight_scale_inv"):
        assert good[name].shape == (2, 3)
        save_file(dict(good, **{name: good[name].t().contiguous()}), path, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=r"\(3, 2\).*\(2, 3\)"):
            freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)


def test_fused_scales_blocked_across_gate_and_up_are_refused_before_the_pool_exists(tmp_path, monkeypatch):
    """transformers' FP8 quantizer blocks a fused gate_up [2I, H] as one grid: with I = 192, 3 row
    blocks, the middle one holding gate and up rows under one scale, where the pool blocks gate and
    up apart (4). Refused by name, before an expert is read. (transformers' dequantize=True reads no
    fused FP8 experts: it leaves their codes undequantized.)"""
    write_fp8_checkpoint(one_layer_qwen3_moe(hidden=256, inter=192), tmp_path, True)
    path = os.path.join(tmp_path, "model.safetensors")
    good = load_file(path)
    name = "model.layers.0.mlp.experts.gate_up_proj_scale_inv"
    assert good[name].shape == (4, 4, 2)
    save_file(dict(good, **{name: good[name][:, :3].contiguous()}), path, metadata={"format": "pt"})
    import freetoken_plugin.loader as loader_mod

    monkeypatch.setattr(loader_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))
    with pytest.raises(CheckpointError, match=r"gate_up_proj_scale_inv is \(4, 3, 2\): 128-row blocks across the "
                                              r"gate/up boundary .*load_model\(path, quantize='fp8'\)$"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)


@pytest.mark.parametrize("inter", [100, 32])
def test_fused_scales_that_could_be_either_grid_are_refused_before_the_pool_exists(tmp_path, monkeypatch, inter):
    """At I = 100 (and I = 32, with transformers' floor of 2 scale rows) one grid across the gate/up
    boundary, which transformers reads fused FP8 experts as, and gate and up blocked apart have the
    same shape but scale different rows: the file does not say which, so it is refused by name
    (it loaded as gate and up blocked apart)."""
    write_fp8_checkpoint(random_qwen3_moe(64, dense=96, inter=inter), tmp_path, True)
    import freetoken_plugin.loader as loader_mod

    monkeypatch.setattr(loader_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))
    with pytest.raises(CheckpointError, match=r"^model\.layers\.0\.mlp\.experts\.gate_up_proj_scale_inv is "
                                              rf"\(8, 2, 1\): at intermediate size {inter} one grid .* cannot tell "
                                              r"which this file holds: .*load_model\(path, quantize='fp8'\)$"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)


def test_checkpoint_problems_are_found_before_any_expert_is_read(tmp_path, monkeypatch):
    """A missing scale of a non-expert linear, the last layer's experts with a missing or misshapen
    scale or a weight of another dtype, and FP8 experts in a checkpoint whose config.json names no
    quantization, are refused from the shards' headers: before the host pool exists (and before a
    cache size sized for bf16 experts is judged)."""
    import freetoken_plugin.loader as loader_mod

    model = tiny_model("qwen3_moe")
    write_fp8_checkpoint(model, tmp_path, False)
    monkeypatch.setattr(loader_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))
    path = os.path.join(tmp_path, "model.safetensors")
    good = load_file(path)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    save_file({k: v for k, v in good.items() if k != name}, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"lacks its scales \\({name}; "):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)
    # The experts of the last layer, checked from the headers too: a missing scale, a scale grid
    # of another shape, and a weight of another dtype.
    last = max(int(k.split(".")[2]) for k in good if k.startswith("model.layers."))
    expert = f"model.layers.{last}.mlp.experts.1.down_proj"
    for change, message in [(lambda t: t.pop(f"{expert}.weight_scale_inv"), f"lacks {expert}.weight_scale_inv"),
                            (lambda t: t.update({f"{expert}.weight_scale_inv": torch.ones(7, 7)}),
                             f"{expert}.weight_scale_inv is torch.float32 \\(7, 7\\), expected the block scales"),
                            # UE8M0 exponents saved as integer codes: the dtype is named, and what would work
                            (lambda t: t.update({f"{expert}.weight_scale_inv":
                                                 t[f"{expert}.weight_scale_inv"].to(torch.uint8)}),
                             f"{expert}.weight_scale_inv is torch.uint8: scales are read as floating point "
                             r"\(float32, bfloat16, float8_e8m0fnu, \.\.\.\); save them as such"),
                            (lambda t: t.update({f"{expert}.weight": t[f"{expert}.weight"].float()}),
                             f"{expert}.weight is torch.float32 in an FP8 checkpoint")]:
        tensors = dict(good)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=message):
            freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)
        with pytest.raises(CheckpointError, match=message):
            freetoken_plugin.loader.check_checkpoint(str(tmp_path))  # what demo and generate check first
    # A non-expert tensor missing altogether, and a linear in FP8 of another kind (e5m2).
    for change, message in [(lambda t: t.pop("model.norm.weight"),
                             r"lacks 1 tensor the model needs, e\.g\. \['model\.norm\.weight'\]"),
                            (lambda t: t.update({name[:-len("_scale_inv")]: t[name[:-len("_scale_inv")]].to(
                                torch.float8_e5m2)}), r"o_proj\.weight is torch\.float8_e5m2 in an FP8 checkpoint")]:
        tensors = dict(good)
        change(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=message):
            freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)
    save_file(good, path, metadata={"format": "pt"})
    config_path = os.path.join(tmp_path, "config.json")
    config = json.load(open(config_path))
    del config["quantization_config"]
    json.dump(config, open(config_path, "w"))
    with pytest.raises(CheckpointError, match=r"\.weight is torch\.float8_e4m3fn \(FP8\) in a checkpoint whose config\.json "
                                              "has no FP8 quantization_config"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", cache_bytes=1000, progress=False)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.experts.2.down_proj.weight_scale_inv",
                                  "model.layers.0.self_attn.q_proj.weight_scale_inv"], ids=["expert", "linear"])
def test_a_non_finite_block_scale_is_refused(tmp_path, name):
    """A NaN or inf scale would turn its block's outputs into NaN: refused by name."""
    write_fp8_checkpoint(tiny_model("qwen3_moe"), tmp_path, False)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + " holds 1 non-finite scale "):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


@pytest.mark.parametrize("name,message", [
    ("model.layers.0.self_attn.q_proj.weight", "holds 1 FP8 NaN code: the checkpoint is damaged"),
    ("model.layers.1.mlp.experts.gate_up_proj", "holds 1 FP8 NaN code in expert 3: the checkpoint is damaged")],
    ids=["dequantized-linear", "fused-experts"])
def test_a_nan_code_is_refused_by_name(tmp_path, name, message):
    """An FP8 NaN code (0x7f) in a linear that load_model dequantizes (q_proj), or among experts read
    into the pool as stored (fused: the expert is named too), would make every output it touches NaN:
    refused by name."""
    write_fp8_checkpoint(random_qwen3_moe(64, dense=96, inter=128), tmp_path, True)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    codes = tensors[name].view(torch.uint8)
    (codes[3] if codes.dim() == 3 else codes).view(-1)[5] = 0x7F  # (fused experts: in expert 3)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name} {message}"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


@pytest.mark.parametrize("quantized", [True, False], ids=["fp8", "float"])
def test_a_layer_stored_fused_and_per_expert_is_refused(tmp_path, quantized):
    """Two copies of one layer's experts (per expert and fused): which is meant? Refused by name (the
    fused copy was read, and the per-expert one called tensors "with no place in the model")."""
    model = tiny_model("qwen3_moe")
    if quantized:
        write_fp8_checkpoint(model, tmp_path, False)
    else:
        model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    p = "model.layers.1.mlp.experts"
    experts = sorted({int(k[len(p) + 1:].split(".")[0]) for k in tensors if k.startswith(p + ".")})
    if not experts:
        pytest.skip("this transformers saves Qwen3-MoE's experts fused")
    rows = lambda e, n: tensors[f"{p}.{e}.{n}.weight"]  # noqa: E731
    tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([rows(e, "gate_proj"), rows(e, "up_proj")]) for e in experts])
    tensors[f"{p}.down_proj"] = torch.stack([rows(e, "down_proj") for e in experts])
    if quantized:
        scale = lambda e, n: tensors[f"{p}.{e}.{n}.weight_scale_inv"]  # noqa: E731
        tensors[f"{p}.gate_up_proj_scale_inv"] = torch.stack([torch.cat([scale(e, "gate_proj"), scale(e, "up_proj")])
                                                             for e in experts])
        tensors[f"{p}.down_proj_scale_inv"] = torch.stack([scale(e, "down_proj") for e in experts])
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"^{p} holds its experts fused \\({p}.gate_up_proj\\) and also per "
                                              f"expert \\({p}.0.gate_proj.weight, ...\\): two versions"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)
    # A per-expert copy of which only one tensor is left is named by that tensor.
    save_file({k: v for k, v in tensors.items() if not k.startswith(f"{p}.0.") or k.startswith(f"{p}.0.down_proj")},
              path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"and also per expert \\({p}.0.down_proj.weight, ...\\)"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)


def test_an_unquantized_expert_in_an_fp8_checkpoint_says_what_works(tmp_path):
    """One layer's experts left in float32 (modules_to_not_convert): one FP8 pool cannot hold them,
    and the message says so and what would work."""
    write_fp8_checkpoint(tiny_model("qwen3_moe"), tmp_path, False)
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    for key in [k for k in tensors if k.startswith("model.layers.1.mlp.experts.") and k.endswith("_scale_inv")]:
        weight = key[:-len("_scale_inv")]
        tensors[weight] = formats.dequantize_fp8(tensors[weight], tensors.pop(key))
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"float32 in an FP8 checkpoint, whose experts share one pool.*"
                                              r"modules_to_not_convert.*offload_experts\(model, quantize='fp8'\)"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


@pytest.mark.parametrize("damage", ["missing scale", "float32 weight"])
def test_messages_name_a_renamed_checkpoints_own_tensors(tmp_path, damage):
    """Mixtral's checkpoints name their experts block_sparse_moe.experts.<e>.w1 / w2 / w3, which
    the model holds as mlp.experts.gate_up_proj / down_proj: a problem with one of them names the
    tensor as the checkpoint does, so that it can be found in the shard or its index."""
    tiny_model("mixtral", experts=4).save_pretrained(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    expert = "model.layers.1.block_sparse_moe.experts.2"
    assert f"{expert}.w3.weight" in tensors  # the checkpoint's own names, as save_pretrained writes them
    out = {}
    for name, t in tensors.items():
        if ".experts." in name:
            out[name], out[name + "_scale_inv"] = formats.quantize_fp8(t.float())
        else:
            out[name] = t
    if damage == "missing scale":
        del out[f"{expert}.w3.weight_scale_inv"]
        message = f"lacks {expert}.w3.weight_scale_inv"
    else:
        out[f"{expert}.w1.weight"] = formats.dequantize_fp8(out[f"{expert}.w1.weight"], out[f"{expert}.w1.weight_scale_inv"])
        message = f"{expert}.w1.weight is torch.float32 in an FP8 checkpoint"
    save_fp8_checkpoint(out, tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=8, device="cpu", progress=False)


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_demo_on_an_fp8_checkpoint_with_partial_blocks(tmp_path, fused, capsys):
    """`freetoken demo --model` on a block-FP8 checkpoint whose dimensions are not multiples of 128:
    its reference is the checkpoint dequantized by the block rule (transformers' CPU fallback gets
    the partial blocks wrong), so the offloaded model's tokens are reported equal."""
    require("cpu", "expert_gemm")
    from freetoken_plugin.cli import main

    model = random_qwen3_moe(200, dense=136, inter=136)
    write_fp8_checkpoint(model, tmp_path, fused)
    assert main(["demo", "--device", "cpu", "--model", str(tmp_path), "--cache-slots", "16",
                 "--prompt-tokens", "10", "--new-tokens", "6"]) == 0
    assert re.search(r"greedy tokens\s+identical", capsys.readouterr().out)


def test_the_dequantized_copy_checks_space_and_keeps_the_other_files(tmp_path, monkeypatch):
    """write_dequantized_copy (the FP8 demo's reference) refuses a disk without room for it before
    writing any shard, and copies the checkpoint's other files (generation settings) beside it."""
    import collections
    import shutil

    from freetoken_plugin.loader import write_dequantized_copy

    model = tiny_model("qwen3_moe")
    write_fp8_checkpoint(model, tmp_path / "ckpt", True)
    (tmp_path / "ckpt" / "generation_config.json").write_text('{"repetition_penalty": 1.3}')
    usage = collections.namedtuple("usage", "total used free")
    with monkeypatch.context() as m:
        m.setattr(shutil, "disk_usage", lambda p: usage(10 ** 6, 10 ** 6, 1000))
        with pytest.raises(CheckpointError, match="needs .* where 1000 B are free; point TMPDIR to a larger disk"):
            write_dequantized_copy(str(tmp_path / "ckpt"), str(tmp_path / "ref"), torch.float32)
    assert not any(n.endswith(".safetensors") for n in os.listdir(tmp_path / "ref"))
    write_dequantized_copy(str(tmp_path / "ckpt"), str(tmp_path / "ref"), torch.float32)
    assert (tmp_path / "ref" / "generation_config.json").read_text() == '{"repetition_penalty": 1.3}'
    assert "quantization_config" not in json.load(open(tmp_path / "ref" / "config.json"))


def host_pool_of(model):
    return model._freetoken_handle.runtime.host


@pytest.mark.parametrize("arch,hidden,inter", [("qwen3_moe", 64, 32), ("qwen3_moe", 200, 136), ("gpt_oss", 64, 32)])
def test_quantize_fp8_while_loading_equals_offload_experts_quantize(tmp_path, arch, hidden, inter):
    """load_model(path, quantize="fp8") on a float checkpoint (save_pretrained's per-expert
    tensors; GPT-OSS: fused, transposed, interleaved, biases; sizes with partial blocks) fills the
    FP8 pool expert by expert with the rule of offload_experts(quantize="fp8"): the same bytes and
    scales, the same greedy tokens."""
    require("cpu", "expert_gemm")
    model = random_qwen3_moe(hidden, 96, inter) if arch == "qwen3_moe" else tiny_model(arch)
    model.save_pretrained(tmp_path)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False, quantize="fp8")
    freetoken_plugin.offload_experts(model, cache_slots=16, device="cpu", progress=False, quantize="fp8")
    got, want = host_pool_of(loaded), host_pool_of(model)
    assert got.shape.format == want.shape.format == "fp8"
    for a, b in zip(got.banks, want.banks):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    prompt = torch.randint(2, 100, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.generate(prompt, **KW), model.generate(prompt, **KW))


def test_quantize_while_loading_keeps_quantized_checkpoints_or_refuses(tmp_path):
    """An FP8 checkpoint's experts are FP8 already (quantize="fp8" changes nothing, "int4" is refused); MXFP4 experts
    stay MXFP4 (quantizing them again is refused); an unknown format is refused before reading."""
    require("cpu", "expert_gemm")
    fp8_dir = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_model("qwen3_moe"), fp8_dir, fused=False)
    loaded = freetoken_plugin.load_model(str(fp8_dir), cache_slots=16, device="cpu", progress=False, quantize="fp8")
    assert host_pool_of(loaded).shape.format == "fp8"
    with pytest.raises(ValueError, match=r"quantize='int8': load_model quantizes a float checkpoint's experts to 'fp8'"):
        freetoken_plugin.load_model(str(fp8_dir), device="cpu", progress=False, quantize="int8")
    for int4 in ("int4", "int4-g32"):  # FP8 experts would be rounded a second time
        with pytest.raises(CheckpointError, match=f"holds FP8 experts, which load as they are .*; quantize='{int4}' "
                                                  "would round them a second time: leave quantize out"):
            freetoken_plugin.load_model(str(fp8_dir), device="cpu", progress=False, quantize=int4)
    # Sizes no int4 group divides: still the FP8 experts named (not "use quantize='fp8'"), exit 2 from the CLI.
    odd_dir = tmp_path / "fp8_odd_sizes"
    write_fp8_checkpoint(random_qwen3_moe(200, dense=96, inter=136), odd_dir, fused=False)
    with pytest.raises(CheckpointError, match="holds FP8 experts, which load as they are .*; quantize='int4' would"):
        freetoken_plugin.load_model(str(odd_dir), device="cpu", progress=False, quantize="int4")
    from freetoken_plugin.cli import main

    assert main(["generate", "--model", str(odd_dir), "--prompt-ids", "1,2,3", "--device", "cpu",
                 "--quantize", "int4"]) == 2
    from test_mxfp4 import write_mxfp4_checkpoint

    mx_dir = tmp_path / "mxfp4"
    write_mxfp4_checkpoint(tiny_model("gpt_oss"), mx_dir)
    for quantize in ("fp8", "int4"):
        with pytest.raises(CheckpointError, match=f"holds MXFP4 experts, which load as they are .*quantize='{quantize}'"):
            freetoken_plugin.load_model(str(mx_dir), device="cpu", progress=False, quantize=quantize)


def test_quantize_while_loading_names_an_expert_it_cannot_quantize(tmp_path):
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    name = next(n for n in tensors if n.endswith(".experts.3.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    prefix = name.split(".experts.")[0] + ".experts"
    # The checkpoint's problem: a CheckpointError (the command line's exit status 2), as a NaN block
    # scale of an FP8 checkpoint is.
    with pytest.raises(CheckpointError, match=f"expert 3 of {re.escape(prefix)} holds inf or NaN in its down weights"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False, quantize="fp8")


def test_fp8_experts_with_biases_are_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    """No block-FP8 checkpoint format holds expert biases (transformers' FP8Experts has none), so
    where they belong beside the FP8 rows is unknown: a GPT-OSS checkpoint whose fused experts are
    FP8 and whose biases stay is refused, naming what keeps them (the float checkpoint, quantized
    while loading). It had loaded with its bias banks never written."""
    import transformers as tf

    config = tiny_config("gpt_oss", experts=4)
    config.intermediate_size = 128  # fused FP8 scales of one shape whichever way gate and up are blocked
    torch.manual_seed(0)
    model = random_weights(tf.AutoModelForCausalLM.from_config(config))
    model.save_pretrained(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).float().transpose(1, 2).contiguous()  # [E, out, in]
        q, s = formats.quantize_fp8(weight, parts=2 if name.endswith("gate_up_proj") else 1)
        tensors[name], tensors[name + "_scale_inv"] = q, s
    save_fp8_checkpoint(tensors, tmp_path)
    monkeypatch.setattr(freetoken_plugin.loader, "_load_non_experts", lambda *a: pytest.fail("a weight was read"))
    message = r"GptOssExperts has expert biases.*load_model\(path, quantize='fp8'\), which keeps the biases"
    with pytest.raises(CheckpointError, match=message):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=8, device="cpu", progress=False)
    with pytest.raises(CheckpointError, match=message):
        freetoken_plugin.loader.check_checkpoint(str(tmp_path))


def test_mxfp4_experts_of_a_family_that_keeps_gate_then_up_rows_are_refused(tmp_path):
    """MXFP4 checkpoints interleave gate and up rows (GPT-OSS, the one family that ships them); on a
    family whose experts keep gate rows then up rows the order is undefined, and reading it as
    GPT-OSS's scrambled the rows without a word."""
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)  # per-expert tensors: replaced by each layer's fused MXFP4 ones
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = {n: t for n, t in load_file(file).items() if ".experts." not in n}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):  # gate_up_proj [E, 2I, H]: gate rows, then up rows
            for weight, tensor in (("gate_up_proj", module.gate_up_proj), ("down_proj", module.down_proj)):
                blocks, scales = formats.quantize_mxfp4(tensor.detach().float())
                tensors[f"{name}.{weight}_blocks"] = blocks.reshape(*blocks.shape[:2], -1, 16).contiguous()
                tensors[f"{name}.{weight}_scales"] = scales.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.load(open(os.path.join(tmp_path, "config.json")))
    config["quantization_config"] = {"quant_method": "mxfp4"}
    json.dump(config, open(os.path.join(tmp_path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="Qwen3MoeExperts keeps gate rows then up rows: load_model reads MXFP4 "
                                              "experts in GPT-OSS's layout"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=8, device="cpu", progress=False)


def test_an_fp8_dtype_in_config_json_computes_in_the_checkpoints_float_dtype(tmp_path):
    """Some published block-FP8 checkpoints name float8_e4m3fn as config.json's dtype (from_pretrained
    fails on them: no Float8 storage to build the model in): load_model computes in the checkpoint's
    own float dtype, as with "auto", and gives the same tokens as the same checkpoint naming it; a
    dense checkpoint naming an FP8 dtype is refused in one line."""
    require("cpu", "expert_gemm")
    write_fp8_checkpoint(tiny_model("qwen3_moe", dtype=torch.bfloat16), str(tmp_path), fused=False)
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)
    want = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False).generate(ids, **kw)
    config = json.load(open(tmp_path / "config.json"))
    config.pop("dtype", None)
    config["torch_dtype"] = "float8_e4m3fn"
    json.dump(config, open(tmp_path / "config.json", "w"))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert loaded.dtype == torch.bfloat16 and loaded.config.dtype == torch.bfloat16
    assert torch.equal(loaded.generate(ids, **kw), want)
    dense = tmp_path / "dense"
    tiny_model("qwen3_moe").save_pretrained(dense)
    config = json.load(open(dense / "config.json"))
    config["dtype"] = "float8_e4m3fn"
    json.dump(config, open(dense / "config.json", "w"))
    with pytest.raises(CheckpointError, match="dtype 'float8_e4m3fn' is not one load_model computes in"):
        freetoken_plugin.load_model(str(dense), cache_slots=16, device="cpu", progress=False)


@pytest.mark.slow  # about 15 s: the checkpoint is written from a float32 model
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_loading_an_fp8_checkpoint_holds_its_experts_once(tmp_path, fused):
    """Peak resident memory of a process that loads a block-FP8 checkpoint of ~145 MiB of experts
    grows by the checkpoint and a few experts (~50 MiB more here): not by a float32 layer (192 MiB),
    nor by the experts a second time (~145 MiB)."""
    import transformers as tf

    from helpers import load_model_peak_growth

    config = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=512, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=512, moe_intermediate_size=512,
                               num_experts=64, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                               max_position_embeddings=256, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    write_fp8_checkpoint(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32), tmp_path, fused)
    ckpt_bytes = os.path.getsize(tmp_path / "model.safetensors")
    layer_float32 = 64 * 3 * 512 * 512 * 4
    grown = load_model_peak_growth(tmp_path, cache_slots=8, stream_prefill=False)
    assert grown < ckpt_bytes + 0.5 * layer_float32, (
        f"peak grew {grown / 2**20:.0f} MiB for a {ckpt_bytes / 2**20:.0f} MiB checkpoint")
