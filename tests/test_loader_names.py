"""load_model reads checkpoints under the names their architectures keep on the Hub, as
from_pretrained does (transformers' conversion mapping: renamed routers, Granite-MoE's
input_linear experts, Qwen3-VL-MoE's transposed experts), builds the architecture config.json
names where no Auto class has a language-model head for it, computes buffers that a module with
weights keeps out of checkpoints (Gemma4's embedding scale), and refuses in one line, before the
host pool, what it cannot read: a tensor transformers computes from others, a missing persistent
buffer, a config.json that needs the checkpoint's own code."""
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
                                           "MiMoV2FlashExperts", "Qwen3VLMoeTextExperts", "Gemma4TextExperts"])
def test_a_checkpoint_from_save_pretrained_loads_as_from_pretrained_loads_it(experts_class, tmp_path):
    """save_pretrained writes the Hub's names (Phi-MoE's block_sparse_moe.gate, Granite-MoE's
    input_linear / output_linear / router.layer, ERNIE's moe_statics, MiMo's attention_sink_bias,
    Qwen3-VL-MoE's experts transposed); load_model read only the module names and refused them.
    Qwen3-VL-MoE has no AutoModelForCausalLM (its class comes from `architectures`); Gemma4's
    embedding scale is a buffer of a module with weights. The loaded model computes
    from_pretrained's logits and greedy tokens with a cache smaller than its experts."""
    require("cpu", "expert_gemm")
    model = family_model(experts_class)
    model.save_pretrained(tmp_path)
    reference = type(model).from_pretrained(tmp_path).eval()
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)
    assert type(loaded) is type(reference)
    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(ids, **kw), reference.generate(ids, **kw))


def test_a_tensor_transformers_computes_from_others_is_refused_before_reading(tmp_path, monkeypatch):
    """BailingHybrid's checkpoints keep q/k/v convolutions that transformers concatenates on load:
    load_model reads tensors as stored, so it refuses them in one line naming from_pretrained +
    offload_experts, before the host pool."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    mapping = get_checkpoint_conversion_mapping("bailing_hybrid") or []
    if not any(isinstance(t, WeightConverter) and "conv1d" in str(t.target_patterns) for t in mapping):
        pytest.skip(f"transformers {transformers.__version__} does not concatenate BailingHybrid's convolutions")
    family_model("BailingHybridExperts").save_pretrained(tmp_path)
    no_host_pool(monkeypatch)
    with pytest.raises(CheckpointError, match=r"computes BailingHybridForCausalLM's \['conv1d.weight'\] from the "
                                              r"checkpoint's .*Concatenate.* call freetoken_plugin.offload_experts"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)


def test_a_missing_persistent_buffer_is_refused_from_the_headers(tmp_path, monkeypatch):
    """DeepSeek-V3's router correction bias is a buffer: a checkpoint without it was refused only
    after every expert had been read."""
    from safetensors.torch import load_file, save_file

    tiny_model("deepseek_v3").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = next(n for n in tensors if n.endswith("mlp.gate.e_score_correction_bias"))
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    no_host_pool(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"lacks 1 tensor the model needs, e.g. \['{name}'\]"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=12, device="cpu", progress=False)


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
