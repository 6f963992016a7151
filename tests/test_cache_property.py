"""Property-based run of the slot cache: random sequences of admissions, copy plans and layer
streams against the plain-Python CacheModel, checking after every step that the maps agree, the
bijection holds and every registered slot holds its owner's host bytes."""
import random
import struct

import pytest
import torch

import ft_ops
from ft_ops.testing.cache_model import CacheModel
from ft_ops.testing import reference
from ft_ops.policies import DUEL, DUEL_WORDS, HD_B0, HD_D0, HIT_DENSITY, LRU, OPPORTUNITY, new_policy_state, pack_estimates
from helpers import DEVICES, make_pool, require

# (layers, experts, slots): S = E, S = 2E, an odd size, a pool that fills past 1,024 slots
# (the CUDA kernel for 1,025-4,096 slots), and a large pool.
# The 3,000- and 16,384-slot pools take seconds on the CPU: in the slow set (pytest -m slow, which CI runs).
POOLS = [(4, 8, 8), (4, 8, 16), (3, 16, 41), pytest.param(40, 128, 3000, marks=pytest.mark.slow),
         pytest.param(2, 64, 16384, marks=pytest.mark.slow)]
# Steps per pool: a short run by default, the long one under the `slow` marker (CI runs both).
STEPS = {"cpu": 150, "cuda": 300}
SLOW_STEPS = {"cpu": 1500, "cuda": 3000}  # 7,500 on CPU and 15,000 on CUDA over the five pools


def random_routing(rng: random.Random, experts: int, hot: list) -> list:
    tokens, top_k = rng.randint(1, 8), rng.randint(1, min(4, experts))
    rows = []
    for _ in range(tokens):
        # Skewed routing with duplicates: most picks come from a small hot set.
        rows.append([rng.choice(hot) if rng.random() < 0.7 else rng.randrange(experts) for _ in range(top_k)])
    return rows


def add_shadow_hits(rng: random.Random, words: list) -> None:
    """Duel: most calls, both shadows replay one more call (1-4 distinct experts each, routed with
    repeats, some hit); the shadow that trails in the score hits more, so the score keeps crossing
    0 and the calls take LRU's keys and hit density's about equally often."""
    if rng.random() < 0.8:
        lru_hits_more = struct.unpack("<d", struct.pack("<q", words[8]))[0] <= 0
        for base, lead in ((0, lru_hits_more), (4, not lru_hits_more)):
            distinct = rng.randint(1, 4)
            routed = distinct + rng.randint(0, 3)
            hits = rng.randint((distinct + 1) // 2, distinct) if lead else rng.randint(0, distinct // 2)
            words[base:base + 4] = [words[base] + 1, words[base + 1] + routed, words[base + 2] + distinct,
                                    words[base + 3] + distinct - hits]


def model_policy_state(model: CacheModel) -> list:
    """The policy_state the kernels should hold for the model's hit-density state."""
    pairs = model.layers * model.experts
    clocks, words = [0] * pairs, [pack_estimates(HD_B0, HD_D0)] * pairs
    for (layer, e), (clock, b, d) in model.pair_state.items():
        clocks[layer * model.experts + e], words[layer * model.experts + e] = clock, pack_estimates(b, d)
    duel = model.duel_words if model.policy == DUEL else []
    return clocks + words + [pack_estimates(b, d) for b, d in model.estimates] + duel


def check_against_model(pool, model: CacheModel, where: str, state=None) -> None:
    if state is not None:
        assert state.tolist() == model_policy_state(model), f"policy_state diverged {where}"
    assert pool.slot_of.tolist() == model.slot_map(), f"slot_of diverged {where}"
    assert pool.owner_of.tolist() == model.owner_ids(), f"owner_of diverged {where}"
    assert pool.last_use.tolist() == model.last_use, f"last_use diverged {where}"
    assert int(pool.clock) == model.clock
    assert reference.check_pool_invariants(pool.slot_of.cpu(), pool.owner_of.cpu()) == []
    assert pool.bytes_mismatches() == [], f"a slot holds bytes that are not its owner's {where}"


POLICIES = [pytest.param(LRU, id="lru"), pytest.param(OPPORTUNITY, id="opportunity"),
            pytest.param(HIT_DENSITY, id="hitdensity"), pytest.param(DUEL, id="duel")]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers,experts,slots", POOLS)
def test_random_sequences_match_the_cache_model(device, layers, experts, slots, policy):
    if device == "cpu" and policy in (HIT_DENSITY, DUEL) and slots > 8192:
        pytest.skip("the model keys 16,384 slots in Python per call: the slow run covers it on the CPU")
    run_sequence(device, layers, experts, slots, STEPS[device], policy)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers,experts,slots", POOLS)
def test_long_random_sequences_match_the_cache_model(device, layers, experts, slots, policy):
    if device == "cpu" and policy == DUEL and slots > 8192:
        pytest.skip("the CPU kernel keys every pool size alike, and hit density's long run covers this pool on "
                    "the CPU; CUDA runs it (the scan kernel)")
    run_sequence(device, layers, experts, slots, SLOW_STEPS[device], policy)


def run_sequence(device, layers, experts, slots, steps, policy=LRU):
    require(device, "dedup_and_admit")
    require(device, "async_layer_copy")
    rng = random.Random(f"{layers}-{experts}-{slots}-{policy}")
    pool = make_pool(layers, experts, slots, device, seed=slots, row_shapes=((2, 8), (8,)))
    model = CacheModel(layers, experts, slots, policy)
    pool.clock.fill_(model.clock)  # opportunity's and hit density's clocks start at 1
    state = new_policy_state(policy, layers, experts, slots, device)
    hot = rng.sample(range(experts), max(1, experts // 4))
    for step in range(steps):
        layer = rng.randrange(layers)
        action = rng.random()
        where = f"at step {step}"
        if action < 0.65:
            routing = random_routing(rng, experts, hot)
            frac = rng.choice([1.0, 1.0, 0.5, 0.25, 0.0, 0.8])
            lo = rng.randrange(slots + 1) if rng.random() < 0.2 else 0
            hi = min(slots, lo + rng.randrange(experts + 1)) if lo else 0
            ids = torch.tensor(routing, device=device)
            if policy == DUEL:  # what two shadows might have added since the last call
                add_shadow_hits(rng, model.duel_words)
                state[-DUEL_WORDS:] = torch.tensor(model.duel_words, device=device)
            slot_ids, plan_e, plan_s, n = ft_ops.dedup_and_admit(*pool.state, layer, ids, frac, lo, hi, None, policy,
                                                                 policy_state=state)
            ft_ops.copy_experts(pool.banks, pool.host_rows(layer), plan_e, plan_s, n)
            want_ids, want_plan = model.admit(layer, [e for row in routing for e in row], frac, lo, hi)
            assert slot_ids.flatten().tolist() == want_ids, where
            got_plan = list(zip(plan_e.tolist(), plan_s.tolist()))[: int(n)]
            assert got_plan == want_plan, where
            assert all(x == (-1, -1) for x in list(zip(plan_e.tolist(), plan_s.tolist()))[int(n):])
        elif action < 0.9:
            first = rng.randrange(slots - experts + 1)
            skip = rng.random() < 0.6
            lo = rng.randrange(slots + 1) if rng.random() < 0.3 else 0
            hi = min(slots, lo + rng.randrange(2 * experts + 1)) if lo else 0
            sources = None
            if skip and rng.random() < 0.5:  # the host's hints: mostly right, some stale or wrong
                truth = pool.slot_of[layer].tolist()
                sources = torch.tensor([rng.choice([t, t, -1, rng.randrange(slots)]) for t in truth],
                                       dtype=torch.int32)
            ref_banks = [b.cpu().clone() for b in pool.banks]
            want_from_host = reference.async_layer_copy(*[t.cpu().clone() for t in pool.state], ref_banks,
                                                        [h[layer] for h in pool.host], layer, first, skip, lo, hi,
                                                        policy, sources)
            from_host = ft_ops.async_layer_copy(*pool.state, pool.banks, pool.host_rows(layer), layer, first, skip,
                                                lo, hi, policy, sources)
            want_map, host_rows = model.layer_copy(layer, first, skip, (lo, hi))
            assert pool.slot_of[layer].tolist() == want_map, where
            assert int(from_host) == int(want_from_host), where
            if sources is None:
                assert int(from_host) == len(host_rows), where
            assert pool.region_mismatches(layer, first) == [], f"the region is not the layer's {where}"
            for a, b in zip(pool.banks, ref_banks):  # never-written slots hold NaN in both
                torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True, msg=where)
        else:
            ids = torch.tensor(random_routing(rng, experts, hot), device=device)
            got = ft_ops.slot_lookup(pool.slot_of, layer, ids).flatten().tolist()
            assert got == [model.slot_of.get((layer, e), -1) for e in ids.flatten().tolist()], where
            continue
        check_against_model(pool, model, where, state)
