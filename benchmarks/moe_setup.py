"""A stack of Qwen3-30B-A3B-shaped MoE layers with random weights in a pinned host pool, shared by
bench_prefill.py and bench_decode.py."""
import torch

import ft_ops
from ft_ops import formats
from ft_ops.slot_pool import ExpertShape, HostPool

E, H, I, K = 128, 2048, 768, 8


def random_host_pool(layers: int, fmt: str = formats.DENSE) -> HostPool:
    """Random bf16 experts (quantized to block-FP8 with fmt="fp8"), generated on the GPU a layer at
    a time and copied into pinned memory."""
    shape = ExpertShape(layers, E, H, I, torch.bfloat16, False, fmt)
    host = HostPool.allocate(shape, pin=True, progress=True)
    for layer in range(layers):
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        if fmt == formats.FP8:
            (w13, s13), (w2, s2) = formats.quantize_fp8(w13, parts=2), formats.quantize_fp8(w2)
            host.w13_scale[layer].copy_(s13)
            host.w2_scale[layer].copy_(s2)
        host.w13[layer].copy_(w13)
        host.w2[layer].copy_(w2)
    torch.cuda.synchronize()
    return host


def uniform_routing(tokens: int, layers: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(layers):
        logits = torch.randn(tokens, E, device="cuda", generator=g)
        w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        out.append((ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)))
    return out


def admit_every_expert(runtime) -> None:
    """Makes every expert of every layer resident (a pool that holds them all), so the timed decode
    steps are all hits."""
    pool = runtime.pool
    for layer in range(runtime.shape.layers):
        out = ft_ops.dedup_and_admit(*pool.state, layer, torch.arange(runtime.shape.experts, device=pool.device))
        ft_ops.copy_experts(pool.banks, runtime.host.layer_rows(layer), *out[1:])
    torch.cuda.synchronize()
