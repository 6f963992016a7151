"""The CPU expert_gemm's decode path (src/cpu/expert_gemv.cpp: groups of at most 4 tokens an
expert, each weight row read once and dequantized in registers) against the float64 reference, in
every format it takes (bf16, block-FP8, MXFP4; float16 beside them, which takes ATen's GEMMs):
groups of 1 to 6 tokens in one call (both sides of the 4-token limit), rows whose lengths leave
every loop's tail (64- and 16-value steps, the value-by-value rest, partial FP8 blocks, MXFP4 groups
beyond a whole step), biases; every e4m3 and e2m1 code decoded exactly wherever it sits in a row;
the result does not depend on the thread count."""
import pytest
import torch

import ft_ops
from ft_ops import formats
from ft_ops.activations import SILU, SWIGLUOAI
from ft_ops.testing import reference
from test_expert_gemm import relative_error, seed_of

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def group_sizes_problem(fmt, dtype, hidden, inter, bias, seed):
    """Six tokens, top-6: slot s is used by s + 1 tokens (groups of 1 to 6 pairs), slot 6 by none,
    one pair left at -1."""
    gen = torch.Generator().manual_seed(seed)
    slots, tokens, top_k = 7, 6, 6
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = torch.randn(slots, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(slots, hidden, inter, generator=gen) * inter ** -0.5
    slot_ids = torch.full((tokens, top_k), -1, dtype=torch.int32)
    for s in range(6):
        slot_ids[: s + 1, s] = s
    slot_ids[5, 5] = -1  # slot 5 keeps 5 pairs; one pair not computed here
    slot_ids[5, 0] = 5   # ... and takes one more from the first column
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    b13 = (torch.randn(slots, 2 * inter, generator=gen) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(slots, hidden, generator=gen) * 0.1).to(dtype) if bias else None
    prob = dict(hidden=x, slot_ids=slot_ids, weights=weights, b13=b13, b2=b2)
    if fmt == "dense":
        return dict(prob, w13=w13.to(dtype), w2=w2.to(dtype))
    if fmt == "fp8":
        (q13, s13), (q2, s2) = formats.quantize_fp8(w13, parts=2), formats.quantize_fp8(w2)
    elif fmt == "fp8_rows":
        spread = lambda w: w * 2.0 ** torch.randint(-4, 5, (*w.shape[:2], 1), generator=gen)
        (q13, s13), (q2, s2) = formats.quantize_fp8_rows(spread(w13)), formats.quantize_fp8_rows(spread(w2))
    else:
        (q13, s13), (q2, s2) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
    return dict(prob, w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)


# (hidden, inter): 200 = 3 x 64 + 8 and 72 = 64 + 8 leave tails after both steps and cut an FP8
# block; 288 / 96 are whole MXFP4 groups: 9 groups (two 4-group steps and one more) and 3.
DENSE_SHAPES = [(200, 72), (128, 48), (16, 8)]
MXFP4_SHAPES = [(288, 96), (64, 32)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("hidden,inter", DENSE_SHAPES)
@pytest.mark.parametrize("fmt,dtype", [("dense", torch.bfloat16), ("dense", torch.float16), ("fp8", torch.bfloat16),
                                       ("fp8", torch.float32), ("fp8_rows", torch.bfloat16), ("fp8_rows", torch.float32)])
def test_decode_groups_match_the_float64_reference(fmt, dtype, hidden, inter, bias):
    prob = group_sizes_problem(fmt, dtype, hidden, inter, bias, seed_of("gemv", fmt, dtype, hidden, inter, bias))
    got = ft_ops.expert_gemm(**prob, activation=SILU)
    want = reference.expert_gemm(**prob, activation=SILU)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert relative_error(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("hidden,inter", MXFP4_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_decode_groups_match_the_float64_reference(dtype, hidden, inter):
    prob = group_sizes_problem("mxfp4", dtype, hidden, inter, True, seed_of("gemv-mxfp4", dtype, hidden, inter))
    got = ft_ops.expert_gemm(**prob, activation=SWIGLUOAI)
    want = reference.expert_gemm(**prob, activation=SWIGLUOAI)
    assert relative_error(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("fmt", ["dense", "fp8", "fp8_rows", "mxfp4"])
def test_one_token_per_group_is_the_same_at_every_thread_count(fmt):
    """Each row's dot product is one thread's, in one order: the thread count changes nothing."""
    prob = group_sizes_problem(fmt, torch.bfloat16, 288, 96, True, seed_of("gemv-threads", fmt))
    activation = SWIGLUOAI if fmt == "mxfp4" else SILU
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ft_ops.expert_gemm(**prob, activation=activation)
        torch.set_num_threads(max(2, threads))
        many = ft_ops.expert_gemm(**prob, activation=activation)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def one_hot_down_column(fmt, codes, index, inter):
    """expert_gemm of one token whose activation is one-hot at `index` with value silu(32) = 32
    exactly (gate 32, up 1 there, every other weight zero), routing weight 1/32: output row r is
    w2[r, index] exactly (one product, sums of zeros, two exact scalings). w2's column `index` holds
    `codes` (e4m3 bytes or e2m1 codes; MXFP4 with scale 128, so values times 2)."""
    rows = codes.numel()
    x = torch.zeros(1, rows)
    x[0, 0] = 1.0
    w13 = torch.zeros(1, 2 * inter, rows)
    w13[0, index, 0], w13[0, inter + index, 0] = 32.0, 1.0
    ids, weights = torch.zeros(1, 1, dtype=torch.int32), torch.full((1, 1), 1.0 / 32)
    if fmt == "fp8":
        w2 = torch.zeros(1, rows, inter, dtype=torch.uint8)
        w2[0, :, index] = codes
        return ft_ops.expert_gemm(x, ids, weights, w13.to(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn),
                                  activation=SILU, w13_scale=torch.ones(1, 2 * (1 + (inter - 1) // 128), 1 + (rows - 1) // 128),
                                  w2_scale=torch.ones(1, 1 + (rows - 1) // 128, 1 + (inter - 1) // 128))
    q13, s13 = formats.quantize_mxfp4(w13)
    w2 = torch.zeros(1, rows, inter // 2, dtype=torch.uint8)
    w2[0, :, index // 2] = codes << (4 * (index % 2))  # odd values in the high nibble
    return ft_ops.expert_gemm(x, ids, weights, q13, w2, activation=SILU, w13_scale=s13,
                              w2_scale=torch.full((1, rows, inter // 32), 128, dtype=torch.uint8))


# The column the codes sit in: read by the 64-value step, or by the value-by-value tail of a row of
# 72 (FP8); MXFP4 rows of 160 values: low and high nibble in the 4-group step, high in the last group.
CODE_COLUMNS = [("fp8", 0, 72), ("fp8", 67, 72), ("mxfp4", 0, 160),
                ("mxfp4", 1, 160), ("mxfp4", 129, 160)]


@pytest.mark.parametrize("fmt,index,inter", CODE_COLUMNS)
def test_every_code_of_the_weight_formats_decodes_exactly(fmt, index, inter):
    """Every finite e4m3 bit pattern and every e2m1 code (subnormals, the largest values, both
    zeros) is decoded to the value torch gives it, wherever in a row it sits: the row kernels decode
    with bit arithmetic, not a table."""
    if fmt == "fp8":
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        codes = codes[torch.isfinite(codes.view(torch.float8_e4m3fn).float())]
        values = codes.view(torch.float8_e4m3fn).float()
    else:
        codes = torch.arange(32, dtype=torch.uint8) % 16  # hidden must be whole groups of 32
        values = torch.tensor(formats.E2M1_VALUES, dtype=torch.float32)[codes.long()] * 2  # scale 2^1
    out = one_hot_down_column(fmt, codes, index, inter)
    assert torch.equal(out[0], values.to(out.dtype))  # -0 comes back as 0: it is summed with zeros
