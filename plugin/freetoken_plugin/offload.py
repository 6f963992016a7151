"""offload_experts: converts a loaded transformers MoE model in place so that its experts live in
one pinned host pool and run through ft_ops with one device slot pool shared by every layer."""
import copy
import dataclasses
import functools
import inspect
import math
import numbers
import operator
import re
import types
import weakref
from typing import Dict, List, Optional, Tuple

import torch

import ft_ops
from ft_ops import formats
from ft_ops.moe import OffloadedExperts, OffloadRuntime, check_runtime_options, hidden_dtype_problem
from ft_ops.policies import DEFAULT_EVICTION, policy_id
from ft_ops.progress import bar, done
from ft_ops.slot_pool import ExpertShape, HostPool, human_bytes

from .backend import BACKEND_NAME, register
from .host_memory import check_host_pool_fits
from .layouts import (EXPERT_PARAM_NAMES, FP8_SCALE_NAMES, ExpertsLayout, UnsupportedExperts, canonical_weights,
                      fp8_scales, get_parameter, is_experts_module, module_shape, module_tensors_of, read_layout,
                      set_parameter)
from .served_class import PICKLE_REFUSED, served_subclass
from .undecorated import FAMILIES, experts_of, family_of, owner_block, served_blocks, switch_block
from .verify import check_block_forward, check_expert_function, check_from_host


class OffloadHandle:
    """What offload_experts returns: the runtime and a summary of the pools. The model holds its
    handle, so the handle refers to the model weakly: a strong reference would make a cycle that
    kept the pools (GiBs of pinned host memory, the slot pool on the GPU) alive after `del model`
    until the cyclic garbage collector ran."""

    def __init__(self, model: torch.nn.Module, runtime: OffloadRuntime, module_names: List[str] = (),
                 expert_parameters: Optional[Dict[str, torch.nn.Parameter]] = None):
        self._model = weakref.ref(model)
        self.runtime = runtime
        self.module_names = list(module_names)
        # The offloaded expert weights' meta-device stand-ins by name, which the model's
        # get_parameter gives (_offloaded_model_methods).
        self.expert_parameters = dict(expert_parameters or {})

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise ReferenceError("the model this OffloadHandle belongs to was deleted")
        return model

    @property
    def slots(self) -> int:
        return self.runtime.pool.slots

    @property
    def device_bytes(self) -> int:
        return self.runtime.pool.nbytes

    @property
    def host_bytes(self) -> int:
        return self.runtime.host.nbytes

    def stats(self) -> dict:
        return self.runtime.stats()

    def __deepcopy__(self, memo):
        # Within a deep copy of the model: the copy's handle, on the copy's runtime.
        model = self._model()
        return OffloadHandle(memo.get(id(model), model), copy.deepcopy(self.runtime, memo), self.module_names,
                             self.expert_parameters)

    def __reduce__(self):
        raise TypeError(PICKLE_REFUSED)

    def __repr__(self) -> str:
        shape = self.runtime.shape
        model = self._model()
        return (f"OffloadHandle({type(model).__name__ if model is not None else 'deleted model'}: {shape.layers} MoE "
                f"layers x {shape.experts} experts ({shape.format}, {human_bytes(shape.expert_bytes)} each) in "
                f"{human_bytes(self.host_bytes)} of host memory; {self.slots} slots ({human_bytes(self.device_bytes)}) "
                f"on {self.runtime.pool.device})")


def resolve_device(device, argument: str = "device") -> torch.device:
    """`device` as a torch.device, refused at once (one line, before any memory is touched) when it
    is not a device freetoken runs on or names a CUDA device this process cannot use. `argument`
    is how the messages name the setting: "device" (device='cpu') or a command-line flag
    ("--device": --device cpu)."""
    def given(value) -> str:
        return f"{argument} {value}" if argument.startswith("-") else f"{argument}={str(value)!r}"

    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"  # as torch reads an index: the accelerator's (freetoken's is CUDA)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{given(device)} is not a device: freetoken runs experts on 'cuda' (or 'cuda:N') "
                         "or 'cpu'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise ValueError(f"{given(device)} was asked for, but CUDA is not available ({why}); "
                             f"pass {given('cpu')} to run the experts on the CPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{given(device)} was asked for, but only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
        if not ft_ops.cuda_kernels_available():
            raise ValueError(f"{given(device)} was asked for, but ft_ops was built without its CUDA kernels; "
                             "rebuild it where nvcc is available (pip install --no-build-isolation -e .)")
    elif device.type != "cpu":
        raise ValueError(f"{given(device)}: freetoken runs experts on 'cuda' or 'cpu'")
    return device


def find_experts(model: torch.nn.Module):
    """(name, module) of every experts block, in module order: the decorated classes', and those of
    the undecorated blocks freetoken serves (undecorated.py)."""
    served = {id(experts_of(block)) for _, block in served_blocks(model)}
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m) or id(m) in served]


def check_family_blocks(model: torch.nn.Module) -> None:
    """Every block that owns experts of an undecorated family freetoken serves (undecorated.py) is
    that family's block class itself (a subclass may compute otherwise, and would be left holding
    its experts) and holds no forward of its own on the instance (serving the block would set it
    aside; accelerate's hook alone is known): cheap, before anything is read."""
    own_experts = {f.block_class: f for f in FAMILIES if f.experts_attr is None}  # blocks that are their experts
    for name, block in model.named_modules():
        owned = block._modules.get("experts")
        family = family_of(owned) if owned is not None else None
        if family is None:
            family = next((own_experts[k.__name__] for k in type(block).__mro__ if k.__name__ in own_experts), None)
        if family is None:
            continue
        where, cls = name or "the model", type(block).__name__
        if cls != family.block_class:
            held = f"holds {family.experts_class}" if family.experts_attr else f"is a subclass of {family.block_class}"
            raise UnsupportedExperts(f"{cls} at {where} {held} but is not {family.block_class}: "
                                     f"freetoken replaces the forward of {family.block_class} itself (a subclass may "
                                     f"compute otherwise), so the model is left unchanged: use {family.block_class}")
        own_forward = block.__dict__.get("forward")
        if own_forward is not None and not hasattr(block, "_hf_hook"):
            raise UnsupportedExperts(f"{cls} at {where} has a forward set on the instance "
                                     f"({getattr(own_forward, '__qualname__', type(own_forward).__name__)}), which "
                                     "serving the block would set aside, so the model is left unchanged: remove it, "
                                     "or set it after offload_experts")


def check_undecorated_blocks(model: torch.nn.Module, experts, layouts: List[ExpertsLayout]) -> None:
    """The routed forward freetoken runs in place of an undecorated block's, checked against the
    block's own (verify.check_block_forward) on the first and the last such block (the check is
    of the class's code; two blocks catch one changed on its instance)."""
    undecorated = [i for i, (_, module) in enumerate(experts) if family_of(module) is not None]
    for i in sorted({undecorated[0], undecorated[-1]} if undecorated else ()):
        check_block_forward(owner_block(model, experts[i][0]), layouts[i])


# Class names of experts or MoE blocks that transformers' experts interface does not decorate (e.g.
# DogeCDMoE); the model and decoder-layer classes of such families do not match.
_MOE_CLASS_NAME = re.compile(r"Expert|MoE$|Moe$|Mo[Ee](Block|Layer)$")


def undecorated_moe_classes(model: torch.nn.Module) -> List[str]:
    """The names of the model's experts or MoE block classes that are not decorated experts."""
    return sorted({type(m).__name__ for m in model.modules()
                   if _MOE_CLASS_NAME.search(type(m).__name__) and not is_experts_module(m)})


def no_experts_error(model: torch.nn.Module) -> ValueError:
    """Why a model without decorated experts cannot be offloaded, naming its undecorated experts
    classes if it has any."""
    undecorated = undecorated_moe_classes(model)
    if undecorated:
        return UnsupportedExperts(
            f"{type(model).__name__}'s experts ({', '.join(undecorated)}) are not decorated with transformers' "
            "use_experts_implementation, so freetoken cannot replace them (docs/families.md lists the families it "
            "serves)")
    return ValueError(
        f"{type(model).__name__} has no experts module (a class decorated with transformers' "
        "use_experts_implementation, holding gate_up_proj or up_proj, and down_proj); is it a Mixture-of-Experts "
        "model?")


def describe(layout: ExpertsLayout) -> str:
    return (f"{layout.experts} experts of {layout.hidden} x {layout.intermediate}, {layout.dtype}, "
            f"{layout.activation}{', bias' if layout.bias else ''}")


def read_layouts(experts) -> List[ExpertsLayout]:
    """Every block's layout; one slot pool needs them all equal but for the expert function, which
    the runtime takes per layer (Step3p7 clamps some layers only)."""
    layouts = [read_layout(m) for _, m in experts]
    first = layouts[0]
    for (name, module), lay in zip(experts, layouts):
        if dataclasses.replace(lay, activation=first.activation) != first:
            raise UnsupportedExperts(
                f"experts module {name} ({type(module).__name__}: {describe(lay)}) differs from {experts[0][0]} "
                f"({type(experts[0][1]).__name__}: {describe(first)}); one slot pool holds one expert shape and "
                + ("dtype: cast the model to one dtype first (model.to(torch.bfloat16))"
                   if dataclasses.replace(lay, dtype=first.dtype, activation=first.activation) == first else
                   "layout, so offload a sub-model whose experts are all alike (e.g. model.thinker)"))
    return layouts


def check_top_k(model: torch.nn.Module, experts: int) -> None:
    """Experts routed per token within the `experts` each experts block holds, as load_model
    checks config.json (the routers' top-k would fail only at the first forward, with torch's
    "selected index k out of range")."""
    k_name, k = routed_per_token_entry(model.config)
    if k is not None and k > experts:
        raise ValueError(f"{type(model).__name__}'s config routes {k} experts per token ({k_name}), but its experts "
                         f"blocks hold {experts} experts; a token takes at most {experts} experts: build the model "
                         f"from a config whose {k_name} is at most {experts}")


def _check_hidden_dtype(model: torch.nn.Module, layout: ExpertsLayout) -> None:
    """Dense experts compute in their own dtype, so the hidden states reaching them must be of it:
    a model whose embeddings (where its hidden states start) hold another dtype than its experts is
    refused before anything changes (its forward would fail at the first experts block)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point or weight.dtype == layout.dtype:
        return
    # Embeddings its class keeps in float32 whatever the model's dtype (Ergo's): the layers cast
    # what they pass on, as transformers runs the model (a wrong dtype would still be refused at
    # the first experts block, by name).
    keep = {*(getattr(model, "_keep_in_fp32_modules", None) or ()),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())}
    name = next((n for n, m in model.named_modules() if m is embeddings), "")
    if weight.dtype == torch.float32 and keep.intersection(name.split(".")):
        return
    raise UnsupportedExperts(f"the experts are {layout.dtype} but the rest of the model (its embeddings) "
                             f"{weight.dtype}, so its hidden states reach the experts as {weight.dtype}; freetoken "
                             "computes experts in their own dtype: cast the model to one dtype first "
                             f"(model.to({layout.dtype}) or model.to({weight.dtype}))")


def _model_device(model: torch.nn.Module, experts) -> torch.device:
    expert_params = {id(get_parameter(m, n)) for _, m in experts for n in EXPERT_PARAM_NAMES
                     if get_parameter(m, n) is not None}
    for p in model.parameters():
        if id(p) not in expert_params:
            return p.device
    return torch.device("cpu")


def _plain_number(value):
    """A 0-dim real tensor as the Python number it holds, so that a float tensor follows a float's
    rules and an integer tensor an int's; anything else as it is."""
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool
            and not value.is_complex()):
        return value.item()
    return value


def _is_number(value) -> bool:
    """A real number (numpy's too), not a bool and not a string; a tensor only as _plain_number
    reads it (a bool tensor, or a 1-dim one of one element, is not a number)."""
    if isinstance(value, (bool, torch.Tensor)):
        return False
    if isinstance(value, numbers.Real):
        return True
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


class CacheSizeError(ValueError):
    """A cache size that cannot serve the model (the command line's exit status 2)."""


def resolve_slots(experts: int, layers: int, expert_bytes: int, cache_slots: Optional[int],
                  cache_bytes: Optional[int], stream_prefill: bool, progress: bool = False) -> int:
    """The pool's slots for `layers` layers of `experts` experts from the size asked for (or the
    default), refused below what the pool needs: one layer of experts for prefill streaming, one
    expert without it; a size beyond the model's experts takes all of them, and says so."""
    E = experts
    if cache_slots is not None and cache_bytes is not None:
        raise CacheSizeError("pass cache_slots or cache_bytes, not both")
    cache_slots, cache_bytes = _plain_number(cache_slots), _plain_number(cache_bytes)
    for name, value in (("cache_slots", cache_slots), ("cache_bytes", cache_bytes)):
        if value is not None and not _is_number(value):
            raise CacheSizeError(f"{name} must be a number, got {value!r}"
                             + (" (bytes as an int: 16 * 2**30 for 16 GiB)" if name == "cache_bytes" else ""))
        if value is not None and isinstance(value, float) and not math.isfinite(value):
            raise CacheSizeError(f"{name} must be a finite number, got {value!r}")
    # Prefill streaming copies a whole layer into the pool; admission alone serves a pool of any
    # size (what a call cannot admit is computed on the CPU).
    least, least_named = (E, "one MoE layer's experts") if stream_prefill else (1, "one expert")
    least_slots = f"{least} slot{'s' if least > 1 else ''}"
    if cache_slots is not None:
        if cache_slots <= 0:
            raise CacheSizeError(f"cache_slots must be positive, got {cache_slots}; give at least {least_named} "
                                 f"({least_slots}, {human_bytes(least * expert_bytes)})")
        if int(cache_slots) != cache_slots:
            raise CacheSizeError(f"cache_slots is a number of experts, a whole number; got {cache_slots}")
        slots = int(cache_slots)
    elif cache_bytes is not None:
        if cache_bytes <= 0:
            raise CacheSizeError(f"cache_bytes must be positive, got {cache_bytes}; give at least {least_named} "
                                 f"({least_slots}, {least * expert_bytes} bytes)")
        slots = int(cache_bytes) // expert_bytes
    else:
        slots = 2 * E + E // 4  # two streaming regions and a quarter layer of decode cache
    if cache_bytes is not None and slots < 1:
        raise CacheSizeError(f"cache_bytes={cache_bytes} holds no expert of {human_bytes(expert_bytes)} "
                             f"({expert_bytes} bytes); give at least {least * expert_bytes} bytes "
                             f"({f'one layer of {E} experts' if stream_prefill else 'one expert'})")
    if stream_prefill and slots < E:
        given = f"cache_bytes={cache_bytes} holds {slots}" if cache_bytes is not None else f"a cache of {slots}"
        raise CacheSizeError(
            f"{given} expert slot{'' if slots == 1 else 's'}, below one layer of {E} experts, which "
            f"prefill streaming needs: give at least {E} slots ({human_bytes(E * expert_bytes)}; {2 * E} slots, "
            f"{human_bytes(2 * E * expert_bytes)}, overlap transfer and compute), or (in Python) pass "
            "stream_prefill=False")
    if slots > layers * E and (cache_slots is not None or cache_bytes is not None):
        given = f"cache_slots={cache_slots}" if cache_slots is not None else f"cache_bytes={cache_bytes}"
        done(f"{given} holds more than the model's {layers * E} experts: the cache takes all of them "
             f"({layers * E} slots, {human_bytes(layers * E * expert_bytes)})", progress)
    return min(slots, layers * E)


def verified_blocks(layouts: List[ExpertsLayout]) -> List[int]:
    """The blocks whose function is checked numerically: the first and the last (cheap, and a
    reader that got one block right by accident rarely gets two), and the first of each other
    expert function the layers compute."""
    first_of = {}
    for layer, layout in enumerate(layouts):
        first_of.setdefault(layout.activation, layer)
    return sorted({0, len(layouts) - 1, *first_of.values()})


QUANTIZE_CHOICES = ("fp8", "int4", *(f"int4-g{g}" for g in sorted(formats.INT4_GROUPS)))


def asks_int4(quantize: Optional[str]) -> bool:
    """Whether quantize= names an int4 format ("int4" or "int4-gG"), before any size is checked."""
    return quantize in QUANTIZE_CHOICES and quantize != formats.FP8


def as_given(argument: str, value) -> str:
    """The setting `argument` with `value` as its user wrote it: in Python (quantize='fp8') or, for
    a command-line flag (an `argument` that starts with '-'), on the command line (--quantize fp8)."""
    return f"{argument} {value}" if argument.startswith("-") else f"{argument}={value!r}"


def quantized_format(quantize: Optional[str], hidden: int, inter: int, gated: bool,
                     argument: str = "quantize") -> Tuple[str, int]:
    """The (format, int4 group) that quantize= asks for a float model's experts of these sizes:
    "fp8" block-FP8 (128 x 128 scales); "int4" symmetric int4 with a float scale per group of 128
    values of a row (64 or 32 where 128 does not divide both sizes), "int4-g32" / "-g64" / "-g128"
    that group; None: the experts as they are (DENSE). Refused in one line: other names, a group
    that does not divide the sizes, int4 for ungated experts. `argument` is how the messages name
    the setting: "quantize" (quantize='fp8') or a command-line flag ("--quantize": --quantize fp8)."""
    def given(value) -> str:
        return as_given(argument, value)

    if quantize is None:
        return formats.DENSE, 0
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"{given(quantize)}: freetoken quantizes experts to 'fp8' (128 x 128 block scales) or "
                         "'int4' (symmetric, a scale per 128 values; 'int4-g32', 'int4-g64' or 'int4-g128' for one "
                         "group size), or pass quantize=None to keep them as they are")
    if quantize == formats.FP8:
        return formats.FP8, 0
    if not gated:
        raise ValueError(f"{given(quantize)}: int4 experts must be gated (gate and up rows), and these have no "
                         f"gate projection; use {given('fp8')}")
    fitting = formats.int4_groups_dividing(hidden, inter)
    if quantize == formats.INT4:
        if not fitting:
            raise ValueError(f"{given(quantize)}: no int4 group of 32, 64 or 128 values divides the hidden and "
                             f"intermediate sizes ({hidden} and {inter}); use {given('fp8')}")
        return formats.INT4, fitting[0]
    group = int(quantize.removeprefix("int4-g"))
    if group not in fitting:
        instead = " or ".join(given(f"int4-g{g}") for g in fitting) or given("fp8")
        raise ValueError(f"{given(quantize)}: groups of {group} values do not divide the hidden and intermediate "
                         f"sizes ({hidden} and {inter}); use {instead}")
    return formats.INT4, group


def expert_format(layouts: List[ExpertsLayout], quantize: Optional[str]) -> Tuple[str, int]:
    """The pool's (format, int4 group): the module's own (FP8 modules stay FP8), or what `quantize`
    asks for (quantized_format)."""
    first = layouts[0]
    if first.fp8 and asks_int4(quantize):  # before int4's size checks
        raise ValueError(f"quantize={quantize!r}: these experts are FP8 already (transformers' FP8 quantizer), and "
                         "freetoken keeps them as they are rather than round them a second time; leave quantize out")
    fmt, group = quantized_format(quantize, first.hidden, first.intermediate, first.gated)
    if first.fp8:
        return formats.FP8, 0  # already block-FP8: taken as it is
    return fmt, group


def fill_host_layer(host: HostPool, layer: int, module: torch.nn.Module, layout: ExpertsLayout,
                    name: str) -> None:
    """One experts block (`name`, for errors) into the host pool, in the pool's format: copied, or
    quantized to FP8 (gate and up blocked as the two projections they are), or FP8 weights and scales
    taken as they are."""
    w13, w2, b13, b2 = canonical_weights(module, layout)
    if layout.fp8:
        s13, s2 = fp8_scales(module)
        host.w13_scale[layer].copy_(s13)
        host.w2_scale[layer].copy_(s2)
    if host.shape.format in (formats.FP8, formats.INT4) and not layout.fp8:
        quantize_into_host(host, layer, w13, w2, layout, name)
    else:
        host.w13[layer].copy_(w13)
        host.w2[layer].copy_(w2)
    if layout.bias:
        host.b13[layer].copy_(b13)
        host.b2[layer].copy_(b2)


def quantize_into_host(host: HostPool, layer: int, w13: torch.Tensor, w2: torch.Tensor, layout: ExpertsLayout,
                       name: str) -> None:
    """Quantization of one layer's canonical float weights (w13 [E, 2I, H], w2) into an FP8 host
    pool (gate and up blocked apart) or an int4 one (the pool's group), expert by expert: the
    float32 values of one expert are the only temporaries, and an expert that cannot be quantized is
    named (`name`: its block)."""
    fmt = host.shape.format
    asked = fmt if fmt == formats.FP8 else f"int4-g{host.shape.group}"  # the pool's format in quantize='s words
    banks = (("gate/up" if layout.gated else "up", w13, host.w13, host.w13_scale, 2 if layout.gated else 1),
             ("down", w2, host.w2, host.w2_scale, 1))
    what = "block FP8 cannot represent (its 128 x 128 block would be NaN)" if fmt == formats.FP8 else \
        "int4 cannot represent (its group's scale would be NaN)"
    for e in range(w13.shape[0]):
        for bank, w, q_out, s_out, parts in banks:
            try:
                if fmt == formats.FP8:
                    q, scale = formats.quantize_fp8(w[e], parts=parts)
                else:
                    q, scale = formats.quantize_int4(w[e], host.shape.group)
            except formats.NonFiniteWeights:
                raise ValueError(f"quantize={asked!r}: expert {e} of {name} holds inf or NaN in its {bank} weights, which "
                                 f"{what}; fix the model's weights, or leave quantize out") from None
            except ValueError as error:
                instead = "quantize='fp8' (float32 scales) takes them, or leave quantize out" if fmt == formats.INT4 \
                    else "leave quantize out"
                raise ValueError(f"quantize={asked!r}: expert {e} of {name}, {bank} weights: "
                                 f"{re.sub('^quantize_(fp8|int4): ', '', str(error))}; {instead}") from None
            q_out[layer, e].copy_(q)
            s_out[layer, e].copy_(scale)


def check_options(options: dict, progress: bool = True) -> None:
    """Refuses unknown OffloadRuntime options and bad values of known ones (the eviction policy,
    fetch_fraction, rates, the switches, cpu_share_tokens) before any weight moves."""
    accepted = [n for n in inspect.signature(OffloadRuntime.__init__).parameters
                if n not in ("self", "host", "slots", "device", "activation", "top_k")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hint = " (the eviction policy is eviction=...)" if "policy" in unknown else ""
        raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{hint}; the sizes "
                        f"are cache_slots or cache_bytes, and the runtime takes {', '.join(accepted)}")
    policy_id(options.get("eviction", DEFAULT_EVICTION))
    tokens = options.get("cpu_share_tokens")
    if tokens is not None and (not isinstance(tokens, numbers.Integral) or isinstance(tokens, bool) or tokens < 1):
        raise ValueError(f"cpu_share_tokens must be a positive whole number of tokens (an int), got {tokens!r}")
    for switch, value in (*((k, options[k]) for k in ("skip_resident", "collect_stats", "stream_prefill")
                             if k in options), ("progress", progress)):
        if not isinstance(value, bool):
            raise TypeError(f"{switch} must be True or False, got {value!r}")
    check_runtime_options(options.get("fetch_fraction", 1.0), options.get("rates"), options.get("collect_stats", True))


def offload_experts(model: torch.nn.Module, *, cache_slots: Optional[int] = None,
                    cache_bytes: Optional[int] = None, device=None, progress: bool = True,
                    quantize: Optional[str] = None, **options) -> OffloadHandle:
    """Moves every experts block's weights into one pinned host pool, frees the module copies,
    builds one slot pool on `device` (default: where the rest of the model is, or CUDA when the
    model is on the CPU and a GPU exists), moves the rest of the model there, and switches the
    experts to the "freetoken" backend. quantize="fp8" stores the experts as block-FP8 (128 x 128
    scales, as transformers quantizes), quantize="int4" as symmetric int4 with a scale per 128 values
    of a row ("int4-g32", "int4-g64": smaller groups; quantized_format); experts that transformers
    loaded as FP8 stay FP8. Before
    switching, one experts block's own forward and the offloaded computation are compared on a probe
    (verify.py). Options go to ft_ops.moe.OffloadRuntime (fetch_fraction, stream_prefill,
    skip_resident, collect_stats, rates, eviction). If anything fails, the model is left exactly as
    it was."""
    register()
    if not isinstance(model, torch.nn.Module):
        hint = "; for a checkpoint directory use freetoken_plugin.load_model(path)" if isinstance(model, str) else ""
        raise TypeError(f"offload_experts takes a loaded transformers model (a torch.nn.Module), got "
                        f"{type(model).__name__}{hint}")
    check_options(options, progress)
    if device is not None:
        device = resolve_device(device)
    experts = find_experts(model)
    check_family_blocks(model)
    if not experts:
        raise no_experts_error(model)
    if any(getattr(m, "_freetoken_experts", None) is not None for _, m in experts):
        where = [name for name, _ in _offloaded_modules(model)]
        at = f" (its submodule {where[0]!r})" if where and where[0] else ""
        raise ValueError(f"the experts of this module are already offloaded by freetoken{at}; "
                         "freetoken_plugin.stats(model) reads them; to offload them with other settings, load the "
                         "model again and offload that")
    on_meta = [name for name, m in experts if any(p.is_meta for p in m.parameters())]
    if on_meta:
        raise ValueError(f"the experts of {on_meta[0]} are on the meta device (not loaded): load the model's weights "
                         "first, or read the checkpoint with freetoken_plugin.load_model(path)")
    layouts = read_layouts(experts)
    first = layouts[0]
    check_top_k(model, first.experts)
    check_undecorated_blocks(model, experts, layouts)
    if device is None:
        here = _model_device(model, experts)
        device = resolve_device("cuda" if here.type == "cpu" and torch.cuda.is_available() else here)
    fmt, group = expert_format(layouts, quantize)
    if fmt == formats.DENSE:  # (quantized experts compute in the hidden states' dtype)
        _check_hidden_dtype(model, first)
    shape = ExpertShape(len(experts), first.experts, first.hidden, first.intermediate, first.dtype, first.bias, fmt,
                        gated=first.gated, group=group)
    slots = resolve_slots(first.experts, shape.layers, shape.expert_bytes, cache_slots, cache_bytes,
                          options.get("stream_prefill", True), progress)

    check_host_pool_fits(shape, 0, "offload_experts(model, quantize='fp8'), or load_model(path, quantize='fp8') from "
                                   "its checkpoint (which never holds the float experts)", 0)
    # Build everything new before touching the model.
    host = HostPool.allocate(shape, pin=device.type == "cuda", progress=progress)
    quantizing = fmt in (formats.FP8, formats.INT4) and not first.fp8
    verb = "quantized" if quantizing else "copied"
    with torch.no_grad():
        for layer in bar(range(shape.layers), f"host pool ({fmt})", progress, unit="layer"):
            fill_host_layer(host, layer, experts[layer][1], layouts[layer], experts[layer][0])
    done(f"{verb} {shape.layers} MoE layers of experts to the {'pinned ' if host.is_pinned else ''}host pool "
         f"({fmt}, {human_bytes(host.nbytes)})", progress)
    for layer in verified_blocks(layouts):
        if fmt != formats.DENSE:  # the module computes with the pool's (dequantized) weights for the check
            check_from_host(experts[layer][1], layouts[layer], host, layer)
        else:
            check_expert_function(experts[layer][1], layouts[layer], host, layer)
    runtime = OffloadRuntime(host, slots, device, activation=[lay.activation for lay in layouts],
                             top_k=routed_per_token(model.config), **options)
    return install(model, experts, layouts, runtime, device)


class _ExpertsFromHost:
    """A state_dict hook of an offloaded experts module: its entries are the weights in the host
    pool, in the module's own layout, so state_dict() and save_pretrained() of an offloaded model
    hold the model's real experts. Contiguous views of the pool where the layout allows (free);
    transposed, interleaved or split (DBRX's) layouts are copies. save_pretrained clones tensors
    that share storage, so saving holds one more copy of the experts in host memory while it writes. Experts quantized
    to FP8 by offload_experts or read from an FP8, MXFP4 or int4 checkpoint into a float module are written
    dequantized, in the module's dtype (what the model now computes); an FP8 module's own weights
    (and its scale_inv, which it keeps) are written as FP8.
    An object, not a closure: a deep copy of the model copies it with the host pool it reads (the
    copy's own), and pickling the model stops here with a message (PICKLE_REFUSED)."""

    def __init__(self, host: HostPool, layer: int, layout: ExpertsLayout):
        self.host, self.layer, self.layout = host, layer, layout

    def __call__(self, module, state_dict, prefix, local_metadata):
        host, layer, layout = self.host, self.layer, self.layout
        b13 = host.b13[layer] if host.b13 is not None else None
        b2 = host.b2[layer] if host.b2 is not None else None
        w13, w2 = host.w13[layer], host.w2[layer]
        if host.shape.format == formats.MXFP4:  # GPT-OSS's experts from their checkpoint: exact in any float
            w13 = formats.dequantize_mxfp4(w13, host.w13_scale[layer], dtype=layout.dtype)
            w2 = formats.dequantize_mxfp4(w2, host.w2_scale[layer], dtype=layout.dtype)
        elif host.shape.format == formats.INT4:  # GPTQ's and compressed-tensors' codes and scales: exact in float32
            w13 = formats.dequantize_int4(w13, host.w13_scale[layer], dtype=layout.dtype)
            w2 = formats.dequantize_int4(w2, host.w2_scale[layer], dtype=layout.dtype)
        elif host.shape.format in formats.FP8_FORMATS and not layout.fp8:  # (block or row scales: dequantize_fp8 tells)
            w13 = formats.dequantize_fp8(w13, host.w13_scale[layer], parts=2 if layout.gated else 1, dtype=layout.dtype)
            w2 = formats.dequantize_fp8(w2, host.w2_scale[layer], parts=1, dtype=layout.dtype)
        tensors = {n: None if t is None else module_shape(layout, t)
                   for n, t in module_tensors_of(w13, w2, b13, b2, layout).items()}
        if layout.fp8:
            tensors.update(zip(FP8_SCALE_NAMES, (host.w13_scale[layer], host.w2_scale[layer])))
        for n, t in tensors.items():
            if prefix + n in state_dict and t is not None:
                state_dict[prefix + n] = t.contiguous()

    def __deepcopy__(self, memo):
        return _ExpertsFromHost(copy.deepcopy(self.host, memo), self.layer, self.layout)

    def __reduce__(self):
        raise TypeError(PICKLE_REFUSED)


def _own_configs(model: torch.nn.Module) -> list:
    """Gives the model's modules their own copies of the config objects they hold, under any
    attribute name (one deep copy, so a sub-config stays the object its parent config holds), and
    returns (module, attribute, original) to put back. The backend is selected through the
    configs' `_experts_implementation`: two models built from one config object share it, and
    switching it would switch the other model too. Every copy is made before any is assigned, so
    a copy that fails changes nothing; a config that cannot be copied is then switched in place,
    as it is (the model it belongs to still offloads)."""
    from transformers import PretrainedConfig

    holders = [(module, name, value) for module in model.modules() for name, value in vars(module).items()
               if isinstance(value, PretrainedConfig)]
    memo = {}
    try:
        copies = [memo[id(value)] if id(value) in memo else copy.deepcopy(value, memo) for _, _, value in holders]
    except Exception:  # e.g. a config attribute that does not pickle
        return []
    for (module, name, _), copied in zip(holders, copies):
        module.__dict__[name] = copied
    return holders


def install(model: torch.nn.Module, experts, layouts, runtime: OffloadRuntime, device) -> OffloadHandle:
    """Switches the experts modules to the backend, frees their weights and moves the rest of the
    model to `device`; on any failure every change is undone."""
    undo, own_configs, stand_ins = [], [], {}
    config_before = getattr(model.config, "_experts_implementation", None)
    try:
        own_configs = _own_configs(model)
        for layer, ((name, module), layout) in enumerate(zip(experts, layouts)):
            names = layout.param_names + (FP8_SCALE_NAMES if layout.fp8 else ())
            saved = {n: get_parameter(module, n) for n in names if get_parameter(module, n) is not None}
            stand_ins.update({f"{name}.{n}": torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                                requires_grad=False) for n, p in saved.items()})
            undecorated = family_of(module) is not None  # its block's forward is switched, not a config
            config = None if undecorated else module.config
            undo.append((module, saved, config, getattr(config, "_experts_implementation", None), []))
            for n, p in saved.items():
                where = p.device if p.device.type != "meta" else torch.device("cpu")
                set_parameter(module, n, torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=where),
                                                             requires_grad=False))
            undo[-1][4].append(module.register_state_dict_post_hook(_ExpertsFromHost(runtime.host, layer, layout)))
            object.__setattr__(module, "_freetoken_experts", OffloadedExperts(runtime, layer))
            if undecorated:
                undo[-1][4].append(types.SimpleNamespace(remove=switch_block(owner_block(model, name))))
            else:
                module.config._experts_implementation = BACKEND_NAME
        model.config._experts_implementation = BACKEND_NAME
        ancestors_hooks = _refuse_expert_weights_in_load_state_dict(model, [name for name, _ in experts])
        undo.append((model, {}, None, None, ancestors_hooks))
        if _model_device(model, experts) != device or any(b.device != device for b in model.buffers()):
            model.to(device)
    except BaseException:
        # Back to the original config objects; the switches are undone on the objects that were
        # switched too (the originals themselves when they could not be copied).
        for module, saved, config, impl, hooks in reversed(undo):
            for n, p in saved.items():
                set_parameter(module, n, p)
            for h in hooks:
                h.remove()
            if "_freetoken_experts" in module.__dict__:
                object.__delattr__(module, "_freetoken_experts")
            if config is not None:
                config._experts_implementation = impl
        model.config._experts_implementation = config_before
        for module, name, original in own_configs:
            module.__dict__[name] = original
        raise
    # One forward at a time through the pools (ft_ops/forward_lock.py), streamed passes started
    # before the embedding (and by generate, as soon as it is called): a subclass of its class.
    model.__class__ = served_subclass(type(model), "offloaded model", _offloaded_model_methods, _is_offloaded)
    for sub in model.modules():  # transformers' switch would run another implementation on freed weights
        if callable(getattr(type(sub), "set_experts_implementation", None)):
            object.__setattr__(sub, "set_experts_implementation", _keep_backend)
    handle = OffloadHandle(model, runtime, [name for name, _ in experts], stand_ins)
    object.__setattr__(model, "_freetoken_handle", handle)
    return handle


def _keep_backend(experts_implementation) -> None:
    """set_experts_implementation of an offloaded model: the experts' weights are in the host pool,
    so no other implementation can run them."""
    wanted = (set(experts_implementation.values()) if isinstance(experts_implementation, dict)
              else {experts_implementation})
    if wanted - {BACKEND_NAME}:
        raise RuntimeError(f"set_experts_implementation({experts_implementation!r}): this model's experts are offloaded "
                           f"(their weights are in freetoken's host pool), so they run as {BACKEND_NAME!r} only; load "
                           "the model again, without offload_experts, to run them another way")


class _RefuseExpertWeights:
    """A load_state_dict pre-hook of a module that holds offloaded experts (the experts modules and
    every module above them): their weights live in the host pool, which loading cannot reach.
    torch loads a module's own tensors right after its pre-hooks and then its children, so the
    hook of the module load_state_dict was called on sees every expert key before any tensor is
    copied: the refusal leaves the whole model as it was. `paths`: the experts modules' names
    relative to the hooked module ("" for the module itself)."""

    def __init__(self, paths: List[str]):
        self.paths = paths

    def __call__(self, module, state_dict, prefix, *args) -> None:
        for path in self.paths:
            where = prefix + (path + "." if path else "")
            for n in EXPERT_PARAM_NAMES + FP8_SCALE_NAMES:
                if where + n in state_dict:
                    raise RuntimeError(
                        f"load_state_dict: {where + n} belongs to offloaded experts (their weights are in freetoken's "
                        "host pool, which loading cannot change); load the weights into the model before "
                        "offload_experts, or load the checkpoint with freetoken_plugin.load_model")


def _refuse_expert_weights_in_load_state_dict(model: torch.nn.Module, names: List[str]) -> list:
    """Registers _RefuseExpertWeights on the experts modules named `names` and on every module above
    them; returns the hooks' handles."""
    below: Dict[str, List[str]] = {}  # module name -> its offloaded experts' relative names
    for name in names:
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            below.setdefault(".".join(parts[:depth]), []).append(".".join(parts[depth:]))
    return [model.get_submodule(owner)._register_load_state_dict_pre_hook(_RefuseExpertWeights(paths), with_module=True)
            for owner, paths in below.items()]


TOP_K_NAMES = ("num_experts_per_tok", "moe_topk", "experts_per_token", "num_experts_per_token", "top_k", "moe_top_k")
# The sub-configs that hold a model's MoE settings: a multimodal model's text_config, DBRX's ffn_config.
MOE_SUB_CONFIGS = ("text_config", "ffn_config")


def routed_per_token(config) -> Optional[int]:
    """Experts routed per token, from a transformers config (or its text_config, or DBRX's
    ffn_config); None if unnamed."""
    return routed_per_token_entry(config)[1]


def routed_per_token_entry(config) -> Tuple[Optional[str], Optional[int]]:
    """(the config's name for it, experts routed per token), as routed_per_token reads them."""
    for c in (config, *(getattr(config, n, None) for n in MOE_SUB_CONFIGS)):
        for name in TOP_K_NAMES:
            value = getattr(c, name, None) if c is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return name, value
    return None, None


def _forward_is_compiled(model) -> bool:
    """The model's forward runs compiled (`model.forward = torch.compile(model.forward)` or
    `model.compile()`): its layers admit, so no pass may be opened for it."""
    return (hasattr(model.forward, "_torchdynamo_orig_callable")
            or getattr(model, "_compiled_call_impl", None) is not None)


def _setting(name: str, kwargs, model):
    """A generate() setting as that call will see it: the call's keyword, else the model's
    generation_config (None if neither has it)."""
    if name in kwargs:
        return kwargs[name]
    return getattr(getattr(model, "generation_config", None), name, None)


def _new_tokens(args, kwargs, model=None) -> int:
    """Tokens the first forward of generate(*args, **kwargs) will run: the prompt's, less a history
    already in a given cache, at most one chunk of a chunked prefill; 0 where that cannot be told
    (then the model's forward decides, as without this estimate)."""
    if model is not None and _setting("cache_implementation", kwargs, model) == "paged":
        return 0  # continuous batching schedules its own forwards
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args and isinstance(args[0], torch.Tensor) else None))
    if not isinstance(ids, torch.Tensor):
        ids = kwargs.get("inputs_embeds")
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            return 0
        ids = ids[..., 0]
    if ids.dim() == 0:
        return 0
    # transformers renames past_key_values and cache_params to `cache`.
    past = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("cache_params")))
    new = ids.shape[-1]
    if past is not None:
        get = getattr(past, "get_seq_length", None)
        if not callable(get):
            return 0
        mask = kwargs.get("attention_mask")
        # The whole sequence passed (the usual call): only what follows the history runs. With a
        # mask longer than the ids, only the new tokens were passed.
        if not (isinstance(mask, torch.Tensor) and mask.shape[-1] > ids.shape[-1]):
            new = ids.shape[-1] - int(get())
    chunk = _setting("prefill_chunk_size", kwargs, model) if model is not None else None
    if isinstance(chunk, int) and chunk > 0:
        new = min(new, chunk)
    return max(new, 0) * (ids.numel() // max(ids.shape[-1], 1))


def _is_offloaded(model) -> bool:
    return "_freetoken_handle" in model.__dict__


def _offloaded_model_methods(cls: type) -> dict:
    """What an offloaded model's class (served_class.py) does in place of `cls`'s:

    `_call_impl` (every call of the model, whatever sets its forward: accelerate's hooks, or
    `model.forward = torch.compile(model.forward)`) holds the runtime's forward lock (another
    thread's calls wait until it returns; released in `finally`, so a KeyboardInterrupt leaves it
    free, which torch's always-called forward hooks, run after an Exception only, did not) and, for
    a forward that will stream its experts, queues the copies of the first MoE layers before the
    embedding runs (_start_streamed_pass). Compiled code takes no lock (a traced graph cannot; the
    generate around it holds it) and starts no pass.

    `generate` (where `cls` has one) holds the lock for the whole call and, for a prompt that will
    stream, queues its first layers' copies when generate is called: the work generate does before
    its first forward (checks, inputs, the cache; ~4 ms at 8k tokens on the H200 machine,
    docs/performance.md) overlaps the link instead of delaying it, and the model's call finds the
    pass open and unused and keeps it. Never raises for the estimate's sake.

    `get_parameter` of an offloaded expert weight gives a stand-in on the meta device with the
    weight's shape and dtype (its values are in the host pool; the module holds an empty tensor):
    save_pretrained compares each tensor with its parameter's shape to decide whether to transpose
    it back to the checkpoint's layout (Qwen3-VL-MoE's experts), and against the empty tensor it
    transposed the experts state_dict gives in the module's layout.

    They read the runtime from the model they run on, so a copy of the model uses its own."""
    original_call = cls._call_impl

    def _call_impl(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return original_call(self, *args, **kwargs)
        handle = self.__dict__.get("_freetoken_handle")
        if handle is None:
            return original_call(self, *args, **kwargs)
        lock = handle.runtime.forward_lock
        lock.acquire()
        try:
            _start_streamed_pass(self, handle, args, kwargs)
            return original_call(self, *args, **kwargs)
        finally:
            lock.release()

    original_apply = cls._apply

    def _apply(self, fn, *args, **kwargs):
        handle = self.__dict__.get("_freetoken_handle")
        if handle is not None:
            _refuse_cast(handle.runtime.shape, fn)
        return original_apply(self, fn, *args, **kwargs)

    original_get_parameter = cls.get_parameter

    def get_parameter(self, target: str):
        handle = self.__dict__.get("_freetoken_handle")
        stand_in = handle.expert_parameters.get(target) if handle is not None else None
        return stand_in if stand_in is not None else original_get_parameter(self, target)

    methods = {"_call_impl": _call_impl, "_apply": _apply, "get_parameter": get_parameter}
    original_generate = getattr(cls, "generate", None)
    if callable(original_generate):
        @functools.wraps(original_generate)
        def generate(self, *args, **kwargs):
            handle = self.__dict__.get("_freetoken_handle")
            # Continuous batching (a paged cache) runs the forwards in a thread of its own while
            # this one waits: holding the lock here would block them. Their calls take turns.
            if handle is None or _setting("cache_implementation", kwargs, self) == "paged":
                return original_generate(self, *args, **kwargs)
            lock = handle.runtime.forward_lock
            outer = lock.depth()
            lock.acquire()
            try:
                top_k = routed_per_token(self.config)
                if top_k is not None and handle.runtime.streamer is not None:
                    try:
                        tokens = 0 if _forward_is_compiled(self) else _new_tokens(args, kwargs, self)
                    except Exception:  # an unusual call: leave it to the model's call
                        tokens = 0
                    if tokens:
                        handle.runtime.begin_forward(tokens, top_k)
                return original_generate(self, *args, **kwargs)
            finally:
                lock.release_to(outer)  # down to this thread's holds before the call

        methods["generate"] = generate
    return methods


def _refuse_cast(shape: ExpertShape, fn) -> None:
    """`model.to(dtype)`, `.half()`, `.double()`, ... (torch's `_apply(fn)`) of an offloaded model,
    refused before any tensor is cast where the experts could not compute in the new dtype
    (moe.hidden_dtype_problem): the host pool keeps its dtype, so the cast would leave bf16/float32
    experts behind (state_dict and save_pretrained would mix dtypes) and the next forward would
    refuse the model. What `fn` does to a dtype is read off an empty tensor; a function that cannot
    run on it (a device this machine lacks) is left to torch. A cast of a submodule
    (model.model.to(...)) is not seen here: the next forward refuses it."""
    try:
        cast = fn(torch.empty(0, dtype=shape.dtype))
    except Exception:
        return
    if not isinstance(cast, torch.Tensor) or cast.dtype == shape.dtype:
        return
    problem = hidden_dtype_problem(shape, cast.dtype)
    if problem:
        how = ("the host pool keeps it, which a cast does not reach: cast the model before offload_experts (or pass "
               "dtype= to load_model)" if shape.dtype_fixed else "cast to one of those")
        raise TypeError(f"cannot cast an offloaded model to {cast.dtype}: {problem}; {how}")


def _start_streamed_pass(model, handle: OffloadHandle, args, kwargs) -> None:
    """A forward that will stream its experts queues the copies of the first MoE layers before the
    embedding runs (OffloadRuntime.begin_forward). Not for a forward compiled as `model.forward =
    torch.compile(model.forward)` (its layers admit)."""
    top_k = routed_per_token(model.config)
    if top_k is None or handle.runtime.streamer is None or _forward_is_compiled(model):
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        embeds = kwargs.get("inputs_embeds")
        tokens = embeds.shape[:-1].numel() if isinstance(embeds, torch.Tensor) else 0
    else:
        tokens = ids.numel() if isinstance(ids, torch.Tensor) else 0
    if tokens:
        handle.runtime.begin_forward(tokens, top_k)


def _offloaded_modules(model: torch.nn.Module) -> list:
    """(name, handle) of every module in `model` that offload_experts or load_model offloaded
    (the model itself has the name ""): a user may have offloaded an inner model."""
    return [(name, m.__dict__["_freetoken_handle"]) for name, m in model.named_modules()
            if "_freetoken_handle" in m.__dict__]


def stats(model) -> dict:
    """Hits, misses, rows and bytes over the link, CPU-served rows, per phase (a host sync).
    `model` is the offloaded model, a module that contains it, a part of it holding its experts, or
    the handle offload_experts returned."""
    if isinstance(model, OffloadHandle):  # what offload_experts returned: its own stats()
        return model.stats()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"stats takes a model offloaded by freetoken (a torch.nn.Module) or the handle "
                        f"offload_experts returned, got {type(model).__name__}")
    found = _offloaded_modules(model)
    if not found:
        # A part of an offloaded model (model.model): the runtime its offloaded experts share.
        runtimes = {id(m.__dict__["_freetoken_experts"].runtime): m.__dict__["_freetoken_experts"].runtime
                    for m in model.modules() if "_freetoken_experts" in m.__dict__}
        if len(runtimes) == 1:
            return next(iter(runtimes.values())).stats()
        if runtimes:
            raise ValueError(f"this module holds experts of {len(runtimes)} freetoken offloads: pass the offloaded "
                             "model itself (or a part holding experts of one offload only)")
        raise ValueError("this module is not offloaded by freetoken and holds no experts it offloaded: pass the "
                         "offloaded model (or a part of it holding its experts), or offload one with "
                         "offload_experts or load_model")
    if len(found) > 1:
        names = ", ".join(name or "the model itself" for name, _ in found)
        raise ValueError(f"this model holds {len(found)} freetoken offloads ({names}): pass the one to read, "
                         "e.g. stats(model.get_submodule(name))")
    return found[0][1].stats()
