"""ft_ops._C.mapped_view: a CUDA tensor over pinned host memory, which the decode path hands to
copy_experts so a compiled graph holds no CPU tensor."""
import pytest
import torch

import ft_ops
from ft_ops import _C
from ft_ops.slot_pool import ExpertShape, HostPool
from helpers import require


def test_cpu_build_says_what_it_needs():
    if ft_ops.has_kernel("copy_experts", "cuda"):
        pytest.skip("this build has CUDA kernels")
    with pytest.raises(RuntimeError, match="needs the CUDA build"):
        _C.mapped_view(torch.zeros(4), 0)


def test_mapped_rows_feed_copy_experts():
    require("cuda", "copy_experts")
    host = torch.randn(6, 5, 16).pin_memory()
    view = _C.mapped_view(host[2:], 0)  # a view that does not start at the allocation
    assert view.is_cuda and view.shape == (4, 5, 16)
    assert torch.equal(view.cpu(), host[2:])
    bank = torch.full((3, 5, 16), float("nan"), device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        experts = torch.tensor([3, 0, -1], dtype=torch.int32, device="cuda")
        slots = torch.tensor([0, 2, -1], dtype=torch.int32, device="cuda")
        ft_ops.copy_experts([bank], [view], experts, slots, torch.tensor([2], dtype=torch.int32, device="cuda"))
    stream.synchronize()
    assert torch.equal(bank[0].cpu(), host[5]) and torch.equal(bank[2].cpu(), host[2])
    assert bank[1].isnan().all()
    del host  # the view keeps the pinned memory alive
    assert view.sum().isfinite()


def test_pageable_host_pool_is_refused():
    require("cuda", "copy_experts")
    with pytest.raises(RuntimeError, match="pinned CPU tensor"):
        _C.mapped_view(torch.zeros(4), 0)
    host = HostPool.allocate(ExpertShape(1, 2, 8, 4, torch.float32, False), pin=False)
    with pytest.raises(ValueError, match="must be pinned"):
        host.device_layer_rows(0, torch.device("cuda"))


def test_pinned_host_pool_takes_exactly_its_size():
    """HostPool.allocate pins through cudaHostRegister, not torch's power-of-two pinned blocks: a
    bank takes its own bytes, is pinned, and feeds copy_experts through its mapped view."""
    if not ft_ops.cuda_kernels_available():
        pytest.skip("needs the CUDA kernels and a GPU")
    shape = ExpertShape(2, 3, 40, 24, torch.bfloat16, False)
    host = HostPool.allocate(shape, pin=True)
    for bank in host.banks:
        assert bank.is_pinned()
        assert bank.untyped_storage().nbytes() == bank.numel() * bank.element_size()
    host.w13.copy_(torch.randn(host.w13.shape))
    host.w2.copy_(torch.randn(host.w2.shape))
    banks = [torch.zeros(4, *b.shape[2:], dtype=b.dtype, device="cuda") for b in host.banks]
    plan = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    slots = torch.tensor([1, 3], dtype=torch.int32, device="cuda")
    ft_ops.copy_experts(banks, host.device_layer_rows(1, torch.device("cuda")), plan, slots,
                        torch.tensor([2], dtype=torch.int32, device="cuda"))
    assert torch.equal(banks[0][1].cpu(), host.w13[1, 2]) and torch.equal(banks[1][3].cpu(), host.w2[1, 0])
