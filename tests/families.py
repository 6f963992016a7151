"""Every transformers MoE family whose experts class is decorated with use_experts_implementation:
found in the installed transformers (not listed by hand), built as a tiny random model from its
config class, with what freetoken must do for it (FAMILIES).

A decorated class missing from FAMILIES fails the family test until someone checks what its experts
compute and adds it here and to docs/families.md. Families of a newer transformers than the one
installed are simply not found.
"""
import dataclasses
import glob
import importlib
import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from ft_ops.activations import GELU_TANH, RELU2, SILU, SWIGLUOAI, Activation

CLAMPED_10 = Activation("silu", limit=10.0)  # min(gate, 10), clamp(up, -10, 10), silu
SOFTCAPPED = Activation("silu", gate_softcap=4.0, up_softcap=25.0)


@dataclass(frozen=True)
class Family:
    """What freetoken must do for one decorated experts class, and how to build its tiny model."""
    function: Optional[Activation]          # what the class computes (None: refused)
    refused: Optional[str] = None           # the UnsupportedExperts message (a regex) when refused
    config: Dict = field(default_factory=dict)  # overrides of the generic tiny config (see TINY_TEXT)
    head: Optional[str] = None              # model class, when the first one that holds the experts is unfit
    inputs: str = "generate"                # "generate": greedy generate; "logits": argmax of one forward
                                            # (models without a usual decode loop); "embeds": one forward
                                            # from input embeddings


# Keyed by experts class. `config` lists only what the generic tiny config cannot give: MoE layers
# where the default puts dense ones, one attention layer among linear-attention ones (generate needs
# one), and sizes that must agree with each other.
FAMILIES: Dict[str, Family] = {
    "AfmoeExperts": Family(SILU),
    "AriaExperts": Family(SILU),  # transposed weights
    "AXK1Experts": Family(SILU),
    "AXK2Experts": Family(SILU),
    "BailingHybridExperts": Family(SILU, config=dict(layer_types=["linear_attention", "full_attention"],
                                                     mlp_layer_types=["sparse", "sparse"])),
    "BeamExperts": Family(SILU),  # overrides _apply_gate: silu computed in float32
    "Cohere2MoeExperts": Family(SILU),
    "DeepseekOcr2TextExperts": Family(SILU),
    "DeepseekV2Experts": Family(SILU),
    "DeepseekV3Experts": Family(SILU),
    "DeepseekV32Experts": Family(SILU),
    "DeepseekV4Experts": Family(CLAMPED_10, config=dict(mlp_layer_types=["moe", "moe"])),  # `limit`, no alpha
    "DiffusionGemmaTextExperts": Family(GELU_TANH, inputs="logits",
                                        config=dict(canvas_length=8, vision_config=dict(model_type="gemma4_vision"),
                                                    text_config=dict(enable_moe_block=True, top_k_experts=2,
                                                                     vocab_size_per_layer_input=128,
                                                                     hidden_size_per_layer_input=16))),
    "Dots1Experts": Family(SILU, config=dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)),
    "Dots3NoteExperts": Family(SILU),
    "Ernie4_5_MoeExperts": Family(SILU),
    "Ernie4_5_VLMoeMoeExperts": Family(SILU, config=dict(text_config=dict(
        moe_intermediate_size=[32, 32], moe_k=2, rope_parameters=dict(rope_type="default", mrope_section=[3, 3, 2])))),
    "ErgoExpertProjections": Family(RELU2),  # ErgoExperts: its own norm of each route around the dispatch
    "ExaoneMoeExperts": Family(SILU),
    "FlexOlmoExperts": Family(SILU),
    "FlintExperts": Family(SILU, config=dict(mlp_only_layers=[])),
    "Gemma4TextExperts": Family(GELU_TANH, config=dict(text_config=dict(enable_moe_block=True, top_k_experts=2,
                                                                        vocab_size_per_layer_input=128,
                                                                        hidden_size_per_layer_input=16))),
    "Glm4MoeExperts": Family(SILU),
    "Glm4MoeLiteExperts": Family(SILU),
    "Glm4vMoeTextExperts": Family(SILU, config=dict(text_config=dict(
        rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], partial_rotary_factor=0.5)))),
    "Glm5NextTextExperts": Family(CLAMPED_10, config=dict(text_config=dict(  # `swiglu_limit`
        layer_types=["linear_attention", "full_attention"], kv_lora_rank=16, q_lora_rank=32, v_head_dim=16, qk_nope_head_dim=16, index_head_dim=16, index_n_heads=2,
        linear_head_dim=16, linear_num_heads=4))),
    "GlmMoeDsaExperts": Family(SILU),
    "GptOssExperts": Family(SWIGLUOAI),  # interleaved, transposed, biases
    "GraniteMoeExperts": Family(SILU),
    "GraniteMoeSWAExperts": Family(SILU),
    "GraniteMoeHybridExperts": Family(SILU, config=dict(layer_types=["attention", "mamba"])),
    "GraniteMoeSharedExperts": Family(SILU),
    "HunYuanMoEV1Experts": Family(SILU),
    "HYV3Experts": Family(SILU),
    "HYV4Experts": Family(CLAMPED_10),  # `swiglu_limit`
    "HYV4VLExperts": Family(CLAMPED_10),  # `swiglu_limit`
    "InklingExperts": Family(SILU),
    "Inkling2Experts": Family(SOFTCAPPED, config=dict(unpadded_vocab_size=128, vocab_size=160)),  # a padded unembedding
    "Inkling2LoopExperts": Family(SOFTCAPPED, config=dict(unpadded_vocab_size=128)),
    "JambaExperts": Family(SILU, config=dict(attn_layer_period=2, attn_layer_offset=0, expert_layer_period=1,
                                             expert_layer_offset=0)),
    "KimiLinearExperts": Family(SILU, config=dict(layer_types=["linear_attention", "full_attention"],
                                                  mlp_layer_types=["sparse", "sparse"])),
    "Kolibri1Experts": Family(SILU),
    "Kolibri1_1Experts": Family(SILU, config=dict(index_num_heads=1, mlp_only_layers=[])),
    "LagunaExperts": Family(SILU),
    "LaraMiniExperts": Family(SILU),
    # zero experts: weight 0 on real ones. Its config names its own sizes (the defaults: 28 layers,
    # 309 M parameters at the tiny table's width).
    "LongcatFlashExperts": Family(SILU, config=dict(
        qk_rope_head_dim=16, num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=32, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, zero_expert_num=4)),
    "Lfm2MoeExperts": Family(SILU, config=dict(num_dense_layers=0, layer_types=["full_attention", "conv"])),  # F.silu
    "MellumExperts": Family(SILU),
    "MiMoV2FlashExperts": Family(SILU, config=dict(num_key_value_heads=2)),
    "MiniCPM5MoeExperts": Family(SILU),
    "MiniMaxExperts": Family(SILU),
    "MiniMaxM2Experts": Family(SILU),
    "MiniMaxM3VLExperts": Family(SWIGLUOAI),  # `swiglu_alpha` / `swiglu_limit`, concatenated
    "Mistral4Experts": Family(SILU),
    "MistralLarge4TextExperts": Family(SILU),
    "MixtralExperts": Family(SILU),
    "MuseSparkExperts": Family(SILU,  # has_post_expert_norm: the backend runs the norm of each route
                               config=dict(projector_hidden_size=64, text_config=dict(moe_hidden_size=64),
                                           audio_config=dict(num_hidden_layers=4, depths=[1, 1, 1, 1],
                                                             hidden_sizes=[16, 16, 16, 16], out_hidden_size=64))),
    "NemotronHExperts": Family(RELU2),  # no gate: relu(up x)^2
    "OlmoeExperts": Family(SILU),
    "OpenAIPrivacyFilterExperts": Family(SWIGLUOAI, inputs="logits"),  # a token classifier; concatenated
    "PhimoeExperts": Family(SILU),
    "Qwen2MoeExperts": Family(SILU),
    "Qwen3_5MoeExperts": Family(SILU, config=dict(layer_types=["linear_attention", "full_attention"])),
    "Qwen3MoeExperts": Family(SILU),
    "Qwen3NextExperts": Family(SILU, config=dict(layer_types=["linear_attention", "full_attention"])),
    "Qwen3OmniMoeThinkerTextExperts": Family(SILU, head="Qwen3OmniMoeThinkerForConditionalGeneration",
                                             config=dict(vision_start_token_id=120)),
    "Qwen3OmniMoeTalkerTextExperts": Family(SILU, head="Qwen3OmniMoeTalkerForConditionalGeneration", inputs="embeds",
                                            config=dict(text_config=dict(shared_expert_intermediate_size=32),
                                                        spatial_merge_size=2)),
    "Qwen3VLMoeTextExperts": Family(SILU),
    "Qwen4ExpTextExperts": Family(SILU, config=dict(layer_types=["linear_attention", "full_attention"],
                                                    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                                                    indexer_budget=8, indexer_compress_ratio=4)),
    "SolarOpenExperts": Family(SILU),
    "Step3p7Experts": Family(SILU, config=dict(text_config=dict(sliding_window=64))),  # limits: test_families.py
    "UnlimitedOcrTextExperts": Family(SILU),
    "ZayaExperts": Family(SILU, config=dict(num_experts_per_tok=1)),
}

# MoE families whose experts are not decorated and that freetoken does not serve (Llama 4's, DBRX's and JetMoE's
# it serves by replacing their blocks' forward: tests/test_llama4.py, tests/test_dbrx.py): tiny model
# class and config overrides.
UNDECORATED = {
    "doge": ("DogeForCausalLM", dict(is_moe=True, num_experts=16, num_experts_per_tok=2)),  # DogeCDMoE
}

# The generic tiny configuration: set where the config class has the field (text and vision parts).
TINY_TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=8, num_local_experts=8,
                 n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_topk=2, layer_types=None,
                 first_k_dense_replace=0, mlp_only_layers=None, mlp_layer_types=["sparse", "sparse"],
                 max_position_embeddings=512, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1,
                 eos_token_id=None)
TINY_VISION = dict(depth=1, num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16, out_hidden_size=64,
                   deepstack_visual_indexes=[], encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                   d_model=32, output_dim=64, downsample_hidden_size=16)
HEAD_ORDER = ("ForCausalLM", "ForConditionalGeneration", "ForBlockDiffusion", "ForTokenClassification")


def decorated_classes() -> List[Tuple[str, str, str]]:
    """(family, modeling module, class) of every experts class decorated with
    use_experts_implementation in the installed transformers, read from the sources."""
    import transformers

    root = os.path.dirname(transformers.__file__)
    found = []
    for path in sorted(glob.glob(os.path.join(root, "models", "*", "modeling_*.py"))):
        with open(path) as f:
            source = f.read()
        if "@use_experts_implementation" not in source:
            continue
        family = os.path.basename(os.path.dirname(path))
        for cls in re.findall(r"^@use_experts_implementation(?:\([^)]*\))?\s*\nclass (\w+)", source, re.M):
            found.append((family, os.path.basename(path)[:-3], cls))
    return found


def _fields(config_class) -> set:
    return {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()


def tiny_kwargs(config_class, table=TINY_TEXT) -> dict:
    """Constructor arguments of `config_class` (and its sub-configs) that make a tiny model."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = {k: v for k, v in table.items() if k in _fields(config_class)}
    defaults = getattr(config_class, "sub_configs_defaults", {}) or {}
    for name, sub in (getattr(config_class, "sub_configs", {}) or {}).items():
        if not (inspect.isclass(sub) and issubclass(sub, PreTrainedConfig)):  # AutoConfig: by model type
            model_type = getattr(defaults.get(name), "model_type", None)
            if model_type is None:
                continue
            sub = CONFIG_MAPPING[model_type]
        part = TINY_VISION if any(w in name for w in ("vision", "visual", "audio")) else TINY_TEXT
        kwargs[name] = tiny_kwargs(sub, part)
        if getattr(sub, "model_type", None):
            kwargs[name]["model_type"] = sub.model_type
    return kwargs


def _merge(into: dict, overrides: dict) -> dict:
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v
    return into


def _heads(module, experts_class: str):
    from transformers import PreTrainedModel

    heads = [o for n, o in vars(module).items() if inspect.isclass(o) and issubclass(o, PreTrainedModel)
             and o.__module__ == module.__name__ and any(n.endswith(h) for h in HEAD_ORDER)]
    return sorted(heads, key=lambda h: next(i for i, s in enumerate(HEAD_ORDER) if h.__name__.endswith(s)))


def build(family: str, modeling: str, experts_class: str, spec: Family, seed: int = 0):
    """The tiny float32 model of `experts_class`'s family, random weights large enough that greedy
    tokens are decisive. Raises with every head's error if none builds."""
    module = importlib.import_module(f"transformers.models.{family}.{modeling}")
    heads = [getattr(module, spec.head)] if spec.head else _heads(module, experts_class)
    errors = []
    for head in heads:
        kwargs = tiny_kwargs(head.config_class)
        overrides = dict(spec.config)
        if "text_config" in overrides and "text_config" not in kwargs:  # a text-only head of a VLM family
            overrides.update(overrides.pop("text_config"))
        try:
            config = head.config_class(**_merge(kwargs, overrides))
            torch.manual_seed(seed)
            model = head(config).eval()
        except Exception as error:  # noqa: BLE001 (reported below, with every head's error)
            errors.append(f"{head.__name__}: {type(error).__name__}: {error}")
            continue
        if any(is_of(m, experts_class) for m in model.modules()):
            randomize(model, seed)
            return model
        errors.append(f"{head.__name__} holds no {experts_class}")
    raise RuntimeError(f"no tiny model of {family} holds {experts_class}: " + " | ".join(errors))


def is_of(module: torch.nn.Module, experts_class: str) -> bool:
    """`module` is an `experts_class`, or a subclass of it (ergo's experts subclass the decorated
    projections to add a norm per expert)."""
    return any(k.__name__ == experts_class for k in type(module).__mro__)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of a trained model's scale rather than the init's, so logits are decisive (as in
    freetoken_plugin.tiny); norms keep their init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point or (p.dim() == 1 and "norm" in name):
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() > 1 else 0.05))
