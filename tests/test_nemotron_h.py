"""Experts without a gate through the public API, on a tiny Nemotron-H (its MoE layers compute
down(relu(up x)^2)): offload_experts as it is and with quantize="fp8", state_dict of the offloaded
model, and load_model on the checkpoints save_pretrained writes (per-expert `backbone.` names) and on
block-FP8 checkpoints of that layout. Greedy tokens equal transformers' own model with the same
weights. (test_families.py checks the experts block itself against the class's forward.)"""
import dataclasses
import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import freetoken_plugin
from families import FAMILIES, build, decorated_classes
from ft_ops import formats
from helpers import require
from test_loader_fp8 import save_fp8_checkpoint

KW = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)


def tiny_nemotron_h(**config):
    """The family test's tiny Nemotron-H, with `config` overriding its sizes."""
    found = [c for c in decorated_classes() if c[2] == "NemotronHExperts"]
    if not found:
        pytest.skip("this transformers has no Nemotron-H with decorated experts")
    spec = FAMILIES["NemotronHExperts"]
    spec = dataclasses.replace(spec, config=dict(spec.config, **config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(*found[0], spec)


def prompt():
    return torch.randint(2, 100, (1, 8), generator=torch.Generator().manual_seed(1))


def generate(model):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Mamba layers' slow-path notes
        return model.generate(prompt(), **KW)


def experts_of(model):
    return [m for m in model.modules() if type(m).__name__ == "NemotronHExperts"]


def test_offloaded_nemotron_h_generates_its_tokens_and_saves_its_weights(tmp_path):
    require("cpu", "expert_gemm")
    model = tiny_nemotron_h()
    want = generate(model)
    ups = [m.up_proj.detach().clone() for m in experts_of(model)]
    handle = freetoken_plugin.offload_experts(model, cache_slots=8, device="cpu", progress=False)
    shape = handle.runtime.host.shape
    assert not shape.gated and handle.runtime.host.w13.shape[2] == shape.intermediate, "the up rows alone"
    assert torch.equal(generate(model), want)
    state = model.state_dict()
    saved = [state[k] for k in state if k.endswith("experts.up_proj")]
    assert len(saved) == len(ups) and all(torch.equal(a, b) for a, b in zip(saved, ups))


def test_nemotron_h_quantized_to_fp8_is_the_dequantized_model(tmp_path):
    """quantize="fp8" blocks the up projection as one projection (I = 200: a partial second row
    block); the model then computes with the dequantized experts, which its state_dict holds."""
    require("cpu", "expert_gemm")
    model = tiny_nemotron_h(moe_intermediate_size=200)
    freetoken_plugin.offload_experts(model, cache_slots=8, device="cpu", quantize="fp8", progress=False)
    got = generate(model)
    state = model.state_dict()
    reference = tiny_nemotron_h(moe_intermediate_size=200)
    with torch.no_grad():
        for module_name, module in reference.named_modules():
            if type(module).__name__ != "NemotronHExperts":
                continue
            for name in ("up_proj", "down_proj"):
                q, s = formats.quantize_fp8(getattr(module, name).float())
                getattr(module, name).copy_(formats.dequantize_fp8(q, s))
                assert torch.equal(state[f"{module_name}.{name}"], getattr(module, name)), f"{module_name}.{name}"
    assert torch.equal(got, generate(reference))


@pytest.mark.parametrize("fmt", ["float32", "float32-fused", "fp8"])
def test_load_model_reads_nemotron_h_checkpoints(tmp_path, fmt):
    """save_pretrained's layout (backbone.layers.<l>.mixer.experts.<e>.up_proj.weight, as NVIDIA's
    checkpoints), in float32, with the experts fused as the module holds them (experts.up_proj
    [E, I, H]), or with every expert weight block-FP8 (weight_scale_inv): the FP8 experts stay FP8
    in the host pool."""
    require("cpu", "expert_gemm")
    model = tiny_nemotron_h()
    model.save_pretrained(tmp_path)
    if fmt == "float32-fused":
        tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
        out = {n: t for n, t in tensors.items() if ".experts." not in n}
        for name, module in model.named_modules():
            if type(module).__name__ == "NemotronHExperts":
                out[f"{name}.up_proj"], out[f"{name}.down_proj"] = module.up_proj.detach(), module.down_proj.detach()
        save_file(out, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    if fmt == "fp8":
        tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
        assert any(".experts.0.up_proj.weight" in n for n in tensors), "save_pretrained wrote per-expert tensors"
        out = {}
        for name, t in tensors.items():
            if ".experts." in name and name.endswith(".weight"):
                q, s = formats.quantize_fp8(t.float())
                out[name], out[name + "_scale_inv"] = q, s
                # The reference computes with the dequantized weight.
                target = name.replace("backbone.", "model.", 1)
                layer_prefix, rest = target.split(".experts.")
                e, proj, _ = rest.split(".")
                with torch.no_grad():
                    getattr(model.get_submodule(layer_prefix + ".experts"), proj)[int(e)] = formats.dequantize_fp8(q, s)
            else:
                out[name] = t
        save_fp8_checkpoint(out, tmp_path)
    want = generate(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=8, device="cpu", progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert not host.shape.gated and host.shape.format == ("fp8" if fmt == "fp8" else "dense")
    assert host.w13.shape[2] == host.shape.intermediate, "the up rows alone"
    assert torch.equal(generate(loaded), want)


def test_a_nemotron_h_checkpoint_without_its_experts_says_which_names_it_looked_for(tmp_path):
    require("cpu", "expert_gemm")
    model = tiny_nemotron_h()
    model.save_pretrained(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    kept = {n: t for n, t in tensors.items() if ".experts." not in n}
    save_file(kept, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(freetoken_plugin.CheckpointError, match=r"experts\.<e>\.up_proj\.weight"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=8, device="cpu", progress=False)


def test_an_mxfp4_config_on_experts_without_a_gate_is_refused_before_reading(tmp_path):
    require("cpu", "expert_gemm")
    tiny_nemotron_h().save_pretrained(tmp_path)
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(freetoken_plugin.CheckpointError, match="NemotronHExperts has no gate: MXFP4 experts are gated ones"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=8, device="cpu", progress=False)
