"""Experts without a gate (Nemotron-H: down(relu(up x)^2)) on the GPU: the decode call against the
HBM floor of the bytes it reads, beside a gated call of the same intermediate size (1.5x the
bytes), and a prompt against a torch._grouped_mm pipeline on resident weights. NVIDIA Nemotron 3
Nano's MoE layer shape (128 experts, hidden 2688, expert intermediate 1856, top-6), bf16 and
block-FP8 experts scattered over a 512-slot pool. Writes ungated.json."""
import argparse

import torch

import ft_ops
from common import device_copy_gbps, graph_ms_per_call, median_ms, print_table, warm_gpu, write_report
from ft_ops import formats
from ft_ops.activations import RELU2, SILU

E, H, I, K = 128, 2688, 1856, 6
SLOTS = 512


def pool(gated: bool, fmt: str, seed: int = 0):
    """The layer's experts in `fmt` at random slots of a SLOTS-slot pool: (banks, slot of each
    expert, the experts in bf16 as a reference pipeline reads them)."""
    torch.manual_seed(seed)
    rows = 2 * I if gated else I
    r13 = torch.randn(E, rows, H, device="cuda") * H ** -0.5
    r2 = torch.randn(E, H, I, device="cuda") * I ** -0.5
    where = torch.randperm(SLOTS, device="cuda")[:E]
    banks = {}
    if fmt == formats.FP8:
        (q13, s13), (q2, s2) = formats.quantize_fp8(r13, parts=2 if gated else 1), formats.quantize_fp8(r2)
        for name, t in (("w13", q13), ("w2", q2), ("w13_scale", s13), ("w2_scale", s2)):
            banks[name] = torch.zeros(SLOTS, *t.shape[1:], dtype=t.dtype, device="cuda")
            banks[name][where] = t
        r13, r2 = formats.dequantize_fp8(q13, s13, 2 if gated else 1), formats.dequantize_fp8(q2, s2)
    else:
        for name, t in (("w13", r13), ("w2", r2)):
            banks[name] = torch.zeros(SLOTS, *t.shape[1:], dtype=torch.bfloat16, device="cuda")
            banks[name][where] = t.to(torch.bfloat16)
    return banks, where.int(), r13.to(torch.bfloat16), r2.to(torch.bfloat16)


def routing(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w, ids = torch.softmax(torch.randn(tokens, E, device="cuda", generator=g), -1).topk(K, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def gemm(banks, x, slot_ids, weights, activation):
    return ft_ops.expert_gemm(x, slot_ids, weights, banks["w13"], banks["w2"], None, None, activation,
                              banks.get("w13_scale"), banks.get("w2_scale"))


def decode_rows(hbm_gbps: float):
    rows = []
    for fmt in (formats.DENSE, formats.FP8):
        for gated in (False, True):
            banks, where, _, _ = pool(gated, fmt)
            expert_bytes = sum(t[0].numel() * t.element_size() for t in banks.values())
            activation = SILU if gated else RELU2
            for tokens in (1, 4, 16):
                calls = 16  # distinct routings per graph, so that replays do not run from L2
                inputs, unique = [], 0
                for c in range(calls):
                    ids, weights = routing(tokens, 100 * tokens + c)
                    inputs.append((torch.randn(tokens, H, dtype=torch.bfloat16, device="cuda"), where[ids], weights))
                    unique += ids.unique().numel()
                it = iter(range(10 ** 9))

                def one_call():
                    x, s, w = inputs[next(it) % calls]
                    gemm(banks, x, s, w, activation)

                warm_gpu()
                us = graph_ms_per_call(one_call, calls) * 1000
                floor_us = unique / calls * expert_bytes / (hbm_gbps * 1e9) * 1e6
                rows.append(dict(format="bf16" if fmt == formats.DENSE else fmt, experts="gated (SiLU)" if gated else
                                 "ungated (relu2)", expert_MiB=round(expert_bytes / 2 ** 20, 2), tokens=tokens,
                                 us=round(us, 1), floor_us=round(floor_us, 1), ratio_to_floor=round(us / floor_us, 2)))
            del banks
            torch.cuda.empty_cache()
    return rows


def reference_prompt(x, ids, weights, r13, r2):
    """The prompt as a user would write it with torch._grouped_mm on resident [E, ...] weights."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    offs = torch.bincount(flat, minlength=E).cumsum(0).int()
    token = order // K
    h = torch._grouped_mm(x.index_select(0, token), r13.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(torch.relu(h).square(), r2.transpose(1, 2), offs=offs)
    y = y * weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def prompt_rows(tokens_list=(2048, 8192)):
    rows = []
    banks, where, r13, r2 = pool(False, formats.DENSE)
    for tokens in tokens_list:
        x = torch.randn(tokens, H, dtype=torch.bfloat16, device="cuda")
        ids, weights = routing(tokens, tokens)
        ours_out = gemm(banks, x, where[ids], weights, RELU2)
        ref_out = reference_prompt(x, ids, weights, r13, r2)
        err = float((ours_out.float() - ref_out.float()).norm() / ref_out.float().norm())
        warm_gpu()
        ours = median_ms(lambda: gemm(banks, x, where[ids], weights, RELU2))
        ref = median_ms(lambda: reference_prompt(x, ids, weights, r13, r2))
        rows.append(dict(tokens=tokens, ours_ms=round(ours, 3), ref_ms=round(ref, 3), speedup=round(ref / ours, 3),
                         ours_TFLOPs=round(4 * tokens * K * H * I / ours / 1e9, 1), rel_err_vs_ref=f"{err:.1e}"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="decode,prompt", help="comma-separated: decode, prompt")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"decode", "prompt"}
    if unknown:
        parser.error(f"unknown --parts {sorted(unknown)}; choose from decode, prompt")
    hbm = device_copy_gbps()
    decode = decode_rows(hbm) if "decode" in parts else []
    prompt = prompt_rows() if "prompt" in parts else []
    write_report("ungated", decode + prompt, {"device_copy_GBps": round(hbm, 1), "shape": dict(E=E, H=H, I=I, K=K),
                                              "slots": SLOTS})
    print(f"measured ceiling: device copy {hbm:.0f} GB/s (read+write); shape E {E}, H {H}, I {I}, top-{K}")
    print_table("decode: expert_gemm against the HBM floor of its bytes (graph replay)", decode,
                ["format", "experts", "expert_MiB", "tokens", "us", "floor_us", "ratio_to_floor"])
    print_table("prompt, bf16 ungated: expert_gemm (experts scattered over the pool) against torch._grouped_mm "
                "on resident weights", prompt, ["tokens", "ours_ms", "ref_ms", "speedup", "ours_TFLOPs", "rel_err_vs_ref"])


if __name__ == "__main__":
    main()
