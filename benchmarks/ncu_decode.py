"""The one-token decode expert_gemm calls of every expert format, for Nsight Compute: each format's
call runs a few times untimed, then once between cudaProfilerStart and cudaProfilerStop, so
`ncu --profile-from-start off` reads exactly one call (its gate_up and down_combine kernels) per
format. The gpu_check.sh step ncu-decode runs it under ncu and writes the reports to $OUT:

  ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
      --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \\
      --section LaunchStats --section Occupancy python3 benchmarks/ncu_decode.py

Shapes: bf16 and FP8 at Qwen3-30B-A3B's layer (H 2048, I 768, top-8, SwiGLU), MXFP4 at
GPT-OSS-120B's (H 2880, I 2880, top-4, clamped SwiGLU with biases), 256 slots each."""
import torch

import ft_ops
from ft_ops import formats
from ft_ops.activations import SWIGLUOAI

SLOTS = 256


def bf16_and_fp8_calls(gen: torch.Generator):
    E, H, I, K = 128, 2048, 768, 8
    w13 = torch.randn(SLOTS, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w2 = torch.randn(SLOTS, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * I ** -0.5
    (q13, s13), (q2, s2) = formats.quantize_fp8(w13, parts=2), formats.quantize_fp8(w2)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w, ids = torch.softmax(torch.randn(1, E, device="cuda", generator=gen), -1).topk(K, dim=-1)
    slots = torch.randperm(SLOTS, device="cuda", generator=gen)[:E].int()[ids]
    return {"bf16": lambda: ft_ops.expert_gemm(x, slots, w.float(), w13, w2),
            "fp8": lambda: ft_ops.expert_gemm(x, slots, w.float(), q13, q2, w13_scale=s13, w2_scale=s2)}


def mxfp4_call(gen: torch.Generator):
    E, H, I, K = 128, 2880, 2880, 4
    q13 = torch.randint(0, 256, (SLOTS, 2 * I, H // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s13 = torch.randint(118, 123, (SLOTS, 2 * I, H // 32), dtype=torch.uint8, device="cuda", generator=gen)
    q2 = torch.randint(0, 256, (SLOTS, H, I // 2), dtype=torch.uint8, device="cuda", generator=gen)
    s2 = torch.randint(118, 123, (SLOTS, H, I // 32), dtype=torch.uint8, device="cuda", generator=gen)
    b13 = (torch.randn(SLOTS, 2 * I, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(SLOTS, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    w, ids = torch.softmax(torch.randn(1, E, device="cuda", generator=gen), -1).topk(K, dim=-1)
    slots = torch.randperm(SLOTS, device="cuda", generator=gen)[:E].int()[ids]
    return {"mxfp4": lambda: ft_ops.expert_gemm(x, slots, w.float(), q13, q2, b13, b2, SWIGLUOAI, s13, s2)}


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("ncu_decode.py runs the CUDA decode kernels: run it on a machine with a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = {**bf16_and_fp8_calls(gen), **mxfp4_call(gen)}
    for call in calls.values():
        for _ in range(5):
            call()
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    for name, call in calls.items():
        torch.cuda.nvtx.range_push(name)
        cudart.cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        torch.cuda.nvtx.range_pop()
        print(f"[ncu_decode] profiled one {name} call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
