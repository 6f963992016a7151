"""Semantics of copy_experts and async_layer_copy (docs/ops.md), on every device with a kernel."""
import contextlib

import pytest
import torch

import ft_ops
from ft_ops.testing import reference
from helpers import DEVICES, admit_and_copy, assert_state_equal, make_pool, require

pytestmark = pytest.mark.parametrize("device", DEVICES)


def test_copy_experts_copies_exactly_the_plan(device):
    require(device, "copy_experts")
    pool = make_pool(2, 8, 6, device)
    plan_e = torch.tensor([5, 2, 7, -1], dtype=torch.int32, device=device)
    plan_s = torch.tensor([4, 0, 2, -1], dtype=torch.int32, device=device)
    n = torch.tensor([2], dtype=torch.int32, device=device)
    before = [b.clone() for b in pool.banks]
    ft_ops.copy_experts(pool.banks, pool.host_rows(1), plan_e, plan_s, n)
    for bank, old, host in zip(pool.banks, before, pool.host):
        assert torch.equal(bank[4].cpu(), host[1, 5]) and torch.equal(bank[0].cpu(), host[1, 2])
        untouched = [1, 2, 3, 5]  # slot 2 is beyond num_copies
        assert torch.allclose(bank[untouched].cpu(), old[untouched].cpu(), equal_nan=True)


def test_copy_experts_with_a_bad_plan_raises_on_cpu_and_copies_nothing_bad_on_cuda(device):
    """Plan values outside the rows, and a count beyond the plan: the CPU refuses them; on CUDA,
    where checking them would need a host sync, the kernel copies the valid entries only and
    neither reads nor writes past the tensors (it wrote slot S + 3 and read plan entries past the
    end before)."""
    require(device, "copy_experts")
    pool = make_pool(2, 8, 6, device)
    plan_e = torch.tensor([5, 13, 2, 1], dtype=torch.int32, device=device)  # 13 >= E
    plan_s = torch.tensor([4, 1, 9, 3], dtype=torch.int32, device=device)   # 9 >= S
    n = torch.tensor([7], dtype=torch.int32, device=device)                 # more than the plan's 4
    if device == "cpu":
        with pytest.raises(RuntimeError):
            ft_ops.copy_experts(pool.banks, pool.host_rows(1), plan_e, plan_s, n)
        return
    before = [b.clone() for b in pool.banks]
    ft_ops.copy_experts(pool.banks, pool.host_rows(1), plan_e, plan_s, n)
    torch.cuda.synchronize()
    for bank, old, host in zip(pool.banks, before, pool.host):
        assert torch.equal(bank[4].cpu(), host[1, 5]) and torch.equal(bank[3].cpu(), host[1, 1])
        untouched = [0, 1, 2, 5]
        assert torch.allclose(bank[untouched].cpu(), old[untouched].cpu(), equal_nan=True)


def test_full_layer_copy_registers_every_expert(device):
    require(device, "async_layer_copy")
    E = 8
    pool = make_pool(3, E, 2 * E + 3, device)
    from_host = ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(2), 2, 3, False)
    assert from_host.dtype == torch.int64 and from_host.shape == () and int(from_host) == E
    assert pool.slot_of[2].tolist() == list(range(3, 3 + E))
    assert pool.owner_of.tolist()[3:3 + E] == [2 * E + e for e in range(E)]
    assert pool.last_use.tolist()[3:3 + E] == [1] * E and int(pool.clock) == 1
    assert pool.bytes_mismatches() == []


def test_region_reuse_invalidates_previous_owners(device):
    """Region A holds layer 0, region B layer 1; layer 2 into region A drops every layer-0 owner."""
    require(device, "async_layer_copy")
    E = 4
    pool = make_pool(3, E, 2 * E, device)
    for layer, first in [(0, 0), (1, E), (2, 0)]:
        ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(layer), layer, first, True)
    assert pool.slot_of[0].tolist() == [-1] * E
    assert pool.slot_of[1].tolist() == list(range(E, 2 * E))
    assert pool.slot_of[2].tolist() == list(range(E))
    assert pool.bytes_mismatches() == []


@pytest.mark.parametrize("hinted", [False, True])
def test_skip_resident_reads_only_missing_rows_from_the_host(device, hinted):
    """Resident rows are copied from their slots into the region and stay registered there; the
    missing rows come from the host. With row_sources (the host's view: right for experts 1 and 3,
    stale for 4 and 2, -1 for the rest) the region and the maps are the same."""
    require(device, "async_layer_copy")
    E = 6
    R = 2 * E  # the buffer region is [R, R + E)
    pool = make_pool(2, E, 3 * E, device)
    # Layer 1: expert 1 in slot 0 and expert 4 in slot 1 (outside the region), expert 3 in its own
    # target slot R+3, expert 0 inside the region but in R+5. Layer 0: expert 2 in R+2.
    placed = {(1, 1): 0, (1, 4): 1, (1, 3): R + 3, (1, 0): R + 5, (0, 2): R + 2}
    for (layer, e), s in placed.items():
        pool.slot_of[layer, e] = s
        pool.owner_of[s] = layer * E + e
        pool.last_use[s] = 1
        for bank, host in zip(pool.banks, pool.host):
            bank[s] = host[layer, e].to(device)
    pool.clock.fill_(1)
    # R+3's bytes are right, but poisoned they show whether the op copied the row again.
    for bank in pool.banks:
        bank[R + 3] = float("nan")
    sources = torch.tensor([-1, 0, 5, R + 3, 7, -1], dtype=torch.int32) if hinted else None
    from_host = ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(1), 1, R, True, 0, 0, 0, sources)
    # Experts 0, 2, 5 are missing; with hints, 4's stale hint is read again from the host.
    assert int(from_host) == (4 if hinted else 3)
    assert pool.slot_of[1].tolist() == [R + 0, 0, R + 2, R + 3, 1, R + 5]
    assert pool.slot_of[0, 2].item() == -1  # layer 0 lost its region slot
    # R+1 and R+4 hold copies of experts 1 and 4, which stay registered in slots 0 and 1.
    assert pool.owner_of[R + 1].item() == -1 and pool.owner_of[R + 4].item() == -1
    assert pool.last_use[[0, 1, R + 3]].tolist() == [2, 2, 2]  # resident experts count as used
    for bank, host in zip(pool.banks, pool.host):
        assert torch.isnan(bank[R + 3]).all(), "a row already in its target slot was copied again"
        for e in (0, 1, 2, 4, 5):
            assert torch.equal(bank[R + e].cpu(), host[1, e])
    assert reference.check_pool_invariants(pool.slot_of.cpu(), pool.owner_of.cpu()) == []


@pytest.mark.parametrize("stream", ["current", "default"])
def test_a_layer_of_many_runs_lands_whole_on_any_stream(device, stream):
    """Every other expert resident outside the region, the rest missing: dozens of host runs and
    device runs, which CUDA submits per stream as batches, except on the legacy default stream
    (the batch call refuses it) and under capture, where it copies run by run."""
    require(device, "async_layer_copy")
    if device == "cpu" and stream == "default":
        pytest.skip("streams are CUDA's")
    E = 40
    R = E  # resident experts sit in [0, E), the region is [R, R + E)
    pool = make_pool(2, E, 2 * E, device, seed=3)
    resident = list(range(1, E, 2))
    for i, e in enumerate(resident):
        pool.slot_of[1, e] = i
        pool.owner_of[i] = E + e
        pool.last_use[i] = 1
        for bank, host in zip(pool.banks, pool.host):
            bank[i] = host[1, e].to(device)
    pool.clock.fill_(1)
    sources = torch.full((E,), -1, dtype=torch.int32)
    sources[resident] = torch.arange(len(resident), dtype=torch.int32)
    on = torch.cuda.default_stream() if device == "cuda" and stream == "default" else None
    if on is not None:  # the pool was filled on the test's stream; torch's streams do not sync with the default one
        on.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(on) if on is not None else contextlib.nullcontext():
        from_host = ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(1), 1, R, True, 0, 0, 0, sources)
    if on is not None:
        torch.cuda.current_stream().wait_stream(on)
    assert int(from_host) == E - len(resident)
    for bank, host in zip(pool.banks, pool.host):
        assert torch.equal(bank[R:R + E].cpu(), host[1])
    assert reference.check_pool_invariants(pool.slot_of.cpu(), pool.owner_of.cpu()) == []


def test_row_sources_are_checked(device):
    require(device, "async_layer_copy")
    E = 4
    pool = make_pool(1, E, 2 * E, device)
    args = (*pool.state, pool.banks, pool.host_rows(0), 0, 0)
    with pytest.raises(RuntimeError, match="pass it with skip_resident=True"):
        ft_ops.async_layer_copy(*args, False, 0, 0, 0, torch.full((E,), -1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="CPU int32 tensor of 4 entries"):
        ft_ops.async_layer_copy(*args, True, 0, 0, 0, torch.full((E + 1,), -1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"row_sources\[2\] is 8"):
        ft_ops.async_layer_copy(*args, True, 0, 0, 0, torch.tensor([-1, 0, 2 * E, -1], dtype=torch.int32))
    assert int(pool.clock) == 0, "a refused call changed the pool"


def test_without_skip_resident_a_resident_copy_moves_into_the_region(device):
    require(device, "async_layer_copy")
    E = 4
    pool = make_pool(1, E, 2 * E, device)
    admit_and_copy(pool, 0, torch.tensor([2], device=device))  # slot 0
    ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(0), 0, E, False)
    assert pool.slot_of[0].tolist() == list(range(E, 2 * E))
    assert pool.owner_of.tolist()[0] == -1 and pool.last_use.tolist()[0] == 0
    assert reference.check_pool_invariants(pool.slot_of.cpu(), pool.owner_of.cpu()) == []


@pytest.mark.parametrize("skip", [False, True])
def test_matches_reference(device, skip):
    require(device, "async_layer_copy")
    gen = torch.Generator().manual_seed(3)
    E, S = 8, 20
    pool = make_pool(3, E, S, device)
    ref = pool.clone()
    ref.banks = [b.cpu() for b in ref.banks]
    for step in range(30):
        layer = int(torch.randint(3, (1,), generator=gen))
        if step % 2:
            ids = torch.randint(E, (3, 2), generator=gen)
            admit_and_copy(pool, layer, ids.to(device))
            out = reference.dedup_and_admit(*ref.state, layer, ids.to(ref.slot_of.device))
            reference.copy_experts(ref.banks, [h[layer] for h in ref.host], *out[1:])
        else:
            first = int(torch.randint(S - E + 1, (1,), generator=gen))
            got = ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(layer), layer, first, skip)
            want = reference.async_layer_copy(*ref.state, ref.banks, [h[layer] for h in ref.host], layer, first, skip)
            assert int(got) == int(want)
            assert pool.region_mismatches(layer, first) == []
        assert_state_equal(pool, ref)
        assert pool.bytes_mismatches() == []


def test_row_lengths_come_from_the_shapes_not_the_strides(device):
    """A one-slot bank that is a column slice ([1, 4] of a [1, 8] tensor: torch calls it contiguous,
    ignoring a size-1 dimension's stride) and banks with empty rows: both copies take a row's length
    from its shape. They took stride(0): 8 floats were read from 4-float host rows and written past
    the view, and empty rows crashed the CPU copy (a stranger's check of docs/ops.md)."""
    require(device, "copy_experts")
    require(device, "async_layer_copy")

    def host(t):
        return t.pin_memory() if device == "cuda" else t

    state = lambda: [torch.full((1, 1), -1, dtype=torch.int32, device=device),  # noqa: E731
                     torch.full((1,), -1, dtype=torch.int32, device=device),
                     torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)]
    one = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    # copy_experts: expert 1 of two into the one slot.
    parent = torch.zeros(1, 8, device=device)
    rows = host(torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]))
    ft_ops.copy_experts([parent[:, :4]], [rows], one(1), one(0), one(1))
    assert parent.cpu().tolist() == [[5.0, 6.0, 7.0, 8.0, 0.0, 0.0, 0.0, 0.0]]
    # async_layer_copy: a one-expert layer into a one-slot pool.
    parent = torch.zeros(1, 8, device=device)
    ft_ops.async_layer_copy(*state(), [parent[:, :4]], [rows[:1]], 0, 0, False)
    assert parent.cpu().tolist() == [[1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]]
    # A bank whose rows are empty beside one that is not: nothing to copy for it (on CUDA its host
    # rows are a device tensor, as the streamer's device-to-device sources are: an empty tensor
    # cannot be pinned).
    empty = torch.zeros(1, 0, device=device)
    bank = torch.zeros(1, 4, device=device)
    ft_ops.copy_experts([bank, torch.zeros(1, 0, device=device)], [rows[:1], empty], one(0), one(0), one(1))
    ft_ops.async_layer_copy(*state(), [bank, torch.zeros(1, 0, device=device)], [rows[1:], empty], 0, 0, False)
    assert bank.cpu().tolist() == [[5.0, 6.0, 7.0, 8.0]]
