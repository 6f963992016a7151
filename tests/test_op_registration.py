"""The registration triad for every op: torch.library.opcheck (schema, fake kernel, AOT dispatch
static and dynamic) and torch.compile(fullgraph=True) agreeing with eager."""
import pytest
import torch

import ft_ops
from ft_ops.activations import SWIGLUOAI, Activation, as_activation
from ft_ops.policies import DUEL, DUEL_WORDS, HIT_DENSITY, LRU, duel_counters, new_policy_state
from ft_ops.shadow_caches import ShadowCaches
from helpers import DEVICES, admit_and_copy, assert_state_equal, make_pool, require
from test_expert_gemm import random_problem, seed_of, relative_error

pytestmark = pytest.mark.parametrize("device", DEVICES)

INKLING2 = Activation("silu", gate_softcap=4.0, up_softcap=25.0)


def opcheck_host_rows(pool, layer):
    """A layer's host rows as opcheck can pass them: opcheck runs the op on clones of its inputs,
    and a clone of a pinned host tensor is pageable, which the CUDA copy kernels refuse; rows in
    device memory, which they take as well, clone as they are."""
    rows = pool.host_rows(layer)
    return [r.to(pool.slot_of.device) for r in rows] if pool.slot_of.is_cuda else rows


def warm_pool(device):
    pool = make_pool(3, 8, 16, device)
    admit_and_copy(pool, 0, torch.tensor([[1, 2], [2, 5]], device=device))
    admit_and_copy(pool, 1, torch.tensor([[0, 7]], device=device))
    return pool


def test_opcheck_slot_lookup(device):
    require(device, "slot_lookup")
    pool = warm_pool(device)
    ids = torch.tensor([[1, 2], [6, 5]], device=device)
    torch.library.opcheck(torch.ops.freetoken.slot_lookup.default, (pool.slot_of, 0, ids))


def test_opcheck_dedup_and_admit(device):
    require(device, "dedup_and_admit")
    pool = warm_pool(device)
    ids = torch.tensor([[1, 3], [6, 3]], device=device)
    torch.library.opcheck(torch.ops.freetoken.dedup_and_admit.default, (*pool.state, 0, ids, 0.5, 2, 4))
    stats = torch.zeros(5, dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.freetoken.dedup_and_admit.default, (*pool.state, 0, ids, 0.5, 2, 4, stats))
    state = new_policy_state(HIT_DENSITY, 3, 8, 16, device)  # hit density mutates its state too
    torch.library.opcheck(torch.ops.freetoken.dedup_and_admit.default,
                          (*pool.state, 0, ids, 1.0, 2, 4, stats, HIT_DENSITY, 0.0, 0.0, state))
    # Duel reads and writes its words (here its shadows have hit more under LRU: LRU's keys), and
    # a shadow's call adds to a view of them.
    duel = new_policy_state(DUEL, 3, 8, 16, device)
    duel[-DUEL_WORDS:-DUEL_WORDS + 8] = torch.tensor([3, 6, 5, 1, 3, 6, 5, 4], device=device)
    torch.library.opcheck(torch.ops.freetoken.dedup_and_admit.default,
                          (*pool.state, 0, ids, 1.0, 2, 4, stats, DUEL, 0.0, 0.0, duel))
    torch.library.opcheck(torch.ops.freetoken.dedup_and_admit.default,
                          (*pool.state, 0, ids, 1.0, 0, 0, duel[-DUEL_WORDS:-DUEL_WORDS + 4], LRU))
    # With its shadow caches, which the call replays in (and counts into its words).
    shadows = ShadowCaches(3, 8, 16, device, duel)
    torch.library.opcheck(torch.ops.freetoken.dedup_and_admit.default,
                          (*pool.state, 0, ids, 1.0, 2, 4, stats, DUEL, 0.0, 0.0, duel, list(shadows.tensors)))
    # More routed ids than experts: the copy plan holds one entry per expert (min(numel, E)).
    many = torch.tensor([[1, 3, 6, 0], [6, 3, 2, 7], [4, 1, 5, 3]], device=device)
    torch.library.opcheck(torch.ops.freetoken.dedup_and_admit.default, (*pool.state, 1, many, 1.0, 2, 4))


@pytest.mark.parametrize("policy", [HIT_DENSITY, DUEL], ids=["hitdensity", "duel"])
def test_compiled_stateful_admission_matches_eager(device, policy):
    """policy_state is mutated in place under torch.compile(fullgraph=True) as in eager; under Duel
    also by its shadow caches' replay of each call (their maps and the words they count into)."""
    require(device, "dedup_and_admit")
    torch._dynamo.reset()
    pool = make_pool(3, 8, 12, device)
    pool.clock.fill_(1)
    twin = pool.clone()
    state = new_policy_state(policy, 3, 8, 12, device)
    twin_state = state.clone()
    shadows = list(ShadowCaches(3, 8, 12, device, state).tensors) if policy == DUEL else None
    twin_shadows = [t.clone() for t in shadows] if policy == DUEL else None

    def admit(slot_of, owner_of, last_use, clock, policy_state, shadows, layer, ids):
        return ft_ops.dedup_and_admit(slot_of, owner_of, last_use, clock, layer, ids, 1.0, 0, 0, None, policy,
                                      policy_state=policy_state, shadows=shadows)

    compiled = torch.compile(admit, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        ids = torch.randint(8, (2, 2), generator=gen).to(device)
        got = compiled(*pool.state, state, shadows, step % 3, ids)
        want = admit(*twin.state, twin_state, twin_shadows, step % 3, ids)
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"step {step}"
        assert_state_equal(pool, twin)
        assert torch.equal(state, twin_state), f"policy_state differs at step {step}"
        if policy == DUEL:
            assert all(torch.equal(g, w) for g, w in zip(shadows, twin_shadows)), f"shadows differ at step {step}"
    if policy == DUEL:
        lru, density = duel_counters(state[-DUEL_WORDS:].tolist())
        assert lru[0] == density[0] == int(state[-1]) == 12  # every call replayed in the shadows


def test_opcheck_copy_experts(device):
    require(device, "copy_experts")
    pool = warm_pool(device)
    plan_e = torch.tensor([3, 4, -1], dtype=torch.int32, device=device)
    plan_s = torch.tensor([9, 10, -1], dtype=torch.int32, device=device)
    n = torch.tensor([2], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.freetoken.copy_experts.default,
                          (pool.banks, opcheck_host_rows(pool, 2), plan_e, plan_s, n))


def test_opcheck_async_layer_copy(device):
    require(device, "async_layer_copy")
    pool = warm_pool(device)
    experts = pool.slot_of.shape[1]
    sources = torch.full((experts,), -1, dtype=torch.int32)  # a host tensor: the host reads the hints
    sources[1] = 0  # a stale hint: read again from the host
    for skip, rows in ((False, None), (True, None), (True, sources)):
        torch.library.opcheck(torch.ops.freetoken.async_layer_copy.default,
                              (*pool.state, pool.banks, opcheck_host_rows(pool, 2), 2, 8, skip, 0, 0, 0, rows))


def test_opcheck_expert_gemm(device):
    require(device, "expert_gemm")
    prob = random_problem(5, 2, 6, 32, 16, torch.float32, device, True, seed_of("opcheck", device))
    op = torch.ops.freetoken.expert_gemm.default
    torch.library.opcheck(op, tuple(prob.values()) + ("silu",))
    # The activation's parameters positionally and by name (the schema's defaults fill the rest).
    torch.library.opcheck(op, tuple(prob.values()) + ("silu", 1.702, 1.5, 1.0, 0.9, 1.1))
    torch.library.opcheck(op, tuple(prob.values()) + ("gelu",), dict(limit=1.0, gate_softcap=0.8))
    torch.library.opcheck(op, tuple(prob.values()) + ("silu",), dict(limit=1.0, limit_after_act=True))
    ungated = random_problem(5, 2, 6, 32, 16, torch.float32, device, True, seed_of("opcheck ungated", device), gated=False)
    torch.library.opcheck(op, tuple(ungated.values()) + ("relu",), dict(gated=False))


@pytest.mark.parametrize("activation", ["silu", SWIGLUOAI, INKLING2, Activation("silu", limit=1.0, limit_after_act=True),
                                        "relu2"],
                         ids=["silu", "swigluoai", "softcapped", "limit-after-act", "ungated-relu2"])
def test_compiled_decode_step_matches_eager(device, activation):
    """Admission, copy plan and GEMM traced as one fullgraph: same maps, bytes and output, with a
    preset's name or an Activation (a constant of the graph) as the expert function."""
    require(device, "dedup_and_admit")
    require(device, "expert_gemm")
    torch._dynamo.reset()
    E, H, I = 8, 32, 16
    rows = 2 * I if as_activation(activation).gated else I  # ungated: w13 holds the up rows alone
    pool = make_pool(2, E, 12, device, row_shapes=((rows, H), (H, I)))
    twin = pool.clone()

    def step(slot_of, owner_of, last_use, clock, w13, w2, host13, host2, x, ids, weights):
        slot_ids, plan_e, plan_s, n = ft_ops.dedup_and_admit(slot_of, owner_of, last_use, clock, 1, ids, 1.0, 0, 0)
        ft_ops.copy_experts([w13, w2], [host13, host2], plan_e, plan_s, n)
        looked_up = ft_ops.slot_lookup(slot_of, 1, ids)
        return ft_ops.expert_gemm(x, slot_ids, weights, w13, w2, None, None, activation), looked_up

    compiled = torch.compile(step, fullgraph=True)
    gen = torch.Generator().manual_seed(seed_of("compiled decode step", device, str(activation)))
    for _ in range(3):
        ids = torch.randint(E, (3, 2), generator=gen).to(device)
        x = torch.randn(3, H, generator=gen).to(device)
        weights = torch.rand(3, 2, generator=gen).to(device)
        out_c, look_c = compiled(*pool.state, *pool.banks, *pool.host_rows(1), x, ids, weights)
        out_e, look_e = step(*twin.state, *twin.banks, *twin.host_rows(1), x, ids, weights)
        assert_state_equal(pool, twin)
        assert torch.equal(look_c, look_e)
        assert relative_error(out_c, out_e.double()) < 1e-5
        for a, b in zip(pool.banks, twin.banks):
            assert torch.allclose(a, b, equal_nan=True)


def test_compiled_layer_stream_matches_eager(device):
    require(device, "async_layer_copy")
    torch._dynamo.reset()
    pool = warm_pool(device)
    twin = pool.clone()

    sources = torch.full((pool.slot_of.shape[1],), -1, dtype=torch.int32)

    def stream(slot_of, owner_of, last_use, clock, b0, b1, h0, h1, rows):
        return ft_ops.async_layer_copy(slot_of, owner_of, last_use, clock, [b0, b1], [h0, h1], 2, 8, True, 0, 0, 0,
                                       rows)

    compiled = torch.compile(stream, fullgraph=True)
    got = compiled(*pool.state, *pool.banks, *pool.host_rows(2), sources)
    want = stream(*twin.state, *twin.banks, *twin.host_rows(2), sources)
    assert torch.equal(got, want)
    assert_state_equal(pool, twin)
    assert pool.bytes_mismatches() == []
