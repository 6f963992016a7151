"""expert_gemm on FP8 weights, with block scales and with row scales (fp8_rows), against the float64
reference that dequantizes the same FP8 weights: shapes with whole and partial 128 x 128 blocks (the
CUDA tensor-core kernel and the any-shape kernels), token counts of decode and of a prompt, biases, a
clamped activation, slots -1, every hidden dtype; ungated experts (the up rows alone); opcheck and
torch.compile; the errors. Row-scaled problems give every row its own power of two (2^-4 .. 2^4), so a
row read with another row's scale is far off."""
import pytest
import torch

import ft_ops
from ft_ops import formats
from ft_ops.activations import RELU2, SILU, SWIGLUOAI, Activation
from ft_ops.testing import reference
from helpers import DEVICES, require
from test_expert_gemm import poison_next_allocation, relative_error, seed_of

pytestmark = pytest.mark.parametrize("device", DEVICES)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
SCALES = ["block", "rows"]  # 128 x 128 scale blocks (fp8), one scale a row (fp8_rows)


def fp8_problem(tokens, top_k, slots, hidden, inter, dtype, device, bias, seed, w2_block_spread=False, gated=True,
                scales="block"):
    gen = torch.Generator().manual_seed(seed)
    parts = 2 if gated else 1  # ungated: w13 holds the up rows alone
    x = torch.randn(tokens, hidden, generator=gen)
    # Per-expert magnitudes differ, so the blocks' scales differ.
    w13 = torch.randn(slots, parts * inter, hidden, generator=gen) * hidden ** -0.5 * (1 + torch.rand(slots, 1, 1, generator=gen))
    w2 = torch.randn(slots, hidden, inter, generator=gen) * inter ** -0.5 * (1 + torch.rand(slots, 1, 1, generator=gen))
    if w2_block_spread:  # each 128 x 128 block of w2 times its own power of two (2^-4 .. 2^4)
        blocks = 2.0 ** torch.randint(-4, 5, (slots, -(-hidden // 128), -(-inter // 128)), generator=gen)
        w2 = w2 * blocks.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :hidden, :inter]
    if scales == "rows":
        row_spread = lambda w: w * 2.0 ** torch.randint(-4, 5, (*w.shape[:2], 1), generator=gen)
        (q13, s13), (q2, s2) = formats.quantize_fp8_rows(row_spread(w13)), formats.quantize_fp8_rows(row_spread(w2))
    else:
        q13, s13 = formats.quantize_fp8(w13, parts=parts)
        q2, s2 = formats.quantize_fp8(w2)
    used = torch.randperm(slots, generator=gen)[: max(1, slots // 2)]
    slot_ids = used[torch.randint(len(used), (tokens, top_k), generator=gen)]
    slot_ids[torch.rand(tokens, top_k, generator=gen) < 0.15] = -1
    if tokens and top_k > 1:
        slot_ids[0, 1] = slot_ids[0, 0]  # one slot twice for a token
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    b13 = torch.randn(slots, parts * inter, generator=gen) * 0.1 if bias else None
    b2 = torch.randn(slots, hidden, generator=gen) * 0.1 if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(device)
    return dict(hidden=cast(x), slot_ids=slot_ids.int().to(device), weights=weights.to(device), w13=q13.to(device),
                w2=q2.to(device), b13=cast(b13), b2=cast(b2), w13_scale=s13.to(device), w2_scale=s2.to(device))


def check(device, dtype, hidden, inter, tokens, bias=False, activation=SILU, top_k=4, slots=10, w2_block_spread=False,
          scales="block"):
    seed = seed_of("fp8", device, dtype, hidden, inter, tokens, bias, str(activation), scales)
    prob = fp8_problem(tokens, top_k, slots, hidden, inter, dtype, device, bias, seed, w2_block_spread,
                       gated=ft_ops.activations.as_activation(activation).gated, scales=scales)
    if device == "cuda":
        poison_next_allocation((tokens, hidden), dtype)
    out = ft_ops.expert_gemm(**prob, activation=activation)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    assert torch.isfinite(out).all(), f"non-finite output (seed {seed})"
    cpu = {k: (v.cpu() if v is not None else None) for k, v in prob.items()}
    want = reference.expert_gemm(**cpu, activation=activation)
    err = relative_error(out, want)
    assert err < TOLERANCE[dtype], (f"relative error {err:.2e} (seed {seed}, {dtype}, H={hidden}, I={inter}, "
                                    f"T={tokens}, {scales} scales)")


# (hidden, intermediate): whole blocks (the CUDA tensor-core kernel), partial blocks at the edges of
# rows and columns, a last tile of fewer rows than the vector down kernel's 4 (130, 80), and shapes
# only the any-shape kernels take.
SHAPES = [(256, 128), (256, 192), (192, 80), (130, 80), (130, 24), (64, 48)]


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_matches_dequantizing_reference(device, hidden, inter, tokens, scales):
    require(device, "expert_gemm")
    check(device, torch.bfloat16, hidden, inter, tokens, scales=scales)


@pytest.mark.parametrize("hidden,inter,tokens,top_k", [(2880, 64, 3, 4), (1088, 32, 3, 8), (256, 32, 64, 64)])
@pytest.mark.parametrize("scales", SCALES)
def test_wide_rows_and_many_routed_experts(device, hidden, inter, tokens, top_k, scales):
    """The tensor-core kernel stages the hidden values 1,024 columns at a time: several windows, a
    partial last one (1,088 = 1,024 + 64 columns); 64 tokens of top_k 64 (4,096 pairs) make the
    chunk's slot list large enough to opt in to more than 48 KiB of shared memory."""
    require(device, "expert_gemm")
    check(device, torch.bfloat16, hidden, inter, tokens, top_k=top_k, slots=max(10, top_k), scales=scales)


@pytest.mark.parametrize("hidden,inter,top_k,tokens", [(64, 2944, 8, 1), (80, 128, 4, 2), (256, 320, 1, 3),
                                                       (128, 704, 8, 1), (64, 3008, 2, 1), (256, 128, 8, 5),
                                                       (128, 128, 10, 2), (72, 128, 8, 3)])
@pytest.mark.parametrize("scales", SCALES)
def test_down_projection_edges(device, hidden, inter, top_k, tokens, scales):
    """w2's 128 x 128 blocks scaled by powers of two from 2^-4 to 2^4 (a block read with another's
    scale is far off), with biases, at the edges of CUDA's tensor-core down kernel: I = 2,944 (the
    largest I whose shared memory fits 48 KiB beside the static part), H = 80 (gate_up with FMAs,
    down on tensor cores), top_k 1, I % 128 == 64 (a last scale block of one 64-column chunk), 11
    chunks (several batches), top_k 8 over several tokens, and the shapes it refuses for the FMA down
    kernel: I = 3,008 (just over), top_k 10, H = 72 (not a multiple of 16). Row scales: every row
    its own power of two."""
    require(device, "expert_gemm")
    check(device, torch.bfloat16, hidden, inter, tokens, bias=True, top_k=top_k, slots=max(10, top_k),
          w2_block_spread=scales == "block", scales=scales)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_ungated_matches_dequantizing_reference(device, hidden, inter, tokens, scales):
    """Ungated FP8 experts (w13 the up rows alone, blocked as one projection), with biases: the
    one-token, tensor-core and any-shape gate_up kernels read the up rows as the gate too."""
    require(device, "expert_gemm")
    check(device, torch.bfloat16, hidden, inter, tokens, bias=True, activation=RELU2, scales=scales)
    if tokens == 3:
        check(device, torch.float32, hidden, inter, tokens, activation=RELU2, scales=scales)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hidden_dtypes(device, dtype, scales):
    require(device, "expert_gemm")
    check(device, dtype, 256, 192, 2, scales=scales)


@pytest.mark.parametrize("activation", [SWIGLUOAI, Activation("gelu_tanh", limit=3.0),
                                        Activation("silu", limit=3.0, limit_after_act=True)], ids=str)
@pytest.mark.parametrize("scales", SCALES)
def test_biases_and_parameterized_activations(device, activation, scales):
    require(device, "expert_gemm")
    check(device, torch.bfloat16, 256, 128, 5, bias=True, activation=activation, scales=scales)


def test_no_tokens_and_all_minus_one(device):
    require(device, "expert_gemm")
    prob = fp8_problem(3, 2, 4, 128, 64, torch.bfloat16, device, False, seed=5)
    prob["slot_ids"].fill_(-1)
    if device == "cuda":
        poison_next_allocation((3, 128), torch.bfloat16)
    assert (ft_ops.expert_gemm(**prob) == 0).all()
    if device == "cuda":
        poison_next_allocation((3, 128), torch.bfloat16)
    assert (ft_ops.expert_gemm(**dict(prob, slot_ids=prob["slot_ids"][:, :0], weights=prob["weights"][:, :0])) == 0).all()
    empty = fp8_problem(0, 2, 4, 128, 64, torch.bfloat16, device, False, seed=6)
    assert ft_ops.expert_gemm(**empty).shape == (0, 128)


@pytest.mark.parametrize("scales", SCALES)
def test_opcheck_and_compile(device, scales):
    require(device, "expert_gemm")
    prob = fp8_problem(3, 2, 6, 128, 64, torch.float32, device, True, seed=7, scales=scales)
    args = (prob["hidden"], prob["slot_ids"], prob["weights"], prob["w13"], prob["w2"], prob["b13"], prob["b2"],
            "silu", 1.0, 0.0, 0.0, 0.0, 0.0, prob["w13_scale"], prob["w2_scale"])
    # test_schema runs arithmetic on every tensor argument, which torch lacks for float8 on the CPU
    # (see test_dequantize.py); the op mutates nothing, checked below.
    torch.library.opcheck(torch.ops.freetoken.expert_gemm.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    before = prob["w13"].view(torch.uint8).clone()
    eager = ft_ops.expert_gemm(**prob)
    assert torch.equal(before, prob["w13"].view(torch.uint8))
    compiled = torch.compile(lambda p: ft_ops.expert_gemm(**p), fullgraph=True)
    assert torch.allclose(compiled(prob), eager, rtol=1e-6, atol=1e-6)


def test_errors(device):
    require(device, "expert_gemm")
    prob = fp8_problem(2, 2, 4, 128, 64, torch.bfloat16, device, False, seed=8)
    with pytest.raises(RuntimeError, match="both w13_scale and w2_scale"):
        ft_ops.expert_gemm(**dict(prob, w2_scale=None))
    with pytest.raises(RuntimeError, match=r"w13_scale must be \[4, 2, 1\]"):
        ft_ops.expert_gemm(**dict(prob, w13_scale=prob["w13_scale"][:, :1]))
    with pytest.raises(RuntimeError, match="need w13_scale and w2_scale"):
        ft_ops.expert_gemm(**dict(prob, w13_scale=None, w2_scale=None))
    with pytest.raises(RuntimeError, match="w13 must be float8_e4m3fn"):
        ft_ops.expert_gemm(**dict(prob, w13=prob["w13"].to(torch.bfloat16)))
    rows = fp8_problem(2, 2, 4, 128, 64, torch.bfloat16, device, False, seed=8, scales="rows")
    with pytest.raises(RuntimeError, match=r"w2_scale must be \[4, 128\] \(one scale a row"):
        ft_ops.expert_gemm(**dict(rows, w2_scale=rows["w2_scale"][:, :64]))
    with pytest.raises(RuntimeError, match="w13_scale is one scale a row but w2_scale 128 x 128 blocks"):
        ft_ops.expert_gemm(**dict(rows, w2_scale=prob["w2_scale"]))


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_calls_replay_in_a_cuda_graph_on_a_side_stream(device, dtype, scales):
    """A one-token call captured in a CUDA graph on a non-default stream replays the eager result,
    for fresh inputs copied in."""
    require(device, "expert_gemm")
    if device != "cuda":
        pytest.skip("CUDA graphs")
    probs = [fp8_problem(1, 8, 24, 256, 192, dtype, device, True, seed=s, scales=scales) for s in (11, 12)]
    static = {k: (v.clone() if v is not None else None) for k, v in probs[0].items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ft_ops.expert_gemm(**static)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = ft_ops.expert_gemm(**static)
    torch.cuda.current_stream().wait_stream(stream)
    for prob in probs:
        for k in ("hidden", "slot_ids", "weights"):
            static[k].copy_(prob[k])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ft_ops.expert_gemm(**static))


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("hidden,inter", [(256, 192), (192, 80)])  # (192, 80): a partial 128-column block
@pytest.mark.parametrize("bias", [False, True])
def test_one_token_call_equals_the_same_token_in_a_larger_call(device, bias, hidden, inter, scales):
    """A one-token call (the decode step, which CUDA serves with its own gate_up kernel) computes
    each row exactly as a call of several tokens does: the same products and sums, bit for bit.
    (The CPU kernel takes a slot's rows another way once more than 4 pairs share it.)"""
    require(device, "expert_gemm")
    if device != "cuda":
        pytest.skip("the CUDA decode kernels' property")
    prob = fp8_problem(3, 8, 24, hidden, inter, torch.bfloat16, device, bias, seed=21, scales=scales)
    many = ft_ops.expert_gemm(**prob, activation=SWIGLUOAI)
    for t in range(3):
        one = {k: (v[t:t + 1] if k in ("hidden", "slot_ids", "weights") else v) for k, v in prob.items()}
        assert torch.equal(ft_ops.expert_gemm(**one, activation=SWIGLUOAI)[0], many[t]), f"token {t}"
