"""Verify, do not guess: before a model is switched to the freetoken backend, one experts block of
the original module and its converted computation (the same module's forward through the backend,
with expert_gemm on the block's canonical rows in the host pool, on the CPU, as its experts) run on
the same probe, at the scale of real hidden states and at 100x that, where every clamp and softcap
of a family is far exceeded. If they differ beyond the dtype's rounding, the conversion is refused
with the class and the measured difference: a class whose function was read wrongly never runs
with a different function. A block whose forward freetoken replaces (undecorated.py) is checked
against its own forward too (check_block_forward)."""
import copy
import math
from typing import Dict, Optional

import numpy as np
import torch

from ft_ops import formats, ops
from ft_ops.slot_pool import HostPool

from .backend import BACKEND_NAME
from .layouts import (ExpertsLayout, UnsupportedExperts, get_parameter, module_shape, module_tensors_of,
                      parameter_owner, set_parameter)
from .undecorated import experts_of, family_of

# Largest max-abs difference, relative to the module's largest output, that rounding explains: the
# module rounds its intermediates to the weights' dtype, expert_gemm keeps them in float32 (bfloat16
# measures up to 1.5e-2 over every family's tiny model). A different expert function at 100x scale
# differs by order 1.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 8e-3}
# A float32 module on a GPU that allows TF32 matmuls rounds its products to 10 mantissa bits.
TF32_TOLERANCE = 5e-3
SCALES = (1.0, 100.0)


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32 and device.type == "cuda" and (
            getattr(torch.backends.cuda.matmul, "allow_tf32", False) or torch.get_float32_matmul_precision() != "highest"):
        return TF32_TOLERANCE
    return TOLERANCE[dtype]


def probe(layout: ExpertsLayout, seed: int = 0):
    """(hidden [T, H] float32, top_k_index [T, 2], top_k_weights [T, 2]): a few experts spread over
    the block, each routed from two tokens, with unequal routing weights."""
    E = layout.experts
    experts = sorted({0, E // 3, (2 * E) // 3, E - 1})
    n = len(experts)
    tokens = 2 * n
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, layout.hidden, generator=gen)
    ids = torch.tensor(experts)
    first = ids[torch.arange(tokens) % n]
    second = ids[(torch.arange(tokens) + 1) % n]
    index = torch.stack([first, second], dim=1) if n > 1 else first[:, None]
    weights = torch.tensor([0.7, 0.3])[: index.shape[1]].expand(tokens, -1).contiguous()
    return hidden, index, weights


def difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| over the entries both give as finite; inf where only one is."""
    got, want = got.float().cpu(), want.float().cpu()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return float("inf")
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().clamp_min(1e-30)
    return float((got[finite] - want[finite]).abs().max() / scale)


def module_forward(module: torch.nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The module's forward with its configured experts implementation, or, where that implementation
    refuses the call (transformers' grouped_mm needs rows whose strides are multiples of 16 bytes:
    float32 with a hidden size of 130 does not), with its class's eager code, which defines the same
    function: the check is of what the class computes, and freetoken's kernels have no such limit.
    Running out of memory is raised as it is (a CUDA error the eager code raises again). An
    undecorated class (undecorated.py) runs its own forward in the decorated form; where that
    fails, the class is refused by name (UnsupportedExperts)."""
    family = family_of(module)
    with torch.no_grad():
        if family is not None:
            try:
                return family.experts_function(module, x, index, weights)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # noqa: BLE001 (a class that cannot run the probe is refused)
                name = type(module).__name__
                raise UnsupportedExperts(f"{name}: its own forward fails on the probe of {x.shape[0]} tokens of "
                                         f"{x.shape[1]} ({type(error).__name__}: {' '.join(str(error).split())}); "
                                         f"this transformers' {name} computes otherwise than the one freetoken reads, "
                                         "so the model is left unchanged") from None
        try:
            return module(x, index, weights)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            config = module.config
            implementation = getattr(config, "_experts_implementation", None)
            if implementation in (None, "eager"):
                raise
            config._experts_implementation = "eager"
            try:
                return module(x, index, weights)
            finally:
                config._experts_implementation = implementation


def converted_forward(module: torch.nn.Module, experts, x: torch.Tensor, index: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """What the module computes once offloaded, `experts` standing for its OffloadedExperts: its
    own forward through the freetoken backend, so what the class does around the dispatch (Ergo's
    norm of each route) and what the backend adds (MuseSpark's post_expert_norm) are checked too.
    An undecorated class is `experts` itself (its block's routing: check_block_forward)."""
    if family_of(module) is not None:
        return experts(x, index, weights)
    config = module.config
    implementation = config._experts_implementation
    before = module.__dict__.get("_freetoken_experts")
    object.__setattr__(module, "_freetoken_experts", experts)
    config._experts_implementation = BACKEND_NAME
    try:
        with torch.no_grad():
            return module(x, index, weights)
    finally:
        config._experts_implementation = implementation
        if before is None:
            object.__delattr__(module, "_freetoken_experts")
        else:
            object.__setattr__(module, "_freetoken_experts", before)


def check_expert_function(module: torch.nn.Module, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """Runs `module` (its class's forward, with its configured experts implementation; module_forward) and
    its converted forward (converted_forward, expert_gemm on host layer `layer` as its experts) on
    the probe at each of SCALES; raises UnsupportedExperts
    naming the class and the difference if they disagree. The module must hold the weights of
    that host layer (for an FP8 pool: dequantized, check_from_host)."""
    hidden, index, weights = probe(layout)
    device = get_parameter(module, layout.param_names[0]).device
    b13 = host.b13[layer] if host.b13 is not None else None
    b2 = host.b2[layer] if host.b2 is not None else None
    s13 = host.w13_scale[layer] if host.w13_scale is not None else None
    s2 = host.w2_scale[layer] if host.w2_scale is not None else None
    limit = tolerance(layout.dtype, device)

    routed = []  # the routes each call of the stand-in OffloadedExperts computed

    def host_experts(x, top_k_index, top_k_weights):  # called as the backend calls OffloadedExperts
        routed.append(top_k_index.numel())
        return ops.expert_gemm(x.cpu(), top_k_index.cpu(), top_k_weights.cpu(), host.w13[layer], host.w2[layer], b13,
                               b2, layout.activation, s13, s2).to(x.device)

    def outputs(scale: float):
        x = (hidden * scale).to(layout.dtype)
        args = x.to(device), index.to(device), weights.to(device=device, dtype=layout.dtype)
        routed.clear()
        want, got = module_forward(module, *args), converted_forward(module, host_experts, *args)
        # Both sides run the module's own forward: one that computes its experts itself, never
        # through the dispatch, would agree with itself and then run on freed weights.
        if sum(routed) < index.numel():
            raise UnsupportedExperts(f"{type(module).__name__}'s forward computes {'no' if not routed else 'not every'} "
                                     "route through transformers' experts dispatch (it computes its experts "
                                     "itself), so freetoken cannot serve them; the model is left unchanged")
        return want, got

    for scale in SCALES:
        want, got = outputs(scale)
        while scale > 10 and not torch.isfinite(want).all():  # float16 overflowed, not the function
            scale /= 10
            want, got = outputs(scale)
        diff = difference(got, want)
        if not diff <= limit:
            raise UnsupportedExperts(
                f"{type(module).__name__}: the offloaded experts would differ from the module's own forward by "
                f"{diff:.2g} (max-abs, relative) at {scale:g}x input scale, beyond the {layout.dtype} rounding "
                f"tolerance {limit:g}; freetoken computes {layout.activation} with this layout, so the class "
                "computes something else and the model is left unchanged")


def lazy_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """Zeros from calloc: the pages of a large tensor are mapped on first write, so a full-size
    parameter of which only a few experts are written costs those experts' memory."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(*shape)


def check_from_host(module: torch.nn.Module, layout: ExpertsLayout, host: HostPool, layer: int) -> None:
    """check_expert_function with the module's weight parameters, for the check, set to the host
    layer's experts in the module's own layout, on the CPU; they are put back afterwards. Only the
    experts the probe routes to are materialized (dequantized to the compute dtype for a quantized
    pool, so the module and expert_gemm compute with the same weights); the others are zeros that
    take no memory, so checking a layer of a large model costs a few experts, not a layer."""
    saved: Dict[str, Optional[torch.nn.Parameter]] = {}
    for n in layout.param_names:
        owner, leaf = parameter_owner(module, n)
        if owner is not None and leaf in owner._parameters:
            saved[n] = owner._parameters[leaf]
    ids = probe(layout)[1].unique()
    w13, w2 = host.w13[layer], host.w2[layer]
    if host.shape.format == formats.DENSE:
        w13, w2 = w13[ids], w2[ids]
    else:
        # gate and up blocked apart (FP8, gated); fp8_rows' and MXFP4's scales are per row: parts unused
        parts13 = 2 if host.shape.format == formats.FP8 and layout.gated else 1
        w13 = ops.dequantize_experts(w13, host.w13_scale[layer], ids, parts13, layout.dtype)
        w2 = ops.dequantize_experts(w2, host.w2_scale[layer], ids, 1, layout.dtype)
    b13 = host.b13[layer][ids] if host.b13 is not None else None
    b2 = host.b2[layer][ids] if host.b2 is not None else None
    tensors: Dict[str, Optional[torch.Tensor]] = {}
    for n, rows in module_tensors_of(w13, w2, b13, b2, layout).items():
        tensors[n] = None
        if rows is not None:
            full = lazy_zeros((layout.experts, *rows.shape[1:]), rows.dtype)
            full[ids] = rows
            tensors[n] = module_shape(layout, full)
    config = getattr(module, "config", None)  # undecorated classes hold none (and no FP8 weights)
    implementation = getattr(config, "_experts_implementation", None)
    try:
        for n in saved:
            t = tensors[n]
            set_parameter(module, n, None if t is None else torch.nn.Parameter(t, requires_grad=False))
        if layout.fp8:
            # FP8Experts' grouped forwards need transformers' FP8 kernels even for wide weights;
            # its eager forward computes dequantized weights with plain matrix products.
            config._experts_implementation = "eager"
        check_expert_function(module, layout, host, layer)
    finally:
        for n, p in saved.items():
            set_parameter(module, n, p)
        if layout.fp8:
            config._experts_implementation = implementation


class _StandInExperts:
    """One function per expert for the block check: route rows r of expert e give r * |r| * c_e,
    c_e a vector of signs and magnitudes drawn per expert. It maps zero to zero, as an expert
    without biases does; it grows with its input (quadratically, so input scaling and output
    scaling differ at any scale) and tells any expert from any other."""

    def __init__(self, experts: int, hidden: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (experts, hidden), generator=gen) * 2.0 - 1.0
        self.coefficients = signs * (1.0 + torch.rand(experts, 1, generator=gen))

    def __call__(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """rows [..., H] of the experts `expert_ids` (broadcast to rows' leading dimensions)."""
        return rows * rows.abs() * self.coefficients.to(rows.device)[expert_ids]

    def routed(self, x, top_k_index, top_k_weights):  # as the offloaded experts are called
        out = self(x.unsqueeze(1), top_k_index)
        return (out * top_k_weights.unsqueeze(-1)).sum(dim=1)


# The block check compares two float32 computations of the same stand-in: only the order of a sum
# over a token's experts differs.
BLOCK_TOLERANCE = 1e-5


def check_block_forward(block: torch.nn.Module, layout: ExpertsLayout, seed: int = 0) -> None:
    """The routed forward that replaces an undecorated block's (undecorated.py) against the block's
    own forward, on a probe at 1x and 100x scale: both on a float32 copy of the block (router and
    shared expert as the block holds them) whose experts are one stand-in function
    (_StandInExperts, called as the block calls its experts), so no expert weight is read and
    load_model runs it before any is. Raises UnsupportedExperts naming the block's class and what
    differs (or what failed); the model is left unchanged."""
    family = family_of(experts_of(block))
    name = type(block).__name__
    stand_in = _StandInExperts(layout.experts, layout.hidden, seed)
    # [batch, tokens, H], as a model calls its blocks
    probe_hidden = torch.randn(2, 4, layout.hidden, generator=torch.Generator().manual_seed(seed))
    # The copy leaves the experts behind (a stand-in takes their place): a few non-expert weights
    # in float32, never a layer of experts.
    copy_ = copy.deepcopy(block, memo=family.stand_ins(block, stand_in)).float()
    device = next(copy_.parameters()).device
    for scale in SCALES:
        hidden = (probe_hidden * scale).to(device)
        try:
            with torch.no_grad():
                want = type(block).forward(copy_, hidden)
                got = family.routed_forward(copy_, stand_in.routed, hidden)
        except Exception as error:  # noqa: BLE001 (any failure of the replacement on this block is a refusal)
            raise UnsupportedExperts(f"{name}: the forward freetoken runs in its place fails on this transformers' "
                                     f"{name} ({type(error).__name__}: {error}); {_REFUSED}") from None
        want, got = (w if isinstance(w, tuple) else (w,) for w in (want, got))
        problem = None
        if _shapes(want) != _shapes(got):
            problem = f"returns {_shapes(got)} where the block returns {_shapes(want)}"
        else:
            diff = max(difference(b, a) for a, b in zip(want, got) if isinstance(a, torch.Tensor))
            if not diff <= BLOCK_TOLERANCE:
                problem = (f"differs from it by {diff:.2g} (max-abs, relative, float32) at {scale:g}x input scale, "
                           f"beyond the {BLOCK_TOLERANCE:g} a sum's order explains")
        if problem:
            raise UnsupportedExperts(f"{name}: the forward freetoken runs in its place {problem}; {_REFUSED}")


def _shapes(outputs) -> list:
    return [tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__ for o in outputs]


_REFUSED = ("this transformers' block computes otherwise than the one freetoken replaces (that of transformers "
            "5.17 to 5.25), so the model is left unchanged: use such a transformers, or report it")
