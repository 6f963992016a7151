"""load_model: builds a transformers MoE model from a local safetensors checkpoint with its expert
tensors read from the files straight into the pinned host pool. Expert weights never touch the
GPU and are never held twice in host memory; everything else goes to the device."""
import dataclasses
import json
import math
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from ft_ops import formats, user_warnings
from ft_ops.moe import OffloadRuntime
from ft_ops.progress import bar, done
from ft_ops.slot_pool import ExpertShape, HostPool, human_bytes

from .backend import register
from . import compressed_tensors, int4_checkpoints
from .checkpoint_names import checkpoint_name, model_named_entries, quantized_scale_name
from .host_memory import check_host_pool_fits
from .expert_reading import (check_experts, experts_fill, find_entry, holds_packed_fp4, holds_row_scales,
                             per_expert_names, quantizing_fill, refuse_unquantized_mxfp4)
from .fp8_scales import BLOCKS_ONLY, checked_dequantized, dequantized, scale_kind, scale_problem, strategies_of
from .layouts import EXPERT_PARAM_NAMES
from .offload import (MOE_SUB_CONFIGS, as_given, asks_int4, check_options, check_undecorated_blocks, find_experts,
                      install, no_experts_error, quantized_format, read_layouts, resolve_device, resolve_slots,
                      routed_per_token, routed_per_token_entry, undecorated_moe_classes, verified_blocks,
                      QUANTIZE_CHOICES)
from .safetensors_io import FP8_DTYPES, CheckpointError, Entry, check_floating, load_tensor, read_header
from .verify import check_from_host


class _Entries(dict):
    """The shards' entries by name, with the names the loader has looked up (`used`): what is left
    at the end has no place in the model."""

    def __init__(self, *args):
        super().__init__(*args)
        self.used = set()


def _warn_unexpected(path: str, entries: Dict[str, Entry], model: torch.nn.Module) -> None:
    """Names the checkpoint's tensors that the checks found no place for (transformers lists them
    as unexpected), except those the model class says to ignore (e.g. DeepSeek-V3's MTP layer)."""
    buffers = [name for name, _ in model.named_buffers()]
    for name in buffers:  # read later, when present (the checks covered the parameters)
        find_entry(entries, name)
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = {name.rsplit(".", 1)[-1] for name in buffers}
    if "inv_freq" in buffers:  # what from_pretrained also leaves unreported: older checkpoints carry them
        patterns.append(r"rotary_emb\.inv_freq")
    if "position_ids" in buffers:
        patterns.append(r"(^|\.)position_ids$")
    ignore = [re.compile(p) for p in patterns]
    left = sorted(checkpoint_name(entries, n) for n in entries
                  if n not in entries.used and not any(p.search(n) for p in ignore))
    if left:
        count, verb = (f"{len(left)} tensors", "have") if len(left) != 1 else ("1 tensor", "has")
        user_warnings.warn(f"{path}: {count} of the checkpoint {verb} no place in {type(model).__name__} and "
                           f"{'are' if len(left) != 1 else 'is'} not read, e.g. {left[:3]}")


def _shards_of_index(index: str) -> List[str]:
    """The shard files model.safetensors.index.json names, or a one-line refusal of a damaged index."""
    try:
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index} is not valid JSON ({e}); re-download it or save the model again") from None
    except AttributeError:  # valid JSON, not an object
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no \"weight_map\" object from tensor names to shard files; "
                              "re-download it or save the model again")
    bad = [v for v in weight_map.values() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointError(f"{index} maps a tensor to {bad[0]!r}; a weight_map's values are the names of "
                              "shard files beside the index")
    return sorted(set(weight_map.values()))


def read_checkpoint(path: str) -> Dict[str, Entry]:
    """The shards' headers. model.safetensors first, as from_pretrained reads it (save_pretrained
    of an unsharded model into a directory that held shards removes them but leaves their index)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        shards = ["model.safetensors"]
    elif os.path.isfile(index):
        shards = _shards_of_index(index)
    else:
        torch_files = [f for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")
                       if os.path.isfile(os.path.join(path, f))]
        if torch_files:
            raise CheckpointError(f"{path} holds {torch_files[0]} and no safetensors; load_model reads safetensors "
                                  "checkpoints: load it with transformers' from_pretrained and offload its experts "
                                  "with offload_experts, or convert it once (model.save_pretrained writes safetensors)")
        raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json; "
                              "load_model reads safetensors checkpoints")
    entries: Dict[str, Entry] = {}
    for shard in shards:
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise CheckpointError(f"the index of {path} names {shard}, which is missing")
        entries.update(read_header(file))
    return _Entries(entries)


def _non_expert_bytes(model: torch.nn.Module, experts) -> int:
    """The bytes of the model's weights that are not experts (the skeleton's, on the meta device)."""
    expert_params = {f"{name}.{n}" for name, _ in experts for n in EXPERT_PARAM_NAMES}
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in expert_params)


def _dequantized_fp8(entries, pname: str, entry: Entry, dtype: torch.dtype,
                     scale_name: Optional[str] = None) -> torch.Tensor:
    """An FP8 weight dequantized to `dtype`: weight * its scale (of a 128 x 128 block, partial blocks
    at the edges; of the whole weight or of its row where the checkpoint's config allows those); a
    fused expert gate_up_proj [E, 2I, H] is blocked per projection. Used for the non-expert linears on
    load (their weights and scales checked from the headers by _check_entry) and for the demo's
    dequantized copy (whose `entries` go by the checkpoint's names: `scale_name` is the scale's there)."""
    scale_entry = find_entry(entries, scale_name or pname + "_scale_inv")
    name = checkpoint_name(entries, pname)
    if scale_entry is None:
        raise CheckpointError(f"{name} is FP8 but the checkpoint lacks its scales")
    parts = 2 if pname.endswith("gate_up_proj") else 1
    weight = dequantized(load_tensor(entry), scale_entry, scale_name or checkpoint_name(entries, pname + "_scale_inv"),
                         strategies_of(entries), dtype, parts)
    return checked_dequantized(weight, name)


def _persistent_buffers(model: torch.nn.Module) -> List[str]:
    """The names of the model's buffers that checkpoints hold (state_dict's buffers)."""
    names = []
    for module_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        names += [f"{module_name}.{n}" if module_name else n for n, b in module.named_buffers(recurse=False)
                  if b is not None and n not in skip]
    return names


def _owner_model(model: torch.nn.Module, module_name: str):
    """The innermost transformers PreTrainedModel that holds the module `module_name` (its
    _init_weights knows the module's class)."""
    from transformers import PreTrainedModel

    owner = model
    for name, sub in model.named_modules():
        if isinstance(sub, PreTrainedModel) and (not name or module_name.startswith(name + ".")):
            owner = sub
    return owner


def _unset(dtype: torch.dtype):
    """The value a buffer holds until computed: NaN, or an integer type's lowest value (which no
    initialisation computes as a count or an index); booleans are not told apart."""
    if dtype.is_floating_point:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _still_unset(buf: torch.Tensor) -> bool:
    if buf.dtype == torch.bool:
        return False
    return bool((buf.isnan() if buf.is_floating_point() else buf == _unset(buf.dtype)).any())


def _materialize_computed_buffers(model: torch.nn.Module) -> None:
    """Buffers the checkpoint does not hold (rotary frequencies, an embedding's scale, and
    persistent ones a checkpoint left out) are computed on the CPU, as from_pretrained computes
    them: a module without parameters (a rotary embedding) is built again from its config;
    otherwise the model's own weight initialisation fills the buffers, its parameters (read from
    the checkpoint already) marked initialised so that it leaves them alone. A buffer it does not
    compute, or a parameter it changes, is refused. A persistent buffer computed so is named in a
    warning (transformers' "newly initialized" keys), except those the class expects missing."""
    persistent = set(_persistent_buffers(model))
    expected = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    computed = []
    for name, module in list(model.named_modules()):
        meta = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.device.type == "meta"]
        if not meta:
            continue
        computed += [f"{name}.{n}" if name else n for n in meta]
        if hasattr(module, "config") and next(module.parameters(), None) is None:
            with torch.device("cpu"):
                rebuilt = type(module)(config=module.config)
            parent_name, _, leaf = name.rpartition(".")
            model.get_submodule(parent_name).register_module(leaf, rebuilt)
            continue
        for n in meta:  # unset until computed: what the initialisation leaves unset, it did not compute
            buf = module._buffers[n]
            module._buffers[n] = torch.full_like(buf, _unset(buf.dtype), device="cpu")
        init = getattr(_owner_model(model, name), "_init_weights", None)
        # What the checkpoint gave (parameters, buffers it holds) is marked initialised, so that
        # transformers' init functions leave it alone, and checked unchanged after.
        loaded = list(module.parameters()) + [b for n, b in module.named_buffers(recurse=False)
                                              if n not in meta and b is not None]
        versions = [t._version for t in loaded]
        for t in loaded:
            t._is_hf_initialized = True
        try:
            if init is not None:
                with torch.no_grad():
                    init(module)
        finally:
            for t in loaded:
                del t._is_hf_initialized
        unset = [n for n in meta if _still_unset(module._buffers[n])]
        if init is None or unset or [t._version for t in loaded] != versions:
            what = (f"buffers {unset or meta} are neither in the checkpoint nor computed by {type(model).__name__}'s "
                    "initialisation" if init is None or unset else
                    f"computing its buffers {meta}, {type(model).__name__}'s initialisation changed tensors the "
                    "checkpoint holds")
            raise CheckpointError(f"{name}: {what}; load the model with from_pretrained and call "
                                  "freetoken_plugin.offload_experts(model, cache_bytes=...)")
    left = [n for n in computed if n in persistent and not any(p.search(n) for p in expected)]
    if left:
        user_warnings.warn(f"{len(left)} buffer{'s' if len(left) != 1 else ''} of the model "
                           f"{'are' if len(left) != 1 else 'is'} not in the checkpoint and computed by its "
                           f"initialisation, as from_pretrained does: {left[:3]}")


def looks_like_hub_id(path: str) -> bool:
    """Whether a missing path reads as a Hugging Face Hub id (owner/name), not as a file system path."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None and not path.startswith(".")


def _check_path(path: str) -> None:
    if isinstance(path, torch.nn.Module):
        raise CheckpointError(f"load_model takes the path of a local checkpoint directory, got a "
                              f"{type(path).__name__}; for a loaded model use offload_experts(model, cache_bytes=...)")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        shown = repr(path) if isinstance(path, (str, os.PathLike, int, float, type(None))) else f"a {type(path).__name__}"
        raise CheckpointError(f"load_model takes the path of a local checkpoint directory, got {shown}")
    if not os.path.exists(path):
        hub = (f": for a Hugging Face Hub id, download it first (hf download {path} --local-dir DIR) and pass DIR"
               if looks_like_hub_id(str(path)) else "")
        raise CheckpointError(f"{path} does not exist; load_model reads a local checkpoint directory (config.json and "
                              f"safetensors shards){hub}")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is a file; load_model reads a checkpoint directory (config.json and "
                              "safetensors shards)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{path} has no config.json; pass a checkpoint directory saved by save_pretrained")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{config_path} is not a JSON file ({' '.join(str(error).split())[:120]}); a "
                              "checkpoint's config.json is the JSON object save_pretrained writes") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} holds a JSON {type(config).__name__}, not an object; a checkpoint's "
                              "config.json is the JSON object save_pretrained writes")
    model_type = config.get("model_type")
    architectures = config.get("architectures")
    if (not isinstance(model_type, str) or not model_type) and isinstance(architectures, list) and architectures:
        # A sub-model's config saved alone (Qwen3-Omni's talker): its class reads it, the Auto classes do not.
        raise CheckpointError(f"{config_path} names the class {architectures[0]} but no model_type, as a "
                              "sub-model's config saved alone does, so load_model cannot tell which model to build; "
                              f"load it with transformers.{architectures[0]}.from_pretrained(path) and call "
                              "freetoken_plugin.offload_experts(model, cache_bytes=...)")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{config_path} has no model_type (got {model_type!r}); a checkpoint's config.json "
                              "names its architecture, e.g. \"model_type\": \"qwen3_moe\"")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise CheckpointError(f"{config_path}: quantization_config is {quant!r}; it must be an object such as "
                              '{"quant_method": "fp8", "weight_block_size": [128, 128]}, or absent for a dense checkpoint')


def _checkpoint_formats(path: str, config) -> Tuple[str, str]:
    """The formats of a checkpoint from its config: its experts' (dense, block-FP8: quant_method
    "fp8" with 128 x 128 blocks, Hugging Face's layout; or MXFP4: GPT-OSS's, quant_method "mxfp4",
    and DeepSeek-V4's FP4-packed experts, quant_method "fp8" with expert_dtype "fp4", e2m1 pairs in
    int8 with an e8m0 scale per 32 values, MXFP4's bytes) and its other linears' (block-FP8 under
    quant_method "fp8", whatever the experts' format; else dense: GPT-OSS's MXFP4 checkpoints keep
    them bf16). compressed-tensors' FP8 checkpoints are FP8 in both (their experts with row scales
    go to an fp8_rows pool: _skeleton, from the headers). int4 checkpoints (compressed-tensors'
    pack-quantized, GPTQ: int4_checkpoints.py) are INT4 in both: their experts go to an int4 pool,
    their other int4 linears are dequantized. Other quantizations are refused."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return formats.DENSE, formats.DENSE
    get = quant.get if isinstance(quant, dict) else (lambda k, d=None: getattr(quant, k, d))
    method = get("quant_method")
    method = getattr(method, "value", method)
    if isinstance(method, str) and method.lower() in ("fp8", "mxfp4") and method != method.lower():
        raise CheckpointError(f"{path}: config.json's quant_method is {method!r}; transformers and load_model read it "
                              f"in lower case: \"quant_method\": \"{method.lower()}\"")
    if method == "fp8":
        # transformers reads a config without the key as 128 x 128 blocks; an explicit null is per tensor.
        block = get("weight_block_size", [formats.FP8_BLOCK, formats.FP8_BLOCK])
        block = list(block) if isinstance(block, (list, tuple)) else block
        if block != [formats.FP8_BLOCK, formats.FP8_BLOCK]:
            raise CheckpointError(f"{path}: FP8 checkpoint with weight_block_size {block!r}; load_model reads "
                                  f"block-FP8 with [{formats.FP8_BLOCK}, {formats.FP8_BLOCK}] blocks")
        scheme = get("activation_scheme", "dynamic")
        scheme = scheme.lower() if isinstance(scheme, str) else scheme  # transformers lower-cases it
        if scheme == "static":
            raise CheckpointError(f"{path}: FP8 checkpoint with static activation scales; load_model reads "
                                  "activation_scheme 'dynamic' (weights in FP8, activations unquantized)")
        if scheme != "dynamic":
            raise CheckpointError(f"{path}: config.json's activation_scheme is {get('activation_scheme')!r}; "
                                  "transformers and load_model read \"dynamic\" (or \"static\", which load_model refuses)")
        expert_dtype = get("expert_dtype", "fp8")
        if expert_dtype not in ("fp8", "fp4"):
            raise CheckpointError(f"{path}: config.json's expert_dtype is {expert_dtype!r}; transformers reads "
                                  "\"fp8\" or \"fp4\"")
        return formats.MXFP4 if expert_dtype == "fp4" else formats.FP8, formats.FP8
    if method == "mxfp4":
        return formats.MXFP4, formats.DENSE
    if _int4_scheme(path, quant) is not None:  # (its checks) compressed-tensors' pack-quantized, GPTQ
        return formats.INT4, formats.INT4
    if method == compressed_tensors.METHOD:
        _fp8_scale_kinds(path, quant)  # (its checks; experts with row scales go to an fp8_rows pool: _skeleton)
        return formats.FP8, formats.FP8
    raise CheckpointError(f"{path} is a quantized checkpoint (quant_method={method!r}): load_model reads dense "
                          "(float32, bfloat16, float16), block-FP8, compressed-tensors FP8 and int4 (W4A16, "
                          "pack-quantized), GPTQ int4 (symmetric), MXFP4 (GPT-OSS) and DeepSeek-V4's (FP8 with FP4 "
                          "experts) checkpoints")


def _int4_scheme(path: str, quant) -> Optional[int4_checkpoints.Int4Scheme]:
    """The int4 scheme of a checkpoint with quantization_config `quant` (a dict, or transformers'
    config object), checked (int4_checkpoints.py): compressed-tensors' pack-quantized or GPTQ; None
    for any other quantization."""
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict()
    if not isinstance(quant, dict):
        return None
    if compressed_tensors.describes(quant) and int4_checkpoints.describes_ct_int4(quant):
        return int4_checkpoints.ct_scheme(path, quant)
    if quant.get("quant_method") == int4_checkpoints.GPTQ:
        return int4_checkpoints.gptq_scheme(path, quant)
    return None


def _fp8_scale_kinds(path: str, quant):
    """The kinds of scales the FP8 weights of a checkpoint with quantization_config `quant` (a dict,
    or transformers' config object) may have (fp8_scales.py): a compressed-tensors checkpoint's
    strategies; block grids for any other."""
    if compressed_tensors.describes(quant) and _int4_scheme(path, quant) is None:
        return compressed_tensors.fp8_strategies(path, quant if isinstance(quant, dict) else quant.to_dict())
    return BLOCKS_ONLY


def _read_config(path: str, dtype: Optional[torch.dtype] = None):
    """transformers' config of the checkpoint, its refusals (an architecture this transformers does
    not know, a field of the wrong kind) in one line."""
    import transformers as tf

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if dtype is None:  # what the config says is checked before transformers reads it
        _config_dtype(path, raw.get("dtype", raw.get("torch_dtype")), isinstance(raw.get("quantization_config"), dict))
    try:
        # Never transformers' interactive question about running the checkpoint's own code.
        return tf.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, OSError, AttributeError) as error:
        # transformers names trust_remote_code where auto_map has an AutoConfig; without one it
        # finds no config for the model_type.
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        unknown = raw.get("model_type") not in CONFIG_MAPPING_NAMES
        if raw.get("auto_map") and ("trust_remote_code" in str(error) or unknown):
            known = [n for n in raw.get("architectures") or [] if isinstance(n, str) and hasattr(tf, n)]
            hint = (f"; its architectures name transformers' {known[0]}: set config.json's \"model_type\" to "
                    f"\"{getattr(tf, known[0]).config_class.model_type}\" to load it as that architecture" if known else "")
            raise CheckpointError(f"{os.path.join(path, 'config.json')}: model_type {raw.get('model_type')!r} needs the "
                                  f"checkpoint's own code (auto_map), which load_model does not run (it builds the "
                                  f"architectures of transformers {tf.__version__}){hint}") from None
        first = str(error).strip().split("\n")[0].strip()
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: transformers {tf.__version__} cannot read it "
                              f"({first}); load_model needs a config.json this transformers knows") from None


def _generation_config(path: str):
    """The model's generation config as from_pretrained makes it: the checkpoint's
    generation_config.json (end-of-turn ids, sampling defaults), or, where it is missing or cannot
    be read, one from the generation settings in config.json (a file that cannot be read is named
    in a warning; transformers only logs it)."""
    import transformers as tf

    file = os.path.join(path, "generation_config.json")
    try:
        return tf.GenerationConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        if os.path.isfile(file):
            first = " ".join(str(error).split())
            user_warnings.warn(f"{file} cannot be read ({first[:160]}); generate takes its settings from config.json, "
                               "as transformers does")
    try:
        return tf.GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)
    except (OSError, ValueError, TypeError):
        return None  # the model's own default, made from its config


def default_model_class(path: str, config):
    """The class load_model builds for `config`, a language-model head as from_pretrained builds
    it: AutoModelForCausalLM (returned as such), else the class config.json names in
    `architectures` where transformers has it (the MoE VLMs, Mistral4, MuseSpark)."""
    import transformers as tf

    if type(config) in tf.AutoModelForCausalLM._model_mapping:
        return tf.AutoModelForCausalLM
    names = [n for n in (getattr(config, "architectures", None) or []) if isinstance(n, str)]
    cls = next((getattr(tf, n) for n in names if hasattr(tf, n)), None)
    # A class that generates text: a language-model head (ForCausalLM, ForConditionalGeneration).
    if cls is None or not hasattr(cls, "_from_config") or not callable(getattr(cls, "can_generate", None)) or \
            not cls.can_generate():
        raise CheckpointError(f"{path}: transformers has no causal language model for model_type "
                              f"{config.model_type!r} (architectures {names or None}); load_model builds text "
                              "generation models (AutoModelForCausalLM, or a generating class config.json names)")
    return cls


def _build(path: str, config, dtype: torch.dtype, cls=None) -> torch.nn.Module:
    import transformers as tf

    cls = cls or default_model_class(path, config)
    build = cls.from_config if cls is tf.AutoModelForCausalLM else cls._from_config
    return build(config, dtype=dtype)


def _check_model_class(cls) -> None:
    """A class the caller asked for must be a transformers model class (checked before the path)."""
    from transformers import PreTrainedModel

    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise TypeError(f"model_class must be a transformers model class (e.g. transformers."
                        f"Llama4ForConditionalGeneration), got {cls!r}")


def _config_for_class(cls, config):
    """The config a class the caller asked for is built from: the checkpoint's, or its text
    config (Llama4ForCausalLM from a multimodal Llama 4 checkpoint, as AutoModelForCausalLM builds
    it); e.g. Llama4ForConditionalGeneration keeps Llama 4's vision tower."""
    get_text_config = getattr(config, "get_text_config", None)
    for candidate in (config, get_text_config() if callable(get_text_config) else None):
        if isinstance(candidate, cls.config_class):
            return candidate
    raise CheckpointError(f"model_class {cls.__name__} is built from a {cls.config_class.__name__}, but the "
                          f"checkpoint's config.json is a {type(config).__name__} (model_type {config.model_type!r}); "
                          "pass a class of that architecture, or leave model_class out")


def _skeleton(path: str, dtype: Optional[torch.dtype], cls=None):
    """Everything load_model decides before it reads a weight: (config, the experts' format, the
    other linears' format, dtype, the shards' entries, the model built on the meta device, its
    experts blocks, their layouts). Raises what load_model would for a checkpoint it cannot serve."""
    _check_path(path)
    import transformers as tf

    config = _read_config(path, dtype)
    _check_top_k(path, config)
    build_config = config if cls is None else _config_for_class(cls, config)
    fmt, linears = _checkpoint_formats(path, config)
    quant = getattr(config, "quantization_config", None)
    scale_kinds = _fp8_scale_kinds(path, quant)
    if (fmt, linears) != (formats.DENSE, formats.DENSE):
        # The model is built unquantized: its experts go to a pool of the checkpoint's format, its
        # other FP8 linears are dequantized to the compute dtype as they are read.
        del config.quantization_config
    entries = read_checkpoint(path)  # the shards' headers: a checkpoint without safetensors stops here
    if fmt == formats.INT4:  # each int4 linear's tensors as one entry under its weight's name
        int4_checkpoints.merge_entries(path, entries, _int4_scheme(path, quant))
    elif compressed_tensors.describes(quant):
        compressed_tensors.check_tensors(path, entries)
    # transformers 5 names it `dtype` (`torch_dtype`, its old name, only warns that it is deprecated);
    # a config.json naming none: the checkpoint's, as from_pretrained's "auto" takes it.
    dtype = dtype or _config_dtype(path, getattr(config, "dtype", None), linears != formats.DENSE or
                                   fmt != formats.DENSE) or _stored_dtype(entries)
    with torch.device("meta"):  # no memory for any weight yet
        model = _build(path, build_config, dtype, cls)
    experts = find_experts(model)
    if not experts:
        if undecorated_moe_classes(model):
            raise no_experts_error(model)
        raise CheckpointError(f"{type(model).__name__} ({config.model_type}) has no experts block freetoken serves: is "
                              "it a Mixture-of-Experts model? load_model serves transformers' MoE architectures "
                              "(docs/families.md lists them)")
    layouts = read_layouts(experts)  # an expert function freetoken does not serve: refused before the names
    entries = model_named_entries(path, entries, model)
    entries.fp8_scales = scale_kinds
    _alias_tied_experts(entries, experts)
    if fmt == formats.FP8 and holds_row_scales(entries, experts[0][0], layouts[0]):
        # compressed-tensors' channel strategy: row scales have no place in the FP8 pool's 128 x 128
        # grid; the fp8_rows pool holds them as they are.
        fmt = formats.FP8_ROWS
    if fmt == formats.FP8 and holds_packed_fp4(entries, experts[0][0], layouts[0]):
        # DeepSeek-V4's FP4-packed experts under a config.json without expert_dtype 'fp4' (as
        # released): transformers tells them from FP8 ones by their int8 dtype, as here.
        fmt = formats.MXFP4
    return config, fmt, linears, dtype, entries, model, experts, layouts


def _alias_tied_experts(entries, experts) -> None:
    """Experts modules that share their parameters (DiffusionGemma's encoder language model runs its
    decoder's layers) are stored once, under one module's name, as save_pretrained writes tied
    weights: the others read the same tensors under their own names. (Each module still takes its
    own layers of the host pool, as offload_experts gives them.)"""
    tied: Dict[tuple, List[str]] = {}
    for name, module in experts:
        params = tuple(id(p) for p in module.parameters(recurse=False))
        if params:
            tied.setdefault(params, []).append(name)
    for names in (n for n in tied.values() if len(n) > 1):
        stored = {n: [k for k in entries if k.startswith(n + ".")] for n in names}
        source = next((n for n in names if stored[n]), None)
        if source is None:
            continue  # refused later, naming the first module
        for name in names:
            if stored[name]:
                continue
            for key in stored[source]:
                alias = name + key[len(source):]
                entries[alias] = entries[key]
                entries.original[alias] = checkpoint_name(entries, key)
                if key in entries.transposed:
                    entries.transposed.add(alias)
                if key in entries.reordered:
                    entries.reordered[alias] = entries.reordered[key]


def _config_dtype(path: str, dtype, quantized: bool = False) -> Optional[torch.dtype]:
    """config.json's dtype (None where it names none, or "auto"), refused in one line where it is
    not one load_model computes in (transformers' own errors: an AttributeError of torch for an
    unknown name, a ValueError at the build for an integer dtype). A quantized checkpoint whose
    config.json names an FP8 dtype (some published block-FP8 checkpoints do) computes in the
    checkpoint's own float dtype, as with "auto" (from_pretrained failed on them)."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if quantized and dtype in FP8_DTYPES:
        return None
    if dtype not in formats.COMPUTE_DTYPES:
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: dtype {str(dtype).replace('torch.', '')!r} is not "
                              "one load_model computes in; it must be bfloat16, float16 or float32 (or pass dtype= to "
                              "load_model)")
    return dtype


_EXPERT_COUNT_NAMES = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def _check_top_k(path: str, config) -> None:
    """Experts per token within the experts config.json gives (the router's top-k would fail only at
    the first forward, with torch's "selected index k out of range")."""
    try:
        k_name, k = routed_per_token_entry(config)
        configs = (config, *(getattr(config, n, None) for n in MOE_SUB_CONFIGS))
        experts = [(name, getattr(c, name, None)) for c in configs if c is not None for name in _EXPERT_COUNT_NAMES]
    except RuntimeError:  # transformers' per-layer configs refuse a global read; from_pretrained's problem
        return
    e_name, e = next(((n, v) for n, v in experts if isinstance(v, int) and not isinstance(v, bool)), (None, None))
    if k is not None and e is not None and k > e:
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: {k} experts per token ({k_name}), but "
                              f"{e_name} is {e}; a token takes at most {e} experts")


def _stored_dtype(entries) -> torch.dtype:
    """The checkpoint's dtype as from_pretrained's "auto" finds it without one in config.json: the
    first floating-point tensor but FP8 of the first shard, by name (not the header's order, which
    lists float32 tensors such as routers kept in float32 and FP8 scales first); float32 if none."""
    first = min((entry.path for entry in entries.values()), default=None)
    for name in sorted(n for n, entry in entries.items() if entry.path == first):
        dtype = entries[name].dtype
        if dtype.is_floating_point and dtype.itemsize > 1:
            return dtype
    return torch.float32


def _check_entry(entries, pname: str, entry: Entry, param: torch.Tensor, linears: str) -> None:
    """What the shards' headers say about a non-expert parameter's tensor, checked without reading
    it: a floating-point tensor of the parameter's shape, or where the linears are block-FP8 an FP8
    weight of that shape with its scale grid. Messages name the checkpoint's own tensors."""
    name = checkpoint_name(entries, pname)
    if linears == formats.FP8 and entry.dtype == formats.FP8_DTYPE:
        if len(entry.shape) != 2 or not pname.endswith(".weight"):
            raise CheckpointError(f"{name} is FP8 but not the 2-D weight of a linear layer")
        scale = find_entry(entries, pname + "_scale_inv")
        if scale is None:
            stem = name[:-len("weight")]
            raise CheckpointError(f"{name} is FP8 but the checkpoint lacks its scales ({name}_scale_inv; "
                                  f"{stem}scale as DeepSeek-V4 names them, {stem}weight_scale as compressed-tensors does)")
        strategies = strategies_of(entries)
        if scale_kind(scale.dtype, scale.shape, entry.shape, strategies) is None:
            raise CheckpointError(scale_problem(checkpoint_name(entries, pname + "_scale_inv"), scale.dtype, scale.shape,
                                                formats.fp8_scale_shape(*entry.shape),
                                                f" (128 x 128 blocks of {tuple(entry.shape)})", strategies,
                                                rows=entry.shape[0]))
    elif linears == formats.FP8 and entry.dtype in FP8_DTYPES:
        raise CheckpointError(f"{name} is {entry.dtype} in an FP8 checkpoint; load_model reads "
                              "float8_e4m3fn weights with their scales")
    elif isinstance(entry, int4_checkpoints.Int4Entry):
        entry.check_values()  # (GPTQ's zero points and group order, read before the pool exists)
    elif param.dtype.is_floating_point:
        check_floating(entry, name)
    if tuple(entry.shape) != tuple(param.shape):
        raise CheckpointError(f"{name}: checkpoint shape {tuple(entry.shape)}, model expects {tuple(param.shape)} "
                              "(the shape config.json gives: check its sizes, e.g. hidden_size and the experts' "
                              "intermediate size, against the checkpoint)")


def _check_headers(entries, model, experts, fmt: str, linears: str) -> None:
    """The checks that need only the shards' headers, made before any expert is read (a refusal
    should not come after minutes of reading): every non-expert tensor present (a tied one under any
    of its names: the skeleton's weights are tied already) and of the model's shape, and in a
    checkpoint whose config.json names no quantization, experts that are plain floating-point
    tensors."""
    expert_params = {f"{name}.{n}" for name, _ in experts for n in EXPERT_PARAM_NAMES}
    missing = []
    for names, param in _tied_groups(model, expert_params):
        present = [n for n in names if find_entry(entries, n) is not None]
        for pname in present:
            _check_entry(entries, pname, find_entry(entries, pname), param, linears)
        if not present:
            missing.append(names[0])
    if missing:
        count = f"{len(missing)} tensor{'s' if len(missing) != 1 else ''}"
        raise CheckpointError(f"the checkpoint lacks {count} the model needs, e.g. {missing[:3]}; load_model "
                              "reads every weight from the checkpoint (from_pretrained, then offload_experts, loads it "
                              "with the missing ones newly initialized, as transformers does)")
    if fmt == formats.DENSE and linears == formats.DENSE:
        prefixes = tuple(f"{prefix}." for prefix, _ in experts)
        for name, entry in entries.items():  # one pass over the headers
            if not name.startswith(prefixes):
                continue
            if name.endswith("_blocks"):
                raise CheckpointError(f"{name.rsplit('.', 1)[0]} is MXFP4 (gate_up_proj_blocks / _scales) but "
                                      "config.json has no MXFP4 quantization_config; load_model reads MXFP4 experts of "
                                      "GPT-OSS checkpoints")
            if name.endswith(("proj", "weight")):
                check_floating(entry, name)


def _tied_groups(model: torch.nn.Module, skip) -> List[tuple]:
    """(names, parameter) for each distinct parameter of the model not named in `skip`: tied
    weights are one parameter under several names."""
    groups: Dict[int, tuple] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in skip:
            groups.setdefault(id(param), ([], param))[0].append(name)
    return list(groups.values())


def _checked_skeleton(path: str, dtype: Optional[torch.dtype], cls=None):
    """_skeleton's model and what the shards' headers say, checked before any weight is read: the
    non-expert tensors, and the experts (of every format). Returns _skeleton's tuple and the
    experts' ExpertShape."""
    config, fmt, linears, dtype, entries, model, experts, layouts = _skeleton(path, dtype, cls)
    _check_headers(entries, model, experts, fmt, linears)
    first = layouts[0]
    if fmt == formats.MXFP4 and not first.gated:  # before ExpertShape, whose size checks would name the wrong problem
        said = "expert_dtype 'fp4'" if linears == formats.FP8 else "quant_method 'mxfp4'"
        raise CheckpointError(f"config.json's quantization_config has {said}, but {type(experts[0][1]).__name__} "
                              "has no gate: MXFP4 experts are gated ones (GPT-OSS's, DeepSeek-V4's); experts without a "
                              "gate load in bf16, float16, float32 or block-FP8")
    if fmt == formats.MXFP4 and linears == formats.DENSE:  # GPT-OSS's layout (DeepSeek-V4's is checked per expert)
        quantized = [find_entry(entries, f"{prefix}.gate_up_proj_blocks") is not None for prefix, _ in experts]
        for prefix, _ in experts:
            refuse_unquantized_mxfp4(entries, prefix, any(quantized))
        if first.split:
            raise CheckpointError(f"config.json's quantization_config says mxfp4, but {type(experts[0][1]).__name__} "
                                  f"holds its experts as {', '.join(first.split)}: load_model reads MXFP4 experts in "
                                  "GPT-OSS's layout, and no MXFP4 format defines this one; load its float checkpoint "
                                  "(load_model(path, quantize='fp8') makes its experts block-FP8)")
        if first.concatenated:  # (after the check above: plain experts under an mxfp4 config are the problem there)
            raise CheckpointError(f"config.json's quantization_config says mxfp4, but {type(experts[0][1]).__name__} "
                                  "keeps gate rows then up rows: load_model reads MXFP4 experts in GPT-OSS's layout "
                                  "(gate and up rows interleaved), and no MXFP4 format defines another order; load "
                                  "its bf16 or block-FP8 checkpoint")
    group = _int4_pool_group(path, entries, experts, layouts) if fmt == formats.INT4 else 0
    try:
        shape = ExpertShape(len(experts), first.experts, first.hidden, first.intermediate, first.dtype, first.bias, fmt,
                            gated=first.gated, group=group)
        shape.bank_specs  # noqa: B018 (computed for its refusal of sizes the format cannot hold)
    except ValueError as error:  # sizes the format cannot hold (MXFP4's 32-value blocks): the checkpoint's problem
        raise CheckpointError(f"{path}: {error} (config.json's hidden and expert intermediate sizes); the "
                              f"checkpoint cannot be {fmt} as its config.json describes it") from None
    # A float checkpoint labelled fp8 (MXFP4 blocks under an fp8 label, and the undecorated families'
    # layouts that no FP8 format defines, are named by check_experts).
    if linears == formats.FP8 and not (first.split or first.paths) and not any(
            getattr(e, "dtype", None) in FP8_DTYPES or n.endswith("_blocks") for n, e in entries.items()):
        raise CheckpointError(f"config.json's quantization_config says fp8, but no tensor of {path} is FP8: remove "
                              "the quantization_config of a checkpoint that is not FP8 (load_model(path, "
                              "quantize='fp8') then makes its experts block-FP8 as it reads them)")
    check_experts(entries, experts, layouts, shape, linears)
    # (after the headers: MXFP4 tensors under an fp8 config are named there)
    if fmt in formats.FP8_FORMATS and first.bias:
        raise CheckpointError(f"{type(experts[0][1]).__name__} has expert biases, which load_model does not read "
                              "beside FP8 experts (transformers' FP8 quantizer stores experts without them), so their "
                              "order beside the FP8 rows is unknown; load its float checkpoint with "
                              "load_model(path, quantize='fp8'), which keeps the biases")
    return (config, fmt, linears, dtype, entries, model, experts, layouts), shape


def _int4_pool_group(path: str, entries, experts, layouts) -> int:
    """The int4 pool's group size from the first MoE layer's first expert (its gate and down
    projections' groups), refused in one line where the experts cannot be int4 (no gate, biases, a
    group the kernels do not take), before any expert is read."""
    first, name = layouts[0], type(experts[0][1]).__name__
    if not first.gated:
        raise CheckpointError(f"{path}: {name} has no gate, and int4 experts are gated ones (gate and up rows); "
                              "load a float or FP8 checkpoint of this model")
    if first.bias:
        raise CheckpointError(f"{path}: {name} has expert biases, which load_model does not read beside int4 experts "
                              "(their checkpoints store per-expert linears without them); load its float checkpoint")
    names = per_expert_names(entries, experts[0][0]) or ("gate_proj", "up_proj", "down_proj")
    w13, w2 = (entries.get(f"{experts[0][0]}.0.{n}.weight") for n in (names[0], names[-1]))
    if not isinstance(w13, int4_checkpoints.Int4Entry) or not isinstance(w2, int4_checkpoints.Int4Entry):
        return formats.MXFP4_GROUP  # (a placeholder: the experts' fill names what the checkpoint holds instead)
    group = int4_checkpoints.pool_group(w13, w2)
    try:
        formats.check_int4_group(group, first.hidden, first.intermediate)
    except ValueError:
        raise CheckpointError(f"{path}: the experts' int4 groups ({w13.group} values of {checkpoint_name(entries, w13.name)}, "
                              f"{w2.group} of {checkpoint_name(entries, w2.name)}) give the pool groups of {group}, which "
                              f"the int4 pool cannot take: a multiple of 32 dividing the hidden size {first.hidden} and "
                              f"the experts' intermediate size {first.intermediate}") from None
    return group


def checkpoint_formats(path: str, dtype: Optional[torch.dtype] = None) -> Tuple[str, str]:
    """The formats of the checkpoint at `path`, its experts' (formats.DENSE, FP8, MXFP4 or INT4) and
    its other linears' (DENSE, FP8 or INT4), from its config.json (whose dtype is checked unless `dtype`
    overrides it). What only the headers tell is not looked at: FP8 experts with row scales
    (FP8_ROWS) or DeepSeek-V4's FP4-packed ones (MXFP4) read as FP8 here."""
    _check_path(path)
    return _checkpoint_formats(path, _read_config(path, dtype))


def write_dequantized_copy(path: str, out_dir: str, dtype: torch.dtype) -> None:
    """A copy of FP8 checkpoint `path` in `out_dir` with every FP8 weight dequantized to `dtype`
    (and every int4 linear of an int4 checkpoint: its codes times their group's scales)
    by freetoken's block rule (partial blocks at the edges included; fused gate_up_proj tensors
    blocked per projection; compressed-tensors' tensor and row scales) and DeepSeek-V4's FP4-packed
    experts by MXFP4's, config.json without its quantization_config and the checkpoint's other files
    (generation_config.json, tokenizer) as they are: a reference that transformers loads as a plain
    model. (transformers' own CPU fallback takes the block size as rows / scale rows, which is wrong
    where a dimension is not a multiple of 128.) One shard in memory at a time; the free space of
    `out_dir` is checked first."""
    import shutil

    from safetensors.torch import save_file

    entries = read_checkpoint(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    entries.fp8_scales = _fp8_scale_kinds(path, config.get("quantization_config"))
    int4 = _int4_scheme(path, config.get("quantization_config"))
    if int4 is not None:  # int4 linears: one Int4Entry each, which load_tensor dequantizes
        int4_checkpoints.merge_entries(path, entries, int4)
    elif compressed_tensors.describes(config.get("quantization_config")):
        compressed_tensors.check_tensors(path, entries)
    scales = {}  # weight name -> its scale's name (`<linear>.scale` or `<linear>.weight_scale_inv`)
    for name in entries:
        renamed = quantized_scale_name(entries, name)
        if renamed.endswith("_scale_inv"):
            scales[renamed[:-len("_scale_inv")]] = name
    weights = {name: entry for name, entry in entries.items() if name not in scales.values()}
    fp4 = {name for name, entry in weights.items() if entry.dtype == torch.int8 and name in scales}
    need = 0
    for name, entry in weights.items():
        values = math.prod(entry.shape) * (2 if name in fp4 else 1)  # FP4: two values a byte
        dequantizing = entry.dtype == formats.FP8_DTYPE or name in fp4 or isinstance(entry, int4_checkpoints.Int4Entry)
        need += values * (dtype.itemsize if dequantizing else entry.dtype.itemsize)
    os.makedirs(out_dir, exist_ok=True)
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise CheckpointError(f"a dequantized copy of {path} needs {human_bytes(need)} in {out_dir}, where "
                              f"{human_bytes(free)} are free; point TMPDIR to a larger disk")
    for name in os.listdir(path):
        source = os.path.join(path, name)
        if os.path.isfile(source) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(source, os.path.join(out_dir, name))
    config.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    shards: Dict[str, List[str]] = {}
    for name, entry in weights.items():
        shards.setdefault(entry.path, []).append(name)
    weight_map = {}
    for i, names in enumerate(shards.values()):
        tensors = {}
        for name in names:
            entry = weights[name]
            if name in fp4:  # e2m1 pairs with an e8m0 scale per 32 values: MXFP4's bytes
                scale = load_tensor(entries[scales[name]])
                tensor = formats.dequantize_mxfp4(load_tensor(entry).view(torch.uint8), scale.view(torch.uint8), dtype)
            elif entry.dtype == formats.FP8_DTYPE:
                tensor = _dequantized_fp8(entries, name, entry, dtype, scales.get(name))
            elif isinstance(entry, int4_checkpoints.Int4Entry):
                tensor = load_tensor(entry).to(dtype)
            else:
                tensor = load_tensor(entry)
            tensors[name] = tensor.contiguous()
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def check_checkpoint(path: str, dtype: Optional[torch.dtype] = None) -> ExpertShape:
    """Raises, before any weight is read, what load_model(path, dtype=dtype) would raise for a
    checkpoint it cannot serve (missing path, no safetensors shards, no decorated experts, an expert
    function it does not know, tensors whose headers do not fit the model); returns the shape of its
    experts."""
    register()
    return _checked_skeleton(path, dtype)[1]


def _load_non_experts(entries, model, experts, linears: str, device) -> None:
    """Every tensor of the model but the experts, read to `device` (block-FP8 linears dequantized),
    buffers the checkpoint lacks computed: before the experts, so that a problem here comes before
    the long read into the host pool."""
    expert_params = {f"{name}.{n}" for name, _ in experts for n in EXPERT_PARAM_NAMES}
    untied: Dict[str, torch.nn.Parameter] = {}

    def read(pname: str, param: torch.Tensor) -> torch.nn.Parameter:
        entry = find_entry(entries, pname)
        if linears == formats.FP8 and entry.dtype == formats.FP8_DTYPE:
            tensor = _dequantized_fp8(entries, pname, entry, param.dtype)
        else:
            tensor = load_tensor(entry)
        # requires_grad as from_pretrained's: a backward then reaches the experts' op and its
        # refusal, as on an offload_experts model, not autograd's "does not require grad".
        return torch.nn.Parameter(tensor.to(device=device, dtype=param.dtype), requires_grad=param.requires_grad)

    def put(name: str, value: torch.nn.Parameter) -> None:
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = value

    with torch.no_grad():
        for names, param in _tied_groups(model, expert_params):
            # A tied group (the skeleton's weights are tied already) is read from whichever of its
            # names the checkpoint holds, and every name gets that one parameter; names the
            # checkpoint holds with other values keep their own (from_pretrained unties them).
            present = [n for n in names if find_entry(entries, n) is not None]
            if not present:
                continue  # a group no name of which is in the checkpoint was refused by _check_headers
            loaded = read(present[0], param)
            for other in present[1:]:
                value = read(other, param)
                if not torch.equal(value, loaded):
                    untied[other] = value
            for name in names:
                put(name, untied.get(name, loaded))
            if any(n in untied for n in names):
                user_warnings.warn(f"the config ties {', '.join(names)}, but the checkpoint holds "
                                   f"{', '.join(n for n in names if n in untied)} with other values than "
                                   f"{present[0]}: they are not tied (as from_pretrained does; set "
                                   "tie_word_embeddings=False in config.json to silence this)")
        for bname, buf in list(model.named_buffers()):
            entry = find_entry(entries, bname)
            if entry is not None:
                if buf.dtype.is_floating_point:
                    check_floating(entry, bname)
                module_name, _, leaf = bname.rpartition(".")
                model.get_submodule(module_name)._buffers[leaf] = load_tensor(entry).to(dtype=buf.dtype)
        _materialize_computed_buffers(model)
    model.tie_weights()
    for name, value in untied.items():  # tie_weights ties by the config: undo it where the checkpoint differs
        put(name, value)
        tied = getattr(model, "all_tied_weights_keys", None)  # transformers' record ({target: source}), for saving
        if isinstance(tied, dict):
            for target in [t for t, source in tied.items() if name in (t, source)]:
                tied.pop(target)


def check_requantizing(path: str, fmt: str, quantize: Optional[str], argument: str = "quantize") -> None:
    """Refuses `quantize` for checkpoint `path` whose experts are quantized already (`fmt`, the
    format check_checkpoint's shape names): MXFP4 and int4 experts by any format, FP8 ones by int4
    (quantize="fp8" keeps them as they are). `argument` names the setting as the caller's user
    gave it (quantized_format's): "quantize", or the command line's "--quantize"."""
    if quantize is None:
        return
    if fmt in formats.PACKED_FORMATS:
        raise CheckpointError(f"{path} holds {'MXFP4' if fmt == formats.MXFP4 else 'int4'} experts, which load as they "
                              f"are (about a quarter of bf16's bytes); {as_given(argument, quantize)} would dequantize "
                              f"and quantize them again: leave {argument} out")
    if fmt in formats.FP8_FORMATS and asks_int4(quantize):
        raise CheckpointError(f"{path} holds FP8 experts, which load as they are (half of bf16's bytes); "
                              f"{as_given(argument, quantize)} would round them a second time: leave {argument} out")


def load_model(path: str, *, cache_bytes: Optional[int] = None, cache_slots: Optional[int] = None,
               device=None, dtype: Optional[torch.dtype] = None, progress: bool = True,
               quantize: Optional[str] = None, model_class=None, **options):
    """The model of checkpoint directory `path` (config.json + safetensors shards), its experts
    offloaded: experts go from the files into the pinned host pool, the rest to `device` (default:
    CUDA if available). The model is the class from_pretrained's AutoModelForCausalLM builds (else
    the generating class config.json's `architectures` names), or `model_class` (a transformers
    class of the checkpoint's architecture, e.g. Llama4ForConditionalGeneration to keep Llama 4's
    vision tower). FP8, MXFP4 and int4 checkpoints' experts stay as they are; quantize="fp8" makes
    a float checkpoint's experts block-FP8 as they are read, quantize="int4" symmetric int4 with a
    scale per 128 values of a row ("int4-g32", "int4-g64": smaller groups; offload.quantized_format),
    one layer at a time: the host holds the quantized pool and one float layer, never the float
    experts. Before the model is switched, one
    experts block's own forward (the class's code, on the block's weights from the pool) and the
    offloaded computation are compared on a probe (verify.py). Options go to OffloadRuntime.
    Returns the model; freetoken_plugin.stats(model) reads its counters."""
    register()
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={quantize!r}: load_model quantizes a float checkpoint's experts to 'fp8' (128 x "
                         "128 block scales, as transformers quantizes) or 'int4' (symmetric, a scale per 128 values; "
                         "'int4-g32', 'int4-g64' or 'int4-g128' for one group size), or pass quantize=None to keep "
                         "them as stored")
    check_options(options, progress)
    if model_class is not None:
        _check_model_class(model_class)
    if isinstance(dtype, str):  # as transformers takes it: "bfloat16", "auto" (the checkpoint's)
        dtype = None if dtype == "auto" else getattr(torch, dtype, dtype)
    if dtype is not None and dtype not in formats.COMPUTE_DTYPES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32 (or their names, or None or "
                        f"'auto': the checkpoint's), got {dtype!r}")
    device = resolve_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    (config, fmt, linears, dtype, entries, model, experts, layouts), shape = _checked_skeleton(path, dtype, model_class)
    first = layouts[0]
    check_requantizing(path, fmt, quantize)  # (before int4's size checks, whose advice would be quantize='fp8')
    target, group = quantized_format(quantize, first.hidden, first.intermediate, first.gated)
    quantizing = target != formats.DENSE and fmt == formats.DENSE
    if quantizing:
        shape = dataclasses.replace(shape, format=target, group=group)
    # Beside the pool while it fills: the other weights where they stay on the host, and a
    # quantizing fill's float layer and the layer it reads.
    others = _non_expert_bytes(model, experts) if device.type == "cpu" else 0
    quantizing_extra = 2 * dataclasses.replace(shape, format=formats.DENSE, group=0).expert_bytes * shape.experts + others
    check_host_pool_fits(shape, quantizing_extra if quantizing else others,
                         "load it with load_model(path, quantize='fp8')", quantizing_extra)
    _warn_unexpected(path, entries, model)
    generation_config = _generation_config(path)
    slots = resolve_slots(first.experts, shape.layers, shape.expert_bytes, cache_slots, cache_bytes,
                          options.get("stream_prefill", True), progress)

    _load_non_experts(entries, model, experts, linears, device)
    check_undecorated_blocks(model, experts, layouts)  # their routers and shared experts are loaded now
    if generation_config is not None and model.can_generate():
        model.generation_config = generation_config

    host = HostPool.allocate(shape, pin=device.type == "cuda", progress=progress)
    fill = experts_fill(fmt, linears)
    if quantizing:
        fill = quantizing_fill(shape)
    for layer in bar(range(shape.layers), "experts -> host pool", progress, unit="layer"):
        fill(entries, experts[layer][0], layouts[layer], host, layer)
    done(f"{'quantized' if quantizing else 'read'} {shape.layers} MoE layers of experts into the "
         f"{'pinned ' if host.is_pinned else ''}host pool ({shape.format}, {human_bytes(host.nbytes)})", progress)
    for layer in verified_blocks(layouts):
        check_from_host(experts[layer][1], layouts[layer], host, layer)
    runtime = OffloadRuntime(host, slots, device, activation=[lay.activation for lay in layouts],
                             top_k=routed_per_token(model.config),
                             **options)
    install(model, experts, layouts, runtime, device)
    return model.eval()
