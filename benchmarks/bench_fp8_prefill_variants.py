"""The two ways a prompt can compute a layer of block-FP8 experts (issue 19's item 3), one layer at the
Qwen3-30B-A3B shape (128 experts, hidden 2048, intermediate 768, top-8), uniform routing:

- dequantize then grouped GEMM (the production path): `expert_gemm` on the FP8 bank with a slot map
  dequantizes the experts into a bf16 scratch bank, window by window, and runs the bf16 grouped
  tensor-core GEMM on them. Its GEMM alone (the same call on an already-bf16 bank) is timed beside it.
- FP8 tensor-core GEMMs: torch's block-scaled FP8 matmul (`torch.nn.functional.scaled_mm`,
  cuBLASLt, activations scaled per 1 x 128, weights per 128 x 128: DeepSeek-V3's recipe, SM90 only)
  per expert, on the tokens already sorted by expert, captured in one CUDA graph (no launch gaps):
  the path as torch's ops give it (each group's activations quantized, gate_up, SiLU-and-multiply,
  quantized again, down), and its GEMMs alone on inputs quantized beforehand: the floor of any path
  made of these per-expert GEMMs. The gather of tokens by expert and the weighted sum back are
  left out.
- torch's grouped FP8 GEMM (`torch._scaled_grouped_mm`, CUTLASS; on SM90 it scales rows only: one
  scale per activation row and per weight output row), given the exact block scales by splitting K
  into its 128-column blocks: block c of the activations has one scale per row and block c of a
  weight one per output row (its 128 x 128 grid's column c repeated), so the layer is the sum over c
  of one grouped call each (16 for gate_up, 6 for down at this shape), each returned in bf16 (the
  only output SM90 takes) and added in float32. The same
  quantized activations as the per-expert variant, each group padded to a multiple of 16 rows; with
  and without quantizing them.

Errors against a float32 computation with the dequantized weights (the FP8 path's on its
per-pair rows). Both against the tensor-core bound of the layer's FLOPs at the bf16 rate measured here
(cuBLAS on one square GEMM), and against each other. Writes fp8_prefill_variants.json.

    python3 benchmarks/bench_fp8_prefill_variants.py                 # 2k and 8k tokens
    python3 benchmarks/bench_fp8_prefill_variants.py --tokens 8192
"""
import argparse

import torch
import torch.nn.functional as F

import ft_ops
from ft_ops import formats
from common import capture_graph, median_ms, print_table, warm_gpu, write_report
from moe_setup import E, H, I, K

FP8_MAX = 448.0


def quantize_rows(x: torch.Tensor):
    """x [n, k] -> (e4m3 [n, k], float32 scale_inv [n, k / 128], column-major as cuBLASLt wants it):
    one scale per 1 x 128 block."""
    n, k = x.shape
    blocks = x.float().view(n, k // 128, 128)
    scale = blocks.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(n, k)
    return q, scale.t().contiguous().t()


def weight_scales(scale: torch.Tensor) -> torch.Tensor:
    """A weight's [N / 128, K / 128] scale_inv as the 128 x 128 recipe takes it for mat_b = W.t():
    the K blocks padded to a multiple of 4, then transposed."""
    n_blocks, k_blocks = scale.shape
    padded = torch.zeros(n_blocks, -(-k_blocks // 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :k_blocks] = scale
    return padded.t()


def fp8_matmul(xq, xs, w, ws):
    return F.scaled_mm(xq, w.t(), xs, F.ScalingType.BlockWise1x128, ws, F.ScalingType.BlockWise128x128,
                       output_dtype=torch.bfloat16)


def chunk_rows(xq: torch.Tensor, xs: torch.Tensor):
    """quantize_rows' (e4m3 [n, k], scale_inv [n, k / 128]) as K blocks: [k / 128, n, 128] contiguous
    and their row scales [k / 128, n]."""
    n, k = xq.shape
    return xq.view(n, k // 128, 128).transpose(0, 1).contiguous(), xs.t().contiguous()


def chunk_weights(q: torch.Tensor, scale_inv: torch.Tensor):
    """Experts' e4m3 [E, N, K] with 128 x 128 scale_inv [E, ceil(N / 128), K / 128] as K blocks:
    [K / 128, E, N, 128] contiguous (block c as mat_b is [c].transpose(-2, -1): [E, 128, N],
    column-major) and each block's scale per output row, [K / 128, E, N] float32."""
    e, n, k = q.shape
    blocks = q.view(e, n, k // 128, 128).permute(2, 0, 1, 3).contiguous()
    rows = scale_inv.float().permute(2, 0, 1).repeat_interleave(128, dim=2)[:, :, :n].contiguous()
    return blocks, rows


def grouped_by_k_blocks(a_blocks, a_scales, b_blocks, b_scales, offs, mm=None) -> torch.Tensor:
    """Sum over the K blocks c of mm(a_blocks[c], b_blocks[c] as [E, 128, N], row scales): the grouped
    rows (offs: each group's end row, int32) times their experts' weights, float32 [n, N]. mm is
    torch._scaled_grouped_mm unless given (the tests pass a float64 model of it)."""
    mm = mm or torch._scaled_grouped_mm
    total = None
    for c in range(a_blocks.shape[0]):
        part = mm(a_blocks[c], b_blocks[c].transpose(-2, -1), a_scales[c], b_scales[c], offs=offs,
                  out_dtype=torch.bfloat16)
        total = part.float() if total is None else total.add_(part)
    return total


def bf16_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ a, iters=10)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def measure(tokens: int, q13, s13, q2, s2, d13, d2, peak_tflops: float) -> dict:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w, ids = torch.softmax(torch.randn(tokens, E, device="cuda", generator=g), -1).topk(K, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float()
    identity = torch.arange(E, device="cuda", dtype=torch.int32)

    def production():
        return ft_ops.expert_gemm(x, ids, w, q13, q2, w13_scale=s13, w2_scale=s2, slot_map=identity)

    def gemm_alone():
        return ft_ops.expert_gemm(x, ids, w, d13, d2, slot_map=identity)

    # The FP8 variant on the tokens sorted by expert; group sizes from this routing (a host read,
    # outside the timing).
    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    order = ids.flatten().argsort(stable=True)  # pairs t * K + k, grouped by expert
    # Each group's rows padded (zeros) to at least 128 and a multiple of 16: cuBLASLt finds no FP8
    # block-scaled algorithm for fewer rows or odd counts (CUBLAS_STATUS_NOT_SUPPORTED, H100).
    rows_of = [max(128, -(-c // 16) * 16) if c else 0 for c in counts]
    starts = [0]
    for r in rows_of:
        starts.append(starts[-1] + r)
    sorted_x = torch.zeros(starts[-1], H, device="cuda", dtype=torch.bfloat16)
    position = torch.cat([torch.arange(starts[e], starts[e] + counts[e]) for e in range(E)]).cuda()
    sorted_x[position] = x[order // K]
    scales13 = [weight_scales(s13[e]) for e in range(E)]
    scales2 = [weight_scales(s2[e]) for e in range(E)]
    out = torch.zeros(starts[-1], H, device="cuda", dtype=torch.bfloat16)
    groups = [(e, starts[e], rows_of[e]) for e in range(E) if counts[e]]

    def fp8_path():  # quantizing each group's activations (its own (1, n)-strided scales), then its GEMMs
        for e, a, n in groups:
            xq, xs = quantize_rows(sorted_x[a:a + n])
            h = fp8_matmul(xq, xs, q13[e], scales13[e])
            aq, as_ = quantize_rows(F.silu(h[:, :I]) * h[:, I:])
            out[a:a + n] = fp8_matmul(aq, as_, q2[e], scales2[e])

    # The float32 reference of the dequantized weights: each pair's output row, and their weighted sum.
    ref_rows = torch.zeros(starts[-1], H, device="cuda", dtype=torch.float32)
    for e, a, n in groups:
        h = sorted_x[a:a + n].float() @ d13[e].float().t()
        ref_rows[a:a + n] = (F.silu(h[:, :I]) * h[:, I:]) @ d2[e].float().t()
    ref = torch.zeros(tokens, H, device="cuda").index_add_(0, order // K, ref_rows[position] * w.flatten()[order, None])

    def rel_err(got, want):
        return f"{float((got.float() - want).norm() / want.norm()):.1e}"

    row = dict(tokens=tokens, production_rel_err=rel_err(production(), ref),
               grouped_bf16_rel_err=rel_err(gemm_alone(), ref))
    fns = dict(production=production, gemm_alone=gemm_alone)
    try:
        fp8_path()
        row["fp8_rel_err"] = rel_err(out[position], ref_rows[position])
        # The FP8 GEMMs alone, on inputs quantized once: the floor of a path made of these calls.
        inputs = [quantize_rows(sorted_x[a:a + n]) for _, a, n in groups]
        mids = [quantize_rows(F.silu(h[:, :I]) * h[:, I:]) for h in
                (fp8_matmul(xq, xs, q13[e], scales13[e]) for (xq, xs), (e, _, _) in zip(inputs, groups))]

        def fp8_gemms_alone():
            for (e, a, n), (xq, xs), (aq, as_) in zip(groups, inputs, mids):
                fp8_matmul(xq, xs, q13[e], scales13[e])
                fp8_matmul(aq, as_, q2[e], scales2[e])

        fns.update(fp8_path=fp8_path, fp8_gemms_alone=fp8_gemms_alone)
    except (RuntimeError, ValueError, NotImplementedError) as e:  # no block-scaled FP8 matmul here
        row["fp8_rel_err"] = f"refused: {str(e).splitlines()[0][:160]}"

    # torch's grouped FP8 GEMM, one call per K block (module docstring), on the rows sorted by expert,
    # each group padded with zero rows to a multiple of 16 (at most 15 rows; whether the op needs it is
    # for a GPU run to show, and the padding is charged to this variant's time).
    sizes16 = [-(-c // 16) * 16 for c in counts]
    starts16 = torch.tensor([0] + sizes16).cumsum(0).tolist()
    position16 = torch.cat([torch.arange(starts16[e], starts16[e] + counts[e]) for e in range(E)]).cuda()
    rows = torch.zeros(starts16[-1], H, device="cuda", dtype=torch.bfloat16)
    rows[position16] = x[order // K]
    offs = torch.tensor(starts16[1:], device="cuda", dtype=torch.int32)
    b13, r13 = chunk_weights(q13, s13)
    b2, r2 = chunk_weights(q2, s2)

    def fp8_grouped():
        a, sa = chunk_rows(*quantize_rows(rows))
        h = grouped_by_k_blocks(a, sa, b13, r13, offs)
        a2, sa2 = chunk_rows(*quantize_rows(F.silu(h[:, :I]) * h[:, I:]))
        return grouped_by_k_blocks(a2, sa2, b2, r2, offs)

    try:
        row["fp8_grouped_rel_err"] = rel_err(fp8_grouped()[position16], ref_rows[position])
        a, sa = chunk_rows(*quantize_rows(rows))
        h = grouped_by_k_blocks(a, sa, b13, r13, offs)
        a2, sa2 = chunk_rows(*quantize_rows(F.silu(h[:, :I]) * h[:, I:]))

        def fp8_grouped_gemms_alone():
            grouped_by_k_blocks(a, sa, b13, r13, offs)
            grouped_by_k_blocks(a2, sa2, b2, r2, offs)

        fns.update(fp8_grouped=fp8_grouped, fp8_grouped_gemms_alone=fp8_grouped_gemms_alone)
    except (RuntimeError, ValueError, NotImplementedError) as e:  # no rows-scaled grouped FP8 GEMM here
        row["fp8_grouped_rel_err"] = f"refused: {str(e).splitlines()[0][:160]}"

    warm_gpu()
    times = {}
    for name, fn in fns.items():
        try:
            times[name] = median_ms(capture_graph(fn).replay, iters=20)
        except RuntimeError as e:  # an op that cannot be captured (a host sync): timed eagerly, and said so
            if name in ("production", "gemm_alone"):
                raise
            torch.cuda.synchronize()
            row[f"{name}_timed"] = f"eagerly (no CUDA graph: {str(e).splitlines()[0][:100]})"
            times[name] = median_ms(fn, iters=20)
    bound_ms = 2 * tokens * K * (2 * I * H + H * I) / (peak_tflops * 1e12) * 1e3
    row.update(dequantize_then_grouped_ms=round(times["production"], 3),
               its_grouped_gemm_ms=round(times["gemm_alone"], 3),
               bf16_flops_bound_ms=round(bound_ms, 3),
               production_over_bound=round(times["production"] / bound_ms, 2))
    if "fp8_path" in times:
        row.update(fp8_path_ms=round(times["fp8_path"], 3), fp8_gemms_alone_ms=round(times["fp8_gemms_alone"], 3),
                   fp8_path_over_production=round(times["fp8_path"] / times["production"], 3),
                   fp8_gemms_over_production=round(times["fp8_gemms_alone"] / times["production"], 3))
    if "fp8_grouped" in times:
        row.update(fp8_grouped_ms=round(times["fp8_grouped"], 3),
                   fp8_grouped_gemms_alone_ms=round(times["fp8_grouped_gemms_alone"], 3),
                   fp8_grouped_over_production=round(times["fp8_grouped"] / times["production"], 3),
                   fp8_grouped_gemms_over_production=round(times["fp8_grouped_gemms_alone"] / times["production"], 3))
    return row


def main(argv=None) -> int:
    assert I % 128 == 0 and H % 128 == 0, "the 128 x 128 scale grids of gate and up stacked need whole blocks"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192", help="prompt lengths, comma-separated")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * I ** -0.5
    (q13, s13), (q2, s2) = formats.quantize_fp8(w13, parts=2), formats.quantize_fp8(w2)
    d13 = formats.dequantize_fp8(q13, s13, 2, torch.bfloat16)
    d2 = formats.dequantize_fp8(q2, s2, 1, torch.bfloat16)
    del w13, w2
    peak = bf16_tflops()
    rows = [measure(int(t), q13, s13, q2, s2, d13, d2, peak) for t in args.tokens.split(",")]
    path = write_report("fp8_prefill_variants", rows, dict(bf16_cublas_tflops=round(peak, 1)))
    print_table(f"one FP8 layer of a prompt (128 experts, top-8), ms; bf16 cuBLAS at {peak:.0f} TFLOP/s", rows,
                list(rows[0]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
