"""A checkpoint's tensors under the names of the model's modules, as from_pretrained sees them.

Checkpoints on the Hub keep their architectures' original names; transformers renames them on load
with the architecture's conversion mapping (transformers/conversion_mapping.py): Phi-MoE's
`block_sparse_moe.gate.weight` is the router's weight, Granite-MoE's `input_linear.weight` the
experts' `gate_up_proj`, Qwen3.5-MoE's `model.language_model.` prefix is `model.`, DeepSeek-V4's
`attn.wq_a` is `self_attn.q_a_proj` (and its block scales `attn.wq_a.scale` are the
`weight_scale_inv` of transformers' FP8 quantizer, as compressed-tensors' `weight_scale` are).
load_model reads tensors by the module names, so it applies the same renamings (and adds the base
model's prefix to a base model's checkpoint, or drops it where the checkpoint's model holds this one
under that prefix: Llama 4's multimodal checkpoints read as its text model). Per-expert tensors
keep their expert index: the loader merges them into its host pool itself (ERNIE-4.5-VL's,
numbered over its text and vision experts, are renamed into their module), and reorders the rows
of fused experts transformers de-interleaves (Inkling2's). A non-expert tensor that transformers
computes from stored ones by operations that only move values (_MOVING_OPS: Kimi-Linear's and
BailingHybrid's q/k/v convolutions, Lara-Mini's fused projection, a rotary permutation) is
a ComputedEntry: its shape comes from transformers' own operations run on meta tensors, its values
from the same operations on the stored tensors when the loader reads it. Other operations are
refused in one line.
"""
import re
from typing import Dict, List, Tuple

import torch

from .safetensors_io import FP8_DTYPES, CheckpointError, Entry, load_tensor

# The conversion operations of the per-expert merge (experts.<e>.gate_proj / up_proj / down_proj,
# or w1 / w3 / w2, into gate_up_proj / down_proj), which the loader does itself.
_EXPERT_MERGE_OPS = {"MergeModulelist", "Concatenate"}
_EXPERT_TARGETS = ("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")


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
    return (ops <= _EXPERT_MERGE_OPS and all("*" in s for s in converter.source_patterns)
            and all(t.endswith(_EXPERT_TARGETS) for t in converter.target_patterns))


# Operations whose result a non-expert tensor may be: they only move values (no arithmetic, no
# quantization), and transformers runs them the same way on meta tensors. PermuteForRope reorders a
# projection's rows for the rotary embedding's layout, Interleave alternates the rows of two
# halves (or undoes that), Inkling2UnpadVocab keeps the first rows of a padded unembedding (in the
# parameter's dtype, as the loader stores every tensor), Inkling2LoopMergeMessageQueries
# concatenates two tensors' rows in another order.
_MOVING_OPS = {"Concatenate", "Chunk", "Split", "Transpose", "PermuteForRope", "Interleave", "Inkling2UnpadVocab",
               "Inkling2LoopMergeMessageQueries"}


class ComputedEntry:
    """A model tensor transformers computes from stored tensors as it loads them: `sources` (the
    converter's source pattern -> the stored tensor's Entry) through `converter`'s operations, of
    which this is the output `target` (a full name). dtype and shape as the entries of the shards'
    headers give them; `load()` reads the sources and runs the operations."""

    def __init__(self, converter, sources: Dict[str, Entry], first_target: str, target: str, model, shape, dtype):
        self.converter, self.sources, self.first_target, self.target = converter, sources, first_target, target
        self.model, self.shape, self.dtype = model, tuple(shape), dtype

    def load(self) -> torch.Tensor:
        return _convert(self.converter, {k: load_tensor(e) for k, e in self.sources.items()}, self.first_target,
                        self.model)[self.target]


def _convert(converter, tensors: Dict[str, torch.Tensor], first_target: str, model) -> Dict[str, torch.Tensor]:
    """transformers' operations of `converter` on `tensors` (source pattern -> tensor), as its
    WeightConverter.convert runs them: the outputs by full name (the first target's name with each
    target pattern in its place)."""
    values = {k: [v] for k, v in tensors.items()}
    for op in converter.operations:
        values = op.convert(values, source_patterns=converter.source_patterns,
                            target_patterns=converter.target_patterns, full_layer_name=first_target, model=model,
                            config=model.config, missing_keys=set())
    pattern = next(k for k in values if k in first_target)
    prefix, _, suffix = first_target.partition(pattern)
    return {prefix + k + suffix: (v[0] if isinstance(v, list) else v) for k, v in values.items()}


def _computed_entries(path: str, model, converter, first_target: str, sources: Dict[str, Entry]) -> List[ComputedEntry]:
    """The model tensors `converter` makes of one group of stored tensors (those that land on
    `first_target`), their shapes from its operations on meta tensors."""
    missing = [p for p in converter.source_patterns if p not in sources]
    if missing:
        raise CheckpointError(f"{path}: {first_target} is computed from {_patterns(converter.source_patterns)}, but "
                              f"the checkpoint lacks {_patterns(missing)} beside {_patterns(sorted(sources))}")
    dtypes = {e.dtype for e in sources.values()}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise CheckpointError(f"{path}: {first_target} is computed from tensors of dtypes {sorted(map(str, dtypes))}; "
                              "load_model computes it from floating-point tensors of one dtype")
    dtype = dtypes.pop()
    if dtype in FP8_DTYPES:
        raise CheckpointError(f"{path}: {first_target} is computed from FP8 tensors; load_model computes such "
                              "tensors from plain floating-point ones only")
    meta = {k: torch.empty(e.shape, dtype=dtype, device="meta") for k, e in sources.items()}
    outputs = _convert(converter, meta, first_target, model)
    return [ComputedEntry(converter, sources, first_target, name, model, t.shape, dtype) for name, t in outputs.items()]


def _moves_values(converter) -> bool:
    return all(type(op).__name__ in _MOVING_OPS for op in converter.operations)


def _transposes_experts(converter) -> bool:
    """Whether a converter only transposes a fused experts tensor (Qwen3-VL-MoE's checkpoints hold
    gate_up_proj as [E, H, 2I]): the loader reads it in the other layout itself."""
    ops = converter.operations
    return (len(ops) == 1 and type(ops[0]).__name__ == "Transpose"
            and {getattr(ops[0], "dim0", None), getattr(ops[0], "dim1", None)} in ({1, 2}, {-1, -2})
            and len(converter.target_patterns) == 1 and converter.target_patterns[0].endswith(_EXPERT_TARGETS))


# Operations that dequantize an expert tensor from it and its scales, and pass it as it is when it
# comes alone (a float checkpoint's, as save_pretrained writes it): Inkling2-Loop's.
_PASSES_A_LONE_TENSOR = {"Inkling2LoopDequantizeExperts"}


def _reorders_experts(converter, pattern: str) -> bool:
    """Whether a converter, for the stored tensor of source `pattern`, only reorders the rows of one
    fused experts tensor (Inkling2's checkpoints hold mlp.experts.w13_weight with gate and up rows
    alternating, which transformers de-interleaves into gate_up_proj): the loader reorders them
    itself as it reads the layer. Behind an operation of _PASSES_A_LONE_TENSOR only for its first
    source (the weight); its other sources (scales) are refused, so a quantized checkpoint is."""
    ops = [type(op).__name__ for op in converter.operations]
    if ops and ops[0] in _PASSES_A_LONE_TENSOR:  # then the rest may be nothing: the tensor as stored
        if pattern != converter.source_patterns[0]:
            return False
        ops = ops[1:]
    elif len(converter.source_patterns) != 1 or not ops:
        return False
    return (all(op == "Interleave" for op in ops) and len(converter.target_patterns) == 1
            and converter.target_patterns[0].endswith(_EXPERT_TARGETS))


def _splits_experts(converter) -> bool:
    """Whether a converter is ERNIE-4.5-VL's split of per-expert tensors between expert modules
    (experts.<e>.down_proj.weight: the first half of a layer's experts into text_moe.experts, the
    second into vision_moe.experts): the loader renames each expert's tensors into its module."""
    return (all(type(op).__name__ == "ErnieFuseAndSplitTextVisionExperts" for op in converter.operations)
            and all(p.startswith("experts.*.") for p in converter.source_patterns)
            and all(t.endswith(_EXPERT_TARGETS) for t in converter.target_patterns))


_EXPERT_INDEX = re.compile(r"^(.*?)experts\.(\d+)\.(.+)$")


def _split_expert_names(split: List[Tuple[str, str, Entry, object]]) -> List[Tuple[str, str, Entry]]:
    """(new name, checkpoint name, entry) of the per-expert tensors of _splits_experts' converters
    (model name, checkpoint name, entry, converter): of a layer's n experts, as transformers splits
    them, the first ceil(n / targets) go to the first target's module, the next to the second's, each
    numbered from 0 there."""
    groups: Dict[Tuple[str, str], List[Tuple[int, str, Entry, object]]] = {}
    for renamed, name, entry, converter in split:
        base, index, rest = _EXPERT_INDEX.match(renamed).groups()
        groups.setdefault((base, rest), []).append((int(index), name, entry, converter))
    out = []
    for (base, rest), members in groups.items():
        size = -(-len(members) // len(members[0][3].target_patterns))
        for index, name, entry, converter in members:
            module = converter.target_patterns[index // size].rsplit(".", 1)[0]
            out.append((f"{base}{module}.{index % size}.{rest}", name, entry))
    return out


def reordered(converter, tensor: torch.Tensor) -> torch.Tensor:
    """A fused experts tensor, stored alone, as transformers' row-reordering `converter`
    (_reorders_experts) leaves it."""
    values = {converter.source_patterns[0]: [tensor]}
    for op in converter.operations:
        values = op.convert(values, source_patterns=converter.source_patterns,
                            target_patterns=converter.target_patterns)
    (out,) = values.values()
    return out[0] if isinstance(out, list) else out


def quantized_scale_name(entries: Dict[str, Entry], name: str) -> str:
    """The name a scale tensor stored as `<linear>.scale` (DeepSeek-V4's FP8 and FP4 weights) or
    `<linear>.weight_scale` (compressed-tensors' FP8 weights; a multiplier too) goes by:
    `<linear>.weight_scale_inv`, as transformers' FP8 quantizer renames the first. Only where
    `<linear>.weight` is quantized (FP8, or int8 holding FP4 pairs), so a model's own `.scale`
    parameters (norms' and the like) keep their names."""
    for ending in (".weight_scale", ".scale"):
        if name.endswith(ending):
            base = name[:-len(ending)]
            weight = entries.get(base + ".weight")
            if weight is not None and (weight.dtype in FP8_DTYPES or weight.dtype == torch.int8):
                return base + ".weight_scale_inv"
    return name


def _rename(name: str, renamings: list) -> str:
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name


def _patterns(patterns) -> str:
    """A transform's patterns as a person reads them (without the regular expressions' escapes)."""
    return ", ".join(p.replace("\\", "") for p in patterns)


def model_named_entries(path: str, entries: Dict[str, Entry], model: torch.nn.Module) -> Dict[str, Entry]:
    """`entries` (the shards' tensors by checkpoint name) by the names `model`'s modules use: a new
    mapping of the same class (the loader's _Entries), with `original` mapping each new name to
    the checkpoint's, `transposed` the fused experts tensors transformers transposes on load and
    `reordered` those whose rows it reorders (name -> its converter, for `reordered()`);
    tensors transformers computes from stored ones are ComputedEntry objects. Raises
    CheckpointError, before any tensor is read, for a tensor computed otherwise than by moving
    values (or an expert tensor computed at all, other than the per-expert merge, the transpose, the
    rows' reordering and ERNIE-4.5-VL's split)
    and for two tensors that land on one name."""
    renamings, converters = _transforms(model)
    model_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model_names.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    # A base model's checkpoint (DeepSeek-V4's: embed.weight, layers.0...): names under the model's
    # base_model_prefix get it, per name, as from_pretrained adds it.
    prefix = getattr(model, "base_model_prefix", None) or ""
    under_prefix = {n.split(".", 2)[1] for n in model_names if prefix and n.startswith(prefix + ".") and n.count(".") > 1}
    top_level = {n.split(".", 1)[0] for n in model_names}
    out = type(entries)()
    original: Dict[str, str] = {}
    transposed = set()
    reorders: Dict[str, object] = {}
    split: List[Tuple[str, str, Entry, object]] = []
    groups: Dict[tuple, Dict[str, Entry]] = {}  # (converter, first target) -> source pattern -> entry
    for stored, entry in entries.items():
        name = quantized_scale_name(entries, stored)
        weight = name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name
        if weight in model_names:
            # Already the module's name (a checkpoint of the model's own state_dict; an FP8 weight's
            # scale goes with it): no renaming (some match module names, e.g. `mlp.shared_expert.`
            # matches `mlp.shared_experts`). Qwen3-VL-MoE's fused experts keep their names but may
            # be stored transposed.
            if any(_transposes_experts(c) and c.rename_source_key(name)[1] is not None for c in converters):
                transposed.add(name)
            # A tensor transformers converts under its own name (Inkling2's padded lm_head.weight,
            # cut to the vocabulary) is converted here too.
            same = [(i, c) for i, c in enumerate(converters) if weight == name and ".experts." not in name
                    and c.rename_source_key(name) == (name, c.source_patterns[0]) and len(c.source_patterns) == 1
                    and _moves_values(c)]
            if same:
                groups.setdefault((same[0][0], name), {})[same[0][1].source_patterns[0]] = entry
                original[name] = stored
                continue
            out[name], original[name] = entry, stored
            continue
        renamed = _rename(name, renamings)
        head = renamed.split(".", 1)[0]
        if renamed not in model_names and head not in top_level and head in under_prefix:
            renamed = f"{prefix}.{renamed}"
        elif (renamed not in model_names and head == prefix and head not in top_level
              and renamed.split(".", 2)[1] in top_level):
            # A checkpoint of the model that holds this one under its base_model_prefix (Llama 4's
            # multimodal checkpoints hold the text model's language_model.model...), read by the text
            # model as from_pretrained reads it: without the prefix.
            renamed = renamed[len(prefix) + 1:]
        computed = False
        for index, converter in enumerate(converters):
            first_target, pattern = converter.rename_source_key(renamed)
            if pattern is None or _merges_experts(converter):
                continue
            if _transposes_experts(converter):
                transposed.add(renamed)
                break
            if _splits_experts(converter) and _EXPERT_INDEX.match(renamed):
                split.append((renamed, stored, entry, converter))
                computed = True
                break
            if _reorders_experts(converter, pattern):
                renamed = first_target
                reorders[renamed] = converter
                break
            if not _moves_values(converter) or ".experts." in renamed:
                ops = ", ".join(type(op).__name__ for op in converter.operations)
                raise CheckpointError(
                    f"{path}: transformers computes {type(model).__name__}'s {_patterns(converter.target_patterns)} "
                    f"from the checkpoint's {_patterns(converter.source_patterns)} ({ops}) as it loads them (e.g. "
                    f"{stored}), which load_model does not do; load the model with from_pretrained and call "
                    "freetoken_plugin.offload_experts(model, cache_bytes=...)")
            groups.setdefault((index, first_target), {})[pattern] = entry
            original[first_target] = stored
            computed = True
            break
        if computed:
            continue
        if renamed in out:
            raise CheckpointError(f"{path}: the checkpoint holds two tensors for {renamed} ({original[renamed]} and "
                                  f"{stored}); remove one of them")
        out[renamed] = entry
        original[renamed] = stored
    for renamed, name, entry in _split_expert_names(split):
        if renamed in out:
            raise CheckpointError(f"{path}: the checkpoint holds two tensors for {renamed} ({original[renamed]} and "
                                  f"{name}); remove one of them")
        out[renamed], original[renamed] = entry, name
    for (index, first_target), sources in groups.items():
        for made in _computed_entries(path, model, converters[index], first_target, sources):
            if made.target in out:
                raise CheckpointError(f"{path}: the checkpoint holds {made.target} and also the tensors transformers "
                                      f"computes it from ({sorted(sources)}); remove one of them")
            out[made.target] = made
            original[made.target] = original[first_target]
    out.original, out.transposed, out.reordered = original, transposed, reorders
    return out


def checkpoint_name(entries, name: str) -> str:
    """The checkpoint's own name of the tensor `name` of model_named_entries' result (for messages)."""
    return getattr(entries, "original", {}).get(name, name)

