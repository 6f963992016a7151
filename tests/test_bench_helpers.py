"""The GPU benchmarks' workload builders, run on the CPU: the pools the admission benchmark
(benchmarks/bench_slot_cache.py) times its calls on (the "free" pool leaves most slots free, the
"full" pool owns every slot with the calls' residents as its most recent rows, so a call's victims
are owned slots chosen by the policy's keys, at every size and call width the benchmark uses), and the decode
GEMM benchmarks' routings (benchmarks/common.py)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_slot_cache import E, aged_pool  # noqa: E402
from common import decode_routings  # noqa: E402
from ft_ops.policies import DUEL, HIT_DENSITY, LRU  # noqa: E402
from helpers import require  # noqa: E402


def residents_of_calls(state, routing):
    slot_of = state[0]
    return [sorted(int(e) for e in set(ids.tolist()) if slot_of[c, e] >= 0) for c, ids in enumerate(routing)]


@pytest.mark.parametrize("slots,k,policy", [(1024, 8, LRU), (1024, 64, HIT_DENSITY), (4096, 8, DUEL),
                                            pytest.param(4096, 64, LRU, marks=pytest.mark.slow),
                                            pytest.param(8192, 8, LRU, marks=pytest.mark.slow),
                                            pytest.param(8192, 64, LRU, marks=pytest.mark.slow),
                                            pytest.param(16384, 8, LRU, marks=pytest.mark.slow),
                                            pytest.param(16384, 64, LRU, marks=pytest.mark.slow)])
def test_the_full_pool_owns_every_slot_and_the_calls_residents_are_its_newest_rows(slots, k, policy):
    require("cpu", "dedup_and_admit")
    state, policy_state, routing = aged_pool(slots, k, 0.25, policy, fill=True, device="cpu")
    slot_of, owner_of, last_use, clock = state
    assert int((owner_of < 0).sum()) == 0 and int((slot_of >= 0).sum()) == slots
    assert (policy_state is None) == (policy == LRU)
    resident_slots = [int(slot_of[c, e]) for c, experts in enumerate(residents_of_calls(state, routing))
                      for e in experts]
    assert resident_slots, "a quarter missing leaves three quarters of each call resident"
    newest = last_use[resident_slots].min()
    others = torch.ones(slots, dtype=torch.bool)
    others[resident_slots] = False
    assert int(last_use[others].max()) < int(newest)
    # No call routes a filler: a call's misses are exactly its experts without a slot.
    for c, ids in enumerate(routing):
        missing = {int(e) for e in ids.tolist()} - set(residents_of_calls(state, routing)[c])
        assert all(int(slot_of[c, e]) < 0 for e in missing)


@pytest.mark.parametrize("slots,k", [(1024, 8), (16384, 64)])
def test_the_free_pool_leaves_most_slots_free(slots, k):
    require("cpu", "dedup_and_admit")
    state, _, routing = aged_pool(slots, k, 0.25, LRU, device="cpu")
    assert int((state[1] < 0).sum()) >= slots // 2
    assert state[0].shape == (len(routing), E)


@pytest.mark.parametrize("tokens,k,disjoint", [(1, 8, True), (1, 4, True), (4, 8, True), (16, 8, False)])
def test_decode_routings_share_no_expert_with_the_call_before_where_they_can(tokens, k, disjoint):
    """In the replayed cycle (the last call before the first), no call reads an expert the call
    before it read (its bytes could come from L2), wherever a call routes at most a third of them."""
    calls = 16
    routings = decode_routings(calls, tokens, 128, k, torch.Generator().manual_seed(tokens))
    assert len(routings) == calls
    for w, ids in routings:
        assert ids.shape == w.shape == (tokens, k) and torch.isfinite(w).all() and (w > 0).all()
        assert all(len(set(row)) == k for row in ids.tolist())
    shared = [set(routings[c][1].flatten().tolist()) & set(routings[(c + 1) % calls][1].flatten().tolist())
              for c in range(calls)]
    assert (not any(shared)) == disjoint


def test_the_fp8_prefill_benchmark_scales_in_the_layouts_torch_block_scaled_matmul_takes():
    """bench_fp8_prefill_variants.py's scales (the layouts of torch's 1 x 128 by 128 x 128 recipe on
    SM90): activations' scale_inv [n, k / 128] column-major, dequantizing to within FP8's rounding;
    a weight's [N / 128, K / 128] grid padded with zeros to a multiple of 4 K blocks, transposed."""
    from bench_fp8_prefill_variants import quantize_rows, weight_scales

    x = torch.randn(48, 384, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (48, 3) and scale.stride() == (1, 48)
    back = (q.float().view(48, 3, 128) * scale[..., None]).view(48, 384)
    assert ((back - x).abs() <= x.abs() / 16 + 1e-6).all()  # e4m3 keeps 3 bits of mantissa
    grid = torch.rand(12, 6)
    padded = weight_scales(grid)
    assert padded.shape == (8, 12) and padded.stride() == (1, 8)
    assert torch.equal(padded[:6], grid.t()) and not padded[6:].any()


def test_the_fp8_prefill_benchmark_sums_its_k_blocks_to_the_block_scaled_product():
    """bench_fp8_prefill_variants.py's grouped FP8 variant (one row-scaled grouped call per 128-column
    K block, summed): with a float64 model of torch._scaled_grouped_mm in place of the CUDA op, the
    sum equals the quantized activations times each group's 128 x 128-scaled weights, dequantized in
    float64, for a weight whose N is not a multiple of 128 and groups of 0, 5 and 11 rows."""
    from bench_fp8_prefill_variants import chunk_rows, chunk_weights, grouped_by_k_blocks, quantize_rows
    from ft_ops import formats

    g = torch.Generator().manual_seed(3)
    experts, n, k = 3, 200, 384
    q, scale_inv = formats.quantize_fp8(torch.randn(experts, n, k, generator=g))
    x = torch.randn(16, k, generator=g)
    counts = [5, 0, 11]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)

    def float64_grouped_mm(a, b, sa, sb, offs, out_dtype):
        assert a.shape[1] == b.shape[1] == 128 and b.stride(1) == 1 and sa.shape == (a.shape[0],)
        out, start = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64), 0
        for e, end in enumerate(offs.tolist()):
            out[start:end] = (a[start:end].double() * sa[start:end, None].double()) @ (b[e].double() * sb[e].double())
            start = end
        return out.float()

    xq, xs = quantize_rows(x)
    got = grouped_by_k_blocks(*chunk_rows(xq, xs), *chunk_weights(q, scale_inv), offs, mm=float64_grouped_mm)
    x_deq = (xq.double().view(16, 3, 128) * xs.double()[..., None]).view(16, k)
    w_deq = formats.dequantize_fp8(q, scale_inv, 1, torch.float64)
    want = torch.cat([x_deq[a:b] @ w_deq[e].t() for e, (a, b) in enumerate(zip([0, 5, 5], offs.tolist()))])
    assert got.shape == (16, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_the_fp8_prefill_benchmarks_grouped_operands_pass_torchs_own_checks():
    """The K-block operands bench_fp8_prefill_variants.py hands torch._scaled_grouped_mm pass the op's
    shape, stride and dtype checks (its meta kernel, on the CPU): mat_a [M, 128] row-major, mat_b
    [E, 128, N] column-major, row scales [M] and [E, N]; the same mat_b row-major is refused."""
    from bench_fp8_prefill_variants import chunk_rows, chunk_weights

    if not hasattr(torch, "_scaled_grouped_mm"):
        pytest.skip("this torch has no _scaled_grouped_mm")
    experts, n, k, m = 4, 256, 384, 64
    b, r = chunk_weights(torch.empty(experts, n, k, dtype=torch.float8_e4m3fn, device="meta"),
                         torch.empty(experts, 2, 3, device="meta"))
    a, sa = chunk_rows(torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta"), torch.empty(3, m, device="meta").t())
    offs = torch.empty(experts, dtype=torch.int32, device="meta")
    out = torch._scaled_grouped_mm(a[0], b[0].transpose(-2, -1), sa[0], r[0], offs=offs, out_dtype=torch.bfloat16)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="transposed|column major"):
        torch._scaled_grouped_mm(a[0], b[0].transpose(-2, -1).contiguous(), sa[0], r[0], offs=offs,
                                 out_dtype=torch.bfloat16)
