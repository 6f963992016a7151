"""A stack of Qwen3-30B-A3B-shaped MoE layers with random weights in a pinned host pool, shared by
bench_prefill.py and bench_decode.py."""
import torch

from ft_ops.slot_pool import ExpertShape, HostPool

E, H, I, K = 128, 2048, 768, 8


def random_host_pool(layers: int) -> HostPool:
    """Random bf16 experts, generated on the GPU a layer at a time and copied into pinned memory."""
    shape = ExpertShape(layers, E, H, I, torch.bfloat16, False)
    host = HostPool.allocate(shape, pin=True, progress=True)
    for layer in range(layers):
        host.w13[layer].copy_(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5)
        host.w2[layer].copy_(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5)
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
