"""load_model: sharded checkpoints written by save_pretrained load with their experts read from the
files into the host pool and generate the unmodified model's tokens; the experts are never held
twice in host memory; broken checkpoints get clear errors."""
import json
import os
import re
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import freetoken_plugin
from freetoken_plugin import CheckpointError
from freetoken_plugin.tiny import ARCHES, tiny_model
from helpers import assert_experts_loaded_once, require


def save(model, path):
    model.save_pretrained(path, max_shard_size="200KB")
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 1, "the test wants a sharded checkpoint"
    return shards


def rewrite_tensor(tmp_path, shards, copy_name, tensor_name, change):
    """A copy of the checkpoint in tmp_path/ok with one tensor dropped (change None) or changed."""
    target = tmp_path / copy_name
    shutil.copytree(tmp_path / "ok", target)
    for shard in shards:
        tensors = load_file(target / shard)
        if tensor_name in tensors:
            if change is None:
                del tensors[tensor_name]
            else:
                tensors[tensor_name] = change(tensors[tensor_name])
            save_file(tensors, target / shard, metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("arch", ARCHES)
def test_sharded_checkpoint_loads_and_generates_the_same_tokens(arch, tmp_path):
    require("cpu", "expert_gemm")
    model = tiny_model(arch)
    save(model, tmp_path)
    prompt = torch.randint(1, 512, (1, 10), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = model.generate(prompt, **kw)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert torch.equal(loaded.generate(prompt, **kw), want)
    assert freetoken_plugin.stats(loaded)["pool"]["slots"] == 16


@pytest.mark.parametrize("kept", ["model.embed_tokens.weight", "lm_head.weight"])
def test_tied_embeddings_load_from_either_name(tmp_path, kept):
    """A model with tied input and output embeddings, its checkpoint holding the tied weight under
    either name (transformers loads both): the same tokens, and the loaded weights still tied."""
    require("cpu", "expert_gemm")
    import transformers as tf
    from safetensors.torch import load_file

    from freetoken_plugin.tiny import tiny_config

    config = tiny_config("qwen3_moe")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    weight = tensors.pop("model.embed_tokens.weight", None)
    weight = tensors.pop("lm_head.weight", weight)
    tensors[kept] = weight
    save_file(tensors, path, metadata={"format": "pt"})
    prompt = torch.randint(1, 512, (1, 10), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = model.generate(prompt, **kw)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.generate(prompt, **kw), want)


@pytest.mark.parametrize("same", [True, False])
def test_tied_embeddings_stored_twice(tmp_path, same):
    """The config ties the embeddings and the checkpoint holds both names: with equal values they
    stay tied; with other values each keeps its own, as from_pretrained does (with a warning), and
    the tokens are from_pretrained's (a stranger's check: the head took the embedding's values)."""
    require("cpu", "expert_gemm")
    import transformers as tf

    from freetoken_plugin.tiny import tiny_config

    config = tiny_config("qwen3_moe")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    embed = tensors.get("model.embed_tokens.weight", tensors.get("lm_head.weight"))
    tensors["model.embed_tokens.weight"] = embed.clone()
    tensors["lm_head.weight"] = embed.clone() if same else torch.randn_like(embed)
    save_file(tensors, path, metadata={"format": "pt"})
    want_model = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = torch.randint(1, 512, (1, 10), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    untied = [w for w in caught if "they are not tied" in str(w.message)]
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == same
    assert len(untied) == (0 if same else 1)
    assert torch.equal(loaded.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(loaded.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(loaded.generate(prompt, **kw), want_model.generate(prompt, **kw))


def test_a_single_file_beside_a_stale_index_is_read_as_from_pretrained_reads_it(tmp_path):
    """save_pretrained of an unsharded model into a directory that held a sharded save removes the
    shards but leaves their index: from_pretrained reads model.safetensors, and so does load_model
    (it followed the index and refused the missing shards)."""
    require("cpu", "expert_gemm")
    save(tiny_model("qwen3_moe", seed=0), tmp_path)
    model = tiny_model("qwen3_moe", seed=1)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "model.safetensors.index.json").exists()
    prompt = torch.randint(1, 512, (1, 10), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert torch.equal(loaded.generate(prompt, **kw), model.generate(prompt, **kw))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_the_dtype_is_the_checkpoints_where_config_json_names_none(tmp_path, arch):
    """from_pretrained takes a checkpoint's own dtype when config.json names none (its first
    floating-point tensor by name); load_model built float32 (twice the host memory of a bf16
    checkpoint). DeepSeek-V3 keeps its routers in float32, which lead the file's header."""
    require("cpu", "expert_gemm")
    import transformers as tf

    tiny_model(arch).to(torch.bfloat16).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = tf.AutoModelForCausalLM.from_pretrained(tmp_path).model.embed_tokens.weight.dtype
    assert want == torch.bfloat16
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert loaded.model.embed_tokens.weight.dtype == want
    assert freetoken_plugin.stats(loaded)["pool"]["expert_bytes"] == 3 * 32 * 64 * 2  # bf16 w13 + w2


def test_a_pytorch_bin_checkpoint_is_refused_with_the_way_out(tmp_path):
    torch.save({}, tmp_path / "pytorch_model.bin")
    tiny_model("qwen3_moe").config.to_json_file(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="holds pytorch_model.bin and no safetensors; .*offload_experts"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


def test_errors_name_what_is_wrong(tmp_path):
    model = tiny_model("qwen3_moe")
    with pytest.raises(CheckpointError, match="has no config.json"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)
    shards = save(model, tmp_path / "ok")
    # A missing expert tensor, then a mis-shaped one.
    missing = rewrite_tensor(tmp_path, shards, "missing", "model.layers.1.mlp.experts.3.up_proj.weight", None)
    with pytest.raises(CheckpointError, match="lacks model.layers.1.mlp.experts.3.up_proj.weight"):
        freetoken_plugin.load_model(str(missing), device="cpu", progress=False)
    bad = rewrite_tensor(tmp_path, shards, "shape", "model.layers.0.mlp.experts.0.down_proj.weight",
                         lambda t: t[:, :-1].contiguous())
    with pytest.raises(CheckpointError, match=r"experts.0.down_proj.weight: checkpoint shape \(64, 31\), "
                       r"expected \(64, 32\) \(the shape config.json gives: check its sizes"):
        freetoken_plugin.load_model(str(bad), device="cpu", progress=False)
    # A truncated shard.
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "ok", cut)
    biggest = max(shards, key=lambda s: os.path.getsize(cut / s))
    size = os.path.getsize(cut / biggest)
    with open(cut / biggest, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=f"{biggest} is truncated"):
        freetoken_plugin.load_model(str(cut), device="cpu", progress=False)
    # Shards that are not safetensors files: garbage bytes, a header that is not a JSON object, an
    # entry without its fields.
    import struct

    for case, data in [("garbage", b"\xff" * 64), ("list", struct.pack("<Q", 4) + b"[1,]"),
                       ("fields", struct.pack("<Q", 13) + b'{"w": {"a":1}')]:
        odd = tmp_path / case
        shutil.copytree(tmp_path / "ok", odd)
        with open(odd / biggest, "wb") as f:
            f.write(data + b" " * 64)
        with pytest.raises(CheckpointError, match=f"{biggest} is not a safetensors file"):
            freetoken_plugin.load_model(str(odd), device="cpu", progress=False)


def test_a_missing_path_or_a_hub_id_is_said_not_to_exist(tmp_path):
    # A hub id is told how to download it; a file system path is not.
    for path, hint in ((str(tmp_path / "nowhere"), r"shards\)$"), ("Qwen/Qwen3-30B-A3B", "download it first")):
        with pytest.raises(CheckpointError, match=f"^{path} does not exist; load_model reads a local checkpoint "
                                                  f"directory .*{hint}"):
            freetoken_plugin.load_model(path, device="cpu", progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file; load_model reads a checkpoint directory"):
        freetoken_plugin.load_model(str(tmp_path / "file"), device="cpu", progress=False)


def test_a_loaded_model_passed_to_load_model_is_pointed_to_offload_experts():
    """One line naming the class (the model's repr was 28 lines), and the call that takes a model."""
    with pytest.raises(CheckpointError, match=r"^load_model takes the path of a local checkpoint directory, got a "
                                              r"Qwen3MoeForCausalLM; for a loaded model use offload_experts\(model, "
                                              r"cache_bytes=\.\.\.\)$"):
        freetoken_plugin.load_model(tiny_model("qwen3_moe"), device="cpu", progress=False)
    for bad, shown in ((None, "None"), ("", "''"), ([1], "a list")):
        with pytest.raises(CheckpointError, match=f"got {re.escape(shown)}$"):
            freetoken_plugin.load_model(bad, device="cpu", progress=False)


def test_a_config_json_that_is_not_a_checkpoints_is_one_line(tmp_path):
    """config.json that is not JSON, not an object, or whose quantization_config is not an object:
    refused in one line by load_model (transformers' own errors were a traceback's worth)."""
    for case, text, message in [("text", "not json", "is not a JSON file"), ("list", "[1, 2]", "holds a JSON list"),
                                ("quant", '{"model_type": "qwen3_moe", "quantization_config": "fp8"}',
                                 "quantization_config is 'fp8'; it must be an object")]:
        path = tmp_path / case
        path.mkdir()
        (path / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=message):
            freetoken_plugin.load_model(str(path), device="cpu", progress=False)


def test_an_unknown_quantize_is_refused_before_the_path_is_read(tmp_path):
    with pytest.raises(ValueError, match="quantize='nf4': load_model quantizes a float checkpoint's experts to 'fp8'"):
        freetoken_plugin.load_model(str(tmp_path / "missing"), device="cpu", progress=False, quantize="nf4")


def test_quantized_or_non_float_experts_are_refused_not_converted(tmp_path):
    """An integer tensor where an expert weight belongs (e.g. int8 in a float model), an FP8 tensor
    without an FP8 quantization_config, or a float checkpoint under one, are refused with a
    CheckpointError naming the tensor (or the label), never silently converted into another model."""
    import json

    shards = save(tiny_model("qwen3_moe"), tmp_path / "ok")
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    ints = rewrite_tensor(tmp_path, shards, "int8", expert, lambda t: (t * 100).to(torch.int8))
    with pytest.raises(CheckpointError, match=f"{expert} is torch.int8, where the model expects a floating-point "
                                              "weight .* load_model reads quantized experts of block-FP8 and GPT-OSS MXFP4"):
        freetoken_plugin.load_model(str(ints), device="cpu", progress=False)
    fp8 = rewrite_tensor(tmp_path, shards, "fp8", expert, lambda t: t.to(torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match=f"{expert} is torch.float8_e4m3fn \\(FP8\\) in a checkpoint whose "
                                              "config.json has no FP8 quantization_config"):
        freetoken_plugin.load_model(str(fp8), device="cpu", progress=False)
    norm = "model.layers.0.input_layernorm.weight"  # not an expert: the same rule
    ints = rewrite_tensor(tmp_path, shards, "int_norm", norm, lambda t: t.to(torch.int32))
    with pytest.raises(CheckpointError, match=f"{norm} is torch.int32"):
        freetoken_plugin.load_model(str(ints), device="cpu", progress=False)
    quantized = tmp_path / "quantized"
    shutil.copytree(tmp_path / "ok", quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="says fp8, but no tensor of .* is FP8: remove the quantization_config"):
        freetoken_plugin.load_model(str(quantized), device="cpu", progress=False)


def test_mxfp4_blocks_without_their_quantization_config_are_refused(tmp_path):
    model = tiny_model("gpt_oss")
    model.save_pretrained(tmp_path / "ok")
    shards = [f for f in os.listdir(tmp_path / "ok") if f.endswith(".safetensors")]
    target = tmp_path / "mxfp4"
    shutil.copytree(tmp_path / "ok", target)
    for shard in shards:  # the names and dtypes of an MXFP4 gpt-oss checkpoint
        tensors = load_file(target / shard)
        for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
            blocks = tensors.pop(name)
            tensors[name + "_blocks"] = torch.zeros(blocks.shape[0], blocks.shape[2], 4, 16, dtype=torch.uint8)
            tensors[name + "_scales"] = torch.zeros(blocks.shape[0], blocks.shape[2], 4, dtype=torch.uint8)
        save_file(tensors, target / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.experts is MXFP4 .* but config.json has no MXFP4 "
                                              "quantization_config"):
        freetoken_plugin.load_model(str(target), device="cpu", progress=False)


def test_a_dense_architecture_is_refused(tmp_path):
    import transformers as tf

    dense = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                               num_hidden_layers=1, num_attention_heads=2))
    dense.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has no experts block freetoken serves: is it a Mixture-of-Experts model\?"):
        freetoken_plugin.load_model(str(tmp_path), device="cpu", progress=False)


@pytest.mark.slow  # seconds on two cores: in the slow set (pytest -m slow), which CI runs too
def test_experts_are_never_held_twice_in_host_memory(tmp_path):
    """Peak resident memory of a process that loads a checkpoint whose experts are ~300 MB stays
    well below what a second copy of the experts would need."""
    from freetoken_plugin.tiny import tiny_config
    import transformers as tf

    config = tiny_config("qwen3_moe", experts=64, top_k=2)
    config.hidden_size, config.moe_intermediate_size = 512, 256
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="100MB")
    # Measured 340-365 MiB on two machines (~60 MiB of slack; the 64-slot device cache on the CPU
    # is allocated but never written); a second copy of the experts would add 288 MiB.
    assert_experts_loaded_once(tmp_path, 3 * 64 * 3 * 512 * 256 * 4, cache_slots=64)


def _gpt_oss_checkpoint(tmp_path):
    model = tiny_model("gpt_oss")  # fused module layout: gate_up_proj [E, H, 2I], down_proj [E, I, H]
    model.save_pretrained(tmp_path / "ok")
    return model, ["model.safetensors"]


@pytest.mark.parametrize("case, change", [("one expert", lambda t: t[:1].contiguous()),
                                          ("one column", lambda t: t[..., :1].contiguous()),
                                          ("short rows", lambda t: t[:, :-1].contiguous())])
def test_a_fused_down_proj_of_another_shape_is_refused_from_the_headers(tmp_path, monkeypatch, case, change):
    """A fused checkpoint's down_proj is checked like its gate_up_proj, from the headers and before
    the host pool exists (a [1, I, H] one was broadcast into every expert: wrong tokens, no error)."""
    from ft_ops.slot_pool import HostPool

    _, shards = _gpt_oss_checkpoint(tmp_path)
    bad = rewrite_tensor(tmp_path, shards, "bad", "model.layers.0.mlp.experts.down_proj", change)

    def no_pool(*args, **kwargs):
        raise AssertionError("the host pool was allocated before the refusal")

    monkeypatch.setattr(HostPool, "allocate", no_pool)
    with pytest.raises(CheckpointError, match=r"experts\.down_proj has shape \(.*\), expected \(8, 32, 64\) \(the "
                                              r"shape config.json gives"):
        freetoken_plugin.load_model(str(bad), device="cpu", progress=False)


def test_the_checkpoints_generation_config_is_the_models(tmp_path):
    """generation_config.json (end-of-turn ids, sampling defaults) is read as from_pretrained reads
    it: generate stops where transformers' model stops; without a readable one, config.json's
    generation settings apply, as there."""
    require("cpu", "expert_gemm")
    import json

    import transformers as tf

    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    first = tf.AutoModelForCausalLM.from_pretrained(tmp_path).generate(prompt, max_new_tokens=8, do_sample=False)
    eos = int(first[0, 6])  # the second new token: generation now stops there
    config = json.loads((tmp_path / "generation_config.json").read_text())
    config["eos_token_id"] = eos
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    want = tf.AutoModelForCausalLM.from_pretrained(tmp_path).generate(prompt, max_new_tokens=8, do_sample=False)
    assert want.shape[1] == 7
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    assert loaded.generation_config.eos_token_id == eos
    assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False), want)
    # Unreadable, or missing with generation settings in config.json: from_pretrained takes those
    # from config.json (and says nothing of the broken file); so does load_model, with a warning.
    (tmp_path / "generation_config.json").write_text("{not json")
    config = json.loads((tmp_path / "config.json").read_text())
    config["repetition_penalty"] = 5.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    for broken in (True, False):
        if not broken:
            (tmp_path / "generation_config.json").unlink()
        want = tf.AutoModelForCausalLM.from_pretrained(tmp_path).generate(prompt, max_new_tokens=8, do_sample=False)
        if broken:
            with pytest.warns(UserWarning, match="generation_config.json cannot be read .* settings from config.json"):
                loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
        else:
            loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
        assert loaded.generation_config.repetition_penalty == 5.0
        assert torch.equal(loaded.generate(prompt, max_new_tokens=8, do_sample=False), want)


def test_tensors_without_a_place_in_the_model_are_named_in_a_warning(tmp_path):
    """Tensors the model has no parameter or buffer for (transformers' "unexpected" keys) are named,
    an expert past config.json's count among them; the model still loads."""
    require("cpu", "expert_gemm")
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.foo.weight"] = torch.zeros(2)
    tensors["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(2)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(2)  # old checkpoints': not named
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"2 tensors of the checkpoint have no place in Qwen3MoeForCausalLM and are "
                                         r"not read, e\.g\. \['model\.layers\.0\.foo\.weight', 'model\.layers\.0\.mlp\."
                                         r"experts\.8\.up_proj\.weight'\]"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


def test_a_config_json_transformers_cannot_read_is_one_line(tmp_path):
    """No model_type, or one this transformers does not know: one line naming config.json (it was
    transformers' own multi-line error, and the command line's exit status 1)."""
    for case, text, message in [("none", '{"hidden_size": 64}', "has no model_type"),
                                ("unknown", '{"model_type": "no_such_model"}', "transformers .* cannot read it")]:
        path = tmp_path / case
        path.mkdir()
        (path / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=message) as error:
            freetoken_plugin.load_model(str(path), device="cpu", progress=False)
        assert "\n" not in str(error.value)


def test_a_loaded_models_backward_is_refused_by_the_experts_op(tmp_path):
    """As on an offload_experts model: the op's own message, not autograd's "does not require grad"
    (load_model's parameters require grad as from_pretrained's do)."""
    require("cpu", "expert_gemm")
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    logits = loaded(torch.randint(1, 512, (1, 12))).logits
    with pytest.raises(RuntimeError, match="freetoken::expert_gemm has no gradient"):
        logits.sum().backward()


@pytest.mark.parametrize("damage", ["overlap", "short span"])
def test_a_header_whose_byte_ranges_do_not_fit_the_shapes_is_refused(tmp_path, damage):
    """Each tensor's data_offsets must span exactly its shape's bytes and not overlap another's:
    a header giving one tensor another's bytes would load wrong weights without a word."""
    import json
    import struct

    from freetoken_plugin.safetensors_io import CheckpointError, read_header
    from safetensors.torch import save_file

    path = str(tmp_path / "shard.safetensors")
    save_file({"a": torch.zeros(4, 8), "b": torch.ones(4, 8)}, path)
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if damage == "overlap":
        header["b"]["data_offsets"] = header["a"]["data_offsets"]
    else:
        header["b"]["data_offsets"][1] -= 64
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    open(path, "wb").write(raw[:8] + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match="damaged header"):
        read_header(path)


def _unsharded_copy(tmp_path, name, config=None, index=None):
    """A copy of a saved tiny checkpoint at tmp_path/ok, config.json changed by `config`, or its one
    shard renamed and listed by an index file of text `index`."""
    target = tmp_path / name
    shutil.copytree(tmp_path / "ok", target)
    if config is not None:
        data = json.loads((target / "config.json").read_text())
        config(data)
        (target / "config.json").write_text(json.dumps(data))
    if index is not None:
        os.rename(target / "model.safetensors", target / "model-00001-of-00001.safetensors")
        (target / "model.safetensors.index.json").write_text(index)
    return str(target)


def test_a_damaged_index_or_config_is_refused_in_one_line_before_the_pool(tmp_path):
    """A model.safetensors.index.json that is not JSON, holds no weight_map or maps to something
    that is not a file name; a config.json dtype that is not a compute dtype; more experts per token
    than experts: each a one-line CheckpointError naming the file (they were a JSONDecodeError,
    KeyError, AttributeError, transformers' own errors, or torch's "selected index k out of range" at
    the first forward)."""
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "ok")
    cases = [
        (dict(index="{not json"), r"model.safetensors.index.json is not valid JSON \("),
        (dict(index='{"metadata": {}}'), r"index.json has no \"weight_map\" object"),
        (dict(index="[1, 2]"), r"index.json has no \"weight_map\" object"),
        (dict(index='{"weight_map": {"model.norm.weight": 3}}'), r"index.json maps a tensor to 3; "),
        (dict(config=lambda c: c.update(dtype="floaty")), r"config.json: dtype 'floaty' is not one load_model "
                                                          r"computes in; it must be bfloat16, float16 or float32"),
        (dict(config=lambda c: c.update(dtype="int8")), r"config.json: dtype 'int8' is not one"),
        (dict(config=lambda c: c.update(num_experts_per_tok=12)), r"config.json: 12 experts per token \(num_experts_per_tok"
                                                                  r".*\), but num_experts is 8; a token takes at most 8"),
    ]
    for i, (change, message) in enumerate(cases):
        path = _unsharded_copy(tmp_path, f"case{i}", **change)
        with pytest.raises(CheckpointError, match=message) as error:
            freetoken_plugin.load_model(path, cache_slots=16, device="cpu", progress=False)
        assert "\n" not in str(error.value)


def test_a_config_dtype_is_overridden_by_the_callers(tmp_path):
    """dtype= wins over config.json's, even one load_model would refuse."""
    require("cpu", "expert_gemm")
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "ok")
    path = _unsharded_copy(tmp_path, "int8", config=lambda c: c.update(dtype="int8"))
    loaded = freetoken_plugin.load_model(path, cache_slots=16, device="cpu", progress=False, dtype=torch.float32)
    assert loaded.dtype == torch.float32


def test_a_missing_non_expert_tensor_names_the_way_out(tmp_path):
    shards = save(tiny_model("qwen3_moe"), tmp_path / "ok")
    path = rewrite_tensor(tmp_path, shards, "missing", "model.norm.weight", None)
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor the model needs, e.g. \['model.norm.weight'\]; "
                                              r"load_model reads every weight .*from_pretrained, then offload_experts"):
        freetoken_plugin.load_model(str(path), cache_slots=16, device="cpu", progress=False)
