"""CUDA-only guarantees of the slot-cache ops: no host synchronization, and admission + copy
captured in a CUDA graph that replays correctly with new routing every step."""
import random

import pytest
import torch

import ft_ops
from ft_ops.testing.cache_model import CacheModel
from helpers import make_pool, require
from test_cache_property import check_against_model
from test_expert_gemm import EVERYTHING, random_problem

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _need_cuda():
    for op in ft_ops._extension.OP_NAMES:
        require("cuda", op)


def decode_op_calls():
    """Every decode-path op once a layer (admission under every policy, Duel's shadows included;
    copies, lookups, the three layer copies), expert_gemm on its decode-sized and grouped paths in
    every format (the one-token kernels of FP8 and MXFP4, a quantized prompt through its slot map),
    and dequantize_experts, as a function to run on the current stream."""
    from ft_ops import formats
    from ft_ops.slot_pool import ExpertShape, SlotPool
    from test_expert_gemm_fp8 import fp8_problem
    from test_mxfp4 import mxfp4_problem

    pool = make_pool(3, 16, 24, "cuda")
    ids = torch.randint(16, (4, 4), device="cuda")
    prob = random_problem(4, 4, 24, 64, 32, torch.bfloat16, "cuda", True, 5)
    grouped = random_problem(300, 8, 40, 128, 64, torch.bfloat16, "cuda", False, 6)
    policy_pools = [SlotPool(ExpertShape(3, 16, 8, 8, torch.bfloat16, False), 24, "cuda", eviction=name)
                    for name in ("hitdensity", "duel", "opportunity")]
    quantized = [fp8_problem(1, 8, 16, 256, 128, torch.bfloat16, "cuda", True, 7),
                 fp8_problem(5, 4, 16, 256, 128, torch.bfloat16, "cuda", False, 8)]
    quantized += [{k: None if t is None else t.to("cuda") for k, t in
                   mxfp4_problem(tokens, 4, 16, 128, 64, torch.bfloat16, True, seed).items()}
                  for tokens, seed in ((1, 9), (5, 10))]
    # A prompt of a quantized bank: the layer's experts dequantized through its slot map (the grouped path).
    prompt = fp8_problem(300, 8, 16, 128, 64, torch.bfloat16, "cuda", False, 11)
    slot_map = torch.arange(16, dtype=torch.int32, device="cuda")
    prompt["slot_ids"] = torch.randint(16, (300, 8), dtype=torch.int32, device="cuda")
    dequantize_slots = torch.tensor([3, -1, 7], dtype=torch.int32, device="cuda")

    def calls():
        for p in policy_pools:
            for layer in range(3):
                p_ids = torch.randint(16, (1, 4), device="cuda") if layer else ids
                ft_ops.dedup_and_admit(*p.state, layer, p_ids, 1.0, 0, 0, None, p.policy, policy_state=p.policy_state,
                                       shadows=p.shadows_of_call(p_ids))
                p.after_admission(p_ids)
        for q in quantized:
            ft_ops.expert_gemm(**q, activation="swigluoai")
        ft_ops.expert_gemm(**prompt, activation="silu", slot_map=slot_map)
        q = quantized[0]
        ft_ops.dequantize_experts(q["w13"], q["w13_scale"], dequantize_slots, 2, torch.bfloat16)
        q = quantized[2]
        ft_ops.dequantize_experts(q["w2"], q["w2_scale"], dequantize_slots, 1, torch.bfloat16)
        for layer in range(3):
            slot_ids, e, s, n = ft_ops.dedup_and_admit(*pool.state, layer, ids, 0.5, 0, 4)
            ft_ops.copy_experts(pool.banks, pool.host_rows(layer), e, s, n)
            ft_ops.slot_lookup(pool.slot_of, layer, ids)
            ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(layer), layer, 8, True)
            ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(layer), layer, 0, True, 0, 0, 0,
                                    torch.full((16,), -1, dtype=torch.int32))
            ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(layer), layer, 0, False)
        ft_ops.expert_gemm(**prob, activation="swigluoai")
        ft_ops.expert_gemm(**grouped, activation="silu")
        ft_ops.expert_gemm(**prob, activation=EVERYTHING)
        ft_ops.expert_gemm(**grouped, activation=EVERYTHING)
    return calls


def test_decode_ops_never_synchronize_with_the_host():
    calls = decode_op_calls()
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda.set_sync_debug_mode("error")
        try:
            calls()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()


def test_decode_ops_return_while_the_gpu_is_still_busy():
    """What set_sync_debug_mode cannot see: a raw cudaStreamSynchronize, cudaDeviceSynchronize or
    synchronous cudaMemcpy in a launcher. The ops are queued behind a long spin kernel on the legacy
    default stream (which a synchronous copy waits for); had any of them waited for the GPU, the
    event recorded after them would be complete when they return."""
    calls = decode_op_calls()
    stream = torch.cuda.default_stream()
    with torch.cuda.stream(stream):
        calls()  # allocations and first-call work, outside the checked part
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        torch.cuda._sleep(1 << 30)  # about half a second of spinning on an H100 / H200
        calls()
        done.record()
        still_busy = not done.query()
    torch.cuda.synchronize()
    assert still_busy, "an op waited for the GPU before returning"


@pytest.mark.parametrize("experts,slots", [(16, 16), (16, 40), (64, 16384)])
def test_captured_admission_and_copy_replay_with_new_routing(experts, slots):
    layers, tokens, top_k = 3, 4, 4
    rng = random.Random(slots)
    pool = make_pool(layers, experts, slots, "cuda", seed=1, row_shapes=((4, 8), (8,)))
    model = CacheModel(layers, experts, slots)
    static_ids = torch.zeros(layers, tokens, top_k, dtype=torch.int64, device="cuda")
    # One decode step over every layer: admission, then the copy plan, per layer.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        warm = pool.clone()  # warm-up on a copy: capture must not see first-use allocations
        for layer in range(layers):
            out = ft_ops.dedup_and_admit(*warm.state, layer, static_ids[layer], 1.0, 0, 0)
            ft_ops.copy_experts(warm.banks, warm.host_rows(layer), *out[1:])
        with torch.cuda.graph(graph, stream=stream):
            outputs = []
            for layer in range(layers):
                out = ft_ops.dedup_and_admit(*pool.state, layer, static_ids[layer], 1.0, 0, 0)
                ft_ops.copy_experts(pool.banks, pool.host_rows(layer), *out[1:])
                outputs.append(out[0])
    torch.cuda.synchronize()
    hot = list(range(experts // 3))
    for step in range(150):
        routing = [[[rng.choice(hot) if rng.random() < 0.6 else rng.randrange(experts) for _ in range(top_k)]
                    for _ in range(tokens)] for _ in range(layers)]
        static_ids.copy_(torch.tensor(routing))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(layers):
            want_ids, _ = model.admit(layer, [e for row in routing[layer] for e in row], 1.0, 0, 0)
            assert outputs[layer].flatten().tolist() == want_ids, f"step {step} layer {layer}"
        check_against_model(pool, model, f"after replay {step}")


def test_captured_decode_gemm_replays():
    prob = random_problem(4, 4, 24, 64, 32, torch.bfloat16, "cuda", False, 9)
    static = {k: (v.clone() if v is not None else None) for k, v in prob.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        ft_ops.expert_gemm(**static)
        with torch.cuda.graph(graph, stream=stream):
            out = ft_ops.expert_gemm(**static)
    torch.cuda.synchronize()
    for seed in range(5):
        fresh = random_problem(4, 4, 24, 64, 32, torch.bfloat16, "cuda", False, 100 + seed)
        for k in ("hidden", "slot_ids", "weights"):
            static[k].copy_(fresh[k])
        graph.replay()
        want = ft_ops.expert_gemm(**{**fresh, "w13": static["w13"], "w2": static["w2"]})
        torch.cuda.synchronize()
        assert torch.equal(out, want)
