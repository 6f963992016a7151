"""load_model on compressed-tensors FP8 checkpoints (quant_method "compressed-tensors", format
"float-quantized", as llm-compressor saves its FP8_BLOCK, FP8 and FP8_DYNAMIC schemes): every
quantized linear float8_e4m3fn `<linear>.weight` with its multiplier `<linear>.weight_scale`, the
experts per expert. The experts stay FP8 from file to slot: block and tensor scales in the FP8
pool, row ("channel") scales, which have no place in its 128 x 128 grid, in the fp8_rows pool (one
float32 scale a row). Greedy tokens equal the same model with every FP8 weight dequantized
(q * scale), in float32."""
import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import freetoken_plugin
from freetoken_plugin import CheckpointError
from freetoken_plugin.offload import find_experts
from ft_ops import formats
from helpers import require
from test_loader_fp8 import assert_computes_the_reference, put_reference_weights, quantizable, random_qwen3_moe

FP8_MAX = 448.0


def quantize(t: torch.Tensor, strategy: str, scale_dtype: torch.dtype):
    """(q, stored scale, the weight they mean) of float weight t by one scale a 128 x 128 block, a
    tensor or a row (amax / 448 each, as llm-compressor's min-max observer gives; the scale rounded
    to its stored dtype before q is computed, so that q * scale is what the checkpoint means)."""
    t = t.float()
    if strategy == "block":
        q, s = formats.quantize_fp8(t)
        s = s.to(scale_dtype)
        return q, s, formats.dequantize_fp8(q, s.float())
    amax = t.abs().amax() if strategy == "tensor" else t.abs().amax(dim=1, keepdim=True)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    if strategy == "tensor":
        s = s.reshape(1)
    q = (t / s.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s, q.float() * s.float()


def quantization_config(strategies):
    """compressed-tensors' quantization_config: one group a strategy, (experts, others) when two."""
    targets = [["re:.*experts.*"], ["re:.*self_attn.*"]] if len(strategies) == 2 else [["Linear"]]
    groups = {}
    for i, (strategy, target) in enumerate(zip(strategies, targets)):
        weights = {"dynamic": False, "group_size": None, "num_bits": 8, "observer": "memoryless_minmax",
                   "strategy": strategy, "symmetric": True, "type": "float"}
        activations = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token", "symmetric": True,
                       "type": "float"}
        if strategy == "block":  # (compressed-tensors 0.20 writes block_structure only where it is set)
            weights["block_structure"] = [128, 128]
            activations.update(strategy="group", group_size=128)
        groups[f"group_{i}"] = {"format": "float-quantized", "input_activations": activations,
                                "output_activations": None, "targets": target, "weights": weights}
    # The keys llm-compressor 0.14 / compressed-tensors 0.20.1 write for FP8_DYNAMIC and FP8_BLOCK (the
    # ignore list holds module names there: the loader does not read it).
    return {"config_groups": groups, "format": "float-quantized", "global_compression_ratio": None,
            "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None, "moe_sparsity_config": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": "0.20.1"}


def write_compressed_tensors_checkpoint(model, path, strategies, scale_dtype=torch.bfloat16):
    """Saves `model` (per-expert tensors), then rewrites each quantizable weight as FP8 + weight_scale
    by the experts' strategy (strategies[0]) or the other linears' (strategies[-1]). Returns the model
    with those weights replaced by what they mean (the reference)."""
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out = {}
    meant = {}
    for name, t in tensors.items():
        # (routers stay float, as llm-compressor's recipes ignore them: Mixtral's block_sparse_moe.gate too)
        if not (name.endswith(".weight") and quantizable(name, t)) or name.endswith(".gate.weight"):
            out[name] = t
            continue
        strategy = strategies[0] if ".experts." in name else strategies[-1]
        q, s, w = quantize(t, strategy, scale_dtype)
        out[name], out[name[:-len("weight")] + "weight_scale"] = q, s
        meant[name] = w
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(strategies)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return put_reference_weights(model, meant)


@pytest.mark.parametrize("strategies,pool", [(("block",), "fp8"), (("tensor",), "fp8"), (("channel",), "fp8_rows"),
                                             (("block", "channel"), "fp8"), (("channel", "block"), "fp8_rows")],
                         ids=["block", "tensor", "channel", "block-experts-channel-attention",
                              "channel-experts-block-attention"])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (160, 192)])
def test_compressed_tensors_fp8_generates_the_dequantized_models_tokens(tmp_path, strategies, pool, hidden, inter):
    require("cpu", "expert_gemm")
    model = random_qwen3_moe(hidden, dense=96, inter=inter)
    ref = write_compressed_tensors_checkpoint(model, tmp_path, strategies)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == pool and host.w13.dtype == torch.float8_e4m3fn
    # the checkpoint's bytes, as stored
    q = load_file(os.path.join(tmp_path, "model.safetensors"))["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(host.w13[1, 3, inter:].view(torch.uint8), q.view(torch.uint8))
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert_computes_the_reference(loaded, ref, seed=7)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v3"])
@pytest.mark.parametrize("strategy,pool", [("block", "fp8"), ("channel", "fp8_rows")])
def test_other_families_load_with_their_own_expert_names(tmp_path, arch, strategy, pool):
    """Mixtral's w1 / w3 / w2 experts, Qwen2-MoE's shared expert and its gate, OLMoE, DeepSeek-V3's
    shared experts, dense first layer and MLA projections: the dequantized model's tokens."""
    require("cpu", "expert_gemm")
    from freetoken_plugin.tiny import tiny_model

    ref = write_compressed_tensors_checkpoint(tiny_model(arch), tmp_path, (strategy,))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert loaded._freetoken_handle.runtime.host.shape.format == pool
    assert_computes_the_reference(loaded, ref, seed=5)


def stored_tensors(path) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def assert_pool_holds_the_checkpoints_experts(host, stored) -> None:
    """Every expert of the fp8_rows pool is the checkpoint's: its FP8 bytes as stored, each scale the
    stored one in float32 (exact from bf16), a tensor scale in every row of its weight."""
    I = host.shape.intermediate
    for layer in range(host.shape.layers):
        for e in range(host.shape.experts):
            base = f"model.layers.{layer}.mlp.experts.{e}"
            for proj, weight, scale in (("gate_proj", host.w13[layer, e, :I], host.w13_scale[layer, e, :I]),
                                        ("up_proj", host.w13[layer, e, I:], host.w13_scale[layer, e, I:]),
                                        ("down_proj", host.w2[layer, e], host.w2_scale[layer, e])):
                q, s = stored[f"{base}.{proj}.weight"], stored[f"{base}.{proj}.weight_scale"]
                assert torch.equal(weight.view(torch.uint8), q.view(torch.uint8)), f"{base}.{proj}.weight"
                assert torch.equal(scale, s.float().reshape(-1).expand(scale.shape)), f"{base}.{proj}.weight_scale"


def rescaled_experts(path, names, strategy: str) -> dict:
    """Rewrites the FP8 weights `names` of the checkpoint at `path` with `strategy`'s scales (the
    weights they mean, quantized again). Returns what the rewritten weights mean, by name."""
    tensors = stored_tensors(path)
    meant = {}
    for name in names:
        w = tensors[name].float() * tensors[name + "_scale"].float()
        tensors[name], tensors[name + "_scale"], meant[name] = quantize(w, strategy, torch.bfloat16)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return meant


def test_row_scaled_experts_stay_fp8_in_the_fp8_rows_pool(tmp_path):
    """FP8_DYNAMIC's experts go from file to pool as stored: the FP8 bytes and one float32 scale a
    row, about half a bf16 pool's bytes (a quarter of the float32 pool this model would need)."""
    require("cpu", "expert_gemm")
    ref = write_compressed_tensors_checkpoint(random_qwen3_moe(160, dense=96, inter=192), tmp_path, ("channel",))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "fp8_rows"
    assert host.w13_scale.shape == (2, 8, 2 * 192) and host.w2_scale.shape == (2, 8, 160)
    assert_pool_holds_the_checkpoints_experts(host, stored_tensors(tmp_path))
    bf16 = dataclasses.replace(host.shape, format=formats.DENSE, dtype=torch.bfloat16)
    assert host.nbytes / (bf16.expert_bytes * bf16.layers * bf16.experts) == pytest.approx(0.5, abs=0.02)
    assert_computes_the_reference(loaded, ref, seed=11)


def test_tensor_scaled_experts_fill_every_row_of_the_fp8_rows_pool(tmp_path):
    """Experts with one scale a weight beside row-scaled ones (the config declaring both) go to the
    fp8_rows pool with that scale in each of their rows: exact, and the model computes what they mean."""
    require("cpu", "expert_gemm")
    ref = write_compressed_tensors_checkpoint(random_qwen3_moe(160, dense=96, inter=192), tmp_path,
                                              ("channel", "tensor"))
    names = [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in (2, 5) for p in ("gate_proj", "up_proj", "down_proj")]
    put_reference_weights(ref, rescaled_experts(tmp_path, names, "tensor"))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "fp8_rows"
    assert_pool_holds_the_checkpoints_experts(host, stored_tensors(tmp_path))
    assert torch.all(host.w2_scale[1, 2] == host.w2_scale[1, 2, 0])  # (checked against the file above)
    assert_computes_the_reference(loaded, ref, seed=13)


def test_save_pretrained_writes_the_row_scaled_experts_dequantized(tmp_path):
    """save_pretrained of the loaded model writes its fp8_rows experts as the model computes them,
    q * the scale of their row in the model's dtype: from_pretrained reads back the reference."""
    require("cpu", "expert_gemm")
    import transformers as tf

    ref = write_compressed_tensors_checkpoint(random_qwen3_moe(64, dense=96, inter=32), tmp_path / "ct", ("channel",))
    loaded = freetoken_plugin.load_model(str(tmp_path / "ct"), cache_slots=16, device="cpu", progress=False)
    loaded.save_pretrained(tmp_path / "saved")
    saved = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for (_, got), (_, want) in zip(find_experts(saved), find_experts(ref)):
        assert torch.equal(got.gate_up_proj, want.gate_up_proj) and torch.equal(got.down_proj, want.down_proj)


def test_quantize_fp8_on_row_scaled_experts_changes_nothing(tmp_path):
    """Row-scaled experts are FP8 already: quantize="fp8" keeps them as stored, as it keeps a
    block-FP8 checkpoint's."""
    require("cpu", "expert_gemm")
    ref = write_compressed_tensors_checkpoint(random_qwen3_moe(64, dense=96, inter=32), tmp_path, ("channel",))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False, quantize="fp8")
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "fp8_rows"
    assert_pool_holds_the_checkpoints_experts(host, stored_tensors(tmp_path))
    assert_computes_the_reference(loaded, ref, seed=3)


def test_the_demos_reference_copy_dequantizes_every_scale_kind(tmp_path):
    """write_dequantized_copy (the demo's reference) reads tensor and row scales too: transformers
    loads the copy as the dequantized model."""
    import transformers as tf
    from freetoken_plugin.loader import write_dequantized_copy

    model = random_qwen3_moe(64, dense=96, inter=32)
    ref = write_compressed_tensors_checkpoint(model, tmp_path / "ct", ("tensor", "channel"))
    write_dequantized_copy(str(tmp_path / "ct"), str(tmp_path / "copy"), torch.float32)
    copy = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.float32)
    for name, value in ref.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value), name


def checkpoint_with(tmp_path, quant=None, strategies=("block",)):
    model = random_qwen3_moe(64, dense=96, inter=32)
    write_compressed_tensors_checkpoint(model, tmp_path, strategies)
    if quant is not None:
        path = os.path.join(tmp_path, "config.json")
        config = json.load(open(path))
        config["quantization_config"] = quant
        json.dump(config, open(path, "w"))
    return str(tmp_path)


def test_schemes_it_does_not_read_are_refused_in_one_line(tmp_path):
    path = checkpoint_with(tmp_path)
    base = quantization_config(("block",))
    group = base["config_groups"]["group_0"]

    def variant(**changes):
        quant = json.loads(json.dumps(base))
        for key, value in changes.items():
            where, _, leaf = key.rpartition("__")
            target = quant
            for part in where.split("__") if where else []:
                target = target[part]
            target[leaf] = value
        return quant

    w = "config_groups__group_0__weights__"
    cases = [(variant(**{w + "num_bits": 4, w + "type": "int"}), "4-bit int weights"),
             (variant(config_groups__group_0__format="pack-quantized"), "format 'pack-quantized'"),
             (variant(**{w + "symmetric": False}), "asymmetric"),
             (variant(**{w + "block_structure": [64, 64]}), r"block_structure \[64, 64\]"),
             (variant(**{w + "strategy": "group", w + "group_size": 32}), "weight strategy 'group'"),
             (variant(**{"config_groups__group_0__input_activations": dict(group["input_activations"], dynamic=False)}),
              "static input_activations"),
             (variant(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
             (variant(quantization_status="frozen"), "quantization_status 'frozen'"),
             (variant(config_groups={}), "no config_groups"),
             (variant(**{w + "dynamic": True}), "dynamic weight scales"),
             (variant(**{"config_groups__group_0__output_activations": dict(group["input_activations"])}),
              "quantizes its output activations"),
             (variant(moe_sparsity_config={"sparsity_structure": "2:4"}), "moe_sparsity_config"),
             (variant(config_groups__group_0__weights=None), "has no weights scheme"),
             (variant(config_groups__group_0__format="naive-quantized", **{w + "type": "int"}), "8-bit int weights")]
    for quant, match in cases:
        json.dump(dict(json.load(open(os.path.join(path, "config.json"))), quantization_config=quant),
                  open(os.path.join(path, "config.json"), "w"))
        with pytest.raises(CheckpointError, match=match) as error:
            freetoken_plugin.load_model(path, device="cpu", progress=False)
        assert "\n" not in str(error.value) and "load_model reads compressed-tensors FP8" in str(error.value)


def test_weight_only_fp8_saved_naive_quantized_loads(tmp_path):
    """Weight-only FP8 (no input_activations) is saved "naive-quantized": the same FP8 bytes."""
    require("cpu", "expert_gemm")
    quant = quantization_config(("channel",))
    quant["format"] = quant["config_groups"]["group_0"]["format"] = "naive-quantized"
    quant["config_groups"]["group_0"]["input_activations"] = None
    model = random_qwen3_moe(64, dense=96, inter=32)
    ref = write_compressed_tensors_checkpoint(model, tmp_path, ("channel",))
    config = json.load(open(tmp_path / "config.json"))
    json.dump(dict(config, quantization_config=quant), open(tmp_path / "config.json", "w"))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert_computes_the_reference(loaded, ref, seed=3)


def test_a_row_scale_in_a_block_checkpoint_is_refused_by_its_name(tmp_path):
    """A scale of a kind the config does not declare (a row scale under the block strategy) is
    refused before the pool exists, naming the checkpoint's tensor and the grid it should be."""
    path = checkpoint_with(tmp_path, strategies=("channel",))
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = quantization_config(("block",))
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.\S+\.weight_scale is torch\.bfloat16 \(\d+, 1\), "
                                              r"expected the block scales \(1, 1\)"):
        freetoken_plugin.load_model(path, device="cpu", progress=False)


def test_a_missing_expert_scale_is_named_as_the_checkpoint_spells_it(tmp_path):
    path = checkpoint_with(tmp_path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.experts.5.down_proj.weight_scale"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight_scale$"):
        freetoken_plugin.load_model(path, device="cpu", progress=False)


def test_row_scaled_experts_beyond_host_memory_are_refused_without_pointing_to_quantize(tmp_path, monkeypatch):
    """The fp8_rows pool beyond the host's memory is refused saying what it needs, without pointing
    to quantize='fp8' (its experts are FP8 already: it would change nothing)."""
    from freetoken_plugin import host_memory

    path = checkpoint_with(tmp_path, strategies=("channel",))
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 2**16)
    with pytest.raises(host_memory.HostMemoryError, match=r"fp8_rows experts, .*\) and this machine has 64\.0 KiB of "
                                                         r"host memory available: free host memory") as error:
        freetoken_plugin.load_model(path, device="cpu", progress=False)
    assert "quantize=" not in str(error.value)


def test_scale_kinds_are_told_apart_by_exact_shapes_first():
    """A row scale [R, 1] squeezed is also a block grid [1, R] where R = ceil(C/128): exact shapes
    decide, a squeezed shape only where one kind alone fits it."""
    from freetoken_plugin.fp8_scales import scale_kind

    both = frozenset({"block", "channel"})
    f32 = torch.float32
    assert scale_kind(f32, (16, 1), (16, 2048), both) == "channel"
    assert scale_kind(f32, (16,), (16, 2048), both) == "channel"
    assert scale_kind(f32, (1, 16), (16, 2048), both) == "block"
    assert scale_kind(f32, (1, 16), (16, 2048), frozenset({"channel"})) == "channel"  # one kind fits it
    assert scale_kind(f32, (300, 1), (300, 256), both) == "channel"
    assert scale_kind(f32, (3, 2), (300, 256), both) == "block"
    assert scale_kind(f32, (1,), (300, 256), frozenset({"tensor", "block"})) == "tensor"
    assert scale_kind(f32, (1,), (300, 256), both) is None
    assert scale_kind(torch.uint8, (3, 2), (300, 256), both) is None
    assert scale_kind(f32, (16,), (16, 2048), frozenset({"block"})) == "block"
    # A squeezed shape two kinds fit is refused: [1, 1, 16] is the grid [1, 16] and the rows [16, 1].
    assert scale_kind(f32, (1, 1, 16), (16, 2048), both) is None


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_damaged_experts_are_refused_by_name_before_the_pool_exists(tmp_path, monkeypatch, strategy):
    """Each check of the experts' fill (FP8 or fp8_rows pool) runs on the headers first."""
    from freetoken_plugin import loader as loader_mod

    path = checkpoint_with(tmp_path, strategies=(strategy,))
    file = os.path.join(path, "model.safetensors")
    good = load_file(file)
    expert = "model.layers.1.mlp.experts.2.down_proj"
    attention = "model.layers.0.self_attn.o_proj"
    monkeypatch.setattr(loader_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))
    # (the kinds the config allows, each with its shape: o_proj and down_proj are [64, 32])
    expected = (r"expected the block scales \(1, 1\)" if strategy == "block"
                else r"expected one scale a row \(channel\) \(64, 1\)$")
    for change, message in [
            (lambda t: t.update({f"{expert}.weight": t[f"{expert}.weight"].float()}),
             f"{expert}.weight_scale is beside torch.float32 {expert}.weight; in a compressed-tensors FP8"),
            (lambda t: (t.pop(f"{expert}.weight_scale"), t.update({f"{expert}.weight": t[f"{expert}.weight"].float()})),
             f"{expert}.weight is torch.float32 in an FP8 checkpoint, whose experts share one pool"),
            (lambda t: t.update({f"{expert}.weight": t[f"{expert}.weight"][:, :16].contiguous()}),
             f"{expert}.weight: checkpoint shape"),
            (lambda t: t.update({f"{expert}.weight_scale": torch.ones(64, 2, dtype=torch.bfloat16)}),
             rf"{expert}.weight_scale is torch.bfloat16 \(64, 2\), {expected}"),
            (lambda t: t.update({f"{attention}.weight_scale": torch.ones(64, 2, dtype=torch.bfloat16)}),
             rf"{attention}.weight_scale is torch.bfloat16 \(64, 2\), {expected}"),
            (lambda t: t.update({f"{expert}.weight_zero_point": torch.zeros(64, 1)}),
             f"{expert}.weight_zero_point belongs to a scheme load_model does not apply"),
            (lambda t: t.update({f"{attention}.input_scale": torch.ones(1)}),
             f"{attention}.input_scale belongs to a scheme")]:
        tensors = dict(good)
        change(tensors)
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=message):
            freetoken_plugin.load_model(path, device="cpu", progress=False)
        with pytest.raises(CheckpointError, match=message):
            freetoken_plugin.loader.check_checkpoint(path)  # the headers alone: what demo and generate check first


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_non_finite_scales_and_nan_codes_are_refused(tmp_path, strategy):
    """An inf scale, and an e4m3fn NaN code (0x7f or 0xff) among the experts' bytes (read as stored
    into the fp8_rows or FP8 pool), are refused by the tensor's name."""
    path = checkpoint_with(tmp_path, strategies=(strategy,))
    file = os.path.join(path, "model.safetensors")
    good = load_file(file)
    expert = "model.layers.1.mlp.experts.4.gate_proj"
    scale = good[f"{expert}.weight_scale"].clone()
    scale.view(-1)[0] = float("inf")
    save_file(dict(good, **{f"{expert}.weight_scale": scale}), file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{expert}.weight_scale holds 1 non-finite scale"):
        freetoken_plugin.load_model(path, device="cpu", progress=False)
    weight = good[f"{expert}.weight"].clone()
    weight.view(torch.uint8)[0, 0], weight.view(torch.uint8)[1, 3] = 0x7F, 0xFF
    save_file(dict(good, **{f"{expert}.weight": weight}), file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{expert}.weight holds 2 FP8 NaN codes: the checkpoint is damaged"):
        freetoken_plugin.load_model(path, device="cpu", progress=False)


@pytest.mark.parametrize("first,later,message", [
    ("block", "channel", r"holds one scale a row \(32, 1\), while the first MoE layer's experts have block"),
    ("channel", "block", r"holds block scales \(1, 1\), while the first MoE layer's experts have one scale a row: "
                         r"their pool is fp8_rows")], ids=["rows-after-blocks", "blocks-after-rows"])
def test_experts_whose_scales_change_kind_across_layers_are_refused_by_name(tmp_path, first, later, message):
    """The pool's format comes from the first MoE layer (block scales: fp8, row scales: fp8_rows),
    and a pool holds one format: a later layer's experts with the other kind are refused by name."""
    path = checkpoint_with(tmp_path, strategies=(later,))
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = quantization_config(("block", "channel"))
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    rescaled_experts(path, [k for k in stored_tensors(path)
                            if k.startswith("model.layers.0.mlp.experts.") and k.endswith(".weight")], first)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight_scale " + message):
        freetoken_plugin.load_model(path, device="cpu", progress=False)


def test_llama4_maverick_layout_loads_its_row_scaled_experts(tmp_path):
    """Llama 4 Maverick's FP8 release as compressed-tensors stores it: the multimodal model's names
    (language_model.model.), the routed experts per expert (feed_forward.experts.<e>.gate_proj /
    up_proj / down_proj, where transformers' own checkpoints fuse them as experts.gate_up_proj [E, H,
    2I]) with one scale a row, the shared expert and attention unquantized: an fp8_rows pool holding
    the checkpoint's bytes, and the tokens and logits of the model with each expert weight replaced
    by what it means. I differs from H, so a transposed or swapped projection fails."""
    require("cpu", "expert_gemm")
    from safetensors.torch import save_file
    from test_llama4 import generate, prompt, tiny_llama4

    model = tiny_llama4("Llama4ForConditionalGeneration", num_experts_per_tok=1, intermediate_size=96)
    model.save_pretrained(tmp_path)
    tensors, stored = stored_tensors(tmp_path), {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name] = t
            continue
        base, inter = name.rsplit(".", 1)[0], t.shape[-1] // 2
        meant = torch.empty_like(t)
        for e in range(t.shape[0]):  # nn.Linear's [out, in] per projection
            projections = ({"gate_proj": t[e, :, :inter].T, "up_proj": t[e, :, inter:].T} if name.endswith("gate_up_proj")
                           else {"down_proj": t[e].T})
            for proj, w in projections.items():
                q, s, w_meant = quantize(w.contiguous(), "channel", torch.bfloat16)
                stored[f"{base}.{e}.{proj}.weight"], stored[f"{base}.{e}.{proj}.weight_scale"] = q, s
                if proj == "gate_proj":
                    meant[e, :, :inter] = w_meant.T
                elif proj == "up_proj":
                    meant[e, :, inter:] = w_meant.T
                else:
                    meant[e] = w_meant.T
        model.get_parameter(name).data.copy_(meant)  # the reference: what the checkpoint means
    save_file(stored, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(quantization_config(("channel",)), ignore=["re:.*vision.*", "lm_head"])
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:.*experts.*"]
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)

    with pytest.warns(UserWarning, match="have no place in Llama4ForCausalLM"):  # (the vision tower)
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=8, device="cpu", progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "fp8_rows" and host.shape.intermediate == 96
    q = stored["language_model.model.layers.1.feed_forward.experts.5.up_proj.weight"]
    assert torch.equal(host.w13[1, 5, 96:].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(generate(loaded), generate(model))
    with torch.no_grad():
        got, want = loaded(prompt()).logits, model(prompt()).logits
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_glm4_moe_loads_its_row_scaled_experts(tmp_path):
    """GLM-4.5's architecture (zai-org's GLM-4.5-Air-FP8 is FP8_DYNAMIC): sigmoid routing with a
    score-correction bias, a shared expert, the first layer dense, partial rotary; its experts in the
    fp8_rows pool, the dequantized model's tokens."""
    require("cpu", "expert_gemm")
    import transformers as tf
    from freetoken_plugin.tiny import TINY, random_weights

    config = tf.Glm4MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, head_dim=16,
                              n_group=1, topk_group=1)
    torch.manual_seed(0)
    model = random_weights(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    ref = write_compressed_tensors_checkpoint(model, tmp_path, ("channel",))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert loaded._freetoken_handle.runtime.host.shape.format == "fp8_rows"
    assert_computes_the_reference(loaded, ref, seed=5)
