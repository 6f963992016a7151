"""load_model reads checkpoints under the names their architectures keep on the Hub, as
from_pretrained does (transformers' conversion mapping: renamed routers, Granite-MoE's
input_linear experts, Qwen3-VL-MoE's transposed experts, Kimi-Linear's concatenated convolutions),
builds the architecture config.json
names where no Auto class has a language-model head for it, computes buffers that a module with
weights keeps out of checkpoints (Gemma4's embedding scale), and refuses in one line, before the
host pool, what it cannot read: a tensor transformers computes otherwise than by moving values, a
config.json that needs the checkpoint's own code. Tensors transformers
concatenates, chunks, splits or transposes on load are computed the same way."""
import json

import pytest
import torch
import transformers

import freetoken_plugin
from families import FAMILIES, build, decorated_classes
from freetoken_plugin import CheckpointError
from freetoken_plugin.tiny import tiny_model
from ft_ops.slot_pool import HostPool
from helpers import require

FAMILY_OF = {c: (f, m) for f, m, c in decorated_classes()}


def family_model(experts_class: str):
    if experts_class not in FAMILY_OF:
        pytest.skip(f"transformers {transformers.__version__} has no {experts_class}")
    family, modeling = FAMILY_OF[experts_class]
    return build(family, modeling, experts_class, FAMILIES[experts_class])


def no_host_pool(monkeypatch):
    """Makes allocating a host pool fail the test: a refusal must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the host pool was allocated before the refusal")
    monkeypatch.setattr(HostPool, "allocate", classmethod(refuse))


@pytest.mark.parametrize("experts_class", ["PhimoeExperts", "GraniteMoeExperts", "Ernie4_5_MoeExperts",
                                           "MiMoV2FlashExperts", "Qwen3VLMoeTextExperts", "Gemma4TextExperts",
                                           "KimiLinearExperts", "BailingHybridExperts", "LaraMiniExperts"])
def test_a_checkpoint_from_save_pretrained_loads_as_from_pretrained_loads_it(experts_class, tmp_path):
    """save_pretrained writes the Hub's names (Phi-MoE's block_sparse_moe.gate, Granite-MoE's
    input_linear / output_linear / router.layer, ERNIE's moe_statics, MiMo's attention_sink_bias,
    Qwen3-VL-MoE's experts transposed); load_model read only the module names and refused them.
    Qwen3-VL-MoE has no AutoModelForCausalLM (its class comes from `architectures`); Gemma4's
    embedding scale is a buffer of a module with weights; Kimi-Linear's and BailingHybrid's q/k/v
    convolutions are concatenated and Lara-Mini's fused projection split as transformers loads them. The loaded model computes
    from_pretrained's logits and greedy tokens with a cache smaller than its experts."""
    require("cpu", "expert_gemm")
    model = family_model(experts_class)
    model.save_pretrained(tmp_path)
    reference = type(model).from_pretrained(tmp_path).eval()
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    assert isinstance(loaded, type(reference)) and type(loaded).__name__ == type(reference).__name__
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(ids, **kw), reference.generate(ids, **kw))


def test_a_tensor_computed_otherwise_than_by_moving_values_is_refused_before_reading(tmp_path, monkeypatch):
    """Tensors transformers computes by concatenating, chunking, splitting or transposing stored
    ones are computed the same way; any other operation (here one that doubles a weight) is refused
    in one line naming from_pretrained + offload_experts, before the host pool."""
    from transformers.core_model_loading import ConversionOps, WeightConverter

    from freetoken_plugin import checkpoint_names

    class Doubling(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            return {target_patterns[0]: 2 * next(iter(input_dict.values()))[0]}

    transforms = checkpoint_names._transforms
    monkeypatch.setattr(checkpoint_names, "_transforms", lambda model: (
        transforms(model)[0], [WeightConverter("self_attn.q_proj.weight", "self_attn.q_proj.weight", [Doubling()])]))
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    # The stored names are the model's own: renamed to themselves, they are read as stored.
    freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors = {n.replace("self_attn.q_proj.weight", "attn_q.weight"): t for n, t in tensors.items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(checkpoint_names, "_transforms", lambda model: (
        transforms(model)[0], [WeightConverter("attn_q.weight", "self_attn.q_proj.weight", [Doubling()])]))
    no_host_pool(monkeypatch)
    with pytest.raises(CheckpointError, match=r"computes Qwen3MoeForCausalLM's self_attn.q_proj.weight from "
                                              r"the checkpoint's attn_q.weight \(Doubling\) .*offload_experts"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)


def test_a_computed_tensor_without_all_its_sources_is_refused_before_reading(tmp_path, monkeypatch):
    """Kimi-Linear's convolution is the concatenation of q_conv1d, k_conv1d and v_conv1d: one of
    them missing is named, before the host pool."""
    from safetensors.torch import load_file, save_file

    family_model("KimiLinearExperts").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = next((n for n in tensors if n.endswith("k_conv1d.weight")), None)
    if name is None:
        pytest.skip(f"transformers {transformers.__version__} stores Kimi-Linear's convolution as one tensor")
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    no_host_pool(monkeypatch)
    with pytest.raises(CheckpointError, match=r"conv1d.weight is computed from .* but the checkpoint lacks "
                                              r"self_attn.k_conv1d.weight beside"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)


def test_a_missing_persistent_buffer_is_computed_as_from_pretrained_computes_it(tmp_path):
    """DeepSeek-V3's router correction bias is a persistent buffer: a checkpoint without it made
    load_model fail after every expert had been read; from_pretrained computes it by the model's
    initialisation (zeros) and says so. load_model does the same, with a warning naming it."""
    from safetensors.torch import load_file, save_file

    tiny_model("deepseek_v3").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = next(n for n in tensors if n.endswith("mlp.gate.e_score_correction_bias"))
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match=rf"1 buffer of the model is not in the checkpoint and computed by its "
                                         rf"initialisation, as from_pretrained does: \['{name}'\]"):
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    assert torch.equal(loaded.get_buffer(name), reference.get_buffer(name))
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_hub_layouts_that_differ_from_the_modules_beyond_names(tmp_path):
    """Qwen3-VL-MoE's Hub checkpoints hold the fused experts transposed ([E, H, 2I], [E, I, H]),
    under the module's names, and transformers transposes a tensor whose shape is not the module's;
    a base model's checkpoint (no `model.` prefix, as DeepSeek-V4's) gets the prefix. Here with
    hidden 64 and intermediate 24, so that both layouts have different shapes."""
    from safetensors.torch import load_file, save_file

    require("cpu", "expert_gemm")
    if "Qwen3VLMoeTextExperts" not in FAMILY_OF:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3-VL-MoE")
    family, modeling = FAMILY_OF["Qwen3VLMoeTextExperts"]
    spec = FAMILIES["Qwen3VLMoeTextExperts"]
    spec = type(spec)(**{**spec.__dict__, "config": {**spec.config, "text_config": {
        **spec.config.get("text_config", {}), "moe_intermediate_size": 24}}})
    model = build(family, modeling, "Qwen3VLMoeTextExperts", spec)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    flipped = {n: t.transpose(1, 2).contiguous() if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else t
               for n, t in tensors.items()}
    assert any(flipped[n].shape != tensors[n].shape for n in tensors)
    save_file(flipped, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = type(model).from_pretrained(tmp_path).eval()
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        torch.testing.assert_close(reference(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)

    base = tmp_path / "base"
    qwen = tiny_model("qwen3_moe")
    qwen.save_pretrained(base)
    tensors = load_file(base / "model.safetensors")
    save_file({n.removeprefix("model."): t for n, t in tensors.items()}, base / "model.safetensors",
              metadata={"format": "pt"})
    loaded = freetoken_plugin.load_model(str(base), cache_slots=12, device="cpu", progress=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, qwen(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_config_that_needs_the_checkpoints_own_code_says_what_to_set(tmp_path):
    """Kimi-K2's config.json says model_type kimi_k2 with auto_map (its own code) over DeepSeek-V3's
    architecture: transformers asked interactively whether to run that code, then load_model said
    only that it cannot read the file."""
    tiny_model("deepseek_v3").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model_type 'kimi_k2' needs the checkpoint's own code \(auto_map\).*"
                                              r"set config.json's \"model_type\" to \"deepseek_v3\""):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    # An auto_map without an AutoConfig entry: transformers finds no config for the model_type.
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"model_type 'kimi_k2' needs the checkpoint's own code \(auto_map\).*"
                                              r"set config.json's \"model_type\" to \"deepseek_v3\""):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)


def test_an_architecture_without_a_language_model_head_is_refused_in_one_line(tmp_path):
    """Without an AutoModelForCausalLM, load_model builds the class `architectures` names only if it
    generates text (Qwen3-VL-MoE's ForConditionalGeneration does; its bare Model does not)."""
    model = family_model("Qwen3VLMoeTextExperts")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = [type(model.model).__name__]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"no causal language model for model_type 'qwen3_vl_moe' \(architectures "
                                              r"\['Qwen3VLMoeModel'\]\); load_model builds text generation models"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)


def test_computing_a_missing_buffer_keeps_the_checkpoints_tensors_of_its_module(tmp_path):
    """MiniMax's lightning attention keeps four persistent buffers: with one left out, the model's
    initialisation computes it, and it recomputed the module's other buffers too, replacing the
    checkpoint's values (from_pretrained keeps them)."""
    from safetensors.torch import load_file, save_file

    require("cpu", "expert_gemm")
    model = family_model("MiniMaxExperts")
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    slope = next((n for n in tensors if n.endswith("slope_rate")), None)
    if slope is None:
        pytest.skip(f"transformers {transformers.__version__}'s MiniMax keeps no slope_rate in its checkpoints")
    tensors[slope] = tensors[slope] * 0.5  # a stored value the initialisation would not compute
    del tensors[slope.replace("slope_rate", "query_decay")]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = type(model).from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match="query_decay"):
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    assert torch.equal(loaded.get_buffer(slope), tensors[slope])
    assert torch.equal(loaded.get_buffer(slope), reference.get_buffer(slope))


def test_names_the_architecture_renames_under_the_prefix_get_it_once(tmp_path, monkeypatch):
    """Llava-style Hub names (`language_model.model.layers...`) get `model.` from the
    architecture's own renaming: the base model's prefix is added per name, only to names that
    need it (per-expert tensors got it twice)."""
    from safetensors.torch import load_file, save_file
    from transformers.core_model_loading import WeightRenaming

    from freetoken_plugin import checkpoint_names

    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({"language_model." + n: t for n, t in tensors.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    transforms = checkpoint_names._transforms
    monkeypatch.setattr(checkpoint_names, "_transforms", lambda m: (
        [WeightRenaming(r"^language_model\.lm_head", "lm_head"), WeightRenaming(r"^language_model\.model\.", "model.")]
        + transforms(m)[0], transforms(m)[1]))
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


# What load_model refuses of a family's save_pretrained checkpoint, in one line before any tensor is
# read (docs/families.md): a model that generates no text, a sub-model whose config.json names no
# model type.
REFUSED_CHECKPOINTS = {
    "OpenAIPrivacyFilterExperts": "transformers has no causal language model",
    "Qwen3OmniMoeTalkerTextExperts": r"names the class Qwen3OmniMoeTalkerForConditionalGeneration but no model_type.*"
                                     r"Qwen3OmniMoeTalkerForConditionalGeneration.from_pretrained",
}
SERVED = [pytest.param(c, id=c) for f, m, c in decorated_classes() if c in FAMILIES and not FAMILIES[c].refused]


@pytest.mark.slow
@pytest.mark.parametrize("experts_class", SERVED)
def test_every_served_familys_checkpoint_loads_as_from_pretrained_loads_it(experts_class, tmp_path):
    """Every family offload_experts serves, written by save_pretrained: load_model computes
    from_pretrained's logits (and greedy tokens, where the family generates) with a cache smaller
    than its experts, or refuses in one line what docs/families.md says it refuses (DiffusionGemma's
    encoder runs its decoder's layers, stored once: it was refused for want of their tensors)."""
    require("cpu", "expert_gemm")
    import warnings

    spec = FAMILIES[experts_class]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = family_model(experts_class)
        model.save_pretrained(tmp_path)
        if experts_class in REFUSED_CHECKPOINTS:
            with pytest.raises(CheckpointError, match=REFUSED_CHECKPOINTS[experts_class]) as error:
                freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
            assert "\n" not in str(error.value)
            return
        reference = type(model).from_pretrained(tmp_path).eval()
        loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
        ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
        with torch.no_grad():
            if spec.inputs == "embeds":
                got, want = (m(inputs_embeds=m.get_input_embeddings()(ids)).logits for m in (loaded, reference))
            else:
                torch.manual_seed(0)  # a model that draws noise (DiffusionGemma's canvas) draws the same both times
                got = loaded(input_ids=ids).logits
                torch.manual_seed(0)
                want = reference(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if spec.inputs == "generate":
            kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
            assert torch.equal(loaded.generate(ids, **kw), reference.generate(ids, **kw))
