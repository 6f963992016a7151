"""DeepSeek-V4's native checkpoints through load_model: block-FP8 attention and shared-expert linears
(float8_e4m3fn with `.scale` float8_e8m0fnu 128 x 128 block scales) beside FP4-packed routed
experts (per expert w1 / w3 / w2 int8 [out, in/2], two e2m1 values a byte with the low nibble the
even column, `.scale` float8_e8m0fnu [out, in/32]), written by these tests in that layout. The
experts go into the MXFP4 host pool as their bytes are (never expanded), the FP8 linears are
dequantized, and the model computes what transformers computes on the same checkpoint with every
weight dequantized (its reference: a float copy the tests write by their own decoding)."""
import dataclasses
import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import freetoken_plugin
from freetoken_plugin import CheckpointError
from helpers import require
from test_loader_fp8 import assert_computes_the_reference

pytest.importorskip("transformers.models.deepseek_v4")
import families as F  # noqa: E402 (after the skip: a transformers without DeepSeek-V4 builds none)

E8M0 = torch.float8_e8m0fnu
# e2m1's 16 codes: the sign in bit 3, then 2 exponent bits and 1 mantissa bit.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_LINEAR = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|shared_experts\.w[123])\.weight$")
FP4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def tiny_v4():
    """The families test's tiny DeepSeek-V4 (hidden 64, experts' intermediate 32, 8 experts), float32,
    with the release's two kinds of MoE layer: the first routed by token id (`hash_moe`, its
    `tid2eid` table a buffer the checkpoint holds), the second by its router."""
    spec = F.FAMILIES["DeepseekV4Experts"]
    spec = dataclasses.replace(spec, config=dict(spec.config, mlp_layer_types=["hash_moe", "moe"]))
    model = F.build("deepseek_v4", "modeling_deepseek_v4", "DeepseekV4Experts", spec)
    table = model.model.layers[0].mlp.gate.tid2eid  # (initialized to zeros: every token to expert 0)
    gen = torch.Generator().manual_seed(3)
    experts = model.config.n_routed_experts
    table.copy_(torch.stack([torch.randperm(experts, generator=gen)[:table.shape[1]] for _ in range(table.shape[0])]))
    return model


def power_of_two_scales(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """UE8M0 scales as DeepSeek's release holds them: the power of two that brings amax within range."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=2.0 ** -100) / largest)))


def fp8_blocks(w: torch.Tensor):
    """w [out, in] as float8_e4m3fn with a power-of-two scale per 128 x 128 block (partial at the
    edges), and the values they hold."""
    rows, cols = w.shape
    grid = (math.ceil(rows / 128), math.ceil(cols / 128))
    padded = torch.zeros(grid[0] * 128, grid[1] * 128)
    padded[:rows, :cols] = w
    tiles = padded.view(grid[0], 128, grid[1], 128)
    scale = power_of_two_scales(tiles.abs().amax(dim=(1, 3)), 448.0)
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    values = (q.float() * scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.view_as(padded)[:rows, :cols].contiguous(), scale.to(E8M0), values


def fp4_pairs(w: torch.Tensor):
    """w [out, in] as e2m1 codes of the nearest magnitude over a power-of-two scale per 32 values,
    packed two a byte (the even column in the low nibble) as int8, and the values they hold."""
    rows, cols = w.shape
    groups = w.view(rows, cols // 32, 32)
    scale = power_of_two_scales(groups.abs().amax(dim=-1), 6.0)
    scaled = groups / scale[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1[:8]).abs().argmin(dim=-1)
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).view(rows, cols)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
    return packed, scale.to(E8M0), fp4_values(packed, scale.to(E8M0))


def fp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The values of int8 FP4 pairs with their e8m0 scales, decoded by the table above."""
    byte = packed.view(torch.uint8).long()
    codes = torch.stack([byte & 15, byte >> 4], dim=-1).flatten(-2)
    return E2M1[codes] * torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(32, dim=-1)


# save_pretrained's names that DeepSeek's release spells otherwise (its checkpoints hold the base
# model without the `model.` prefix).
RELEASED_NAMES = ((r"^model\.embed_tokens\.", "embed."), (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
                  (r"^model\.", ""))


def write_v4_checkpoint(model, path, expert_dtype: bool = True, released: bool = False, fp8_experts: bool = False):
    """`model` saved in DeepSeek-V4's native layout: save_pretrained writes its tensors under the
    release's module names (`attn.wq_a`, `ffn.experts.<e>.w1`, ...), then the linears the release
    keeps in FP8 and the routed experts in FP4 are rewritten so, each with its `.scale`; config.json
    gets the release's quantization_config (and expert_dtype "fp4", which the released configs omit,
    where asked). `released`: the release's names throughout (`embed.weight`, `layers.0...`,
    `hc_head_fn`) in two shards with an index, the FP4 experts' scales in the other shard. Also
    writes `path`/reference, the same checkpoint with every weight the values it holds (float32,
    no quantization_config): transformers loads it as the reference model. `fp8_experts`: the routed
    experts block-FP8 too (expert_dtype "fp8")."""
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out, values = {}, {}
    for name, t in tensors.items():
        if FP8_LINEAR.search(name) or FP4_EXPERT.search(name):
            fp4 = FP4_EXPERT.search(name) and not fp8_experts
            q, scale, values[name] = (fp4_pairs if fp4 else fp8_blocks)(t.float())
            out[name], out[name[:-len("weight")] + "scale"] = q, scale
        else:
            out[name] = values[name] = t
    if released:
        renamed = {}
        for name, t in out.items():
            for pattern, to in RELEASED_NAMES:
                name = re.sub(pattern, to, name)
            renamed[name] = t
        os.remove(os.path.join(path, "model.safetensors"))
        shards = {"model-00001-of-00002.safetensors": {n: t for n, t in renamed.items() if not n.endswith(".scale")},
                  "model-00002-of-00002.safetensors": {n: t for n, t in renamed.items() if n.endswith(".scale")}}
        for file, part in shards.items():
            save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}, f)
    else:
        save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    reference = os.path.join(path, "reference")
    os.makedirs(reference)
    save_file({n: v.contiguous() for n, v in values.items()}, os.path.join(reference, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(reference, "config.json"), "w") as f:
        json.dump(config, f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    if expert_dtype:  # DeepSeek-V4's config moves it into quantization_config
        config["expert_dtype"] = "fp8" if fp8_experts else "fp4"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return reference


def reference_model(reference: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()




def v4_checkpoint(tmp_path, expert_dtype: bool = True, released: bool = False) -> str:
    path = tmp_path / "v4"
    write_v4_checkpoint(tiny_v4(), path, expert_dtype, released)
    return str(path)


@pytest.mark.parametrize("released", [False, True], ids=["expert_dtype-fp4", "as-released"])
def test_a_deepseek_v4_checkpoint_computes_its_dequantized_model(tmp_path, released):
    """The FP4 experts load as MXFP4 bytes (whether config.json says expert_dtype "fp4" or, as the
    releases, nothing: the int8 tensors tell; under the model's names or the release's, in one file
    or in shards), the FP8 linears dequantized; the logits equal the float reference's within
    float32 rounding and the greedy tokens are its tokens."""
    require("cpu", "expert_gemm")
    import transformers as tf

    path = v4_checkpoint(tmp_path, expert_dtype=not released, released=released)
    if released:
        names = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
        assert {"embed.weight", "hc_head_fn", "layers.0.ffn.experts.0.w1.scale"} <= set(names)
    ref = reference_model(os.path.join(path, "reference"))
    # The reference's decoding is transformers' own: its FP8 quantizer dequantizing the checkpoint.
    theirs = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=tf.FineGrainedFP8Config(dequantize=True)).eval()
    their_weights = theirs.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(their_weights[name], value), name
    loaded = freetoken_plugin.load_model(path, cache_slots=12, device="cpu", dtype=torch.float32, progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "mxfp4" and host.w13.dtype == torch.uint8
    stats = loaded._freetoken_handle.stats()["pool"]
    assert stats["format"] == "mxfp4"
    experts = ref.model.layers[0].mlp.experts
    assert host.w13.shape[-2:] == (experts.gate_up_proj.shape[1], experts.gate_up_proj.shape[2] // 2)
    assert loaded.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float32, "FP8 linears are dequantized"
    assert_computes_the_reference(loaded, ref, seed=5)


def test_a_deepseek_v4_checkpoint_with_fp8_experts_loads_them_as_fp8(tmp_path):
    """The same layout with block-FP8 routed experts (expert_dtype "fp8", `.scale` e8m0 block
    scales): an FP8 pool, the reference's tokens."""
    require("cpu", "expert_gemm")
    path = tmp_path / "v4"
    write_v4_checkpoint(tiny_v4(), path, fp8_experts=True)
    ref = reference_model(str(path / "reference"))
    loaded = freetoken_plugin.load_model(str(path), cache_slots=12, device="cpu", dtype=torch.float32, progress=False)
    assert loaded._freetoken_handle.stats()["pool"]["format"] == "fp8"
    assert_computes_the_reference(loaded, ref, seed=6)


def test_a_missing_scale_of_an_fp8_expert_is_named_as_deepseek_v4_names_it(tmp_path):
    path = tmp_path / "v4"
    write_v4_checkpoint(tiny_v4(), path, fp8_experts=True)
    damage(str(path), lambda t: t.pop("model.layers.1.ffn.experts.0.w1.scale"))
    with pytest.raises(CheckpointError, match=re.escape("the checkpoint lacks model.layers.1.ffn.experts.0.w1.scale")):
        freetoken_plugin.load_model(str(path), cache_slots=12, device="cpu", progress=False)


def test_the_pool_holds_the_checkpoints_bytes(tmp_path):
    """Each expert's gate, up and down rows and scales in the host pool are the checkpoint's bytes:
    w1 then w3 in w13, never expanded."""
    path = v4_checkpoint(tmp_path)
    loaded = freetoken_plugin.load_model(path, cache_slots=12, device="cpu", progress=False)
    host = loaded._freetoken_handle.runtime.host
    stored = load_file(os.path.join(path, "model.safetensors"))
    inter = host.w13.shape[-2] // 2
    for layer, e in ((0, 0), (1, 7)):
        base = f"model.layers.{layer}.ffn.experts.{e}"
        w13 = torch.cat([stored[f"{base}.w1.weight"], stored[f"{base}.w3.weight"]]).view(torch.uint8)
        s13 = torch.cat([stored[f"{base}.w1.scale"], stored[f"{base}.w3.scale"]]).view(torch.uint8)
        assert torch.equal(host.w13[layer, e], w13) and torch.equal(host.w13_scale[layer, e], s13)
        assert torch.equal(host.w2[layer, e], stored[f"{base}.w2.weight"].view(torch.uint8))
        assert torch.equal(host.w2_scale[layer, e], stored[f"{base}.w2.scale"].view(torch.uint8))
        assert host.w13.shape[-2] == 2 * inter


def test_the_demo_runs_on_a_deepseek_v4_checkpoint(tmp_path, capsys):
    """`freetoken demo --model` on DeepSeek-V4's layout: its reference is the checkpoint dequantized
    (FP8 linears by the block rule, FP4 experts by MXFP4's), so the tokens are reported equal."""
    require("cpu", "expert_gemm")
    from freetoken_plugin.cli import main

    path = v4_checkpoint(tmp_path)
    assert main(["demo", "--device", "cpu", "--model", path, "--cache-slots", "12",
                 "--prompt-tokens", "10", "--new-tokens", "6"]) == 0
    assert re.search(r"greedy tokens\s+identical", capsys.readouterr().out)


def damage(path: str, change) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def set_config(path: str, **quantization) -> None:
    file = os.path.join(path, "config.json")
    config = json.load(open(file))
    config.pop("expert_dtype", None)
    config["quantization_config"].update(quantization)
    json.dump(config, open(file, "w"))


def test_damaged_fp4_experts_are_refused_by_name(tmp_path, monkeypatch):
    """Before the host pool exists (an FP8 expert under expert_dtype "fp4", a missing scale, scales
    of another dtype, a fused copy beside the per-expert tensors) or as the layer is read (a NaN
    scale), each in one line naming the tensor."""
    import ft_ops.slot_pool

    base = "model.layers.1.ffn.experts.3"

    def allocate(*args, **kwargs):
        raise AssertionError("the host pool was allocated before the checkpoint's problem was found")

    cases = [
        (lambda t: t.update({f"{base}.w3.weight": torch.zeros(32, 64, dtype=torch.float8_e4m3fn)}),
         f"{base}.w3.weight is torch.float8_e4m3fn, but this checkpoint's experts are FP4-packed (config.json's "
         "expert_dtype 'fp4', or int8 experts beside this one", True),
        (lambda t: t.update({f"{base}.w3.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}),
         f"{base}.w3.weight is torch.bfloat16, but this checkpoint's experts are FP4-packed", False),
        (lambda t: t.update({f"{base}.w1.weight": t[f"{base}.w1.weight"].view(torch.uint8)}),
         f"{base}.w1.weight is torch.uint8: FP4-packed experts are int8 tensors", True),
        (lambda t: t.pop(f"{base}.w2.scale"), f"the checkpoint lacks the scales of {base}.w2.weight ({base}.w2.scale)",
         False),
        (lambda t: t.update({f"{base}.w1.scale": t[f"{base}.w1.scale"].float()}),
         f"{base}.w1.scale is torch.float32: the scales of FP4 experts are float8_e8m0fnu", False),
        (lambda t: t.update({f"{base[:-2]}.gate_up_proj": torch.zeros(8, 64, 32, dtype=torch.int8)}),
         f"the checkpoint holds {base[:-2]}.gate_up_proj", False),
    ]
    for i, (change, message, explicit) in enumerate(cases):
        path = tmp_path / str(i)
        write_v4_checkpoint(tiny_v4(), path)
        damage(str(path), change)
        if explicit:
            set_config(str(path), expert_dtype="fp4")
        with monkeypatch.context() as m:
            m.setattr(ft_ops.slot_pool.HostPool, "allocate", allocate)
            with pytest.raises(CheckpointError, match=re.escape(message)):
                freetoken_plugin.load_model(str(path), cache_slots=12, device="cpu", progress=False)
    path = tmp_path / "nan"
    write_v4_checkpoint(tiny_v4(), path)
    damage(str(path), lambda t: t[f"{base}.w2.scale"].view(torch.uint8).__setitem__((0, 0), 0xFF))
    with pytest.raises(CheckpointError, match=re.escape(f"{base}.w2.scale holds e8m0 code 0xFF, which is NaN")):
        freetoken_plugin.load_model(str(path), cache_slots=12, device="cpu", progress=False)


def test_fp4_experts_under_a_float_label_are_refused(tmp_path):
    """int8 FP4 experts in a checkpoint whose config.json has no quantization_config are named, not
    converted."""
    path = v4_checkpoint(tmp_path)
    file = os.path.join(path, "config.json")
    config = json.load(open(file))
    del config["quantization_config"], config["expert_dtype"]
    json.dump(config, open(file, "w"))
    with pytest.raises(CheckpointError, match="is torch.float8_e4m3fn \\(FP8\\) in a checkpoint whose config.json has "
                                              "no FP8 quantization_config"):
        freetoken_plugin.load_model(path, cache_slots=12, device="cpu", progress=False)


def test_a_damaged_fp8_linear_is_named_as_the_checkpoint_names_it(tmp_path):
    """A DeepSeek-V4 FP8 linear whose `.scale` is missing or of the wrong shape is named by the
    checkpoint's own names (`layers.0.attn.wq_a`), not the model's (`self_attn.q_a_proj`)."""
    for case, change, message in (
            ("missing", lambda t: t.pop("model.layers.0.attn.wq_a.scale"),
             "model.layers.0.attn.wq_a.weight is FP8 but the checkpoint lacks its scales "
             "(model.layers.0.attn.wq_a.weight_scale_inv; model.layers.0.attn.wq_a.scale as DeepSeek-V4 names them, "),
            ("shape", lambda t: t.update({"model.layers.0.attn.wq_a.scale": torch.ones(3, 1).to(E8M0)}),
             "model.layers.0.attn.wq_a.scale is torch.float8_e8m0fnu (3, 1), expected the block scales")):
        path = tmp_path / case
        write_v4_checkpoint(tiny_v4(), path)
        damage(str(path), change)
        with pytest.raises(CheckpointError, match=re.escape(message)):
            freetoken_plugin.load_model(str(path), cache_slots=12, device="cpu", progress=False)


def test_a_missing_expert_tensor_is_named(tmp_path):
    """One projection of expert 0 missing (the others there): that tensor is named as missing."""
    path = v4_checkpoint(tmp_path)
    damage(path, lambda t: t.pop("model.layers.1.ffn.experts.0.w1.weight"))
    with pytest.raises(CheckpointError, match=re.escape("the checkpoint lacks model.layers.1.ffn.experts.0.w1.weight")):
        freetoken_plugin.load_model(path, cache_slots=12, device="cpu", progress=False)
