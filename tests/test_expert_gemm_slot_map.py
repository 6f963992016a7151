"""expert_gemm with a slot_map (a layer's experts: the slot of each expert id), every format.

Everywhere the call equals the same call with the ids mapped to slots by hand; on CUDA a prompt-sized
bf16 call on a quantized bank dequantizes the map's experts into a scratch bank a window at a time
(at most LIMITS["dequantize_window_bytes"]) and equals, bit for bit, the grouped GEMM on the whole
layer dequantized; opcheck, torch.compile and the errors."""
import pytest
import torch

import ft_ops
from ft_ops import formats
from ft_ops._extension import LIMITS
from ft_ops.activations import SILU, SWIGLUOAI
from helpers import DEVICES, require
from ft_ops.testing import reference
from test_expert_gemm import poison_next_allocation, relative_error, seed_of

pytestmark = pytest.mark.parametrize("device", DEVICES)
FORMATS = ["dense", "fp8", "fp8_rows", "mxfp4"]


def layer_problem(fmt, tokens, top_k, experts, pool_slots, hidden, inter, dtype, device, bias, seed):
    """A pool of `pool_slots` slots in `fmt` holding a layer of `experts` experts at scattered slots
    (two of them not resident: map -1), expert ids routed to every kind of expert, some -1 or out of
    range."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(pool_slots, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(pool_slots, hidden, inter, generator=gen) * inter ** -0.5
    banks = dict(w13=w13.to(dtype), w2=w2.to(dtype), w13_scale=None, w2_scale=None)
    if fmt == "fp8":
        (q13, s13), (q2, s2) = formats.quantize_fp8(w13, parts=2), formats.quantize_fp8(w2)
        banks = dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    elif fmt == "fp8_rows":
        (q13, s13), (q2, s2) = formats.quantize_fp8_rows(w13), formats.quantize_fp8_rows(w2)
        banks = dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    elif fmt == "mxfp4":
        (q13, s13), (q2, s2) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
        banks = dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    slot_map = torch.randperm(pool_slots, generator=gen)[:experts].int()
    slot_map[torch.randperm(experts, generator=gen)[:2]] = -1
    ids = torch.randint(experts, (tokens, top_k), generator=gen, dtype=torch.int32)
    ids[torch.rand(tokens, top_k, generator=gen) < 0.1] = -1
    ids[torch.rand(tokens, top_k, generator=gen) < 0.05] = experts + 3  # outside the map: not computed
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    b13 = (torch.randn(pool_slots, 2 * inter, generator=gen) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(pool_slots, hidden, generator=gen) * 0.1).to(dtype) if bias else None
    prob = dict(hidden=x.to(dtype), slot_ids=ids, weights=weights, b13=b13, b2=b2, **banks)
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in prob.items()}
    return on, slot_map.to(device)


def mapped_by_hand(prob, slot_map):
    ids = prob["slot_ids"].long()
    inside = (ids >= 0) & (ids < slot_map.numel())
    slots = torch.where(inside, slot_map[ids.clamp(0, slot_map.numel() - 1)].long(), -1)
    return dict(prob, slot_ids=slots.int())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [3, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_slot_map_equals_the_ids_mapped_by_hand(device, fmt, tokens, bias):
    """Where no window is dequantized (the CPU kernels at any size, decode-sized calls, dense banks),
    the map only maps the ids: the same kernels, the same bits."""
    require(device, "expert_gemm")
    seed = seed_of("slot_map", device, fmt, tokens, bias)
    prob, slot_map = layer_problem(fmt, tokens, 4, 12, 20, 128, 64, torch.bfloat16, device, bias, seed)
    if device == "cuda" and fmt != "dense" and tokens >= LIMITS["grouped_gemm_min_tokens"]:
        pytest.skip("dequantized by windows on CUDA: test_prompt_on_a_quantized_layer_...")
    activation = SWIGLUOAI if fmt == "mxfp4" else SILU
    got = ft_ops.expert_gemm(**prob, activation=activation, slot_map=slot_map)
    want = ft_ops.expert_gemm(**mapped_by_hand(prob, slot_map), activation=activation)
    assert torch.equal(got, want)


def dequantized_layer_call(prob, slot_map, activation):
    """The grouped GEMM on the layer's experts dequantized all at once (what the runtime ran before
    the windows), pairs of a non-resident expert left out."""
    parts = 2
    routed = mapped_by_hand(prob, slot_map)["slot_ids"] >= 0
    ids = torch.where(routed, prob["slot_ids"], -1)
    w13 = ft_ops.dequantize_experts(prob["w13"], prob["w13_scale"], slot_map, parts, torch.bfloat16)
    w2 = ft_ops.dequantize_experts(prob["w2"], prob["w2_scale"], slot_map, 1, torch.bfloat16)
    gather = slot_map.clamp(min=0).long()
    bias = lambda b: None if b is None else b[gather]
    return ft_ops.expert_gemm(prob["hidden"], ids, prob["weights"], w13, w2, bias(prob["b13"]), bias(prob["b2"]),
                              activation)


def require_grouped_gemm(device):
    require(device, "expert_gemm")
    if device != "cuda" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the dequantizing prompt path runs the grouped GEMM of CUDA sm_90+")


@pytest.mark.parametrize("fmt", ["fp8", "fp8_rows", "mxfp4"])
@pytest.mark.parametrize("bias", [False, True])
def test_prompt_on_a_quantized_layer_equals_the_layer_dequantized_at_once(device, fmt, bias):
    require_grouped_gemm(device)
    seed = seed_of("dequantized window", fmt, bias)
    prob, slot_map = layer_problem(fmt, 96, 4, 24, 40, 256, 128, torch.bfloat16, device, bias, seed)
    activation = SWIGLUOAI if fmt == "mxfp4" else SILU
    poison_next_allocation((96, 256), torch.bfloat16)
    got = ft_ops.expert_gemm(**prob, activation=activation, slot_map=slot_map)
    want = dequantized_layer_call(prob, slot_map, activation)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), f"max difference {float((got.float() - want.float()).abs().max()):.3e}"
    # The twin above dequantizes with the same code as the path; the float64 oracle does not.
    by_hand = mapped_by_hand(prob, slot_map)
    exact = reference.expert_gemm(**{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in by_hand.items()},
                                  activation=activation)
    assert relative_error(got, exact) < 2e-2


@pytest.mark.parametrize("fmt,bias", [("fp8", False), ("fp8", True), ("fp8_rows", False), ("mxfp4", True)])
def test_a_layer_larger_than_the_scratch_runs_in_windows(device, fmt, bias):
    """48 experts of 100 MB in bf16 (4.8 GB dequantized) go through a 2 GiB scratch bank in three
    windows of 21, 21 and 6, with two experts not resident and ids outside the map: the same output
    as the layer dequantized at once, bit for bit, and the call's peak memory within the window's
    scratch and its activations."""
    require_grouped_gemm(device)
    experts, pool_slots, hidden, inter, tokens, top_k = 48, 50, 4096, 4096, 128, 4
    expert_bytes = 3 * hidden * inter * 2
    window = LIMITS["dequantize_window_bytes"] // expert_bytes
    assert window < experts  # several windows, the last one partial
    gen = torch.Generator(device="cuda").manual_seed(seed_of("large layer", fmt, bias))
    w13 = torch.randn(pool_slots, 2 * inter, hidden, device="cuda", generator=gen) * hidden ** -0.5
    w2 = torch.randn(pool_slots, hidden, inter, device="cuda", generator=gen) * inter ** -0.5
    if fmt == "fp8":
        (q13, s13), (q2, s2) = formats.quantize_fp8(w13, parts=2), formats.quantize_fp8(w2)
    elif fmt == "fp8_rows":
        (q13, s13), (q2, s2) = formats.quantize_fp8_rows(w13), formats.quantize_fp8_rows(w2)
    else:
        (q13, s13), (q2, s2) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
    del w13, w2
    slot_map = torch.randperm(pool_slots, device="cuda", generator=gen)[:experts].int()
    slot_map[torch.tensor([3, 30], device="cuda")] = -1
    ids = torch.randint(experts, (tokens, top_k), device="cuda", generator=gen, dtype=torch.int32)
    ids[torch.rand(tokens, top_k, device="cuda", generator=gen) < 0.05] = experts + 1
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), dim=-1)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    b = lambda *shape: (torch.randn(*shape, device="cuda", generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    prob = dict(hidden=x, slot_ids=ids, weights=weights, w13=q13, w2=q2, b13=b(pool_slots, 2 * inter),
                b2=b(pool_slots, hidden), w13_scale=s13, w2_scale=s2)
    activation = SWIGLUOAI if fmt == "mxfp4" else SILU
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = ft_ops.expert_gemm(**prob, activation=activation, slot_map=slot_map)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    assert growth < window * expert_bytes + (256 << 20), f"the call took {growth / 2**30:.2f} GiB"
    want = dequantized_layer_call(prob, slot_map, activation)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), f"max difference {float((got.float() - want.float()).abs().max()):.3e}"


def test_opcheck_and_compile_with_a_slot_map(device):
    require(device, "expert_gemm")
    prob, slot_map = layer_problem("dense", 5, 2, 6, 9, 64, 32, torch.float32, device, True, seed=11)
    args = (prob["hidden"], prob["slot_ids"], prob["weights"], prob["w13"], prob["w2"], prob["b13"], prob["b2"],
            "silu", 1.0, 0.0, 0.0, 0.0, 0.0, None, None, False, True, slot_map)
    torch.library.opcheck(torch.ops.freetoken.expert_gemm.default, args)
    eager = ft_ops.expert_gemm(**prob, slot_map=slot_map)
    compiled = torch.compile(lambda p, m: ft_ops.expert_gemm(**p, slot_map=m), fullgraph=True)
    assert torch.equal(compiled(prob, slot_map), eager)


@pytest.mark.parametrize("tokens", [3, 70])
def test_an_empty_map_computes_nothing(device, tokens):
    require(device, "expert_gemm")
    prob, _ = layer_problem("fp8", tokens, 2, 6, 9, 128, 64, torch.bfloat16, device, True, seed=12)
    empty = torch.empty(0, dtype=torch.int32, device=device)
    if device == "cuda":
        poison_next_allocation((tokens, 128), torch.bfloat16)
    assert (ft_ops.expert_gemm(**prob, slot_map=empty) == 0).all()


def test_int64_ids_beyond_int32_are_outside_the_map(device):
    require(device, "expert_gemm")
    prob, slot_map = layer_problem("dense", 3, 2, 6, 9, 64, 32, torch.bfloat16, device, False, seed=14)
    ids = prob["slot_ids"].long()
    ids[0, 0] = 2 ** 32 + 1  # would read as expert 1 if cast to int32 first
    got = ft_ops.expert_gemm(**dict(prob, slot_ids=ids), slot_map=slot_map)
    ids[0, 0] = -1
    assert torch.equal(got, ft_ops.expert_gemm(**dict(prob, slot_ids=ids), slot_map=slot_map))


def test_bad_slot_maps_are_refused_in_one_line(device):
    require(device, "expert_gemm")
    prob, slot_map = layer_problem("dense", 3, 2, 6, 9, 64, 32, torch.bfloat16, device, False, seed=13)
    with pytest.raises(RuntimeError, match="slot_map must be int32 or int64"):
        ft_ops.expert_gemm(**prob, slot_map=slot_map.float())
    with pytest.raises(RuntimeError, match=r"slot_map must be 1-D \[experts\]"):
        ft_ops.expert_gemm(**prob, slot_map=slot_map.view(2, 3))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="slot_map"):
            ft_ops.expert_gemm(**prob, slot_map=slot_map.cpu())
    else:  # on the CPU a map entry outside the bank is refused, as slot ids out of range are
        bad = slot_map.clone()
        bad[3] = 99
        with pytest.raises(RuntimeError, match=r"slot_map\[3\] is 99, outside \[-1, 9\)"):
            ft_ops.expert_gemm(**prob, slot_map=bad)
