"""A checkpoint's tensors under the names of the model's modules, as from_pretrained sees them.

Checkpoints on the Hub keep their architectures' original names; transformers renames them on load
with the architecture's conversion mapping (transformers/conversion_mapping.py): Phi-MoE's
`block_sparse_moe.gate.weight` is the router's weight, Granite-MoE's `input_linear.weight` the
experts' `gate_up_proj`, Qwen3.5-MoE's `model.language_model.` prefix is `model.`, DeepSeek-V4's
`attn.wq_a` is `self_attn.q_a_proj`. load_model reads tensors by the module names, so it applies
the same renamings (and adds or drops the base model's prefix as from_pretrained does). Per-expert
tensors keep their expert index: the loader merges them into its host pool itself. A tensor that
transformers computes from others (a concatenation of q/k/v convolutions, a split, a transpose)
is refused in one line: load_model reads tensors as they are stored.
"""
from typing import Dict, Tuple

import torch

from .safetensors_io import CheckpointError, Entry

# The conversion operations of the per-expert merge (experts.<e>.gate_proj / up_proj / down_proj,
# or w1 / w3 / w2, into gate_up_proj / down_proj), which the loader does itself.
_EXPERT_MERGE_OPS = {"MergeModulelist", "Concatenate"}


def _transforms(model: torch.nn.Module) -> Tuple[list, list]:
    """(renamings, converters) transformers applies when it loads `model`'s checkpoints; ([], [])
    with a transformers that has no conversion mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _merges_experts(converter) -> bool:
    """Whether a converter is the per-expert merge (every source one expert's tensor, `*` for the
    expert index; the ops stack and concatenate them): the loader reads those tensors itself."""
    ops = {type(op).__name__ for op in converter.operations}
    return ops <= _EXPERT_MERGE_OPS and all("*" in s for s in converter.source_patterns)


def _transposes_experts(converter) -> bool:
    """Whether a converter only transposes a fused experts tensor (Qwen3-VL-MoE's checkpoints hold
    gate_up_proj as [E, H, 2I]): the loader reads it in the other layout itself."""
    ops = converter.operations
    return (len(ops) == 1 and type(ops[0]).__name__ == "Transpose"
            and {getattr(ops[0], "dim0", None), getattr(ops[0], "dim1", None)} in ({1, 2}, {-1, -2})
            and len(converter.target_patterns) == 1
            and converter.target_patterns[0].endswith(("experts.gate_up_proj", "experts.down_proj")))


def _rename(name: str, renamings: list, base_prefix: str, model_names) -> str:
    from transformers.core_model_loading import rename_source_key

    renamed, _ = rename_source_key(name, renamings, [], base_prefix, model_names)
    return renamed


def model_named_entries(path: str, entries: Dict[str, Entry], model: torch.nn.Module) -> Dict[str, Entry]:
    """`entries` (the shards' tensors by checkpoint name) by the names `model`'s modules use: a new
    mapping of the same class (the loader's _Entries), with `original` mapping each new name to
    the checkpoint's and `transposed` the fused experts tensors transformers transposes on load.
    Raises CheckpointError, before any tensor is read, for a tensor transformers
    would compute from others and for two tensors that land on one name."""
    renamings, converters = _transforms(model)
    base_prefix = getattr(model, "base_model_prefix", None) or None
    model_names = dict.fromkeys(name for name, _ in model.named_parameters(remove_duplicate=False))
    model_names.update(dict.fromkeys(name for name, _ in model.named_buffers(remove_duplicate=False)))
    out = type(entries)()
    original: Dict[str, str] = {}
    transposed = set()
    for name, entry in entries.items():
        if name in model_names:  # already the module's name (a checkpoint of the model's own state_dict)
            out[name], original[name] = entry, name
            continue
        renamed = _rename(name, renamings, base_prefix, model_names) if (renamings or base_prefix) else name
        for converter in converters:
            _, pattern = converter.rename_source_key(renamed)
            if pattern is None or _merges_experts(converter):
                continue
            if _transposes_experts(converter):
                transposed.add(renamed)
                continue
            ops = ", ".join(type(op).__name__ for op in converter.operations)
            raise CheckpointError(
                f"{path}: transformers computes {type(model).__name__}'s {converter.target_patterns} from the "
                f"checkpoint's {converter.source_patterns} ({ops}) as it loads them (e.g. {name}), which load_model "
                "does not do; load the model with from_pretrained and call freetoken_plugin.offload_experts(model, "
                "cache_bytes=...)")
        if renamed in out:
            raise CheckpointError(f"{path}: the checkpoint holds two tensors for {renamed} ({original[renamed]} and "
                                  f"{name}); remove one of them")
        out[renamed] = entry
        original[renamed] = name
    out.original, out.transposed = original, transposed
    return out


def checkpoint_name(entries, name: str) -> str:
    """The checkpoint's own name of the tensor `name` of model_named_entries' result (for messages)."""
    return getattr(entries, "original", {}).get(name, name)

