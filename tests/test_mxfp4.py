"""MXFP4 experts (GPT-OSS's format: uint8 pairs of e2m1 values, e8m0 scales per 32 values) on both
devices: the dequantization equals transformers' own, expert_gemm and dequantize_experts equal the
float64 reference that dequantizes the same bytes (unaligned rows too), a runtime over an MXFP4 host
pool equals the resident stack, and a GPT-OSS MXFP4 checkpoint generates transformers' tokens."""
import os

import pytest
import torch

import ft_ops
from ft_ops import formats
from ft_ops.activations import SWIGLUOAI
from ft_ops.testing import reference
from helpers import DEVICES, require
from moe_helpers import E, L, layers_for, offloaded_stack, random_routing, resident_stack
from test_expert_gemm import poison_next_allocation, relative_error, seed_of

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def mxfp4_problem(tokens, top_k, slots, hidden, inter, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = torch.randn(slots, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(slots, hidden, inter, generator=gen) * inter ** -0.5
    (q13, s13), (q2, s2) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
    slot_ids = torch.randint(slots, (tokens, top_k), generator=gen, dtype=torch.int32)
    slot_ids[torch.rand(tokens, top_k, generator=gen) < 0.15] = -1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    b13 = (torch.randn(slots, 2 * inter, generator=gen) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(slots, hidden, generator=gen) * 0.1).to(dtype) if bias else None
    return dict(hidden=x, slot_ids=slot_ids, weights=weights, w13=q13, w2=q2, b13=b13, b2=b2, w13_scale=s13,
                w2_scale=s2)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_cpu_prompt_groups_compute_as_their_weights_dequantized_to_bf16(fmt):
    """A bf16 prompt on quantized CPU weights (groups of more than 4 pairs: ATen's GEMMs) computes
    exactly what the dense bf16 kernel computes on the same weights dequantized to bf16, as the CUDA
    prompt path does (its scratch bank, then the bf16 grouped GEMM), on a CPU that multiplies bf16
    natively (elsewhere ATen's bf16 GEMM is slower than float32's, and the kernel keeps float32)."""
    require("cpu", "expert_gemm")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512_bf16" not in flags or not torch.backends.mkldnn.enabled:
        pytest.skip("this CPU has no AVX512-BF16 (or oneDNN is off): its prompts compute in float32")
    from test_expert_gemm_fp8 import fp8_problem

    if fmt == "fp8":
        prob = fp8_problem(64, 2, 4, 256, 128, torch.bfloat16, "cpu", True, seed=21)
    else:
        prob = mxfp4_problem(64, 2, 4, 256, 128, torch.bfloat16, True, seed=21)
    ids = prob["slot_ids"].flatten().long()
    counts = torch.bincount(ids[ids >= 0])
    assert int(counts[counts > 0].min()) > 4, "every group must take ATen's GEMMs, not the decode-sized path"
    every = torch.arange(4)
    dense = dict(prob, w13=ft_ops.dequantize_experts(prob["w13"], prob["w13_scale"], every, 2, torch.bfloat16),
                 w2=ft_ops.dequantize_experts(prob["w2"], prob["w2_scale"], every, 1, torch.bfloat16),
                 w13_scale=None, w2_scale=None)
    assert torch.equal(ft_ops.expert_gemm(**prob), ft_ops.expert_gemm(**dense))


def test_dequantization_equals_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = formats.quantize_mxfp4(torch.randn(3, 64, 96) * 3)
    theirs = mxfp4._convert_moe_packed_tensors(blocks.reshape(3, 64, 3, 16), scales, dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), formats.dequantize_mxfp4(blocks, scales))  # theirs is [E, in, out]


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_quantize_mxfp4_takes_the_nearest_code_on_either_device(device):
    """Each value becomes the code of the nearest e2m1 magnitude of its group's scale, a tie (every
    midpoint between two magnitudes is in the input, both signs) going to the lower code, the sign
    bit set for negative values but never for zero; on the device of its input (measure_rates
    quantizes on the pool's device; meta gives the shapes)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    magnitudes = torch.tensor(formats.E2M1_VALUES[:8])
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    gen = torch.Generator().manual_seed(11)
    # Group amax 6 in both rows (scale 2^0: the values are their own scaled values).
    row0 = torch.cat([torch.tensor([6.0, 0.0, -0.0]), midpoints, -midpoints, torch.rand(15, generator=gen) * 12 - 6])
    row1 = torch.cat([torch.tensor([-6.0]), torch.rand(31, generator=gen) * 12 - 6])
    values = torch.stack([row0, row1]).reshape(1, 2, 32)
    blocks, scales = formats.quantize_mxfp4(values.to(device))
    assert blocks.device.type == device and blocks.shape == (1, 2, 16) and scales.shape == (1, 2, 1)
    if device == "meta":
        return
    assert bool((scales == 127).all())
    nearest = (values.abs()[..., None] - magnitudes).abs().argmin(-1)  # the first (lower) of a tie
    want = nearest | ((values < 0) & (nearest > 0)).to(torch.int64) << 3
    got = torch.stack([blocks.cpu() & 0x0F, blocks.cpu() >> 4], -1).reshape(1, 2, 32).to(torch.int64)
    assert torch.equal(got, want)


def test_quantize_mxfp4_refuses_non_finite_weights():
    w = torch.zeros(1, 1, 32)
    for bad in (float("inf"), float("nan")):
        w[0, 0, 3] = bad
        with pytest.raises(ValueError, match="inf or NaN"):
            formats.quantize_mxfp4(w)


@pytest.mark.parametrize("device", DEVICES)
def test_a_streaming_runtime_over_mxfp4_measures_its_rates(device):
    """A pool that streams measures its rates on random MXFP4 experts written into its banks."""
    require(device, "expert_gemm")
    gen = torch.Generator().manual_seed(12)
    w13 = torch.randn(L, E, 64, 64, generator=gen) * 0.1
    w2 = torch.randn(L, E, 64, 32, generator=gen) * 0.1
    (q13, s13), (q2, s2) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
    banks = [t.pin_memory() if device == "cuda" else t for t in (q13, q2, s13, s2)]
    host = ft_ops.slot_pool.HostPool(banks[0], banks[1], w13_scale=banks[2], w2_scale=banks[3], dtype=torch.bfloat16)
    runtime = ft_ops.moe.OffloadRuntime(host, 2 * E, device, activation=SWIGLUOAI)
    assert runtime.streamer is not None
    assert runtime.rates.link_bytes_per_s > 0 and runtime.rates.gemm_flops_per_s > 0


def on(device, prob):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in prob.items()}


def check(device, prob, dtype):
    """expert_gemm on `device` against the float64 reference; on CUDA into a NaN-poisoned output
    allocation, so a row the kernels fail to write shows."""
    args = on(device, prob)
    if device == "cuda":
        poison_next_allocation(tuple(prob["hidden"].shape), dtype)
    got = ft_ops.expert_gemm(**args, activation=SWIGLUOAI)
    want = reference.expert_gemm(**prob, activation=SWIGLUOAI)
    assert got.device.type == device and got.dtype == dtype
    assert torch.isfinite(got).all()
    err = relative_error(got, want)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


# (hidden, intermediate) and the CUDA kernels they take with 16-bit hidden states (float32 takes the
# FMA kernels throughout): gate_up on 64-column steps when H % 64 == 0, else 32-column groups; down
# on tensor cores when I % 64 == 0, else the FMA kernel.
SHAPES = [
    (96, 64),     # gate_up by groups (H % 64 != 0), down on tensor cores (one chunk a row)
    (1056, 96),   # gate_up by groups (33 groups: lanes take 1 or 2), the FMA down kernel (I % 64 != 0)
    (128, 128),   # both wide kernels: two steps (warps 0 and 1), 2 chunks
    (2880, 192),  # GPT-OSS's H: 45 steps, 6 a warp (a full batch and a partial one), warp 7 only 3
    (64, 2880),   # GPT-OSS's I: 45 chunks, top_k x 45 items dealt to 8 warps over several batches
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden,inter", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 17, 70])  # 70: two decode chunks of at most 64 tokens
def test_expert_gemm_matches_the_dequantizing_reference(device, dtype, tokens, hidden, inter):
    """6 slots for 4 x tokens pairs (15 % of them -1): at 17 and 70 tokens a slot serves more than 8
    pairs (several passes of the mma's 8 columns), and a token may pick one slot twice."""
    require(device, "expert_gemm")
    if device == "cpu" and (dtype == torch.float16 or hidden > 96 or inter > 96):
        pytest.skip("the CPU run covers the small shape in float32 and bf16")
    prob = mxfp4_problem(tokens, 4, 6, hidden, inter, dtype, bias=True,
                         seed=seed_of("mxfp4", dtype, tokens, hidden, inter))
    check(device, prob, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden,inter", [(96, 96), (128, 128)])
@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 5, 6, 7, 8, 10])
@pytest.mark.parametrize("bias", [False, True])
def test_expert_gemm_at_every_top_k(device, top_k, hidden, inter, bias):
    """The FMA down kernel (96 x 96) deals an expert's columns to 8 / top_k warps when top_k < 8
    (GPT-OSS: 4); the tensor-core one (128 x 128) takes a block per (16 rows, expert, token), so a
    tile's last block adds top_k partial sums (1 to 10 of them)."""
    require(device, "expert_gemm")
    if device == "cpu" and hidden > 96:
        pytest.skip("the CPU kernel has no such dispatch: the small shape covers it")
    for dtype in (torch.bfloat16, torch.float16):
        prob = mxfp4_problem(3, top_k, 12, hidden, inter, dtype, bias=bias,
                             seed=seed_of("mxfp4-k", top_k, hidden, bias, dtype))
        check(device, prob, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k,inter", [(8, 2944), (8, 3072), (32, 256)])
def test_the_down_kernel_at_large_top_k_and_intermediate(device, top_k, inter):
    """The tensor-core down kernel stages one expert's I act values in f16 a block (top_k x I did
    not fit 48 KB beyond 8 x 2944) and adds a tile's top_k partial sums in a last block."""
    require(device, "expert_gemm")
    if device == "cpu":
        pytest.skip("a CUDA dispatch bound")
    prob = mxfp4_problem(2, top_k, 40, 64, inter, torch.bfloat16, bias=True,
                         seed=seed_of("mxfp4-smem", top_k, inter))
    check(device, prob, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_and_graph_replays_give_the_same_output(device):
    """The down kernel's per-tile counters are zeroed by gate_up each call: the same call, eager and
    replayed from a CUDA graph again and again, gives the same output bit for bit."""
    require(device, "expert_gemm")
    if device == "cpu":
        pytest.skip("the CUDA kernels' workspace")
    prob = on("cuda", mxfp4_problem(3, 4, 12, 128, 128, torch.bfloat16, True, seed=seed_of("mxfp4-repeat")))
    first = ft_ops.expert_gemm(**prob, activation=SWIGLUOAI)
    for _ in range(3):
        assert torch.equal(ft_ops.expert_gemm(**prob, activation=SWIGLUOAI), first)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ft_ops.expert_gemm(**prob, activation=SWIGLUOAI)  # warm-up on the side stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = ft_ops.expert_gemm(**prob, activation=SWIGLUOAI)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(4):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_pair_skipped_gives_zeros(device, dtype):
    """Slot -1 everywhere: no act row is written, the down kernel stages zeros, adds no bias."""
    require(device, "expert_gemm")
    prob = mxfp4_problem(3, 4, 6, 128, 128, dtype, bias=True, seed=seed_of("mxfp4-skipped", dtype))
    prob["slot_ids"].fill_(-1)
    args = on(device, prob)
    if device == "cuda":
        poison_next_allocation((3, 128), dtype)
    assert torch.equal(ft_ops.expert_gemm(**args, activation=SWIGLUOAI).cpu(), torch.zeros(3, 128, dtype=dtype))


def shifted_by_one_byte(t):
    """The same bytes (a uint8 bank) in a tensor that starts one byte past an aligned allocation."""
    flat = torch.zeros(t.numel() + 1, dtype=torch.uint8, device=t.device)
    flat[1:] = t.flatten()
    return flat[1:].view(t.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unaligned", ["hidden+w13", "scales", "w2"])
def test_expert_gemm_on_unaligned_rows(device, unaligned):
    """On CUDA, 128 x 128 rows take both wide kernels when aligned. Hidden rows and a w13 bank that
    do not start on 16 bytes take the value-by-value gate_up kernel (and the tensor-core down
    kernel, which reads neither); scale banks at odd addresses (no 2-byte scale pairs) the gate_up
    kernel by groups and the FMA down kernel; a w2 bank off 16 bytes the value-by-value down kernel."""
    require(device, "expert_gemm")
    cpu = mxfp4_problem(3, 4, 5, 128, 128, torch.bfloat16, bias=True, seed=11)
    prob = on(device, cpu)
    want = reference.expert_gemm(**cpu, activation=SWIGLUOAI)
    if unaligned == "hidden+w13":
        wide = torch.zeros(3, 129, dtype=torch.bfloat16, device=device)
        wide[:, 1:] = prob["hidden"]
        prob = dict(prob, hidden=wide[:, 1:], w13=shifted_by_one_byte(prob["w13"]))
    elif unaligned == "scales":
        prob = dict(prob, w13_scale=shifted_by_one_byte(prob["w13_scale"]),
                    w2_scale=shifted_by_one_byte(prob["w2_scale"]))
    else:
        prob = dict(prob, w2=shifted_by_one_byte(prob["w2"]))
    got = ft_ops.expert_gemm(**prob, activation=SWIGLUOAI)
    assert relative_error(got, want) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_experts_matches_the_reference(device, dtype):
    require(device, "dequantize_experts")
    blocks, scales = formats.quantize_mxfp4(torch.randn(4, 64, 96))
    slots = torch.tensor([3, -1, 0])
    got = ft_ops.dequantize_experts(blocks.to(device), scales.to(device), slots.to(device), 2, dtype).cpu()
    assert got.shape == (3, 64, 96) and got.dtype == dtype
    want = reference.dequantize_experts(blocks, scales, slots, 2, dtype)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unaligned", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_and_edge_scales_dequantize_exactly(device, unaligned, dtype):
    """All 16 e2m1 codes under scales 2^-127 (subnormal products), 2^-126, 1, 2 and 2^127: the same
    bits on both devices, subnormals kept."""
    require(device, "dequantize_experts")
    codes = torch.arange(16, dtype=torch.uint8)
    byte_row = (codes[0::2] | (codes[1::2] << 4)).repeat(2)  # 32 values: every code twice
    rows = 5
    blocks = byte_row.repeat(rows, 1).reshape(1, rows, 16)
    scales = torch.tensor([0, 1, 127, 128, 254], dtype=torch.uint8).reshape(1, rows, 1)
    if unaligned:
        flat = torch.zeros(blocks.numel() + 1, dtype=torch.uint8)
        flat[1:] = blocks.flatten()
        blocks = flat.to(device)[1:].view(1, rows, 16)
    got = ft_ops.dequantize_experts(blocks.to(device), scales.to(device), torch.tensor([0]).to(device), 1,
                                    dtype).cpu()
    want = reference.dequantize_experts(blocks.cpu(), scales, torch.tensor([0]), 1, dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
    assert float(got[0, 0].abs()[got[0, 0] != 0].min()) == 2.0 ** -128  # 0.5 x 2^-127, subnormal


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    require(device, "expert_gemm")
    prob = on(device, mxfp4_problem(3, 2, 4, 64, 32, torch.float32, bias=False, seed=3))
    args = (prob["hidden"], prob["slot_ids"], prob["weights"], prob["w13"], prob["w2"], None, None, "silu", 1.0, 0.0,
            0.0, 0.0, 0.0, prob["w13_scale"], prob["w2_scale"])
    torch.library.opcheck(torch.ops.freetoken.expert_gemm.default, args)
    blocks, scales = formats.quantize_mxfp4(torch.randn(2, 32, 64))
    torch.library.opcheck(torch.ops.freetoken.dequantize_experts.default,
                          (blocks.to(device), scales.to(device), torch.tensor([1, 0], device=device), 1, torch.bfloat16))


def test_errors():
    prob = mxfp4_problem(2, 2, 4, 64, 32, torch.float32, bias=False, seed=4)
    with pytest.raises(RuntimeError, match=r"w13_scale must be uint8 e8m0 \[4, 64, 2\]"):
        ft_ops.expert_gemm(**dict(prob, w13_scale=prob["w13_scale"][:, :, :1]))
    with pytest.raises(RuntimeError, match="quantized weights need w13_scale and w2_scale"):
        ft_ops.expert_gemm(**dict(prob, w13_scale=None, w2_scale=None))
    with pytest.raises(ValueError, match="multiples of 32"):
        formats.bank_specs("mxfp4", 48, 32, torch.bfloat16, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runtime_over_an_mxfp4_host_pool(device, dtype):
    """Prompts that stream (in place, and at 70 tokens through the dequantized layer on CUDA),
    decode steps with misses: every layer equals the resident stack on the same MXFP4 experts."""
    require(device, "expert_gemm")
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 is checked on CUDA; the CPU run covers float32")
    gen = torch.Generator().manual_seed(8)
    H, I = 64, 32
    w13 = torch.randn(L, E, 2 * I, H, generator=gen) * H ** -0.5
    w2 = torch.randn(L, E, H, I, generator=gen) * I ** -0.5
    (q13, s13), (q2, s2) = formats.quantize_mxfp4(w13), formats.quantize_mxfp4(w2)
    pin = device == "cuda"
    host = ft_ops.slot_pool.HostPool(*(t.pin_memory() if pin else t for t in (q13, q2)),
                                     w13_scale=s13.pin_memory() if pin else s13,
                                     w2_scale=s2.pin_memory() if pin else s2, dtype=dtype)
    assert host.shape.format == "mxfp4" and host.shape.hidden == H
    runtime = ft_ops.moe.OffloadRuntime(host, 2 * E, device, activation=SWIGLUOAI, rates=ft_ops.rates.Rates())
    modules = layers_for(runtime)
    for tokens in [48, 1, 2, 70, 1]:
        routing = random_routing(tokens, gen)
        x = torch.randn(tokens, H, generator=gen).to(dtype)
        inputs = []
        got = offloaded_stack(modules, x.to(device), routing, inputs)
        want = resident_stack(host, x, routing, activation=SWIGLUOAI, inputs=inputs)
        for g, w in zip(got, want):
            assert relative_error(g, w.double()) < {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    assert runtime.stats()["pool"]["format"] == "mxfp4"


def write_mxfp4_checkpoint(model, path):
    """Saves a gpt-oss model, then rewrites its experts as GPT-OSS checkpoints hold them:
    gate_up_proj_blocks [E, 2I, H/32, 16] (rows interleaved gate, up, ...), _scales [E, 2I, H/32],
    down_proj_blocks [E, H, I/32, 16], _scales, biases as they are; quantization_config mxfp4."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")]:
        weight = tensors.pop(name).float().transpose(1, 2)  # the module's [E, in, out] -> [E, out, in]
        blocks, scales = formats.quantize_mxfp4(weight)
        tensors[name + "_blocks"] = blocks.reshape(*blocks.shape[:2], -1, 16).contiguous()
        tensors[name + "_scales"] = scales.contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))


def test_gpt_oss_mxfp4_checkpoint_generates_transformers_tokens(tmp_path):
    """A tiny GPT-OSS MXFP4 checkpoint in the exact layout: load_model keeps its experts MXFP4 in the
    host pool and generates the greedy tokens of transformers' GPT-OSS, which dequantizes the same
    bytes on the CPU."""
    require("cpu", "expert_gemm")
    import transformers as tf

    import freetoken_plugin
    from freetoken_plugin.tiny import tiny_model

    write_mxfp4_checkpoint(tiny_model("gpt_oss", experts=8), tmp_path)
    reference_model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    # transformers 5.17 dequantizes MXFP4 experts into bfloat16 parameters whatever dtype is asked
    # for; every MXFP4 value is exact in bfloat16, so casting them back to float32 is exact.
    reference_model.float()
    prompt = torch.randint(1, 512, (1, 10), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = reference_model.generate(prompt, **kw)
    loaded = freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", dtype=torch.float32,
                                         progress=False)
    host = loaded._freetoken_handle.runtime.host
    assert host.shape.format == "mxfp4" and host.w13.dtype == torch.uint8
    assert torch.equal(loaded.generate(prompt, **kw), want)
    with torch.no_grad():
        got, expected = loaded(want).logits, reference_model(want).logits
    assert float((got - expected).norm() / expected.norm()) < 1e-5
    # state_dict() and save_pretrained() hold the real experts: transformers' dequantization of the
    # same bytes (they once went through the FP8 dequantizer, in the packed shape).
    state, reference = loaded.state_dict(), reference_model.state_dict()
    experts = [n for n in reference if ".mlp.experts." in n]
    assert experts and all(torch.equal(state[n], reference[n]) for n in experts)
    loaded.save_pretrained(tmp_path / "saved")
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    assert torch.equal(again.generate(prompt, **kw), want)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    require(device, "expert_gemm")
    prob = on(device, mxfp4_problem(3, 2, 4, 64, 32, torch.float32, bias=True, seed=6))
    eager = ft_ops.expert_gemm(**prob)
    compiled = torch.compile(lambda p: ft_ops.expert_gemm(**p), fullgraph=True)
    assert torch.allclose(compiled(prob), eager, rtol=1e-6, atol=1e-6)
    slots = torch.tensor([2, 0], device=device)
    dequantize = torch.compile(lambda w, s, i: ft_ops.dequantize_experts(w, s, i, 2, torch.float32), fullgraph=True)
    assert torch.equal(dequantize(prob["w13"], prob["w13_scale"], slots),
                       ft_ops.dequantize_experts(prob["w13"], prob["w13_scale"], slots, 2, torch.float32))


@pytest.mark.slow  # 15 s: the checkpoint is written from a float32 model
def test_loading_an_mxfp4_checkpoint_never_expands_a_layer(tmp_path):
    """Peak resident memory of a process that loads a GPT-OSS MXFP4 checkpoint of ~80 MB of experts
    grows by the checkpoint and a few experts: the check of the expert function materializes the 4
    experts its probe routes to (~60 MB here with their float32 copies), not a dequantized layer
    (200 MB in float32 here, 600 MB at the peak of the dequantization: the grown peak was 627 MiB)."""
    import os

    import transformers as tf

    from helpers import load_model_peak_growth

    from freetoken_plugin.tiny import tiny_config

    config = tiny_config("gpt_oss", experts=64)
    config.hidden_size, config.intermediate_size = 512, 512
    torch.manual_seed(0)
    write_mxfp4_checkpoint(tf.AutoModelForCausalLM.from_config(config), tmp_path)
    ckpt_bytes = os.path.getsize(tmp_path / "model.safetensors")
    layer_float32 = 64 * 3 * 512 * 512 * 4
    grown = load_model_peak_growth(tmp_path, cache_slots=8, stream_prefill=False)
    assert grown < ckpt_bytes + 0.5 * layer_float32, (
        f"peak grew {grown / 2**20:.0f} MiB for a {ckpt_bytes / 2**20:.0f} MiB checkpoint")


def _set_nan_scale(t):
    t[3, 5, 0] = 0xFF
    return t


@pytest.mark.parametrize("name,change,message", [
    ("model.layers.0.mlp.experts.gate_up_proj_bias", lambda t: t[:, :-2].contiguous(), r" is torch\.\w+ \[8, \d+\], expected"),
    # e8m0 code 0xFF (no scale: NaN) is refused, not computed.
    ("model.layers.1.mlp.experts.down_proj_scales", _set_nan_scale, " holds e8m0 scale 0xFF"),
], ids=["bias-shape", "nan-scale"])
def test_a_damaged_mxfp4_tensor_is_refused_by_name(tmp_path, name, change, message):
    require("cpu", "expert_gemm")
    import os

    from safetensors.torch import load_file, save_file

    import freetoken_plugin
    from freetoken_plugin.loader import CheckpointError
    from freetoken_plugin.tiny import tiny_model

    write_mxfp4_checkpoint(tiny_model("gpt_oss", experts=8), tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    tensors[name] = change(tensors[name])
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + message):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


def test_mxfp4_experts_are_checked_before_the_host_pool_exists(tmp_path, monkeypatch):
    """The last layer's MXFP4 scales of another shape are refused from the headers, before the
    host pool is allocated, by load_model and by the check demo and generate make first."""
    require("cpu", "expert_gemm")
    import os

    from safetensors.torch import load_file, save_file

    import freetoken_plugin
    import freetoken_plugin.loader as loader_mod
    from freetoken_plugin.loader import CheckpointError
    from freetoken_plugin.tiny import tiny_model

    write_mxfp4_checkpoint(tiny_model("gpt_oss", experts=8), tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    last = max(int(k.split(".")[2]) for k in tensors if k.startswith("model.layers."))
    name = f"model.layers.{last}.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    monkeypatch.setattr(loader_mod.HostPool, "allocate",
                        classmethod(lambda *a, **k: pytest.fail("the host pool was allocated")))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r" is torch\.uint8 \[8, \d+, \d+\], expected"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        loader_mod.check_checkpoint(str(tmp_path))


def test_a_quantization_config_that_does_not_fit_the_tensors_says_which(tmp_path):
    """config.json naming MXFP4 over a bf16 GPT-OSS checkpoint, or FP8 over an MXFP4 one, is refused
    with what the tensors are and what config.json should say."""
    require("cpu", "expert_gemm")
    import json
    import os

    import freetoken_plugin
    from freetoken_plugin.loader import CheckpointError
    from freetoken_plugin.tiny import tiny_model

    dense, mx = os.path.join(tmp_path, "dense"), os.path.join(tmp_path, "mxfp4")
    model = tiny_model("gpt_oss", experts=8)
    model.save_pretrained(dense)
    config = json.load(open(os.path.join(dense, "config.json")))
    config["quantization_config"] = {"quant_method": "mxfp4"}
    json.dump(config, open(os.path.join(dense, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="says mxfp4, but .*gate_up_proj is torch.float32.*remove the "
                                              "quantization_config"):
        freetoken_plugin.load_model(dense, cache_slots=16, device="cpu", progress=False)
    # The same over a Qwen3-MoE whose sizes are not whole MXFP4 groups: the tensors' format is named
    # first, not the sizes an MXFP4 pool would need.
    odd = os.path.join(tmp_path, "odd")
    import transformers as tf

    from freetoken_plugin.tiny import tiny_config

    odd_config = tiny_config("qwen3_moe")
    odd_config.moe_intermediate_size = 48
    tf.AutoModelForCausalLM.from_config(odd_config).save_pretrained(odd)
    config = json.load(open(os.path.join(odd, "config.json")))
    assert config["moe_intermediate_size"] % 32 != 0
    config["quantization_config"] = {"quant_method": "mxfp4"}
    json.dump(config, open(os.path.join(odd, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="says mxfp4, but .*gate_proj.weight is torch.float32"):
        freetoken_plugin.load_model(odd, cache_slots=16, device="cpu", progress=False)
    write_mxfp4_checkpoint(model, mx)
    config = json.load(open(os.path.join(mx, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    json.dump(config, open(os.path.join(mx, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="holds MXFP4 experts .* quant_method should be 'mxfp4'"):
        freetoken_plugin.load_model(mx, cache_slots=16, device="cpu", progress=False)


def test_a_partly_quantized_or_misshapen_mxfp4_checkpoint_says_what_works(tmp_path):
    """An MXFP4 checkpoint with one layer's experts left in float (modules_to_not_convert) is refused
    with the way that loads it (its advice was to remove the quantization_config, which then refused
    the other layers); one whose sizes are not whole 32-value groups is a CheckpointError naming the
    checkpoint (a bare ValueError of the pool's format, the command line's exit status 1)."""
    import json
    import os

    import transformers as tf
    from safetensors.torch import load_file, save_file

    import freetoken_plugin
    from freetoken_plugin.loader import CheckpointError
    from freetoken_plugin.tiny import tiny_config, tiny_model

    model = tiny_model("gpt_oss", experts=8)
    plain, partial = os.path.join(tmp_path, "plain"), os.path.join(tmp_path, "partial")
    model.save_pretrained(plain)
    write_mxfp4_checkpoint(model, partial)
    floats = load_file(os.path.join(plain, "model.safetensors"))
    tensors = load_file(os.path.join(partial, "model.safetensors"))
    for w in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{w}"
        del tensors[name + "_blocks"], tensors[name + "_scales"]
        tensors[name] = floats[name]
    save_file(tensors, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.experts.gate_up_proj is torch.float32 .* while other "
                                              r"layers' experts are MXFP4: .*Mxfp4Config\(dequantize=True\)\) and call "
                                              r"freetoken_plugin.offload_experts"):
        freetoken_plugin.load_model(partial, cache_slots=16, device="cpu", progress=False)
    config = tiny_config("gpt_oss", experts=8)
    config.hidden_size = 80
    odd = os.path.join(tmp_path, "odd")
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(odd)
    tensors = load_file(os.path.join(odd, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).float().transpose(1, 2)
        weight = torch.nn.functional.pad(weight, (0, -weight.shape[-1] % 32))  # whole groups, as a writer might pad
        blocks, scales = formats.quantize_mxfp4(weight)
        tensors[name + "_blocks"] = blocks.reshape(*blocks.shape[:2], -1, 16).contiguous()
        tensors[name + "_scales"] = scales.contiguous()
    save_file(tensors, os.path.join(odd, "model.safetensors"), metadata={"format": "pt"})
    data = json.load(open(os.path.join(odd, "config.json")))
    data["quantization_config"] = {"quant_method": "mxfp4"}
    json.dump(data, open(os.path.join(odd, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"odd: MXFP4 experts need hidden and intermediate sizes that are "
                                              r"multiples of 32, got 80 and 32 .*cannot be mxfp4"):
        freetoken_plugin.load_model(odd, cache_slots=16, device="cpu", progress=False)


def test_mxfp4_experts_beside_a_plain_copy_of_them_are_refused(tmp_path):
    """A layer whose checkpoint holds down_proj_blocks / _scales and also a plain down_proj is refused
    by name (from a stranger's check: it loaded the blocks and ignored the other without a word)."""
    require("cpu", "expert_gemm")
    import os

    import freetoken_plugin
    from freetoken_plugin.loader import CheckpointError
    from freetoken_plugin.tiny import tiny_model
    from safetensors.torch import load_file, save_file

    model = tiny_model("gpt_oss", experts=8)
    write_mxfp4_checkpoint(model, tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.mlp.experts.down_proj"
    tensors[name] = torch.zeros(8, 4, 4, dtype=torch.bfloat16)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts holds MXFP4 experts .* and also "
                                              r"model\.layers\.1\.mlp\.experts\.down_proj .*remove"):
        freetoken_plugin.load_model(str(tmp_path), cache_slots=16, device="cpu", progress=False)


def cuda_kernels_of(call):
    """The names of the CUDA kernels that call() launched, under torch.profiler; None when the
    profiler recorded no kernel at all (no CUPTI), so that a caller can skip rather than fail."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return result, (names or None)


# Hidden sizes of 2, 9, 45 and 65 64-column steps: the one-token kernel's four warps each take two
# of the general kernel's eight step ranges, some partial or empty.
@pytest.mark.parametrize("hidden,inter", [(128, 128), (576, 64), (2880, 192), (4160, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_token_call_equals_the_same_token_in_a_larger_call(dtype, bias, hidden, inter):
    """A one-token call (the decode step, which CUDA serves with its own gate_up kernel on the wide
    kernel's shapes) computes each row exactly as a call of several tokens does, bit for bit; the
    profiler shows that the two calls took the two kernels."""
    require("cuda", "expert_gemm")
    prob = mxfp4_problem(3, 4, 12, hidden, inter, dtype, bias, seed=31)
    prob["slot_ids"][0, 1] = prob["slot_ids"][0, 0]  # a slot twice for one token
    prob["slot_ids"][1, 2] = -1  # a pair served elsewhere
    prob = on("cuda", prob)
    many, kernels_many = cuda_kernels_of(lambda: ft_ops.expert_gemm(**prob, activation=SWIGLUOAI))
    for t in range(3):
        one = {k: (v[t:t + 1] if k in ("hidden", "slot_ids", "weights") else v) for k, v in prob.items()}
        got, kernels_one = cuda_kernels_of(lambda: ft_ops.expert_gemm(**one, activation=SWIGLUOAI))
        assert torch.equal(got[0], many[t]), f"token {t}"
    if kernels_many is None or kernels_one is None:
        pytest.skip("torch.profiler recorded no CUDA kernels here: which gate_up kernel ran is unchecked")
    assert any("mxfp4_one_token_kernel" in n for n in kernels_one), kernels_one
    assert any("mxfp4_mma_wide_kernel" in n for n in kernels_many), kernels_many
    assert not any("mxfp4_one_token_kernel" in n for n in kernels_many), kernels_many


@pytest.mark.slow  # 3 s: a whole benchmark run
def test_the_gpt_oss_model_benchmark_decodes_through_transformers(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_gpt_oss_model.py on a tiny shape on the CPU: a GptOssForCausalLM whose
    experts are an MXFP4 host pool decodes the calibrated routing through generate(), with a cache
    smaller than its experts (misses) and with every expert (the reference)."""
    require("cpu", "expert_gemm")
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_gpt_oss_model.py")
    spec = importlib.util.spec_from_file_location("bench_gpt_oss_model", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(os.path.dirname(path))
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--layers", "3", "--experts", "8", "--top-k", "2", "--hidden", "128",
                       "--expert-intermediate", "64", "--vocab", "32768", "--caches", "0.00025,all",
                       "--decode-tokens", "5", "--device", "cpu"]) == 0
    report = json.load(open(tmp_path / "gpt_oss_model.json"))
    small, every = report["rows"]
    assert small["slots"] < every["slots"] == 3 * 8
    assert 0 <= small["eager_hit_rate"] < every["eager_hit_rate"] <= 1
    assert small["eager_tok_s"] > 0 and small["eager_vs_every_expert"] > 0
    assert "GPT-OSS-120B-shaped model" in capsys.readouterr().out
