"""expert_gemm on the layer shapes of the families beyond Qwen3-30B-A3B's (the shape the other
benchmarks measure), bf16 on the GPU, in one run:
- Nemotron 3 Nano 30B-A3B (Nemotron-H: experts without a gate, down(relu(up x)^2); 128 experts,
  hidden 2688, intermediate 1856, top-6);
- Llama 4 Scout (16 experts, hidden 5120, intermediate 8192, top-1: one expert is 252 MB);
- Qwen3-30B-A3B as the gated reference of the same run.
Per shape: one-token decode against the HBM floor of the bytes it reads (CUDA-graph replay, 16
routings per graph, the layer's experts scattered over an 8 GiB bank), and prompts of 2048 and 8192
tokens against a torch._grouped_mm pipeline of the same function on resident weights. For Llama 4
also its MoE block at one token: transformers' Llama4TextMoe resident (it runs all 16 experts on
every token) against the same block offloaded with every expert cached, each one CUDA graph.
Writes shapes.json."""
import argparse
import gc
import warnings

import torch
import torch.nn.functional as F

import ft_ops
from ft_ops.activations import RELU2, SILU
from common import (bf16_matmul_tflops, capture_graph, decode_routings, hbm_floor_gbps, graph_ms_per_call, median_ms, print_table,
                    warm_gpu, write_report)

# name: experts, hidden, intermediate, experts per token, activation.
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8, SILU),
    "nemotron-3-nano": (128, 2688, 1856, 6, RELU2),
    "llama4-scout": (16, 5120, 8192, 1, SILU),
}
BANK_BYTES = 8 * 2**30


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w, ids = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=g), -1).topk(top_k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def build_bank(E: int, H: int, I: int, act):
    """(w13, w2 of a bank of about BANK_BYTES, slot of each expert, the resident [E, ...] weights)."""
    rows = 2 * I if act.gated else I
    expert_bytes = (rows + I) * H * 2
    slots = max(E, BANK_BYTES // expert_bytes)
    torch.manual_seed(0)
    r13 = torch.randn(E, rows, H, dtype=torch.bfloat16, device="cuda") * H ** -0.5
    r2 = torch.randn(E, H, I, dtype=torch.bfloat16, device="cuda") * I ** -0.5
    w13 = torch.empty(slots, rows, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(slots, H, I, dtype=torch.bfloat16, device="cuda")
    slot_of_expert = torch.randperm(slots, device="cuda")[:E]
    w13[slot_of_expert] = r13
    w2[slot_of_expert] = r2
    return w13, w2, slot_of_expert.int(), r13, r2, expert_bytes


def grouped_reference(x, ids, weights, r13, r2, act):
    """The same function with torch._grouped_mm on resident weights, as a user would write it."""
    E, I = r2.shape[0], r2.shape[2]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    token = order // ids.shape[1]
    h = torch._grouped_mm(x.index_select(0, token), r13.transpose(1, 2), offs=offs)
    a = F.silu(h[:, :I]) * h[:, I:] if act.gated else F.relu(h).square()
    y = torch._grouped_mm(a, r2.transpose(1, 2), offs=offs) * weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def shape_rows(name: str, hbm_gbps: float, peak_tflops: float):
    E, H, I, K, act = SHAPES[name]
    w13, w2, slot_of_expert, r13, r2, expert_bytes = build_bank(E, H, I, act)
    rows = []
    calls, inputs, unique = 16, [], 0
    # Each call routed to none of the previous call's experts (as consecutive layers): none reads
    # its bytes from L2.
    for w, ids in decode_routings(calls, 1, E, K, torch.Generator(device="cuda").manual_seed(1000)):
        inputs.append((torch.randn(1, H, dtype=torch.bfloat16, device="cuda"), slot_of_expert[ids],
                       (w / w.sum(-1, keepdim=True)).float()))
        unique += ids.unique().numel()
    it = iter(range(10 ** 9))

    def one_call():
        x, s, w = inputs[next(it) % calls]
        ft_ops.expert_gemm(x, s, w, w13, w2, activation=act)

    warm_gpu()
    us = graph_ms_per_call(one_call, calls) * 1000
    floor = unique / calls * expert_bytes / (hbm_gbps * 1e9) * 1e6
    rows.append(dict(shape=name, gated=act.gated, tokens=1, slots=w13.shape[0], ours=round(us, 1), reference=round(floor, 1),
                     unit="us", ratio=round(us / floor, 2), reference_is="HBM floor", goal="<= 1.5"))
    for tokens in (2048, 8192):
        x = torch.randn(tokens, H, dtype=torch.bfloat16, device="cuda")
        ids, weights = routing(tokens, E, K, tokens)
        slots = slot_of_expert[ids]
        ours_out = ft_ops.expert_gemm(x, slots, weights, w13, w2, activation=act)
        ref_out = grouped_reference(x, ids, weights, r13, r2, act)
        err = float((ours_out.float() - ref_out.float()).norm() / ref_out.float().norm())
        warm_gpu()
        ours = median_ms(lambda: ft_ops.expert_gemm(x, slots, weights, w13, w2, activation=act))
        ref = median_ms(lambda: grouped_reference(x, ids, weights, r13, r2, act))
        flops = 2 * tokens * K * H * ((2 if act.gated else 1) * I + I)
        rows.append(dict(shape=name, gated=act.gated, tokens=tokens, slots=w13.shape[0], ours=round(ours, 3),
                         reference=round(ref, 3), unit="ms", ratio=round(ours / ref, 3),
                         reference_is="torch._grouped_mm", TFLOPs=round(flops / ours / 1e9, 1),
                         peak_TFLOPs=round(peak_tflops, 1), rel_err=f"{err:.1e}", goal="<= 1.0"))
        del x, ours_out, ref_out
    del w13, w2, r13, r2
    free_memory()
    return rows


def llama4_block_rows(steps: int = 30):
    """Llama 4 Scout's MoE block (one decoder layer's) at one token: transformers' block, resident,
    against the offloaded block with its 16 experts cached (one CUDA graph per step each)."""
    import transformers

    import freetoken_plugin

    E, H, I, K, _ = SHAPES["llama4-scout"]
    config = transformers.Llama4TextConfig(hidden_size=H, intermediate_size=I, intermediate_size_mlp=2 * I,
                                           num_local_experts=E, num_experts_per_tok=K, num_hidden_layers=1,
                                           num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                           vocab_size=1024, no_rope_layers=[1], layer_types=None)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.Llama4ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-2 if "experts" in name else -1] ** -0.5)
    block = next(m for m in model.modules() if type(m).__name__ == "Llama4TextMoe")
    xs = [torch.randn(1, H, dtype=torch.bfloat16, device="cuda") for _ in range(steps)]
    static = torch.empty(1, H, dtype=torch.bfloat16, device="cuda")

    def per_step_ms():
        graph = capture_graph(lambda: block(static))
        warm_gpu()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for x in xs:
            static.copy_(x)
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps

    with torch.no_grad():
        static.copy_(xs[0])
        want = block(static)[0].float()
        resident = per_step_ms()
        freetoken_plugin.offload_experts(model, cache_slots=E, device="cuda", progress=False)
        static.copy_(xs[0])  # the timed replays left the last step's input there
        got = block(static)[0].float()  # admits the routed expert
        for x in xs:  # every expert resident before the timed steps
            block(x)
        for e in range(E):
            block.experts._freetoken_experts(static, torch.full((1, 1), e, device="cuda"),
                                             torch.ones(1, 1, dtype=torch.bfloat16, device="cuda"))
        offloaded = per_step_ms()
    err = float((got - want).norm() / want.norm())
    row = dict(shape="llama4-scout block", gated=True, tokens=1, ours=round(offloaded, 3), reference=round(resident, 3),
               unit="ms", ratio=round(offloaded / resident, 3), reference_is="transformers' block, resident",
               rel_err=f"{err:.1e}", goal="< 1 (sparse)")
    del model, block
    free_memory()
    return [row]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--no-block", action="store_true", help="leave out Llama 4's MoE block")
    args = parser.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    hbm, copy_gbps, read_gbps = hbm_floor_gbps()
    peak = bf16_matmul_tflops()
    print(f"device copy {copy_gbps:.0f} GB/s (read + write), device read {read_gbps:.0f} GB/s (the floor's rate: {hbm:.0f}), "
          f"bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for name in shapes:
        rows += shape_rows(name, hbm, peak)
        print_table(f"{name}: expert_gemm, decode vs HBM floor, prompts vs torch._grouped_mm", rows[-3:],
                    ["shape", "gated", "tokens", "slots", "ours", "reference", "unit", "ratio", "reference_is",
                     "TFLOPs", "rel_err", "goal"])
    if not args.no_block:
        rows += llama4_block_rows()
    write_report("shapes", rows, {"hbm_GBps": round(hbm, 1), "device_copy_GBps": round(copy_gbps, 1),
                                  "device_read_GBps": round(read_gbps, 1), "bf16_matmul_TFLOPs": round(peak, 1)})
    print_table("every shape", rows, ["shape", "gated", "tokens", "ours", "reference", "unit", "ratio", "reference_is",
                                      "rel_err", "goal"])


if __name__ == "__main__":
    main()
