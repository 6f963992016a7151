"""Reading a transformers experts module: its shape, its weight layout and its expert function, and
the conversion of its weights to and from the canonical host layout (w13 [E, 2I, H] gate rows then
up rows, w2 [E, H, I], b13 [E, 2I], b2 [E, H]; experts without a gate, has_gate=False, hold their
up_proj as w13 [E, I, H]).

A layout is how a module holds its experts' weights, named by `ExpertsLayout.param_names` (paths
under the experts module, which a checkpoint of the model holds under the same names):
- fused (transformers' experts interface): gate_up_proj [E, 2I, H] and down_proj [E, H, I] (or
  up_proj alone without a gate), transposed ([E, H, 2I], [E, I, H]) and/or with gate and up rows
  interleaved, with or without biases;
- split (DBRX, undecorated.SplitWeights): gate, up and down as three tensors [E * I, H], each the
  experts' [I, H] blocks stacked; down's block is the transpose of an [out, in] weight;
- fused under other names (JetMoE, undecorated.FusedWeights): [E, 2I, H] and [E, H, I] at the paths
  the family names (`ExpertsLayout.paths`), the rest as the decorated fused layout.
canonical_of and module_tensors_of convert either to and from the canonical rows.

The expert function is read from what the class computes, never from config strings alone: a class
that keeps transformers' default `_apply_gate` computes `act_fn(gate) * up`, so the kind comes from
the type of its `act_fn` object; a class that overrides `_apply_gate` is looked up in an explicit
table of the overrides we know (reading alpha, limit, caps where that class keeps them); anything
else is refused. offload_experts and load_model then check the result numerically (verify.py).
"""
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from ft_ops.activations import GELU, GELU_TANH, RELU2, SILU, Activation

from .undecorated import FAMILIES, family_of

# The tensors of an experts module that the host pool takes over, in the canonical order (w13, w2,
# b13, b2): gated experts, and experts without a gate (has_gate=False: one up projection).
PARAM_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
UNGATED_PARAM_NAMES = ("up_proj", "down_proj", "up_proj_bias", "down_proj_bias")
# The (gate, up, down) paths of the split layouts the undecorated families hold (DBRX's mlp.w1, ...).
SPLIT_PARAM_NAMES = tuple(n for f in FAMILIES if f.split is not None for n in f.split.names)
# The fused weights' paths of the undecorated blocks that are their own experts module (JetMoE's).
RENAMED_PARAM_NAMES = tuple(n for f in FAMILIES if f.fused is not None for n in f.fused.names)
# Every name (path under the experts module) an experts module may hold its weights under.
EXPERT_PARAM_NAMES = tuple(dict.fromkeys(PARAM_NAMES + UNGATED_PARAM_NAMES + SPLIT_PARAM_NAMES + RENAMED_PARAM_NAMES))
# The block scales of an experts module that transformers' FP8 quantizer made (FP8Experts).
FP8_SCALE_NAMES = ("gate_up_proj_scale_inv", "down_proj_scale_inv")


class UnsupportedExperts(ValueError):
    """The experts module cannot be served by the freetoken backend (with the reason)."""


@dataclass(frozen=True)
class ExpertsLayout:
    experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    activation: Activation
    transposed: bool    # gate_up_proj stored [E, H, 2I] and down_proj [E, I, H]
    concatenated: bool  # gate/up as [gate; up] (True) or interleaved gate0, up0, gate1, ... (False)
    bias: bool
    fp8: bool = False   # the module holds block-FP8 weights with *_scale_inv (transformers' FP8 quantizer)
    gated: bool = True  # gate_up_proj (gate and up); False: up_proj alone (has_gate=False)
    post_norm: bool = False  # has_post_expert_norm: the backend runs the module's post_expert_norm on
                             # each route's output, before the routing weight
    split: Tuple[str, ...] = ()  # the split layout's (gate, up, down) paths (module docstring); () fused
    paths: Tuple[str, ...] = ()  # a fused layout's (w13, w2, b13, b2) paths where not the decorated names

    @property
    def param_names(self) -> Tuple[str, ...]:
        """The module's names (paths under it) of its weight tensors: w13, w2, b13, b2 of a fused
        layout; gate, up, down of a split one."""
        if self.split:
            return self.split
        if self.paths:
            return self.paths
        return PARAM_NAMES if self.gated else UNGATED_PARAM_NAMES


def parameter_owner(module: torch.nn.Module, path: str) -> Tuple[Optional[torch.nn.Module], str]:
    """(the module holding the parameter at `path` under `module`, its name there); the owner is
    None where no such submodule exists."""
    owner_path, _, leaf = path.rpartition(".")
    try:
        return (module.get_submodule(owner_path) if owner_path else module), leaf
    except AttributeError:
        return None, leaf


def get_parameter(module: torch.nn.Module, path: str) -> Optional[torch.Tensor]:
    """The parameter at `path` under `module` (None where there is none)."""
    owner, leaf = parameter_owner(module, path)
    return None if owner is None else owner._parameters.get(leaf)


def set_parameter(module: torch.nn.Module, path: str, value: Optional[torch.Tensor]) -> None:
    """Puts `value` in the parameter slot at `path` under `module` (as torch holds it, no checks)."""
    owner, leaf = parameter_owner(module, path)
    owner._parameters[leaf] = value


def module_shape(layout: ExpertsLayout, tensor: torch.Tensor) -> torch.Tensor:
    """A weight of `layout` from its per-expert form ([E, rows, cols], as module_tensors_of gives it)
    to the shape the module holds (split layouts stack the experts' blocks: [E * rows, cols])."""
    return tensor.reshape(-1, tensor.shape[-1]) if layout.split else tensor


def is_experts_module(module: torch.nn.Module) -> bool:
    """A module whose class transformers decorated with use_experts_implementation."""
    return hasattr(module, "is_concatenated") and hasattr(module, "down_proj") and hasattr(module, "config")


def _flag(module: torch.nn.Module, name: str, default: bool) -> bool:
    """A layout flag a decorated class keeps as an attribute, or an undecorated class hard-codes."""
    family = family_of(module)
    if family is not None:
        return family.flags[name]
    return bool(getattr(module, name, default))


def fused_shapes(experts: int, hidden: int, inter: int, transposed: bool, gated: bool = True):
    """The shapes of a fused experts module's gate_up_proj (up_proj when ungated) and down_proj (its
    checkpoint tensors alike): [E, 2I, H] and [E, H, I], or [E, H, 2I] and [E, I, H] when transposed
    (GPT-OSS); I rows for ungated experts' up_proj."""
    rows = 2 * inter if gated else inter
    if transposed:
        return (experts, hidden, rows), (experts, inter, hidden)
    return (experts, rows, hidden), (experts, hidden, inter)


def read_layout(module: torch.nn.Module) -> ExpertsLayout:
    name = type(module).__name__
    family = family_of(module)
    if family is not None and family.split is not None:
        return _read_split_layout(module, family.split)
    if family is not None and family.fused is not None:
        return _read_renamed_fused_layout(module, family.fused)
    gated = bool(getattr(module, "has_gate", True))
    w13_name = "gate_up_proj" if gated else "up_proj"
    if not isinstance(getattr(module, w13_name, None), torch.Tensor):
        raise UnsupportedExperts(f"{name} has no {w13_name} ({'has_gate' if gated else 'has_gate=False'}); "
                                 "expected the fused weights of transformers' experts interface")
    fp8 = getattr(module, w13_name).dtype == torch.float8_e4m3fn
    if getattr(module, w13_name).dtype == torch.int8 and isinstance(getattr(module, f"{w13_name}_scale_inv", None),
                                                                    torch.Tensor):
        raise UnsupportedExperts(f"{name} holds FP4-packed experts (int8 pairs of e2m1 values, transformers' FP8 "
                                 "quantizer with expert_dtype 'fp4', as for DeepSeek-V4), which offload_experts does not "
                                 "take from the module; freetoken_plugin.load_model(path) reads them from the "
                                 "checkpoint into its MXFP4 pool as they are")
    if fp8 and not gated:
        raise UnsupportedExperts(f"{name}: FP8 experts without a gate as transformers' FP8 quantizer holds them; "
                                 "freetoken serves block-FP8 experts without a gate from their checkpoint "
                                 "(freetoken_plugin.load_model(path)), or a bf16 model's with offload_experts(..., "
                                 "quantize='fp8') or load_model(path, quantize='fp8')")
    known = (PARAM_NAMES if gated else UNGATED_PARAM_NAMES) + (FP8_SCALE_NAMES if fp8 else ())
    # A norm of each route's output (MuseSpark's, which the backend applies as the flag asks; Ergo's,
    # which its class applies around the dispatch) stays the module's, run as the module holds it.
    norm = "post_expert_norm." if isinstance(getattr(module, "post_expert_norm", None), torch.nn.Module) else None
    extra = [n for n, _ in module.named_parameters() if n not in known and not (norm and n.startswith(norm))]
    extra += [n for n, _ in module.named_buffers() if not (norm and n.startswith(norm))]
    if fp8 and any(n.endswith("activation_scale") for n in extra):
        raise UnsupportedExperts(f"{name} quantizes its activations with static scales (activation_scheme "
                                 "'static'); freetoken serves block-FP8 weights with dynamic (unquantized) activations")
    if extra:
        raise UnsupportedExperts(f"{name} holds tensors besides its fused weights ({', '.join(extra)}), so it "
                                 "computes more than the FFN expert_gemm serves")
    gate_up, down = getattr(module, w13_name), module.down_proj
    transposed = _flag(module, "is_transposed", False)
    if gate_up.dim() != 3 or down.dim() != 3:
        raise UnsupportedExperts(f"{name}: expected 3-D {w13_name} and down_proj, got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    experts = gate_up.shape[0]
    hidden, rows = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    if gated and rows % 2:
        raise UnsupportedExperts(f"{name}: gate_up_proj has an odd width {rows}")
    inter = rows // 2 if gated else rows
    want_down = fused_shapes(experts, hidden, inter, transposed, gated)[1]
    if tuple(down.shape) != want_down:
        raise UnsupportedExperts(f"{name}: down_proj is {tuple(down.shape)}, expected {want_down}")
    if fp8:
        _check_fp8_module(module, name, experts, hidden, inter, transposed)
        dtype = _compute_dtype(module)
    elif not gate_up.dtype.is_floating_point or gate_up.dtype == torch.float64 or gate_up.element_size() == 1:
        raise UnsupportedExperts(f"{name}: weights are {gate_up.dtype}; expert_gemm computes float32, bfloat16 "
                                 "and float16 experts, and block-FP8 (float8_e4m3fn with 128 x 128 scale_inv)")
    else:
        dtype = gate_up.dtype
    bias = _flag(module, "has_bias", False)
    activation = read_activation(module) if gated else read_ungated_activation(module)
    post_norm = bool(getattr(module, "has_post_expert_norm", False))
    if post_norm and not isinstance(getattr(module, "post_expert_norm", None), torch.nn.Module):
        raise UnsupportedExperts(f"{name} sets has_post_expert_norm but holds no post_expert_norm module to run")
    return ExpertsLayout(experts, hidden, inter, dtype, activation, transposed,
                         _flag(module, "is_concatenated", True), bias, fp8, gated, post_norm)


def _read_split_layout(module: torch.nn.Module, split) -> ExpertsLayout:
    """The split layout (DBRX's) of an undecorated experts class: E, I, H as its forward reads
    them (split.sizes), each of the three tensors [E * I, H] of one floating-point dtype, nothing
    else held, and the function of its gate's activation object (split.act_fn), read as a decorated
    class's act_fn; verify.py then checks it against the class's forward."""
    name = type(module).__name__
    sizes = []
    for attr in split.sizes:
        value = getattr(module, attr, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UnsupportedExperts(f"{name}: expected a positive whole number at {attr} (what its forward splits "
                                     f"its weights by), got {value!r}")
        sizes.append(value)
    experts, inter, hidden = sizes
    tensors = [get_parameter(module, n) for n in split.names]
    missing = [n for n, t in zip(split.names, tensors) if t is None]
    if missing:
        raise UnsupportedExperts(f"{name} has no {', '.join(missing)}; expected its gate, up and down weights at "
                                 f"{', '.join(split.names)}")
    extra = [n for n, _ in module.named_parameters() if n not in split.names]
    extra += [n for n, _ in module.named_buffers()]
    if extra:
        raise UnsupportedExperts(f"{name} holds tensors besides its expert weights ({', '.join(extra)}), so it "
                                 "computes more than the FFN expert_gemm serves")
    for n, t in zip(split.names, tensors):
        if tuple(t.shape) != (experts * inter, hidden):
            raise UnsupportedExperts(f"{name}: {n} is {tuple(t.shape)}, expected {(experts * inter, hidden)} (its "
                                     f"{', '.join(split.sizes)} = {experts}, {inter}, {hidden}: {experts} experts' "
                                     f"[{inter}, {hidden}] blocks)")
    return ExpertsLayout(experts, hidden, inter, _one_float_dtype(name, tensors), _activation_at(module, split.act_fn),
                         transposed=False, concatenated=True, bias=False, split=tuple(split.names))


def _one_float_dtype(name: str, tensors) -> torch.dtype:
    """The one floating-point dtype expert_gemm computes that an undecorated class's weights share."""
    dtypes = {t.dtype for t in tensors}
    dtype = tensors[0].dtype
    if len(dtypes) != 1 or not dtype.is_floating_point or dtype == torch.float64 or dtype.itemsize == 1:
        raise UnsupportedExperts(f"{name}: weights are {', '.join(sorted(str(d) for d in dtypes))}; expert_gemm "
                                 "computes float32, bfloat16 and float16 experts of one dtype (quantize='fp8' makes "
                                 "them block-FP8)")
    return dtype


def _activation_at(module: torch.nn.Module, path: str) -> Activation:
    """The function of the gate's activation object at `path` under an undecorated class's module,
    read as a decorated class's act_fn."""
    name = type(module).__name__
    act_fn = module
    for part in path.split("."):
        act_fn = getattr(act_fn, part, None)
    if act_fn is None:
        raise UnsupportedExperts(f"{name} has no {path}; expected the activation of its gate there")
    return activation_of_function(act_fn, f"{name} ({path})")


def _read_renamed_fused_layout(module: torch.nn.Module, fused) -> ExpertsLayout:
    """The fused layout of a block that is its own experts module (JetMoE's): [E, 2I, H] gate rows
    then up rows and [E, H, I] at fused.names, one floating-point dtype, no expert biases, nothing
    else held but the block's own tensors (its router, its output bias), and the function of its
    gate's activation object (fused.act_fn); verify.py then checks it against the class's forward."""
    name = type(module).__name__
    w13_name, w2_name, b13_name, b2_name = fused.names
    gate_up, down = get_parameter(module, w13_name), get_parameter(module, w2_name)
    if gate_up is None or down is None:
        raise UnsupportedExperts(f"{name} has no {w13_name} and {w2_name}; expected its experts' weights there")
    extra = [n for n, _ in module.named_parameters() if n not in (w13_name, w2_name) + fused.block_tensors]
    extra += [n for n, _ in module.named_buffers()]
    if extra:
        raise UnsupportedExperts(f"{name} holds tensors besides its expert weights, its router and its bias "
                                 f"({', '.join(extra)}), so it computes more than the FFN expert_gemm serves")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
        raise UnsupportedExperts(f"{name}: expected [E, 2I, H] {w13_name} and [E, H, I] {w2_name}, got "
                                 f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    experts, hidden, inter = gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2
    if tuple(down.shape) != (experts, hidden, inter):
        raise UnsupportedExperts(f"{name}: {w2_name} is {tuple(down.shape)}, expected {(experts, hidden, inter)}")
    return ExpertsLayout(experts, hidden, inter, _one_float_dtype(name, (gate_up, down)),
                         _activation_at(module, fused.act_fn), transposed=False, concatenated=True, bias=False,
                         paths=tuple(fused.names))


def _compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The model's compute dtype (hidden states, biases), for weights that do not tell it (FP8)."""
    dtype = getattr(module.config, "dtype", None)  # transformers 5 (torch_dtype only warns)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


def _check_fp8_module(module, name: str, experts: int, hidden: int, inter: int, transposed: bool) -> None:
    """transformers' FP8Experts: [gate; up] rows, 128 x 128 blocks, the same grid as gate and up
    blocked apart (what ft_ops' FP8 format holds; ft_ops/formats.py) only where I is a multiple of 128."""
    from ft_ops.formats import FP8_BLOCK, fp8_scale_shape

    block = tuple(getattr(module, "block_size", None) or ())
    if block != (FP8_BLOCK, FP8_BLOCK):
        raise UnsupportedExperts(f"{name}: FP8 weights with block size {block or 'per tensor'}; freetoken serves "
                                 f"{FP8_BLOCK} x {FP8_BLOCK} blocks")
    if inter % FP8_BLOCK:
        # FP8Experts scales row r of the fused gate_up by scale row r // 128, whatever the grid's
        # shape (which can equal that of gate and up blocked apart: I of 65 to 127 modulo 128).
        raise UnsupportedExperts(
            f"{name}: FP8 experts of intermediate size {inter}, not a multiple of {FP8_BLOCK}: transformers' "
            f"FP8Experts scales the fused gate_up rows as one grid of {FP8_BLOCK}-row blocks across the gate/up "
            "boundary, which freetoken's FP8 format (gate and up blocked apart) cannot hold exactly; load the "
            "checkpoint with freetoken_plugin.load_model(path), or the float model with quantize='fp8'")
    if transposed or module.down_proj.dtype != torch.float8_e4m3fn:
        raise UnsupportedExperts(f"{name}: FP8 experts must hold float8_e4m3fn [E, 2I, H] and [E, H, I] weights")
    want13 = (experts, *fp8_scale_shape(2 * inter, hidden, parts=2))
    want2 = (experts, *fp8_scale_shape(hidden, inter))
    got13, got2 = tuple(module.gate_up_proj_scale_inv.shape), tuple(module.down_proj_scale_inv.shape)
    if got13 != want13 or got2 != want2:
        raise UnsupportedExperts(
            f"{name}: FP8 scales {got13} and {got2}, expected {want13} and {want2} (gate and up blocked as two "
            "projections of 128-row blocks; a fused blocking across the gate/up boundary cannot be served exactly)")


# --- the expert function ----------------------------------------------------------------------

def _default_apply_gate():
    """transformers' default gate, `act_fn(gate) * up` (None where this transformers has none)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return getattr(moe, "_default_apply_gate", None)


def _function_table():
    """act_fn objects -> Activation, by exact type (a subclass may compute something else)."""
    import torch.nn.functional as F
    from transformers import activations as A

    by_type = {torch.nn.SiLU: SILU, torch.nn.GELU: None}  # nn.GELU: by its `approximate` below
    for cls_name, act in (("SiLUActivation", SILU), ("GELUActivation", GELU), ("GELUTanh", GELU_TANH),
                          ("PytorchGELUTanh", GELU_TANH), ("NewGELUActivation", GELU_TANH),
                          ("FastGELUActivation", GELU_TANH), ("AccurateGELUActivation", GELU_TANH),
                          ("QuickGELUActivation", Activation("silu", alpha=1.702))):
        cls = getattr(A, cls_name, None)
        if cls is not None:
            by_type[cls] = act
    by_function = {F.silu: SILU, F.gelu: GELU}
    return by_type, by_function


def activation_of_function(act_fn, owner: str) -> Activation:
    """The kind of an elementwise activation object (not of a config string)."""
    by_type, by_function = _function_table()
    if type(act_fn) is torch.nn.GELU:
        return GELU_TANH if act_fn.approximate == "tanh" else GELU
    if type(act_fn) in by_type:
        return by_type[type(act_fn)]
    # GELUActivation/GELUTanh built with use_gelu_python compute the same function in Python.
    if callable(act_fn) and not isinstance(act_fn, torch.nn.Module):
        for fn, act in by_function.items():
            if act_fn is fn:
                return act
    what = type(act_fn).__name__ if isinstance(act_fn, torch.nn.Module) else getattr(act_fn, "__name__", repr(act_fn))
    raise UnsupportedExperts(f"{owner} computes act_fn(gate) * up with act_fn {what}, which freetoken does not serve "
                             "(it serves SiLU, sigmoid-scaled SiLU and GELU with tanh or erf as the gate's act_fn, "
                             "and relu(x)^2 in experts without a gate)")


def _number(module, path: str, owner: str) -> float:
    """A positive finite float read from an attribute path of the module, as the class reads it."""
    value = module
    for part in path.split("."):
        value = getattr(value, part, None)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise UnsupportedExperts(f"{owner}: expected a positive number at {path}, got {value!r}")
    return float(value)


# Classes that override _apply_gate, by class name: what each computes, as an Activation. The
# numbers are read where the class reads them. A class missing here is refused (never guessed).
_APPLY_GATE_OVERRIDES: Dict[str, Callable[[torch.nn.Module, str], Activation]] = {
    # act(gate.float()) * up.float(): the default function, in float32 (as the kernels compute it).
    "BeamExperts": lambda m, n: activation_of_function(m.act_fn, n),
    # gate = min(gate, limit), up = clamp(up, -limit, limit), act_fn(gate) * up.
    "DeepseekV4Experts": lambda m, n: dataclasses.replace(activation_of_function(m.act_fn, n),
                                                          limit=_number(m, "limit", n)),
    # The same clamp with silu hard-coded and the limit in swiglu_limit.
    "Glm5NextTextExperts": lambda m, n: Activation("silu", limit=_number(m, "swiglu_limit", n)),
    "HYV4Experts": lambda m, n: Activation("silu", limit=_number(m, "swiglu_limit", n)),
    "HYV4VLExperts": lambda m, n: Activation("silu", limit=_number(m, "swiglu_limit", n)),
    # gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit).
    "GptOssExperts": lambda m, n: Activation("silu", alpha=_number(m, "alpha", n), limit=_number(m, "limit", n),
                                             up_offset=1.0),
    "OpenAIPrivacyFilterExperts": lambda m, n: Activation("silu", alpha=_number(m, "alpha", n),
                                                          limit=_number(m, "limit", n), up_offset=1.0),
    # gpt-oss's function on concatenated weights, its numbers named swiglu_alpha / swiglu_limit.
    "MiniMaxM3VLExperts": lambda m, n: Activation("silu", alpha=_number(m, "swiglu_alpha", n),
                                                  limit=_number(m, "swiglu_limit", n), up_offset=1.0),
    # cg tanh(gate / cg) * sigmoid(gate) * cu tanh(up / cu): the sigmoid sees the raw gate.
    "Inkling2Experts": lambda m, n: Activation("silu", gate_softcap=_number(m, "act_fn.gate_softcap.softcap", n),
                                               up_softcap=_number(m, "act_fn.up_softcap.softcap", n)),
    "Inkling2LoopExperts": lambda m, n: Activation("silu",
                                                   gate_softcap=_number(m, "act_fn.gate_softcap.softcap", n),
                                                   up_softcap=_number(m, "act_fn.up_softcap.softcap", n)),
}


def _limit_after_activation(m, n) -> Activation:
    """min(act_fn(gate), limit) * clamp(up, -limit, limit): the clamp after the activation (Step3p7,
    BailingHybrid), with a per-layer limit that is None where the layer has none (then the default
    act_fn(gate) * up)."""
    act = activation_of_function(m.act_fn, n)
    if getattr(m, "limit", None) is None:
        return act
    return dataclasses.replace(act, limit=_number(m, "limit", n), limit_after_act=True)


for _name in ("Step3p7Experts", "BailingHybridExperts"):
    _APPLY_GATE_OVERRIDES[_name] = _limit_after_activation


def _fp8_experts_activation(m, n) -> Activation:
    """transformers' FP8Experts._apply_gate: the family's function, chosen by its config."""
    if getattr(m, "gate_softcap", None) is not None:
        return Activation("silu", gate_softcap=_number(m, "gate_softcap", n), up_softcap=_number(m, "up_softcap", n))
    if getattr(m, "swiglu_alpha", None) is not None:
        # The clamp is the module's `limit` (the config's swiglu_limit unless the layer passes its
        # own); releases without `limit` kept it as `swiglu_limit`.
        limit = "limit" if getattr(m, "limit", None) is not None else "swiglu_limit"
        return Activation("silu", alpha=_number(m, "swiglu_alpha", n), limit=_number(m, limit, n), up_offset=1.0)
    act = activation_of_function(m.act_fn, n)
    if getattr(m, "limit", None) is not None:
        # limit_after_act (transformers 5.25, Step3p7's families): min(act_fn(gate), limit) * up.
        act = dataclasses.replace(act, limit=_number(m, "limit", n),
                                  limit_after_act=bool(getattr(m, "limit_after_act", False)))
    return act


_APPLY_GATE_OVERRIDES["FP8Experts"] = _fp8_experts_activation


def read_ungated_activation(module: torch.nn.Module) -> Activation:
    """The function of an experts class without a gate (transformers computes act_fn(up x)): served
    where act_fn is relu(x)^2, as max(u, 0) * u with the up values as the gate (ft_ops RELU2)."""
    from transformers import activations as A

    name = type(module).__name__
    act_fn = getattr(module, "act_fn", None)
    relu2 = getattr(A, "ReLUSquaredActivation", None)
    if relu2 is not None and type(act_fn) is relu2:
        return RELU2
    what = type(act_fn).__name__ if isinstance(act_fn, torch.nn.Module) else getattr(act_fn, "__name__", repr(act_fn))
    raise UnsupportedExperts(f"{name} has no gate and computes act_fn(up x) with act_fn {what}; freetoken serves "
                             "experts without a gate where act_fn is relu(x)^2 (ReLUSquaredActivation)")


def read_activation(module: torch.nn.Module) -> Activation:
    """The expert function `module`'s class computes, as an Activation (UnsupportedExperts if unknown)."""
    cls = type(module)
    name = cls.__name__
    # What the class computes is read from the class: a gate replaced on one instance would be
    # served with the class's function, so it is refused (the probe checks only the first and last
    # blocks). An instance's forward may be a wrapper (accelerate's hooks set one) and is left alone.
    if "_apply_gate" in vars(module):
        raise UnsupportedExperts(f"this {name} has its own _apply_gate (set on the instance, not its class); "
                                 "freetoken serves the expert function of the class, so it would compute something "
                                 "else for this block")
    # The class whose _apply_gate runs: a subclass that keeps its parent's gate is its parent here.
    owner = next((k for k in cls.__mro__ if "_apply_gate" in vars(k)), None)
    if owner is None or vars(owner)["_apply_gate"] is _default_apply_gate():
        act_fn = getattr(module, "act_fn", None)
        if act_fn is None:
            raise UnsupportedExperts(f"{name} has no act_fn; expected act_fn(gate) * up")
        return activation_of_function(act_fn, name)
    rule = _APPLY_GATE_OVERRIDES.get(owner.__name__)
    if rule is None:
        raise UnsupportedExperts(f"{name} overrides _apply_gate ({owner.__module__}.{owner.__name__}), and freetoken "
                                 "does not know what that override computes; it would not serve it with a guessed "
                                 "function")
    return rule(module, name)


# --- weights ------------------------------------------------------------------------------------

def fp8_scales(module: torch.nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w13_scale, w2_scale) of an FP8 module, already in the canonical layout (_check_fp8_module)."""
    return module.gate_up_proj_scale_inv.detach(), module.down_proj_scale_inv.detach()


def canonical_weights(module: torch.nn.Module, layout: ExpertsLayout
                      ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The module's weights as (w13 [E, 2I, H] (ungated: [E, I, H]), w2 [E, H, I], b13, b2), views or
    copies on the module's device; the caller copies them into the host pool (FP8 modules:
    fp8_scales too)."""
    names = layout.param_names if layout.split or layout.bias else layout.param_names[:2]
    return canonical_of({n: get_parameter(module, n).detach() for n in names}, layout)


def canonical_of(tensors: Dict[str, torch.Tensor], layout: ExpertsLayout):
    """The weights of any layout, by their names (layout.param_names) as the module (or the
    checkpoint) holds them -> (w13 [E, 2I, H], w2 [E, H, I], b13, b2). A split layout's w13 is a
    copy (gate and up blocks side by side), its w2 a view."""
    if layout.split:
        E, I, H = layout.experts, layout.intermediate, layout.hidden
        gate, up, down = (tensors[n].reshape(E, I, H) for n in layout.split)
        return torch.cat([gate, up], dim=1), down.transpose(1, 2), None, None
    w13_name, w2_name, b13_name, b2_name = layout.param_names
    return to_canonical(tensors[w13_name], tensors[w2_name], tensors.get(b13_name), tensors.get(b2_name), layout)


def module_tensors_of(w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
                      layout: ExpertsLayout) -> Dict[str, Optional[torch.Tensor]]:
    """The inverse of canonical_of for the canonical rows of some experts (the leading dimension
    of w13 and w2): the module's tensors by name, each still per expert ([E', ...]; module_shape
    gives the shape the module holds), None for biases a layout has not. Views where a view exists."""
    if layout.split:
        I = layout.intermediate
        return dict(zip(layout.split, (w13[:, :I], w13[:, I:], w2.transpose(1, 2))))
    return dict(zip(layout.param_names, from_canonical(w13, w2, b13, b2, layout)))


def to_canonical(gate_up: torch.Tensor, down: torch.Tensor, b13: Optional[torch.Tensor],
                 b2: Optional[torch.Tensor], layout: ExpertsLayout):
    """Fused weights in the module's layout -> (w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I], b2) (any
    layout: canonical_of)."""
    if layout.transposed:
        gate_up = gate_up.transpose(1, 2)  # [E, 2I, H]
        down = down.transpose(1, 2)        # [E, H, I]
    if layout.gated and not layout.concatenated:  # rows alternate gate, up, gate, up, ...
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        if b13 is not None:
            b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    return gate_up, down, b13, b2


def from_canonical(w13: torch.Tensor, w2: torch.Tensor, b13: Optional[torch.Tensor],
                   b2: Optional[torch.Tensor], layout: ExpertsLayout):
    """The inverse of to_canonical: canonical rows -> (gate_up_proj, down_proj, gate_up_proj_bias,
    down_proj_bias) in the module's fused layout (any layout: module_tensors_of). Views of the
    canonical tensors where a view exists (transposed, concatenated); interleaved rows need a copy."""
    if layout.gated and not layout.concatenated:
        inter = layout.intermediate
        w13 = torch.stack([w13[:, :inter], w13[:, inter:]], dim=2).reshape(w13.shape)  # g0, u0, g1, u1, ...
        if b13 is not None:
            b13 = torch.stack([b13[:, :inter], b13[:, inter:]], dim=2).reshape(b13.shape)
    if layout.transposed:
        w13 = w13.transpose(1, 2)  # [E, H, 2I]
        w2 = w2.transpose(1, 2)    # [E, I, H]
    return w13, w2, b13, b2
