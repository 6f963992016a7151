"""Semantics of slot_lookup and dedup_and_admit (docs/ops.md), on every device with a kernel."""
import contextlib

import pytest
import torch

import ft_ops
from ft_ops.policies import (DUEL, DUEL_WORDS, HIT_DENSITY, LRU, OPPORTUNITY, duel_counters, duel_next, new_policy_state,
                             pack_estimates)
from ft_ops.testing import reference
from helpers import DEVICES, admit_and_copy, assert_state_equal, make_pool, require

pytestmark = pytest.mark.parametrize("device", DEVICES)


def ids_of(values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


def test_duplicates_admit_once_and_share_a_slot(device):
    require(device, "dedup_and_admit")
    pool = make_pool(2, 8, 8, device)
    ids = ids_of([[3, 5], [5, 3], [3, 1]], device)
    slot_ids, plan_e, plan_s, n = admit_and_copy(pool, 0, ids)
    assert int(n) == 3  # experts 3, 5, 1 once each
    # Most-routed first: 3 (three times), 5 (twice), 1; free slots in ascending order.
    assert plan_e.tolist()[:3] == [3, 5, 1]
    assert plan_s.tolist()[:3] == [0, 1, 2]
    assert plan_e.tolist()[3:] == [-1] * 3 and plan_s.tolist()[3:] == [-1] * 3
    assert slot_ids.dtype == torch.int32 and slot_ids.shape == ids.shape
    assert slot_ids.tolist() == [[0, 1], [1, 0], [0, 2]]
    assert pool.bytes_mismatches() == []
    assert int(pool.clock) == 1 and pool.last_use[:3].tolist() == [1, 1, 1]


def test_hits_refresh_last_use_and_copy_nothing(device):
    require(device, "dedup_and_admit")
    pool = make_pool(1, 8, 4, device)
    admit_and_copy(pool, 0, ids_of([0, 1, 2], device))
    slot_ids, _, _, n = admit_and_copy(pool, 0, ids_of([2, 0], device))
    assert int(n) == 0 and slot_ids.tolist() == [2, 0]
    assert pool.last_use.tolist() == [2, 1, 2, 0]


def test_victims_are_least_recently_used_and_never_used_in_the_same_call(device):
    require(device, "dedup_and_admit")
    pool = make_pool(1, 8, 3, device)
    admit_and_copy(pool, 0, ids_of([0], device))  # slot 0 @1
    admit_and_copy(pool, 0, ids_of([1], device))  # slot 1 @2
    admit_and_copy(pool, 0, ids_of([2], device))  # slot 2 @3
    # 0 is a hit (refreshed to 4); the single miss 7 must take slot 1 (oldest among others).
    slot_ids, plan_e, plan_s, n = admit_and_copy(pool, 0, ids_of([0, 7], device))
    assert slot_ids.tolist() == [0, 1] and int(n) == 1 and plan_s.tolist()[0] == 1
    assert int(pool.slot_of[0, 1]) == -1  # the victim's old owner lost its slot
    # Three misses, but only the two slots not used by this call can be victims.
    slot_ids, _, _, n = admit_and_copy(pool, 0, ids_of([7, 3, 4, 5], device))
    assert int(n) == 2
    assert slot_ids.tolist()[0] == 1  # 7 is a hit
    assert sorted(s for s in slot_ids.tolist()[1:] if s >= 0) == [0, 2]
    assert slot_ids.tolist().count(-1) == 1
    assert reference.check_pool_invariants(pool.slot_of.cpu(), pool.owner_of.cpu()) == []
    assert pool.bytes_mismatches() == []


def test_protected_range_is_never_a_victim(device):
    require(device, "dedup_and_admit")
    pool = make_pool(1, 16, 8, device)
    slot_ids, _, plan_s, n = admit_and_copy(pool, 0, ids_of(list(range(6)), device), lo=2, hi=6)
    assert int(n) == 4  # only slots 0, 1, 6, 7 are eligible
    assert sorted(plan_s.tolist()[:4]) == [0, 1, 6, 7]
    assert slot_ids.tolist().count(-1) == 2


@pytest.mark.parametrize("fraction,admitted", [(1.0, 5), (0.5, 3), (0.3, 2), (0.0, 0)])
def test_fetch_fraction_leaves_misses_at_minus_one(device, fraction, admitted):
    require(device, "dedup_and_admit")
    pool = make_pool(1, 16, 16, device)
    ids = ids_of([[9, 4], [4, 1], [12, 4], [9, 7]], device)  # counts: 4:3, 9:2, then 1, 7, 12
    slot_ids, plan_e, _, n = admit_and_copy(pool, 0, ids, fetch_fraction=fraction)
    assert int(n) == admitted  # F = floor(5 * fraction + 0.5)
    assert plan_e.tolist()[:admitted] == [4, 9, 1, 7, 12][:admitted]
    flat = slot_ids.flatten().tolist()
    assert sum(s < 0 for s in flat) == sum(e not in [4, 9, 1, 7, 12][:admitted] for e in ids.flatten().tolist())


def test_pool_with_too_few_victims_admits_what_it_can(device):
    require(device, "dedup_and_admit")
    pool = make_pool(1, 32, 4, device)
    slot_ids, _, _, n = admit_and_copy(pool, 0, ids_of(list(range(10)), device))
    assert int(n) == 4
    assert sorted(slot_ids.tolist())[:6] == [-1] * 6
    assert reference.check_pool_invariants(pool.slot_of.cpu(), pool.owner_of.cpu()) == []


def test_eviction_across_layers_keeps_the_bijection(device):
    require(device, "dedup_and_admit")
    pool = make_pool(3, 4, 4, device)
    admit_and_copy(pool, 0, ids_of([0, 1, 2, 3], device))
    admit_and_copy(pool, 2, ids_of([3, 2], device))  # evicts layer 0's experts 0 and 1
    assert pool.slot_of[0].tolist() == [-1, -1, 2, 3]
    # Equal counts: the lower expert id is admitted first and takes the older victim.
    assert pool.slot_of[2].tolist() == [-1, -1, 0, 1]
    assert pool.owner_of.tolist() == [2 * 4 + 2, 2 * 4 + 3, 2, 3]
    assert pool.bytes_mismatches() == []


def test_int32_ids_and_empty_routing(device):
    require(device, "dedup_and_admit")
    pool = make_pool(1, 8, 8, device)
    slot_ids, plan_e, _, n = admit_and_copy(pool, 0, ids_of([[1, 2]], device, torch.int32))
    assert slot_ids.tolist() == [[0, 1]]
    slot_ids, plan_e, _, n = admit_and_copy(pool, 0, ids_of([], device).reshape(0, 2))
    assert slot_ids.shape == (0, 2) and plan_e.shape == (0,) and int(n) == 0
    assert int(pool.clock) == 2


def test_matches_reference_on_random_routing(device):
    require(device, "dedup_and_admit")
    gen = torch.Generator().manual_seed(1)
    pool = make_pool(4, 16, 24, device)
    ref = pool.clone()
    for step in range(60):
        layer = int(torch.randint(4, (1,), generator=gen))
        ids = torch.randint(16, (int(torch.randint(1, 6, (1,), generator=gen)), 4), generator=gen)
        frac = [1.0, 0.5, 0.25, 0.0][step % 4]
        lo = int(torch.randint(24, (1,), generator=gen))
        hi = min(24, lo + int(torch.randint(8, (1,), generator=gen)))
        got = ft_ops.dedup_and_admit(*pool.state, layer, ids.to(device), frac, lo, hi)
        want = reference.dedup_and_admit(*ref.state, layer, ids, frac, lo, hi)
        for g, w in zip(got, want):
            assert torch.equal(g.cpu(), w.cpu())
        assert_state_equal(pool, ref)


def test_slot_lookup(device):
    require(device, "slot_lookup")
    pool = make_pool(2, 8, 8, device)
    admit_and_copy(pool, 1, ids_of([3, 6], device))
    ids = ids_of([[3, 0], [6, 3]], device)
    got = ft_ops.slot_lookup(pool.slot_of, 1, ids)
    assert got.dtype == torch.int32 and got.tolist() == [[0, -1], [1, 0]]
    assert ft_ops.slot_lookup(pool.slot_of, 0, ids).tolist() == [[-1, -1], [-1, -1]]
    assert torch.equal(got.cpu(), reference.slot_lookup(pool.slot_of.cpu(), 1, ids.cpu()))


def test_stale_hit_after_layer_stream_is_a_miss_and_reload(device):
    """A decode loads layer-0 experts; streaming layer 1 overwrites every slot; layer 0 routed to the
    same experts again must miss and reload its own bytes, never read layer 1's."""
    require(device, "async_layer_copy")
    E = 8
    pool = make_pool(2, E, E, device)
    admit_and_copy(pool, 0, ids_of([1, 4, 6], device))
    ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(1), 1, 0, False)
    assert pool.slot_of[0].tolist() == [-1] * E  # layer 0 lost every slot
    assert ft_ops.slot_lookup(pool.slot_of, 0, ids_of([1, 4, 6], device)).tolist() == [-1, -1, -1]
    slot_ids, plan_e, plan_s, n = admit_and_copy(pool, 0, ids_of([1, 4, 6], device))
    assert int(n) == 3 and (slot_ids >= 0).all()
    for bank, host in zip(pool.banks, pool.host):
        for e, s in zip([1, 4, 6], slot_ids.tolist()):
            assert torch.equal(bank[s].cpu(), host[0, e]), "bank holds another layer's bytes"
    assert pool.bytes_mismatches() == []


def test_stale_hit_with_skip_resident(device):
    require(device, "async_layer_copy")
    E = 8
    pool = make_pool(2, E, 2 * E, device)
    admit_and_copy(pool, 0, ids_of([1, 4], device))  # slots 0, 1
    admit_and_copy(pool, 1, ids_of([2], device))  # slot 2
    # Stream layer 1 into region [E, 2E) with skip_resident: expert 2 stays in slot 2.
    ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(1), 1, E, True)
    assert pool.slot_of[1].tolist() == [E + 0, E + 1, 2] + [E + e for e in range(3, E)]
    assert pool.slot_of[0].tolist()[1] == 0 and pool.slot_of[0].tolist()[4] == 1  # untouched
    # Now stream layer 1 into region [0, E): layer 0's slots are overwritten.
    ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(1), 1, 0, True)
    assert pool.slot_of[0].tolist() == [-1] * E
    slot_ids, *_ = admit_and_copy(pool, 0, ids_of([1, 4], device))
    assert (slot_ids >= 0).all()
    assert pool.bytes_mismatches() == []
    assert reference.check_pool_invariants(pool.slot_of.cpu(), pool.owner_of.cpu()) == []


def test_stats_counts_calls_routed_distinct_and_admitted(device):
    require(device, "dedup_and_admit")
    pool = make_pool(2, 16, 6, device)
    ref = pool.clone()
    stats = torch.zeros(5, dtype=torch.int64, device=device)
    want = torch.zeros(5, dtype=torch.int64)
    gen = torch.Generator().manual_seed(9)
    for step in range(12):
        ids = torch.randint(16, (3, 2), generator=gen)
        frac = [1.0, 0.5][step % 2]
        ft_ops.dedup_and_admit(*pool.state, step % 2, ids.to(device), frac, 0, 0, stats)
        reference.dedup_and_admit(*ref.state, step % 2, ids, frac, 0, 0, want)
        assert stats.tolist() == want.tolist(), f"step {step}"
    assert stats[0] == 12 and stats[1] == 12 * 6 and stats[4] == 0
    assert 0 < stats[3] <= stats[2] <= stats[1]


def assert_call_matches(out, want, got, ref, got_policy, ref_policy, where):
    """A device call's outputs, pool state and policy state equal the reference's."""
    for name, g, w in zip(("slot_ids", "copy_experts", "copy_slots", "num_copies"), out, want):
        assert torch.equal(g.cpu(), w), f"{name} differs ({where})"
    for name, g, w in zip(("slot_of", "owner_of", "last_use", "clock"), got, ref):
        assert torch.equal(g.cpu(), w), f"{name} differs ({where})"
    if ref_policy is not None:
        assert torch.equal(got_policy.cpu(), ref_policy), f"policy_state differs ({where})"


def skip_large_duel_pools_on_the_cpu(device, policy, slots):
    """The CPU kernel keys pools of every size alike (hit density's runs cover its large pools);
    the CUDA kernels differ by pool size, so CUDA runs Duel at every size."""
    if device == "cpu" and policy == DUEL and slots > 4097:
        pytest.skip("Duel on the CPU: the smaller pools cover its one kernel")


def random_policy_state(policy, layers, experts, slots, clock, gen):
    """Hit density's state with every pair's clock and estimates random (many distinct keys, some
    ties), the slots' mirrors random too, and Duel's words random (random_duel_words); None for the
    other policies."""
    state = new_policy_state(policy, layers, experts, slots, "cpu")
    if state is None:
        return None
    pairs = layers * experts
    state[:pairs] = torch.randint(0, int(clock), (pairs,), generator=gen) * (torch.rand(pairs, generator=gen) < 0.7)
    b = (torch.rand(pairs + slots, generator=gen) * 8).floor() / 8  # eight values: ties
    d = 1 + torch.rand(pairs + slots, generator=gen) * 80
    state[pairs:2 * pairs + slots] = torch.tensor([pack_estimates(x, y) for x, y in zip(b.tolist(), d.tolist())])
    if policy == DUEL:
        state[-DUEL_WORDS:] = random_duel_words(gen)
    return state


DUEL_MODES = ("lru", "density", "zero")


def random_duel_words(gen, mode: str = "lru") -> torch.Tensor:
    """Duel's words as two shadows might have left them (counters with routed above distinct, the
    latest in either copy with the other one call behind, a score in [-2, 2), and either no shadow
    call since the last or one whose hits move it), drawn until the next call takes LRU's keys
    (`mode` "lru") or hit density's ("density"); "zero": no shadow call yet and a score of exactly
    0, which takes hit density's."""
    if mode == "zero":
        return torch.zeros(DUEL_WORDS, dtype=torch.int64)

    def counters(calls, admitted):
        return [calls, 8 * calls, 4 * calls, min(admitted, 4 * calls)]

    while True:
        calls = int(torch.randint(1, 50, (1,), generator=gen))
        lru_admitted, density_admitted = (int(x) for x in torch.randint(0, 4 * calls, (2,), generator=gen))
        lru, density = counters(calls, lru_admitted), counters(calls, density_admitted)
        behind = counters(calls - 1, lru_admitted) + counters(calls - 1, density_admitted)
        replays = calls + 2 * int(torch.randint(0, 3, (1,), generator=gen))  # the latest copy: replays % 2
        score = float(torch.rand(1, generator=gen)) * 4 - 2
        seen_calls = calls - int(torch.randint(0, 2, (1,), generator=gen))
        seen = [seen_calls, lru[2] - lru[3] - int(torch.randint(0, 3, (1,), generator=gen)),
                density[2] - density[3] - int(torch.randint(0, 3, (1,), generator=gen))]
        score_bits = torch.tensor([score], dtype=torch.float64).view(torch.int64).item()
        even, odd = (behind, lru + density) if replays % 2 else (lru + density, behind)
        words = even + [score_bits] + seen + odd + [replays]
        if duel_next(words)[1] == (mode == "lru"):
            return torch.tensor(words, dtype=torch.int64)


def refresh_duel_words(policy, ref_policy, got_policy, gen, call: int) -> None:
    """New Duel words in both copies before a Duel test's call: its calls take LRU's keys, hit
    density's, and hit density's from a zero score, in turn."""
    if policy == DUEL:
        words = random_duel_words(gen, DUEL_MODES[call % len(DUEL_MODES)])
        ref_policy[-DUEL_WORDS:] = words
        got_policy[-DUEL_WORDS:] = words.to(got_policy.device)


# The largest pools take seconds on the CPU: in the slow set there (pytest -m slow, which CI runs).
LARGE = pytest.mark.slow


@pytest.mark.parametrize("policy", [LRU, OPPORTUNITY, HIT_DENSITY, DUEL])
@pytest.mark.parametrize("slots", [40, 1024, 1025, pytest.param(4096, marks=LARGE), pytest.param(4097, marks=LARGE),
                                   pytest.param(8192, marks=LARGE), pytest.param(8193, marks=LARGE)])
def test_victim_order_in_full_aged_pools(device, slots, policy):
    """Every slot owned, stamps spread over a few values (many ties, so victims cross several
    levels), a protected range, many misses: the maps and the plan match the reference. The
    sizes straddle the CUDA kernels' limits (1,024, 4,096 and 8,192 slots); trial 3 has stamps
    more than 2^32 calls apart (the CUDA kernel's 32-bit keys do not hold them), and in trial 4
    the clock crosses the last call whose keys fit 32 bits (now + layers < 2^32 - 1)."""
    require(device, "dedup_and_admit")
    skip_large_duel_pools_on_the_cpu(device, policy, slots)
    gen = torch.Generator().manual_seed(slots)
    layers, experts = -(-2 * slots // 256), 256
    for trial in range(5):
        owners = torch.randperm(layers * experts, generator=gen)[:slots].int()
        slot_of = torch.full((layers, experts), -1, dtype=torch.int32)
        slot_of.view(-1)[owners.long()] = torch.arange(slots, dtype=torch.int32)
        last_use = torch.randint(0, 6 + 40 * trial, (slots,), generator=gen)
        if trial == 3:
            epochs = torch.tensor([0, 1 << 32, (1 << 32) + 1, 3 << 32])
            last_use = last_use + epochs[torch.randint(4, (slots,), generator=gen)]
        if trial == 4:
            last_use = (1 << 32) - layers - 4 - torch.randint(0, 3 * layers, (slots,), generator=gen)
        last_use[torch.randperm(slots, generator=gen)[: slots // 8]] = 0  # a few free-stamped slots
        if policy != LRU:
            last_use[torch.randperm(slots, generator=gen)[: slots // 8]] = 1  # a few streamed rows
        clock = torch.tensor([last_use.max() + 1])
        policy_state = random_policy_state(policy, layers, experts, slots, clock, gen)
        state = [slot_of, owners, last_use, clock]
        ref = [t.clone() for t in state]
        got = [t.clone().to(device) for t in state]
        ref_policy = policy_state.clone() if policy_state is not None else None
        got_policy = policy_state.clone().to(device) if policy_state is not None else None
        for step in range(4):
            layer = int(torch.randint(layers, (1,), generator=gen))
            k = [8, 64, 256, 512][step]
            ids = torch.randint(experts, (k,), generator=gen)
            frac = [1.0, 0.5, 1.0, 0.75][step]
            lo = int(torch.randint(slots, (1,), generator=gen))
            hi = min(slots, lo + int(torch.randint(2 * experts, (1,), generator=gen)))
            refresh_duel_words(policy, ref_policy, got_policy, gen, 4 * trial + step)
            out = ft_ops.dedup_and_admit(*got, layer, ids.to(device), frac, lo, hi, None, policy,
                                         policy_state=got_policy)
            want = reference.dedup_and_admit(*ref, layer, ids, frac, lo, hi, None, policy, policy_state=ref_policy)
            assert_call_matches(out, want, got, ref, got_policy, ref_policy, f"trial {trial}, step {step}")


def aged_full_pool(layers, experts, slots, policy, gen):
    """Every slot owned by a random pair, stamps spread over a few dozen calls with some free
    (0) and, beyond LRU, some streamed (1) rows; the clock one past the newest stamp."""
    owners = torch.randperm(layers * experts, generator=gen)[:slots].int()
    slot_of = torch.full((layers, experts), -1, dtype=torch.int32)
    slot_of.view(-1)[owners.long()] = torch.arange(slots, dtype=torch.int32)
    last_use = 2 + torch.randint(0, 40, (slots,), generator=gen)
    last_use[torch.randperm(slots, generator=gen)[: slots // 8]] = 0
    if policy != LRU:
        last_use[torch.randperm(slots, generator=gen)[: slots // 8]] = 1
    return [slot_of, owners, last_use, torch.tensor([int(last_use.max()) + 1])]


def check_calls_against_reference(device, policy, layers, experts, slots, calls, seed):
    """Runs `calls` (k ids, share of them routed to resident experts, fetch fraction) on an aged
    full pool on `device` and in the reference: outputs, maps and policy state equal after each."""
    gen = torch.Generator().manual_seed(seed)
    state = aged_full_pool(layers, experts, slots, policy, gen)
    policy_state = random_policy_state(policy, layers, experts, slots, state[3], gen)
    got = [t.clone().to(device) for t in state]
    got_policy = policy_state.clone().to(device) if policy_state is not None else None
    for step, (k, resident_share, frac) in enumerate(calls):
        layer = int(torch.randint(layers, (1,), generator=gen))
        resident = (state[0][layer] >= 0).nonzero().flatten()
        hits = resident[torch.randint(len(resident), (k,), generator=gen)]
        ids = torch.where(torch.rand(k, generator=gen) < resident_share, hits, torch.randint(experts, (k,), generator=gen))
        refresh_duel_words(policy, policy_state, got_policy, gen, step)
        out = ft_ops.dedup_and_admit(*got, layer, ids.to(device), frac, 0, 0, None, policy, policy_state=got_policy)
        want = reference.dedup_and_admit(*state, layer, ids, frac, 0, 0, None, policy, policy_state=policy_state)
        assert_call_matches(out, want, got, state, got_policy, policy_state, f"step {step}")


@pytest.mark.parametrize("policy", [LRU, OPPORTUNITY, HIT_DENSITY, DUEL])
@pytest.mark.parametrize("slots", [40, 1024, 4096, pytest.param(8192, marks=LARGE), pytest.param(8193, marks=LARGE)])
def test_more_experts_per_layer_than_threads_match_the_reference(device, slots, policy):
    """1,500 experts a layer: more than any admission block has threads (the loop that copies the
    map and computes hit density's estimates takes several passes) and more than the decode
    kernel's first chunk of the map (256 entries). Decode-sized calls (8, 32 ids) and larger ones
    (64, 300), some admitting nothing (fraction 0), on pools of every kernel's size."""
    require(device, "dedup_and_admit")
    skip_large_duel_pools_on_the_cpu(device, policy, slots)
    experts = 1500
    layers = -(-2 * slots // experts)
    calls = [(8, 0.5, 1.0), (32, 0.5, 0.0), (64, 0.5, 0.5), (300, 0.3, 1.0), (8, 0.9, 0.0), (32, 0.2, 1.0)]
    check_calls_against_reference(device, policy, layers, experts, slots, calls, seed=slots)


@pytest.mark.parametrize("slots", [40, 1024, 1025, 4096, pytest.param(8192, marks=LARGE),
                                   pytest.param(8193, marks=LARGE)])
def test_duel_calls_replayed_in_their_shadows_match_the_reference(device, slots):
    """Duel's calls with its shadow caches (dedup_and_admit's shadows: on CUDA the pool's block and
    the two shadows' in one launch, on a side stream here): the pool's outputs and state, both
    shadows' maps and the hit-density shadow's state, and the Duel words the shadows count into,
    equal the reference's (the pool's call, then each shadow's) after every call. The three caches
    start as different aged full pools, so each takes its own victims; decode-sized calls and
    larger ones, on pools of every kernel's size, with the pool's counters or without (the shadows
    count their distinct experts either way), int64 and int32 ids, and a protected range and a
    fetch fraction that bind the pool's call only; a call of no ids replays nothing."""
    require(device, "dedup_and_admit")
    from ft_ops.shadow_caches import ShadowCaches

    gen = torch.Generator().manual_seed(slots + 7)
    layers, experts = -(-2 * slots // 256), 256
    pool = aged_full_pool(layers, experts, slots, DUEL, gen)
    policy_state = random_policy_state(DUEL, layers, experts, slots, pool[3], gen)
    shadows = ShadowCaches(layers, experts, slots, "cpu", policy_state)
    for maps, policy in ((shadows.lru, LRU), (shadows.density, HIT_DENSITY)):
        for t, aged in zip(maps, aged_full_pool(layers, experts, slots, policy, gen)):
            t.copy_(aged)
    shadows.density_state.copy_(random_policy_state(HIT_DENSITY, layers, experts, slots, shadows.density[3], gen))
    ref = [*pool, policy_state, *shadows.tensors]
    got = [t.clone().to(device) for t in ref]
    names = ["slot_of", "owner_of", "last_use", "clock", "policy_state"] + [
        f"{which} shadow's {name}" for which in ("LRU", "hit density")
        for name in ("slot_of", "owner_of", "last_use", "clock")] + ["hit density shadow's state"]
    first_words = policy_state[-DUEL_WORDS:].tolist()
    stream = torch.cuda.Stream() if device == "cuda" else None
    calls = [(8, 0.5, 1.0), (2, 0.9, 1.0), (32, 0.3, 0.5), (0, 0.0, 1.0), (64, 0.5, 1.0), (300, 0.3, 1.0),
             (8, 1.0, 1.0), (8, 0.0, 0.0), (64, 0.2, 0.75), (300, 0.5, 1.0)]
    ref_stats, got_stats = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64, device=device)
    for step, (k, resident_share, frac) in enumerate(calls):
        counted = step % 2 == 1
        id_dtype = torch.int32 if step % 3 == 2 else torch.int64
        lo = int(torch.randint(slots, (1,), generator=gen)) if step >= 4 else 0
        hi = min(slots, lo + int(torch.randint(64, (1,), generator=gen))) if step >= 4 else 0
        layer = int(torch.randint(layers, (1,), generator=gen))
        resident = (ref[0][layer] >= 0).nonzero().flatten()
        hits = resident[torch.randint(len(resident), (k,), generator=gen)]
        ids = torch.where(torch.rand(k, generator=gen) < resident_share, hits,
                          torch.randint(experts, (k,), generator=gen))
        want = reference.dedup_and_admit(*ref[:4], layer, ids, frac, lo, hi, ref_stats if counted else None, DUEL,
                                         policy_state=ref[4], shadows=ref[5:])
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            out = ft_ops.dedup_and_admit(*got[:4], layer, ids.to(device, id_dtype), frac, lo, hi,
                                         got_stats if counted else None, DUEL, policy_state=got[4], shadows=got[5:])
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        for name, g, w in zip(("slot_ids", "copy_experts", "copy_slots", "num_copies"), out, want):
            assert torch.equal(g.cpu(), w), f"{name} differs (step {step})"
        for name, g, w in zip(names, got, ref):
            assert torch.equal(g.cpu(), w), f"{name} differs (step {step})"
        assert torch.equal(got_stats.cpu(), ref_stats), f"the pool's counters differ (step {step})"
    (lru, density), (lru_first, density_first) = duel_counters(ref[4][-DUEL_WORDS:]), duel_counters(first_words)
    # Every call but the one of no ids replayed.
    assert lru[0] - lru_first[0] == density[0] - density_first[0] == len(calls) - 1
    assert int(ref[4][-1]) - first_words[-1] == len(calls) - 1


@pytest.mark.parametrize("policy", [LRU, OPPORTUNITY, HIT_DENSITY, DUEL])
@pytest.mark.parametrize("slots", [40, pytest.param(4096, marks=LARGE), pytest.param(8192, marks=LARGE)])
def test_decode_calls_that_admit_nothing_match_the_reference(device, slots, policy):
    """Decode calls (8 ids) that admit nothing, with misses left to the CPU (fraction 0) or
    without a miss, between calls that admit: the CUDA decode kernel stops keying once it knows
    (each of its three shapes: 256 x 4, 512 x 8, 512 x 16 stamps), and the state after must be
    the reference's."""
    require(device, "dedup_and_admit")
    skip_large_duel_pools_on_the_cpu(device, policy, slots)
    calls = [(8, 0.5, 0.0), (8, 1.0, 1.0), (8, 0.5, 1.0), (8, 1.0, 0.0), (8, 0.0, 0.0), (8, 0.5, 0.5)] * 3
    check_calls_against_reference(device, policy, -(-2 * slots // 256), 256, slots, calls, seed=slots + 1)


@pytest.mark.parametrize("policy", [LRU, OPPORTUNITY, HIT_DENSITY, DUEL])
@pytest.mark.parametrize("slots", [40, 1024, 1025, 4096, 8192])
def test_hits_in_the_oldest_level_are_not_victims(device, slots, policy):
    """The CUDA decode kernel keys the stamps before it knows the call's hits (to find the least
    recently used level during the routing): hits in that level must still be left out, the
    members after them move up, and a level that runs short goes on to the next one. Under
    Opportunity the first level is streamed rows (stamp 1), the usual case after a prompt, and the
    second a stamp one turn of its layer older than the rest."""
    require(device, "dedup_and_admit")
    experts = 128
    # Slots 0-63 hold layer 0's experts 0-63; the rest hold other layers' experts; 64-127 of
    # layer 0 are absent (the misses).
    owners = torch.cat([torch.arange(64), torch.arange(max(0, slots - 64)) + experts]).int()[:slots]
    layers = 2 + slots // experts
    slot_of = torch.full((layers, experts), -1, dtype=torch.int32)
    slot_of.view(-1)[owners.long()] = torch.arange(slots, dtype=torch.int32)
    # Stamps of the first level, the second, the rest (= the clock).
    first, second, rest = (5, 7, 9) if policy == LRU else (1, 100 - layers, 100)
    cases = [
        # The first level is slots 0-9; experts 0 and 2 hit in it, three misses.
        ({range(0, 10): first}, [0, 2, 64, 65, 66], [1, 3, 4]),
        # The first level is slots 0-3 with two hits in it: two victims there, two in the next
        # level (slots 10-20), which holds a hit (expert 10) as well.
        ({range(0, 4): first, range(10, 21): second}, [0, 1, 10, 64, 65, 66, 67], [2, 3, 11, 12]),
    ]
    for stamps, routed, victims in cases:
        last_use = torch.full((slots,), rest, dtype=torch.int64)
        for where, stamp in stamps.items():
            last_use[where.start:where.stop] = stamp
        state = [slot_of.clone(), owners.clone(), last_use, torch.tensor([rest])]
        ids = torch.tensor(routed)
        got = [t.clone().to(device) for t in state]
        policy_state = new_policy_state(policy, layers, experts, slots, "cpu")
        got_policy = policy_state.clone().to(device) if policy_state is not None else None
        out = ft_ops.dedup_and_admit(*got, 0, ids.to(device), 1.0, 0, 0, None, policy, policy_state=got_policy)
        want = reference.dedup_and_admit(*state, 0, ids, 1.0, 0, 0, None, policy, policy_state=policy_state)
        if policy_state is not None:
            assert torch.equal(got_policy.cpu(), policy_state), f"policy_state differs for {routed}"
        assert want[2][: len(victims)].tolist() == victims  # the case is what it says
        for name, g, w in zip(("slot_ids", "copy_experts", "copy_slots", "num_copies"), out, want):
            assert torch.equal(g.cpu(), w), f"{name} differs for {routed}"
        for name, g, w in zip(("slot_of", "owner_of", "last_use", "clock"), got, state):
            assert torch.equal(g.cpu(), w), f"{name} differs for {routed}"


@pytest.mark.parametrize("policy", [LRU, HIT_DENSITY])
def test_a_call_of_more_distinct_experts_than_slots_leaves_exactly_the_excess_out(device, policy):
    """Every miss admitted while a slot can take it: a call of d distinct experts into S slots
    (no protected range, every miss fetched) leaves max(0, d - S) of them without a slot, whatever
    the pool held, as its hits cannot be victims. Duel's shadows count their hits by this
    (ft_ops/shadow_caches.py: ShadowCaches.unadmittable)."""
    require(device, "dedup_and_admit")
    import random

    layers, experts, slots = 3, 16, 6
    pool = [torch.full((layers, experts), -1, dtype=torch.int32), torch.full((slots,), -1, dtype=torch.int32),
            torch.zeros(slots, dtype=torch.int64), torch.full((1,), 1 if policy == HIT_DENSITY else 0, dtype=torch.int64)]
    pool = [t.to(device) for t in pool]
    state = new_policy_state(policy, layers, experts, slots, device) if policy == HIT_DENSITY else None
    rng = random.Random(policy)
    for call in range(200):
        ids = torch.tensor([rng.randrange(experts) for _ in range(rng.choice([2, 4, 8, 12]))])
        slot_ids = ft_ops.dedup_and_admit(*pool, rng.randrange(layers), ids.to(device), policy=policy,
                                          policy_state=state)[0].cpu()
        left = len(set(ids[slot_ids.reshape(-1) < 0].tolist()))
        assert left == max(0, len(set(ids.tolist())) - slots), f"call {call}"
