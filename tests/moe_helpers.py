"""A random stack of MoE layers: a host pool, an offload runtime over it, and the all-resident
reference (expert_gemm over the host layer with expert ids as slots)."""
import torch

import ft_ops
from ft_ops import formats
from ft_ops.moe import OffloadedExperts, OffloadRuntime
from ft_ops.slot_pool import HostPool

L, E, H, I, K = 4, 8, 32, 16, 2


def random_host_pool(device: str, dtype=torch.float32, bias=False, seed=0, layers=L, experts=E, fmt="dense",
                     hidden=H, inter=I, gated=True):
    """Random experts; fmt="fp8", "fp8_rows", "mxfp4" or "int4" (groups of 32) quantizes them
    (ft_ops/formats.py), dtype is then the compute dtype. gated=False: w13 holds the up rows alone."""
    gen = torch.Generator().manual_seed(seed)
    parts = 2 if gated else 1
    w13 = torch.randn(layers, experts, parts * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(layers, experts, hidden, inter, generator=gen) * inter ** -0.5
    b13 = (torch.randn(layers, experts, parts * inter, generator=gen) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(layers, experts, hidden, generator=gen) * 0.1).to(dtype) if bias else None
    scales = {}
    if fmt == "fp8":
        (w13, s13), (w2, s2) = formats.quantize_fp8(w13, parts=parts), formats.quantize_fp8(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    elif fmt == "fp8_rows":
        (w13, s13), (w2, s2) = formats.quantize_fp8_rows(w13), formats.quantize_fp8_rows(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    elif fmt == "mxfp4":  # hidden and inter multiples of 32
        (w13, s13), (w2, s2) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
    elif fmt == "int4":  # hidden and inter multiples of 32
        (w13, s13), (w2, s2) = formats.quantize_int4(w13, 32), formats.quantize_int4(w2, 32)
        scales = dict(w13_scale=s13, w2_scale=s2)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    tensors = dict(w13=w13, w2=w2, b13=b13, b2=b2, **scales)
    if device == "cuda":
        tensors = {k: (None if t is None else t.pin_memory()) for k, t in tensors.items()}
    return HostPool(**tensors, dtype=dtype)


def layers_for(runtime: OffloadRuntime):
    return [OffloadedExperts(runtime, l) for l in range(runtime.shape.layers)]


def resident_stack(host: HostPool, x: torch.Tensor, routing, activation="silu", inputs=None):
    """The same stack with every expert resident: each layer's experts computed in place from the
    host layer. With `inputs` (each layer's input as the offloaded stack saw it), every layer is
    compared on identical input, so rounding differences do not compound through the stack.
    `activation`: one for every layer, or a list of one per layer."""
    out = []
    for layer, (ids, w) in enumerate(routing):
        if inputs is not None:
            x = inputs[layer]
        b13 = host.b13[layer] if host.b13 is not None else None
        b2 = host.b2[layer] if host.b2 is not None else None
        s13 = host.w13_scale[layer] if host.w13_scale is not None else None
        s2 = host.w2_scale[layer] if host.w2_scale is not None else None
        act = activation[layer] if isinstance(activation, (list, tuple)) else activation
        y = ft_ops.expert_gemm(x.cpu(), ids.cpu(), w.cpu(), host.w13[layer], host.w2[layer], b13, b2, act, s13, s2)
        out.append(y)
        x = x.cpu() + y
    return out


def offloaded_stack(modules, x: torch.Tensor, routing, inputs=None):
    out = []
    for module, (ids, w) in zip(modules, routing):
        if inputs is not None:
            inputs.append(x.cpu())
        y = module(x, ids.to(x.device), w.to(x.device))
        out.append(y)
        x = x + y
    return out


def random_routing(tokens: int, gen: torch.Generator, layers=L, experts=E, top_k=K, hot=None):
    routing = []
    for _ in range(layers):
        logits = torch.randn(tokens, experts, generator=gen)
        if hot is not None:
            logits[:, hot] += 2.0  # skew: a few experts are routed most of the time
        w, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
        routing.append((ids, w / w.sum(-1, keepdim=True)))
    return routing
