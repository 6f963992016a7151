"""expert_gemm against the float64 reference on fresh random inputs: every dtype, every activation
kind with every parameter (clamp limit, up offset, softcaps, sigmoid slope), bias settings, -1 slots,
duplicate slots, empty experts, every CUDA path (decode FMA, decode tensor cores, grouped, windowed
grouped), gated and ungated experts."""
import zlib

import pytest
import torch

import ft_ops
from ft_ops import formats
from ft_ops.activations import KINDS, RELU2, Activation, as_activation
from ft_ops.testing import reference
from helpers import DEVICES, require

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

# Parameters per case, sized for the test problems (gate and up are about N(0, 1)), so every clamp
# and cap changes a good share of the values; "all" turns every parameter on at once.
PARAMETERS = {
    "plain": {},
    "alpha": dict(alpha=1.702),
    "limit": dict(limit=0.8),
    "up_offset": dict(up_offset=1.0),
    "gate_softcap": dict(gate_softcap=0.6),
    "up_softcap": dict(up_softcap=0.7),
    "limit_after_act": dict(limit=0.8, limit_after_act=True),  # Step3p7: min(act(gate), limit)
    "all": dict(limit=1.2, up_offset=0.5, gate_softcap=0.9, up_softcap=1.0),
}
# Every family's function in docs/families.md, and everything on at once.
EVERYTHING = Activation("silu", alpha=1.702, limit=1.2, up_offset=0.5, gate_softcap=0.9, up_softcap=1.0)


def activation_cases():
    """Each parameter alone, and all at once, for every kind."""
    for kind in KINDS:
        for name, params in PARAMETERS.items():
            if name == "alpha" and kind != "silu":
                continue  # alpha scales the sigmoid of kind silu only
            if name == "all" and kind == "silu":
                params = dict(params, alpha=1.702)
            yield pytest.param(Activation(kind, **params), id=f"{kind}-{name}")


def every_combination():
    """Every kind with every subset of the parameters (each at its PARAMETERS value)."""
    names = ["limit", "up_offset", "gate_softcap", "up_softcap", "limit_after_act"]
    for kind in KINDS:
        for mask in range(2 ** len(names)):
            for alpha in ((1.0, 1.702) if kind == "silu" else (1.0,)):
                chosen = [n for i, n in enumerate(names) if mask >> i & 1]
                if "limit_after_act" in chosen and "limit" not in chosen:
                    continue  # the clamp after the activation is of the limit
                params = dict(alpha=alpha, **{n: PARAMETERS[n][n] for n in chosen})
                yield pytest.param(Activation(kind, **params), id=f"{kind}-a{alpha:g}-" + ("+".join(chosen) or "plain"))


def seed_of(*case) -> int:
    """A fixed seed per test case: fresh inputs for every case, the same ones on every run."""
    return zlib.crc32(repr(case).encode())


def random_problem(tokens, top_k, slots, hidden, inter, dtype, device, bias, seed, minus_one=0.15, gated=True):
    """Gated experts (w13 [S, 2I, H]) or ungated ones (the up rows alone, [S, I, H])."""
    gen = torch.Generator().manual_seed(seed)
    scale = hidden ** -0.5
    rows = 2 * inter if gated else inter
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(slots, rows, hidden, generator=gen) * scale
    w2 = torch.randn(slots, hidden, inter, generator=gen) * inter ** -0.5
    # Only some slots are used (empty experts), a token may pick one slot twice (duplicates),
    # and some pairs are -1 (served elsewhere).
    used = torch.randperm(slots, generator=gen)[: max(1, slots // 2)]
    slot_ids = used[torch.randint(len(used), (tokens, top_k), generator=gen)]
    slot_ids[torch.rand(tokens, top_k, generator=gen) < minus_one] = -1
    if tokens and top_k > 1:
        slot_ids[0, 1] = slot_ids[0, 0]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    b13 = torch.randn(slots, rows, generator=gen) * 0.1 if bias else None
    b2 = torch.randn(slots, hidden, generator=gen) * 0.1 if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(device)
    return dict(hidden=cast(x), slot_ids=slot_ids.to(torch.int32).to(device), weights=weights.to(device),
                w13=cast(w13), w2=cast(w2), b13=cast(b13), b2=cast(b2))


def poison_next_allocation(shape, dtype) -> None:
    """Leaves a NaN-filled block of this size in the CUDA caching allocator, so an output the
    kernel fails to write shows up as NaN instead of stale zeros."""
    block = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del block


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst row's error, each row's against its own norm or the reference's typical row (the RMS
    of its rows' norms), whichever is larger: one wrong or lost pair of one token shows in its row,
    where one norm over the whole output would average it away over the other rows, and a row whose
    terms cancel is not held to a precision its terms never had."""
    want = want.double().cpu()
    diff = got.double().cpu() - want
    if diff.dim() < 2 or diff.shape[0] == 0:
        return float(diff.norm() / want.norm().clamp_min(1e-30))
    norms = want.reshape(want.shape[0], -1).norm(dim=1)
    scale = torch.maximum(norms, norms.square().mean().sqrt()).clamp_min(1e-30)
    return float((diff.reshape(diff.shape[0], -1).norm(dim=1) / scale).max())


def check(device, dtype, activation, bias, tokens, top_k=4, slots=12, hidden=64, inter=32):
    seed = seed_of(device, dtype, activation, bias, tokens, top_k, slots, hidden, inter)
    prob = random_problem(tokens, top_k, slots, hidden, inter, dtype, device, bias, seed,
                          gated=as_activation(activation).gated)
    if device == "cuda":
        poison_next_allocation((tokens, hidden), dtype)
    out = ft_ops.expert_gemm(**prob, activation=activation)
    assert out.dtype == dtype and out.shape == (tokens, hidden) and out.device == prob["hidden"].device
    assert torch.isfinite(out).all(), f"non-finite output (seed {seed})"
    cpu = {k: (v.cpu() if v is not None else None) for k, v in prob.items()}
    want = reference.expert_gemm(**cpu, activation=activation)
    err = relative_error(out, want)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e} (seed {seed}, {dtype}, {activation}, bias={bias}, T={tokens})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu", "swigluoai"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference(device, dtype, activation, bias):
    require(device, "expert_gemm")
    for tokens in (1, 3, 17):
        check(device, dtype, activation, bias, tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", list(activation_cases()))
def test_every_kind_and_parameter_matches_float64_reference(device, dtype, activation):
    """On CUDA, 64 x 32 rows take the tensor-core decode kernel in 16 bits and the FMA kernel in
    float32; the grouped paths are below."""
    require(device, "expert_gemm")
    for tokens, bias in ((1, False), (17, True)):
        check(device, dtype, activation, bias, tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", list(every_combination()))
def test_every_parameter_combination_in_float32(device, activation):
    require(device, "expert_gemm")
    check(device, torch.float32, activation, True, 9)


def test_the_parameters_change_the_result():
    """Each parameter of the test cases reaches the kernel: a case that ignored one would equal the
    plain function of its kind."""
    prob = random_problem(9, 4, 12, 64, 32, torch.float32, "cpu", True, seed_of("parameters reach the kernel"))
    for kind in KINDS:
        plain = ft_ops.expert_gemm(**prob, activation=Activation(kind))
        for name, params in PARAMETERS.items():
            if name == "plain" or (name == "alpha" and kind != "silu"):
                continue
            changed = ft_ops.expert_gemm(**prob, activation=Activation(kind, **params))
            assert relative_error(changed, plain.double()) > 1e-2, f"{kind} with {params} equals plain {kind}"
        # The clamp after the activation is not the clamp before it (for relu it is:
        # relu(min(g, L)) = min(relu(g), L) with L > 0).
        if kind == "relu":
            continue
        before = ft_ops.expert_gemm(**prob, activation=Activation(kind, limit=0.8))
        after = ft_ops.expert_gemm(**prob, activation=Activation(kind, limit=0.8, limit_after_act=True))
        assert relative_error(after, before.double()) > 1e-2, f"{kind}: limit_after_act equals the clamp before"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_many_tokens_take_the_grouped_path(device, dtype):
    require(device, "expert_gemm")
    # Enough pairs for the CUDA kernel's grouped path; shapes tensor cores accept.
    check(device, dtype, "silu", False, tokens=300, top_k=8, slots=40, hidden=128, inter=64)
    check(device, dtype, "swigluoai", True, tokens=300, top_k=8, slots=40, hidden=128, inter=64)
    check(device, dtype, EVERYTHING, True, tokens=300, top_k=8, slots=40, hidden=128, inter=64)
    check(device, dtype, Activation("gelu", limit=1.2, gate_softcap=0.9), False, tokens=300, top_k=8, slots=40,
          hidden=128, inter=64)
    check(device, dtype, Activation("silu", limit=0.8, limit_after_act=True), False, tokens=300, top_k=8, slots=40,
          hidden=128, inter=64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden,inter", [(128, 48), (72, 24), (30, 10)])
def test_decode_kernels_for_every_row_shape(device, dtype, hidden, inter):
    """16-bit decode: whole 16-row tiles and 32-column chunks take the tensor-core kernel on CUDA
    (128 x 48), other shapes the FMA kernel with 16-byte loads (72 x 24) or scalar loads (30 x 10).
    17 tokens over 6 used slots put more than 8 pairs on a slot (several passes of the mma's 8 columns)."""
    require(device, "expert_gemm")
    for tokens in (1, 4, 17):
        check(device, dtype, "silu", True, tokens, top_k=4, slots=12, hidden=hidden, inter=inter)
    check(device, dtype, "gelu_tanh", False, 17, top_k=8, slots=12, hidden=hidden, inter=inter)
    check(device, dtype, EVERYTHING, True, 17, top_k=8, slots=12, hidden=hidden, inter=inter)
    # down_combine deals an expert's columns to 8 / top_k warps: top-k that do and do not divide 8.
    for top_k in (1, 3, 6, 10):
        check(device, dtype, "silu", True, 5, top_k=top_k, slots=12, hidden=hidden, inter=inter)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_path_on_banks_of_more_than_1023_slots(device):
    """Banks too large for one grouped product (windows of 1,023 slots on CUDA): pairs spread over
    several windows, one window without any pair, slots in the last, partial window."""
    require(device, "expert_gemm")
    check(device, torch.bfloat16, "silu", False, tokens=160, top_k=8, slots=2100, hidden=64, inter=32)
    check(device, torch.bfloat16, "gelu_tanh", True, tokens=96, top_k=4, slots=1100, hidden=64, inter=32)
    check(device, torch.bfloat16, EVERYTHING, True, tokens=96, top_k=4, slots=1100, hidden=64, inter=32)
    # Every pair in the last window (the first holds none): slots 1023..1099 only.
    prob = random_problem(80, 4, 1100, 64, 32, torch.bfloat16, device, True, seed_of("windows", device))
    prob["slot_ids"] = torch.randint(1023, 1100, (80, 4), dtype=torch.int32).to(device)
    cpu = {k: (v.cpu() if v is not None else None) for k, v in prob.items()}
    err = relative_error(ft_ops.expert_gemm(**prob, activation="silu"), reference.expert_gemm(**cpu, activation="silu"))
    assert err < TOLERANCE[torch.bfloat16]


UNGATED = [RELU2, Activation("silu", gated=False), Activation("gelu_tanh", limit=0.8, up_offset=0.5, gated=False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("activation", UNGATED, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_ungated_experts_match_float64_reference(device, dtype, activation, bias):
    """Experts without a gate (w13 the up rows alone, the up values as the gate too): every decode
    kernel (tensor cores in 16 bits at 64 x 32, FMAs with 16-byte loads at 72 x 24, scalar loads at
    30 x 10, passes of more than 8 pairs a slot) and the grouped path (bf16, 300 tokens)."""
    require(device, "expert_gemm")
    for hidden, inter in ((64, 32), (72, 24), (30, 10)):
        for tokens in (1, 4, 17):
            check(device, dtype, activation, bias, tokens, top_k=4, slots=12, hidden=hidden, inter=inter)
    check(device, dtype, activation, bias, tokens=300, top_k=8, slots=40, hidden=128, inter=64)


@pytest.mark.parametrize("device", DEVICES)
def test_ungated_relu2_is_relu_squared_and_windows(device):
    """RELU2 computes down(relu(up x)^2), written out independently here; and on banks of more than
    1,023 slots (the windowed grouped path on CUDA)."""
    require(device, "expert_gemm")
    prob = random_problem(6, 3, 10, 64, 32, torch.float32, device, True, seed_of("relu2", device), gated=False)
    out = ft_ops.expert_gemm(**prob, activation="relu2").double().cpu()
    p = {k: v.double().cpu() for k, v in prob.items()}
    want = torch.zeros(6, 64, dtype=torch.float64)
    for t in range(6):
        for k in range(3):
            s = int(p["slot_ids"][t, k])
            if s >= 0:
                up = p["w13"][s] @ p["hidden"][t] + p["b13"][s]
                want[t] += p["weights"][t, k] * (p["w2"][s] @ torch.relu(up) ** 2 + p["b2"][s])
    assert relative_error(out, want) < TOLERANCE[torch.float32]
    check(device, torch.bfloat16, RELU2, True, tokens=96, top_k=4, slots=1100, hidden=64, inter=32)


@pytest.mark.parametrize("device", DEVICES)
def test_gated_and_ungated_shapes_are_told_apart(device):
    """A gated call on an ungated bank (and the other way round) fails in one line that says what
    would work, never computing with half the rows: dense, block-FP8 (before its scales' shapes are
    checked) and an odd intermediate size."""
    require(device, "expert_gemm")
    ungated = random_problem(2, 2, 4, 32, 16, torch.float32, device, False, 1, gated=False)
    gated = random_problem(2, 2, 4, 32, 16, torch.float32, device, False, 1)
    odd = random_problem(2, 2, 4, 32, 15, torch.float32, device, False, 1, gated=False)
    for prob in (ungated, odd):
        with pytest.raises(RuntimeError, match="experts without a gate .* pass gated=False .* 'relu2'"):
            ft_ops.expert_gemm(**prob, activation="silu")
    with pytest.raises(RuntimeError, match="twice w2's 16 intermediate columns: gate and up rows; pass gated=True"):
        ft_ops.expert_gemm(**gated, activation="relu2")
    for prob, activation in ((ungated, "silu"), (gated, "relu2")):
        q13, s13 = formats.quantize_fp8(prob["w13"].float().cpu())
        q2, s2 = formats.quantize_fp8(prob["w2"].float().cpu())
        fp8 = dict(prob, w13=q13.to(device), w2=q2.to(device), w13_scale=s13.to(device), w2_scale=s2.to(device))
        with pytest.raises(RuntimeError, match="pass gated="):
            ft_ops.expert_gemm(**fp8, activation=activation)


@pytest.mark.parametrize("device", DEVICES)
def test_all_pairs_minus_one_gives_zeros_and_no_tokens_gives_empty(device):
    require(device, "expert_gemm")
    prob = random_problem(4, 2, 6, 16, 8, torch.float32, device, True, seed_of("minus one", device))
    prob["slot_ids"].fill_(-1)
    if device == "cuda":
        poison_next_allocation((4, 16), torch.float32)
    assert torch.equal(ft_ops.expert_gemm(**prob).cpu(), torch.zeros(4, 16))
    none_routed = dict(prob, slot_ids=prob["slot_ids"][:, :0], weights=prob["weights"][:, :0])  # top_k 0
    if device == "cuda":
        poison_next_allocation((4, 16), torch.float32)
    assert torch.equal(ft_ops.expert_gemm(**none_routed).cpu(), torch.zeros(4, 16))
    empty = random_problem(0, 2, 6, 16, 8, torch.float32, device, False, seed_of("empty", device))
    assert ft_ops.expert_gemm(**empty).shape == (0, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_slot_ids_and_int64_and_bank_slices(device):
    require(device, "expert_gemm")
    seed = seed_of("layouts", device)
    prob = random_problem(6, 8, 10, 32, 16, torch.float32, device, False, seed)
    prob["slot_ids"] = prob["slot_ids"].long()[:, ::2]
    prob["weights"] = prob["weights"][:, ::2]
    # A host layer inside a bigger [L, E, ...] pool, as the CPU miss path passes it.
    big13 = torch.randn(3, *prob["w13"].shape, device=device)
    big13[1] = prob["w13"]
    prob["w13"] = big13[1]
    out = ft_ops.expert_gemm(**prob)
    want = reference.expert_gemm(**{k: (v.cpu() if v is not None else None) for k, v in prob.items()})
    assert relative_error(out, want) < TOLERANCE[torch.float32], f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_routing_weights_may_be_low_precision(device):
    require(device, "expert_gemm")
    seed = seed_of("low precision weights", device)
    prob = random_problem(5, 2, 6, 32, 16, torch.bfloat16, device, False, seed)
    prob["weights"] = prob["weights"].to(torch.bfloat16)
    out = ft_ops.expert_gemm(**prob)
    want = reference.expert_gemm(**{k: (v.cpu() if v is not None else None) for k, v in prob.items()})
    assert relative_error(out, want) < TOLERANCE[torch.bfloat16], f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("hidden", [256, 800])  # 800: the warps take unequal numbers of 32-column steps
def test_one_token_call_equals_the_same_token_in_a_larger_call(dtype, bias, hidden):
    """A one-token call (the decode step, its down kernel a dependent launch on sm_90) computes each
    row exactly as a call of several tokens does."""
    require("cuda", "expert_gemm")
    prob = random_problem(3, 8, 24, hidden, 192, dtype, "cuda", bias, seed=41)
    many = ft_ops.expert_gemm(**prob)
    for t in range(3):
        one = {k: (v[t:t + 1] if k in ("hidden", "slot_ids", "weights") else v) for k, v in prob.items()}
        assert torch.equal(ft_ops.expert_gemm(**one)[0], many[t]), f"token {t}"
