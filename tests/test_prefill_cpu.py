"""The CPU share of a streamed prompt (ft_ops/prefill_cpu.py): experts left out of a layer's copy
and computed on the CPU from the host pool give the resident stack's outputs, never become
resident, are counted, and the choice follows the rates."""
import warnings

import pytest
import torch

from ft_ops.moe import OffloadRuntime
from ft_ops.prefill_cpu import PrefillCpuShare
from ft_ops.rates import Rates
from helpers import DEVICES, require
from moe_helpers import E, K, L, layers_for, offloaded_stack, random_host_pool, random_routing, resident_stack

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def relative(a, b):
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def make_runtime(host, slots, device, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # S = E warns that streaming is serialized
        return OffloadRuntime(host, slots, device, rates=Rates(), **kw)


def prompt(runtime, modules, host, gen, tokens=48, prefetch=False, dtype=torch.float32):
    routing = random_routing(tokens, gen, hot=[1, 6])
    x = torch.randn(tokens, host.shape.hidden, generator=gen).to(dtype)
    device = runtime.pool.device
    if prefetch:
        runtime.begin_forward(tokens, K)
    inputs = []
    got = offloaded_stack(modules, x.to(device), routing, inputs)
    want = resident_stack(host, x, routing, inputs=inputs)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert relative(g, w) < TOL[dtype], f"layer {layer}"
    return routing


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_left_to_the_cpu_give_the_resident_outputs(device, prefetch, dtype):
    require(device, "expert_gemm")
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 is checked on CUDA; the CPU run covers float32")
    host = random_host_pool(device, dtype)
    runtime = make_runtime(host, 3 * E, device, prefill_cpu_experts=3)  # 2E in the regions, E outside
    modules = layers_for(runtime)
    gen = torch.Generator().manual_seed(5)
    routing = prompt(runtime, modules, host, gen, prefetch=prefetch, dtype=dtype)
    stream = runtime.stats()["stream"]
    assert stream["cpu_experts"] == 3 * L and stream["copied"] == L * (E - 3)
    on_cpu = sum(int((ids >= E - 3).sum()) for ids, _ in routing)  # the highest ids of an empty pool
    assert stream["cpu_pairs"] == on_cpu > 0
    assert stream["resident_rate"] == 0.0
    slot_of = runtime.pool.slot_of.cpu()
    assert (slot_of[:, E - 3:] == -1).all(), "an expert computed on the CPU became resident"
    owners = runtime.pool.owner_of.cpu()
    for slot in (owners >= 0).nonzero().flatten().tolist():
        layer, e = divmod(int(owners[slot]), E)
        assert all(torch.equal(b[slot].cpu(), h[layer, e].cpu()) for b, h in zip(runtime.pool.banks, host.banks))

    # The next prompt leaves only missing experts to the CPU: the kept ones are copied in the pool.
    runtime.counters.reset()
    kept = (slot_of >= 2 * E).sum().item()
    prompt(runtime, modules, host, gen, prefetch=prefetch, dtype=dtype)
    stream = runtime.stats()["stream"]
    assert stream["cpu_experts"] == 3 * L
    assert stream["copied"] == L * (E - 3) - kept
    # Decode afterwards admits as always.
    x1 = torch.randn(1, host.shape.hidden, generator=gen).to(dtype).to(device)
    ids = torch.tensor([[E - 1, 0]], device=device)
    w = torch.full((1, K), 0.5, device=device)
    want = resident_stack(host, x1.cpu(), [(ids.cpu(), w.cpu())])[0]
    assert relative(modules[0](x1, ids, w), want) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_no_cpu_share_without_a_link_or_when_off(device):
    require(device, "expert_gemm")
    host = random_host_pool(device)
    gen = torch.Generator().manual_seed(2)
    for option in ("auto", 0):
        runtime = make_runtime(host, 3 * E, device, prefill_cpu_experts=option)
        if device == "cpu" or option == 0:  # auto: tiny experts on a GPU never pay for the CPU either
            prompt(runtime, layers_for(runtime), host, gen)
            stream = runtime.stats()["stream"]
            assert stream["cpu_experts"] == 0 and stream["copied"] == L * E
    assert make_runtime(host, 3 * E, device, prefill_cpu_experts=0).prefill_cpu is None


@pytest.mark.parametrize("bad", [-1, 1.5, "half", True, None])
def test_bad_prefill_cpu_experts_is_refused(bad):
    host = random_host_pool("cpu")
    with pytest.raises(ValueError, match="prefill_cpu_experts must be 'auto'.*0 \\(off\\)"):
        make_runtime(host, 3 * E, "cpu", prefill_cpu_experts=bad)


def test_the_auto_count_follows_the_rates():
    """Qwen3-30B-A3B's layer (H 2048, I 768, bf16, 128 experts, top-8) with an H200's rates:
    an 8k prompt leaves a few experts a layer to the CPU, more when the CPU is faster, none when
    the GPU's work before the routing fills the copy (a long prompt's attention), at most half."""
    from ft_ops.slot_pool import ExpertShape

    class Host:  # only the shape is read by the choice
        shape = ExpertShape(48, 128, 2048, 768, torch.bfloat16, False)

    rates = Rates(link_bytes_per_s=54e9, gemm_flops_per_s=440e12, cpu_gemm_flops_per_s=3.5e12, cpu_expert_s=2e-4)
    share = PrefillCpuShare(Host, None, rates, torch.device("cuda"), "auto")
    share.open_pass(8192, 8)
    k = len(share.choose(0, list(range(128))))
    assert 4 <= k <= 16
    assert share.choose(0, list(range(128)))[0] == 128 - k, "the highest ids go to the CPU"
    share.rates = Rates(link_bytes_per_s=54e9, gemm_flops_per_s=440e12, cpu_gemm_flops_per_s=35e12, cpu_expert_s=0)
    assert len(share.choose(0, list(range(128)))) > k, "a faster CPU takes more"
    share.open_pass(256, 8)
    assert len(share.choose(0, list(range(10)))) == 5, "at most half the missing experts"
    share.rates = rates
    share.open_pass(8192, 8)
    # Measured: the GPU's work before the routing as long as the copy leaves the CPU no window.
    share.fixed_s = -128 * Host.shape.expert_bytes / rates.link_bytes_per_s
    assert share.choose(1, list(range(128))) == []
    share.open_pass(2048, 8)
    assert len(share.choose(0, list(range(128)))) > k, "shorter prompts: cheaper CPU experts"
    assert PrefillCpuShare(Host, None, rates, torch.device("cpu"), "auto").choose(0, list(range(128))) == []
