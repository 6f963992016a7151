"""load_model on int4 (W4A16, symmetric) checkpoints: compressed-tensors' "pack-quantized"
(llm-compressor's W4A16: weight_packed int32 [out, in/8], weight_scale [out, in/G], weight_shape)
and GPTQ (qweight int32 [in/8, out] packed along the input, scales [in/G, out], qzeros, g_idx), each
written here in its exact layout (the packing of compressed_tensors' pack_to_int32 and of
AutoGPTQ's QuantLinear.pack, written out independently of the loader). The experts go into an int4
host pool as stored (codes and scales bit-equal), the other int4 linears are dequantized on load, and
the model computes what the same model with every int4 weight dequantized computes, in float32."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import freetoken_plugin
from freetoken_plugin import CheckpointError
from ft_ops import formats
from helpers import require
from test_loader_fp8 import assert_computes_the_reference, put_reference_weights, random_qwen3_moe

GROUP = 32


def quantized(w: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """(codes uint8 [out, in/2] in the pool's layout, scales float32 [out, ceil(in/G)] as stored in
    `scale_dtype`, the weight they mean) of float weight w [out, in], by formats.quantize_int4; where
    G does not divide in, the last group is short (as GPTQ and compressed-tensors write it: the row
    quantized as if padded with zeros, the padding dropped)."""
    inp = w.shape[1]
    padded = torch.nn.functional.pad(w.float(), (0, -inp % group))
    codes, scales = formats.quantize_int4(padded, group)
    scales = scales.to(scale_dtype).float()
    return codes[:, :inp // 2].contiguous(), scales, formats.dequantize_int4(codes, scales)[:, :inp].contiguous()


def signed_values(codes: torch.Tensor) -> torch.Tensor:
    """The int4 values (code - 8) of pool-layout codes [out, in/2], int64 [out, in]."""
    b = codes.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2) - 8


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 (two's complement), as numpy's uint32 view."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_to_int32(values: torch.Tensor) -> torch.Tensor:
    """compressed_tensors' pack_to_int32 for 4 bits, packed_dim 1: the unsigned value + 8, eight a
    word along the row, element i in bits 4i."""
    unsigned = values + 8
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= unsigned[:, i::8] << (4 * i)
    return to_int32(words)


def gptq_pack(values: torch.Tensor, scales: torch.Tensor, group: int, zero_stored: int):
    """AutoGPTQ's QuantLinear.pack of weight values [out, in] (signed, zero 8): qweight [in/8, out]
    (intweight = values + 8 transposed, eight inputs a word, input 8r + j in bits 4j), qzeros
    [in/G, out/8] (the zero as stored, eight outputs a word), scales [in/G, out] float16, g_idx."""
    out, inp = values.shape
    intweight = (values + 8).T.contiguous()  # [in, out]
    qweight = torch.zeros(inp // 8, out, dtype=torch.int64)
    for j in range(8):
        qweight |= intweight[j::8] << (4 * j)
    groups = -(-inp // group)  # (the last group short where G does not divide in)
    zeros = torch.full((groups, out), zero_stored, dtype=torch.int64)
    qzeros = torch.zeros(groups, out // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= zeros[:, j::8] << (4 * j)
    g_idx = torch.tensor([i // group for i in range(inp)], dtype=torch.int32)
    return to_int32(qweight), scales.T.contiguous().half(), to_int32(qzeros), g_idx


def is_linear(name: str, t: torch.Tensor, experts_only: bool) -> bool:
    """The linears the checkpoints quantize: the experts, and (unless `experts_only`) attention's
    projections; never embeddings, norms, routers or the LM head."""
    if not name.endswith(".weight") or t.dim() != 2:
        return False
    if ".experts." in name:
        return True
    return not experts_only and ".self_attn." in name


def ct_config(group, strategy="group", experts_only=False, **weights):
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False,
            "group_size": group if strategy == "group" else None, "actorder": None, "observer": "minmax",
            "block_structure": None, **weights}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", "re:.*mlp.gate$"] + (["re:.*self_attn.*"] if experts_only else []),
            "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}


def gptq_config(group, checkpoint_format="gptq", **changes):
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "lm_head": False,
            "checkpoint_format": checkpoint_format, **changes}


def write_int4_checkpoint(model, path, family: str, group: int = GROUP, experts_only: bool = False,
                          zero_stored: int = 7, scale_dtype=torch.bfloat16, strategy: str = "group", quant=None,
                          group_of=None):
    """Saves `model` (per-expert tensors), then rewrites each quantized linear in `family`'s int4
    layout (`group_of(name)`, where given, each linear's group size: 0 a row). Returns (the model
    with those weights replaced by what they mean, {weight name: (codes, float32 scales)})."""
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    out, meant, stored = {}, {}, {}
    for name, t in tensors.items():
        if not is_linear(name, t, experts_only):
            out[name] = t
            continue
        g = t.shape[1] if strategy == "channel" else group
        if group_of is not None:
            g = group_of(name) or t.shape[1]
        codes, scales, w = quantized(t, g, scale_dtype if family == "ct" else torch.float16)
        stem = name[:-len("weight")]
        if family == "ct":
            out[stem + "weight_packed"] = pack_to_int32(signed_values(codes))
            out[stem + "weight_scale"] = scales.to(scale_dtype)
            out[stem + "weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        else:
            qweight, scales16, qzeros, g_idx = gptq_pack(signed_values(codes), scales, g, zero_stored)
            out.update({stem + "qweight": qweight, stem + "scales": scales16, stem + "qzeros": qzeros,
                        stem + "g_idx": g_idx})
        meant[name], stored[name] = w, (codes, scales)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quant or (ct_config(group, strategy, experts_only) if family == "ct"
                                              else gptq_config(-1 if strategy == "channel" else group,
                                                               "gptq_v2" if zero_stored == 8 else "gptq"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return put_reference_weights(model, meant), stored


def assert_pool_holds_the_stored_experts(host, stored) -> None:
    """Every expert's codes and scales in the int4 pool are the checkpoint's, bit for bit."""
    I = host.shape.intermediate
    for layer in range(host.shape.layers):
        for e in range(host.shape.experts):
            for name, (codes, scales) in stored.items():
                if f"layers.{layer}." not in name or f".experts.{e}." not in name:
                    continue
                proj = name.split(".")[-2]
                rows = {"gate_proj": slice(0, I), "w1": slice(0, I), "up_proj": slice(I, 2 * I), "w3": slice(I, 2 * I)}
                if proj in rows:
                    w, s = host.w13[layer, e, rows[proj]], host.w13_scale[layer, e, rows[proj]]
                else:
                    w, s = host.w2[layer, e], host.w2_scale[layer, e]
                assert torch.equal(w, codes), name
                assert torch.equal(s, scales.repeat_interleave(s.shape[1] // scales.shape[1], dim=1)), name


def load(path, **kw):
    return freetoken_plugin.load_model(str(path), cache_slots=16, device="cpu", progress=False, **kw)


def assert_logits_match(loaded, ref) -> None:
    """One forward of a 12-token prompt: the reference's logits within float32 rounding (the
    cheaper check of the variants; the tests above also compare greedy tokens)."""
    prompt = torch.randint(2, ref.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = loaded(prompt).logits, ref(prompt).logits
    assert float((got - want).norm() / want.norm()) < 1e-5


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One checkpoint of each family (a tiny Qwen3-MoE, attention int4 too), written once for the
    module: {family: (path, reference, stored codes and scales)}."""
    from freetoken_plugin.tiny import tiny_model

    out = {}
    for family in ("ct", "gptq"):
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, *write_int4_checkpoint(tiny_model("qwen3_moe"), path, family))
    return out


def copy_of(written, family, tmp_path):
    shutil.copytree(written[family][0], tmp_path / family)
    return tmp_path / family


@pytest.mark.parametrize("family", ["ct", "gptq"])
def test_int4_checkpoint_loads_its_codes_computes_the_dequantized_model_and_saves_it(tmp_path, written, family):
    """(a) the int4 pool holds the stored codes and scales, bit for bit; (b) the dequantized model's
    greedy tokens and logits; attention's int4 linears are dequantized to float32 on load; (d)
    save_pretrained writes the experts dequantized in the model's dtype: from_pretrained reads back
    the reference's weights."""
    require("cpu", "expert_gemm")
    import transformers as tf

    path, ref, stored = written[family]
    loaded = load(path)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "int4" and host.shape.group == GROUP and host.w13.dtype == torch.uint8
    assert_pool_holds_the_stored_experts(host, stored)
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    assert_computes_the_reference(loaded, ref, seed=7)
    loaded.save_pretrained(tmp_path / "saved")
    saved = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for name, value in ref.state_dict().items():
        assert torch.equal(saved.state_dict()[name], value), name


@pytest.mark.slow  # (about 5 s: Mixtral's w1 / w3 / w2 names, I = 96 != H)
@pytest.mark.parametrize("family", ["ct", "gptq"])
def test_mixtral_int4_checkpoint_computes_the_dequantized_model(tmp_path, family):
    require("cpu", "expert_gemm")
    from freetoken_plugin.tiny import tiny_model

    ref, stored = write_int4_checkpoint(tiny_model("mixtral"), tmp_path, family)
    loaded = load(tmp_path)
    assert_pool_holds_the_stored_experts(loaded._freetoken_handle.runtime.host, stored)
    assert_computes_the_reference(loaded, ref, seed=7)


def assert_logits_match(loaded, ref) -> None:
    """One forward of a 12-token prompt: the reference's logits within float32 rounding (the
    cheaper check of the variants)."""
    prompt = torch.randint(2, ref.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = loaded(prompt).logits, ref(prompt).logits
    assert float((got - want).norm() / want.norm()) < 1e-5


VARIANTS = {"gptq_v2": dict(family="gptq", zero_stored=8),
            # attention left float (ignored, as Kimi-K2-Thinking's non-expert weights are), float16 scales
            "ct-experts-only": dict(family="ct", experts_only=True, scale_dtype=torch.float16),
            # one scale a row (GPTQ's group_size -1): G = in; the pool's group is the common one of gate
            # (in = H = 64) and down (in = I = 32), each row scale repeated: exact
            "ct-channel": dict(family="ct", strategy="channel"),
            "gptq-channel": dict(family="gptq", strategy="channel")}


@pytest.mark.parametrize("variant", ["ct-channel", pytest.param("gptq_v2", marks=pytest.mark.slow),
                                     pytest.param("ct-experts-only", marks=pytest.mark.slow),
                                     pytest.param("gptq-channel", marks=pytest.mark.slow)])
def test_checkpoint_variants_load_their_codes_and_compute_the_dequantized_model(tmp_path, variant):
    require("cpu", "expert_gemm")
    from freetoken_plugin.tiny import tiny_model

    ref, stored = write_int4_checkpoint(tiny_model("qwen3_moe", seed=1), tmp_path, **VARIANTS[variant])
    if variant == "ct-experts-only":
        assert "model.layers.0.self_attn.q_proj.weight" in load_file(tmp_path / "model.safetensors")
    loaded = load(tmp_path)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "int4" and host.shape.group == 32
    assert_pool_holds_the_stored_experts(host, stored)
    assert_logits_match(loaded, ref)


def test_the_demos_reference_copy_dequantizes_int4_linears(tmp_path, written):
    import transformers as tf
    from freetoken_plugin.loader import write_dequantized_copy

    path, ref, _ = written["gptq"]
    write_dequantized_copy(str(path), str(tmp_path / "copy"), torch.float32)
    copy = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.float32)
    for name, value in ref.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value), name


@pytest.fixture
def no_pool(monkeypatch):
    from freetoken_plugin import loader as loader_mod

    monkeypatch.setattr(loader_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))


def refused(path, match):
    with pytest.raises(CheckpointError, match=match) as error:
        load(path)
    assert "\n" not in str(error.value)
    return str(error.value)


def set_quant(path, quant):
    config = json.load(open(os.path.join(path, "config.json")))
    json.dump(dict(config, quantization_config=quant), open(os.path.join(path, "config.json"), "w"))


def test_compressed_tensors_schemes_it_does_not_read_are_refused_in_one_line(tmp_path, written, no_pool):
    """(c) asymmetric, act-order groups, a group size the pool cannot take, 8-bit integers, activation
    quantization: each named in one line before the host pool exists."""
    root, tmp_path = tmp_path, copy_of(written, "ct", tmp_path)
    for quant, match in [(ct_config(GROUP, symmetric=False), "asymmetric weights"),
                         (ct_config(GROUP, actorder="group"), "actorder 'group'"),
                         (ct_config(48), "group_size 48, which the int4 pool cannot take"),
                         (ct_config(16), "group_size 16"),
                         (ct_config(GROUP, num_bits=8), "8-bit int weights in format 'pack-quantized'"),
                         (ct_config(GROUP, strategy="tensor"), "weight strategy 'tensor'")]:
        set_quant(tmp_path, quant)
        assert "and int4 weights (format 'pack-quantized'" in refused(tmp_path, match)
    quant = ct_config(GROUP)
    quant["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True}
    set_quant(tmp_path, quant)
    refused(tmp_path, "quantizes its input_activations")
    # row scales whose groups have no common one the pool takes (gate's 64 values, down's 80: 16)
    write_int4_checkpoint(random_qwen3_moe(64, dense=96, inter=80), root / "rows", "ct", strategy="channel")
    refused(root / "rows", r"\(64 values of model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight, 80 of "
                               r"\S+down_proj\.weight\) give the pool groups of 16, which the int4 pool cannot take")
    # zero points or act-order g_idx stored beside a symmetric config
    set_quant(tmp_path, ct_config(GROUP))
    file = tmp_path / "model.safetensors"
    good = load_file(file)
    for extra in ("weight_zero_point", "weight_g_idx"):
        save_file(dict(good, **{f"model.layers.1.mlp.experts.2.down_proj.{extra}": torch.zeros(4, dtype=torch.int32)}),
                  file, metadata={"format": "pt"})
        refused(tmp_path, rf"down_proj\.{extra} belongs to a scheme load_model does not apply")


def test_gptq_schemes_it_does_not_read_are_refused_in_one_line(tmp_path, written, no_pool):
    tmp_path = copy_of(written, "gptq", tmp_path)
    for quant, match in [(gptq_config(GROUP, sym=False), "sym false: asymmetric"),
                         (gptq_config(GROUP, desc_act=True), "desc_act true: act-order"),
                         (gptq_config(48), "group_size 48"),
                         (gptq_config(GROUP, bits=8), "bits 8"),
                         (gptq_config(GROUP, checkpoint_format="marlin"), "checkpoint_format 'marlin'")]:
        set_quant(tmp_path, quant)
        assert "load_model reads GPTQ checkpoints with bits 4" in refused(tmp_path, match)
    # v1 zeros read as gptq_v2's, an expert's asymmetric zeros, act-order g_idx under desc_act false
    set_quant(tmp_path, gptq_config(GROUP, "gptq_v2"))
    refused(tmp_path, r"qzeros holds zero points 0x77777777, not the symmetric 8 .*checkpoint_format 'gptq'")
    set_quant(tmp_path, gptq_config(GROUP))
    file = tmp_path / "model.safetensors"
    good = load_file(file)
    expert = "model.layers.1.mlp.experts.6.up_proj"
    zeros = good[f"{expert}.qzeros"].clone()
    zeros[0, 1] = 0x77777767
    save_file(dict(good, **{f"{expert}.qzeros": zeros}), file, metadata={"format": "pt"})
    refused(tmp_path, rf"{expert}\.qzeros holds zero points 0x77777767, not the symmetric 7 .*asymmetric")
    g_idx = good[f"{expert}.g_idx"].flip(0).contiguous()
    save_file(dict(good, **{f"{expert}.g_idx": g_idx}), file, metadata={"format": "pt"})
    refused(tmp_path, rf"{expert}\.g_idx is not each input's group in order")
    attention = "model.layers.0.self_attn.k_proj"
    save_file(dict(good, **{f"{attention}.qzeros": torch.zeros_like(good[f"{attention}.qzeros"])}), file,
              metadata={"format": "pt"})
    refused(tmp_path, rf"{attention}\.qzeros holds zero points 0x00000000")
    # A qweight or scales of the wrong size: the message names the tensor its expectation came from.
    save_file(dict(good, **{f"{expert}.qweight": good[f"{expert}.qweight"][:-1].contiguous()}), file,
              metadata={"format": "pt"})
    refused(tmp_path, rf"{expert}\.g_idx is torch\.int32 \[\d+\], expected int \[\d+\] \(qweight \[\d+, \d+\]: ")
    scales = good[f"{expert}.scales"]
    save_file(dict(good, **{f"{expert}.scales": torch.cat([scales, scales[:1]]).contiguous()}), file,
              metadata={"format": "pt"})
    refused(tmp_path, rf"{expert}\.qzeros is torch\.int32 \[\d+, \d+\], expected int32 \[\d+, \d+\] \(scales ")


def test_int4_experts_refuse_quantize_fp8_and_a_float_expert(tmp_path, written, no_pool):
    tmp_path = copy_of(written, "gptq", tmp_path)
    with pytest.raises(CheckpointError, match="holds int4 experts, which load as they are"):
        load(tmp_path, quantize="fp8")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    expert = "model.layers.1.mlp.experts.3.down_proj"
    for part in ("qweight", "scales", "qzeros", "g_idx"):
        del tensors[f"{expert}.{part}"]
    save_file(tensors, file, metadata={"format": "pt"})
    refused(tmp_path, rf"^the checkpoint lacks {expert}\.weight \(an int4 linear: qweight, scales and qzeros, or ")
    tensors[f"{expert}.weight"] = torch.zeros(64, 32)
    save_file(tensors, file, metadata={"format": "pt"})
    refused(tmp_path, rf"{expert}\.weight is torch\.float32, but this checkpoint's quantization_config makes its "
                      "experts int4")


def ct_groups_config(groups):
    """A compressed-tensors config whose config_groups quantize `groups` ({targets: group size})."""
    quant = ct_config(GROUP)
    template = quant["config_groups"].pop("group_0")
    for i, (targets, size) in enumerate(groups.items()):
        weights = dict(template["weights"], group_size=size)
        quant["config_groups"][f"group_{i}"] = dict(template, targets=[targets], weights=weights)
    return quant


def test_gptq_dynamic_entries_that_skip_modules_or_keep_the_format_load(tmp_path):
    """GPTQModel's MoE recipe: "-:" entries leave attention and the router float (stored as plain
    weights), a positive entry that keeps bits / group_size loads as the config says."""
    require("cpu", "expert_gemm")
    dynamic = {r"-:.*self_attn.*": {}, r"-:.*mlp\.gate$": {},
               r"+:.*experts.*": {"bits": 4, "group_size": GROUP, "sym": True, "damp_percent": 0.05}}
    ref, stored = write_int4_checkpoint(random_qwen3_moe(64, dense=96, inter=32), tmp_path, "gptq", experts_only=True,
                                        quant=gptq_config(GROUP, dynamic=dynamic))
    loaded = load(tmp_path)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "int4" and host.shape.group == GROUP
    assert_pool_holds_the_stored_experts(host, stored)
    assert_logits_match(loaded, ref)


def test_gptq_dynamic_overrides_that_change_the_format_are_refused_in_one_line(tmp_path, written, no_pool):
    tmp_path = copy_of(written, "gptq", tmp_path)
    for dynamic, match in [({r"-:.*self_attn.*": {}, r".*down_proj.*": {"group_size": 64}},
                            r"dynamic entry '\.\*down_proj\.\*' overriding group_size 64 \(not 32\)"),
                           ({r"+:.*experts\.3\..*": {"bits": 8, "sym": True}},
                            r"dynamic entry '\+:\.\*experts\\\\\.3\\\\\.\.\*' overriding bits 8 \(not 4\)"),
                           ({r".*q_proj": {"desc_act": True}}, r"overriding desc_act True \(not False\)"),
                           ({r".*q_proj": 8}, r"dynamic entry '\.\*q_proj' whose overrides 8 are not an object"),
                           ({r"-:.*self_attn[": {}},
                            r"dynamic entry '-:\.\*self_attn\[', which is not a regular expression \(unterminated")]:
        set_quant(tmp_path, gptq_config(GROUP, dynamic=dynamic))
        assert "'dynamic' entries that skip modules ('-:') or leave those four settings" in refused(tmp_path, match)


@pytest.mark.parametrize("variant", ["gptq", "gptq-no-g_idx", "ct"])
def test_experts_whose_input_size_their_group_does_not_divide_are_refused_in_one_line(tmp_path, variant, no_pool):
    """GPTQ and compressed-tensors write ceil(in/G) groups, the last short (down: in = I = 192, G =
    128): the int4 pool holds whole groups, so such experts are refused, named, before it exists
    (not read as groups of in / 2 = 96, nor refused as act-order groups)."""
    family = variant.split("-")[0]
    write_int4_checkpoint(random_qwen3_moe(64, dense=96, inter=192), tmp_path, family, group=128, experts_only=True)
    if variant == "gptq-no-g_idx":
        file = tmp_path / "model.safetensors"
        kept = {n: t for n, t in load_file(file).items() if not n.endswith("g_idx")}
        save_file(kept, file, metadata={"format": "pt"})
    part = "scales" if family == "gptq" else "weight_scale"
    refused(tmp_path, rf"model\.layers\.0\.mlp\.experts\.0\.down_proj\.{part} groups rows of 192 values by 128, the "
                      r"last group short \(64 values\): the int4 pool holds whole groups")


def test_non_expert_linears_dequantize_with_a_short_last_group(tmp_path):
    """Attention's q / k / v (in = H = 96) by groups of 64: two scales a row, the second for the
    last 32 values; dequantized exactly (the experts by 32)."""
    require("cpu", "expert_gemm")
    group_of = lambda name: 32 if ".experts." in name else 64  # noqa: E731
    ref, stored = write_int4_checkpoint(random_qwen3_moe(96, dense=96, inter=32), tmp_path, "ct", group_of=group_of,
                                        quant=ct_groups_config({"re:.*experts.*": 32, "re:.*self_attn.*": 64}))
    assert load_file(tmp_path / "model.safetensors")["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 2)
    loaded = load(tmp_path)
    assert loaded._freetoken_handle.runtime.host.shape.group == 32
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        got, want = (getattr(m.model.layers[1].self_attn, name).weight for m in (loaded, ref))
        assert torch.equal(got, want), name
    assert_logits_match(loaded, ref)


def test_a_pool_group_finer_than_a_linears_repeats_each_scale_in_place(tmp_path):
    """gate / up by groups of 64 (two scales a row of H = 128), down by 32: the pool's group is 32,
    each of gate's and up's scales repeated twice where it stands (s0 s0 s1 s1), bit for bit."""
    require("cpu", "expert_gemm")
    group_of = lambda name: 32 if name.endswith("down_proj.weight") else 64  # noqa: E731
    ref, stored = write_int4_checkpoint(random_qwen3_moe(128, dense=96, inter=64), tmp_path, "ct", group_of=group_of,
                                        quant=ct_groups_config({"re:.*down_proj$": 32,
                                                                "re:.*(gate_proj|up_proj|self_attn.*)$": 64}))
    loaded = load(tmp_path)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.group == 32 and host.w13_scale.shape[-1] == 4
    assert stored["model.layers.0.mlp.experts.0.gate_proj.weight"][1].shape == (64, 2)
    assert_pool_holds_the_stored_experts(host, stored)
    assert_logits_match(loaded, ref)


@pytest.mark.parametrize("family", ["ct", "gptq"])
def test_non_finite_expert_scales_are_refused_before_the_pool_exists(tmp_path, written, family, no_pool):
    tmp_path = copy_of(written, family, tmp_path)
    part = "scales" if family == "gptq" else "weight_scale"
    name = f"model.layers.1.mlp.experts.5.down_proj.{part}"
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    scale = tensors[name].clone()
    scale[-1, -1] = float("nan") if family == "gptq" else float("inf")
    save_file(dict(tensors, **{name: scale}), file, metadata={"format": "pt"})
    refused(tmp_path, rf"{name} holds 1 non-finite scale \(inf or NaN\)")


def test_scales_whose_count_the_configs_group_size_does_not_give_are_refused(tmp_path, written, no_pool):
    """Groups of 32 stored (two scales a row of 64) under a config of group_size 64 (one): refused,
    not read as groups of 32."""
    tmp_path = copy_of(written, "gptq", tmp_path)
    set_quant(tmp_path, gptq_config(64))
    refused(tmp_path, r"scales is torch\.float16 \[2, \d+\], expected floating point \[ceil\(in/G\), \d+\] for in = "
                      r"64 and the group sizes config\.json's quantization_config gives \(64\)")
