"""What load_model reads of a compressed-tensors checkpoint's quantization_config (quant_method
"compressed-tensors", as llm-compressor saves them): FP8 weights ("float-quantized", or
"naive-quantized" for weight-only FP8: float8_e4m3fn `<linear>.weight` with its multiplier
`<linear>.weight_scale` in the model's dtype, w = q * scale), with the scale's strategy per group of
modules: "block" (128 x 128, one scale a block, the layout of Hugging Face's block-FP8
checkpoints), "tensor" (one scale a weight: the same in every block) or "channel" (one a row).
Activations stay unquantized, as for block-FP8 checkpoints: dynamic activation quantization (scales
computed at run time, no tensor of the checkpoint: FP8_BLOCK's and FP8_DYNAMIC's) is left out,
static (input_scale tensors: the FP8 scheme's) refused. Symmetric int4 weights stored
"pack-quantized" (W4A16) are int4_checkpoints.py's. Every other scheme (other integer weights,
asymmetric, groups along the row, quantized KV cache, sparsity, transforms) is refused in one line,
before anything is read."""
from typing import FrozenSet

from ft_ops import formats

from .fp8_scales import BLOCK, CHANNEL, TENSOR
from .safetensors_io import FP8_DTYPES, CheckpointError

METHOD = "compressed-tensors"
_READ = ("load_model reads compressed-tensors FP8 weights (FP8_BLOCK, FP8_DYNAMIC and weight-only FP8: 8-bit "
         "float, symmetric, with block [128, 128], channel or tensor scales; activations dynamic or unquantized) "
         "and int4 weights ('pack-quantized' W4A16: 4-bit int, symmetric, group or channel scales)")


def describes(quant) -> bool:
    """Whether quantization_config `quant` (a dict, transformers' config object or None) is
    compressed-tensors'."""
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict()
    return isinstance(quant, dict) and quant.get("quant_method") == METHOD


def fp8_strategies(path: str, quant: dict) -> FrozenSet[str]:
    """The weight scale strategies of `quant` (a compressed-tensors quantization_config), checked:
    raises CheckpointError, naming the key and what load_model reads, for anything but unquantized
    or dynamically quantized activations and 8-bit float weights with block, tensor or channel
    scales."""
    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: config.json's compressed-tensors quantization_config {what}; {_READ}")

    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse(f"has quantization_status {status!r} (its weights are not stored compressed)")
    for key in ("kv_cache_scheme", "sparsity_config", "moe_sparsity_config", "transform_config"):
        if quant.get(key):
            raise refuse(f"has a {key} ({_short(quant[key])}), which load_model does not apply")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("has no config_groups")
    strategies = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise refuse(f"group {name!r} is {_short(group)}, not an object")
        # (a group's own format where groups differ: the top level then says "mixed-precision";
        # "naive-quantized" holds the same FP8 bytes, what weight-only FP8 is saved as)
        fmt = group.get("format") or quant.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise refuse(f"group {name!r} has format {fmt!r} (FP8 weights are stored 'float-quantized')")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise refuse(f"group {name!r} has no weights scheme (only activations quantized)")
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise refuse(f"group {name!r} has {weights.get('num_bits')}-bit {weights.get('type')} weights")
        if weights.get("symmetric", True) is not True:
            raise refuse(f"group {name!r} has asymmetric weights (zero points)")
        if weights.get("dynamic", False):
            raise refuse(f"group {name!r} has dynamic weight scales (computed at run time, not stored)")
        strategy = weights.get("strategy")
        if strategy == BLOCK:
            block = weights.get("block_structure")
            block = list(block) if isinstance(block, (list, tuple)) else block
            if block != [formats.FP8_BLOCK, formats.FP8_BLOCK]:
                raise refuse(f"group {name!r} has block_structure {block!r} (its blocks must be "
                             f"[{formats.FP8_BLOCK}, {formats.FP8_BLOCK}])")
        elif strategy not in (TENSOR, CHANNEL):
            raise refuse(f"group {name!r} has weight strategy {strategy!r}")
        strategies.add(strategy)
        for key in ("input_activations", "output_activations"):
            scheme = group.get(key)
            if scheme is None:
                continue
            if key == "output_activations":
                raise refuse(f"group {name!r} quantizes its output activations")
            if not isinstance(scheme, dict) or not scheme.get("dynamic", False):
                raise refuse(f"group {name!r} has static input_activations scales (load_model leaves activations "
                             "unquantized: it reads checkpoints whose activation scales are dynamic or absent)")
    return frozenset(strategies)


# Tensors of schemes load_model does not apply (zero points, static activation scales, packed 4-bit
# weights and their shapes, NVFP4's global scales, GPTQ's group order): each would change what a
# weight or an activation means, so a checkpoint holding one is refused rather than read without it.
_FOREIGN_SUFFIXES = (".weight_zero_point", ".input_scale", ".input_zero_point", ".output_scale",
                     ".output_zero_point", ".weight_global_scale", ".input_global_scale", ".weight_g_idx",
                     ".weight_packed", ".weight_shape")


def check_tensors(path: str, entries) -> None:
    """Refuses, by name and from the headers alone, a tensor of a compressed-tensors checkpoint that
    its FP8 config does not explain: one of another scheme's (_FOREIGN_SUFFIXES), or a weight_scale
    beside a weight that is not FP8 (which compressed-tensors would multiply, and load_model would
    not)."""
    for name, entry in entries.items():
        if name.endswith(_FOREIGN_SUFFIXES):
            raise CheckpointError(f"{path}: {name} belongs to a scheme load_model does not apply (zero points, static "
                                  f"activation scales, packed or global-scaled weights); {_READ}")
        if name.endswith(".weight_scale"):
            weight = entries.get(name[:-len("_scale")])
            if weight is None or weight.dtype not in FP8_DTYPES:
                held = f"beside {weight.dtype} {name[:-len('_scale')]}" if weight is not None else "without its weight"
                raise CheckpointError(f"{path}: {name} is {held}; in a compressed-tensors FP8 checkpoint a "
                                      "weight_scale scales a float8_e4m3fn weight")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
