"""The offline eviction simulator (ft_ops/eviction.py): LRU is the runtime's rule (against the
plain-Python CacheModel), Belady bounds every policy, the cyclic pattern that starves LRU, and the
invariants every policy keeps (victims in ascending key order as the device takes them, every
routed expert resident after its call, one slot per pair)."""
import os
import random
import struct

import pytest

from ft_ops import eviction
from ft_ops.eviction import (Belady, HitDensity, KeyPolicy, LRU, Opportunity, Policy, STREAMED, policies, requests_from_calls,
                             requests_from_trace, simulate)
from ft_ops.testing.cache_model import CacheModel
from ft_ops.traces import Trace

RECOMMENDED = eviction.Duel  # the runtime's default (ft_ops.policies.DEFAULT_EVICTION)
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "routing", "byte_qwen3moe_8x32_top4.safetensors")
RANDOM_TRACE = os.path.join(os.path.dirname(__file__), "fixtures", "routing", "random_qwen3moe_3x16_top2.safetensors")


def random_calls(rng: random.Random, layers: int, experts: int, top_k: int, tokens: int, dups: bool = False):
    """Decode-like calls: per token, every layer in order; skewed picks with a repeat of the
    previous token's picks (duplicates within a call when `dups`)."""
    hot = {l: rng.sample(range(experts), max(1, experts // 4)) for l in range(layers)}
    prev = {l: [] for l in range(layers)}
    calls = []
    for _ in range(tokens):
        for l in range(layers):
            picks = []
            while len(picks) < top_k:
                r = rng.random()
                e = (rng.choice(prev[l]) if prev[l] and r < 0.4 else
                     rng.choice(hot[l]) if r < 0.8 else rng.randrange(experts))
                if dups or e not in picks:
                    picks.append(e)
            prev[l] = picks
            calls.append((l, picks))
    return calls


def with_streams(layers, experts, calls, every):
    """The calls with a streamed prompt (every expert of every layer) every `every` tokens."""
    out, flags = [], []
    for i, call in enumerate(calls):
        if i % (every * layers) == 0:
            for l in range(layers):
                out.append((l, list(range(experts))))
                flags.append(True)
        out.append(call)
        flags.append(False)
    return requests_from_calls(layers, experts, out, flags)


@pytest.mark.parametrize("layers,experts,top_k,slots,dups", [
    (3, 8, 2, 2, False), (4, 8, 3, 7, True), (2, 16, 4, 11, True), (6, 12, 4, 30, False), (3, 8, 2, 24, True)])
def test_lru_is_the_cache_models_rule(layers, experts, top_k, slots, dups):
    """Call by call, LRU gives every routed id the slot CacheModel.admit gives it, admits the same
    experts into the same slots, and both leave the same owners (streamed layers included: each
    chunk of a layer's experts is one admission)."""
    rng = random.Random(f"{layers}-{experts}-{slots}")
    calls = random_calls(rng, layers, experts, top_k, 60, dups)
    requests = with_streams(layers, experts, calls, every=25)
    routed = iter([ids for _, ids in calls])  # the decode calls as routed, duplicates included
    model = CacheModel(layers, experts, slots)
    checked = []

    def observe(ci, chunk, slot_ids, plan, owner):
        layer = requests.layer_of[ci]
        ids = [p - layer * experts for p in chunk] if requests.stream[ci] else next(routed)
        expect_ids, expect_plan = model.admit(layer, ids, 1.0, 0, 0)
        slot = dict(zip(chunk, slot_ids))
        assert [slot[layer * experts + e] for e in ids] == expect_ids, f"call {ci}"
        assert [(p - layer * experts, s) for p, s in plan] == expect_plan, f"call {ci}"
        assert owner == model.owner_ids(), f"call {ci}"
        checked.append(ci)

    simulate(LRU(), requests, slots, observe)
    assert len(set(checked)) == len(requests)


def test_belady_bounds_every_policy():
    rng = random.Random(7)
    for trial in range(6):
        layers, experts, top_k = rng.choice([(4, 8, 2), (3, 16, 4), (6, 12, 3)])
        calls = random_calls(rng, layers, experts, top_k, 40, dups=trial % 2 == 1)
        requests = requests_from_calls(layers, experts, calls)
        for slots in sorted({top_k, top_k + 3, layers * experts // 4, layers * experts // 2}):
            best = simulate(Belady(), requests, slots).hits
            for policy in policies():
                assert simulate(policy, requests, slots).hits <= best, (policy.name, slots, trial)


def cyclic(layers=8, experts=32, top_k=4, tokens=100):
    """Every token routes the same experts: a working set of layers * top_k pairs, visited in order."""
    return requests_from_calls(layers, experts, [(l, [(3 * l + j) % experts for j in range(top_k)])
                                                 for _ in range(tokens) for l in range(layers)])


def test_cyclic_pattern_starves_lru_but_not_the_recommended_policy():
    requests = cyclic()
    assert simulate(LRU(), requests, 25).hits == 0  # 25 slots < 32 pairs per token
    best = simulate(Belady(), requests, 25).hit_rate
    got = simulate(RECOMMENDED(), requests, 25).hit_rate
    assert got > 0.5 * best > 0
    for slots in (5, 8, 16, 31):  # no cliff below the working set (at top_k slots nothing can hit)
        assert simulate(RECOMMENDED(), requests, slots).hits > 0, slots
    assert simulate(Belady(), requests, 4).hits == 0


class Checked(Policy):
    """Runs a policy and checks, at each call, that its victims are the eligible slots in ascending
    (key, slot) order, the keys being the stored ones (KeyPolicy) or, for Opportunity, the ones the
    device derives from the stamps (Opportunity.device_key) or hit density's (HitDensity.victim_keys)."""

    def __init__(self, inner):
        self.inner, self.name, self.future = inner, inner.name, inner.future

    def reset(self, slots, layers):
        self.inner.reset(slots, layers)
        self.slots, self.layers, self.call, self.expected = slots, layers, None, []

    def begin_call(self, *a):
        self.inner.begin_call(*a)

    def hit(self, *a):
        self.inner.hit(*a)

    def admit(self, *a):
        self.inner.admit(*a)

    def end_call(self):
        self.inner.end_call()

    def keys(self, now):
        p = self.inner
        if isinstance(p, Opportunity):
            return [p.device_key(p.stamp[s], now + 1, self.layers) for s in range(self.slots)]
        if isinstance(p, HitDensity):  # Duel too: hit density's keys or its stamps, as its shadows decide
            return p.victim_keys(now).tolist()
        assert isinstance(p, KeyPolicy)
        return list(p.key)

    def take(self, now, touched):
        if self.call != now:
            keys = self.keys(now)
            self.call = now
            self.expected = sorted((keys[s], s) for s in range(self.slots) if s not in touched)
            self.expected.reverse()
        slot, level = self.inner.take(now, touched)
        assert self.expected, "a victim beyond the eligible slots"
        assert slot == self.expected.pop()[1], f"{self.name}: victim out of key order at call {now}"
        return slot, level


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_policy_invariants(policy):
    rng = random.Random(policy.name)
    layers, experts, top_k = 4, 8, 3
    calls = random_calls(rng, layers, experts, top_k, 80, dups=True)
    for slots in (top_k, 9, 13, 20):
        requests = with_streams(layers, experts, calls, every=30)

        def observe(ci, chunk, slot_ids, plan, owner):
            # (A victim that was a hit of the call would leave its pair at -1.)
            assert all(s >= 0 for s in slot_ids), "a routed expert is not resident after its call"
            assert len(set(slot_ids)) == len(slot_ids), "two pairs of one call share a slot"
            assert len(set(s for _, s in plan)) == len(plan), "one victim taken twice"
            owned = [o for o in owner if o >= 0]
            assert len(owned) == len(set(owned)), "a pair owns two slots"

        result = simulate(Checked(policy), requests, slots, observe)
        assert 0 <= result.hits <= result.distinct
        assert result.hits + result.admitted == result.distinct
        assert result.max_levels <= top_k  # a decode call takes at most top_k victims, one level at least each


def test_duel_shadows_replay_lru_and_hit_density_exactly_and_it_follows_the_better():
    """Duel's shadow caches see every decode call: on decode calls alone (no streamed prompts, which
    reach only the real cache) they hit exactly as LRU and hit density do alone.
    On the random-weight model's trace, where hit density falls 4.3 points below LRU, Duel stays
    within a point of the better of the two at every size."""
    trace = Trace.load(RANDOM_TRACE)
    requests = requests_from_trace(trace)
    for slots in (5, 12, 17, 24):
        duel = eviction.Duel()
        got = simulate(duel, requests, slots).hit_rate
        duel.flush()
        lru, hd = simulate(LRU(), requests, slots), simulate(HitDensity(), requests, slots)
        assert duel.shadow_hits == [lru.hits, hd.hits], slots
        assert got >= max(lru.hit_rate, hd.hit_rate) - 0.01, slots


@pytest.mark.parametrize("trace_path,slots", [(RANDOM_TRACE, 12), (RANDOM_TRACE, 17),
                                             pytest.param(FIXTURE, 26, marks=pytest.mark.slow)],
                         ids=["random-12", "random-17", "fixture-26"])
def test_the_runtimes_duel_hits_exactly_as_the_offline_duel(trace_path, slots):
    """A SlotPool(eviction="duel") served call by call through the CPU ops, its shadow caches
    replaying each call (dedup_and_admit's shadows), hits exactly as eviction.Duel does offline, and
    so does each shadow as LRU and hit density alone; the shadows' counters are the pool's Duel
    words. On the random-weight trace the score takes LRU's keys for part of the run."""
    import torch
    import ft_ops
    from ft_ops.policies import DUEL_WORDS, duel_counters, duel_next
    from ft_ops.slot_pool import ExpertShape, SlotPool

    trace = Trace.load(trace_path)
    if trace_path == FIXTURE:
        trace = trace.first(2)
    requests = requests_from_trace(trace)
    pool = SlotPool(ExpertShape(trace.layers, trace.experts, 8, 8, torch.float32, False), slots, "cpu",
                    eviction="duel")
    hits = lru_keyed = 0
    for i in range(len(trace.sequences)):
        for step in trace.decode_steps(i):
            for layer in range(trace.layers):
                ids = step[layer].reshape(1, -1)
                resident = ft_ops.slot_lookup(pool.slot_of, layer, ids) >= 0
                hits += int(torch.unique(ids[resident]).numel())
                lru_keyed += duel_next(pool.policy_state[-DUEL_WORDS:].tolist())[1]
                ft_ops.dedup_and_admit(*pool.state, layer, ids, 1.0, 0, 0, None, pool.policy,
                                       policy_state=pool.policy_state, shadows=pool.shadows_of_call(ids))
                pool.after_admission(ids)
    duel = eviction.Duel()
    want = simulate(duel, requests, slots)
    duel.flush()
    lru, density = duel_counters(pool.policy_state[-DUEL_WORDS:].tolist())
    assert [lru[2] - lru[3], density[2] - density[3]] == duel.shadow_hits
    assert duel.shadow_hits == [simulate(LRU(), requests, slots).hits, simulate(HitDensity(), requests, slots).hits]
    assert hits == want.hits and lru[2] == want.distinct > 0
    if trace_path == RANDOM_TRACE:
        assert 0 < lru_keyed < len(requests)


def test_duel_next_agrees_with_the_cache_models_own_rule():
    """ft_ops.policies.duel_next (which the reference and the tests use) and CacheModel's separate
    implementation decide and store alike, a score of exactly 0 taking hit density's keys."""
    from ft_ops.policies import DUEL, DUEL_WORDS, duel_next

    rng = random.Random(5)
    assert duel_next([0] * DUEL_WORDS) == ([0] * DUEL_WORDS, False)
    for trial in range(500):
        calls = rng.randint(0, 30)

        def counters(calls):
            return [calls, rng.randint(0, 99), rng.randint(0, 60), rng.randint(0, 60)]

        # Either copy the latest, by the replay count's parity (the other one call behind).
        replays = calls + 2 * rng.randint(0, 3) if calls else 0
        latest, behind = counters(calls) + counters(calls), counters(max(calls - 1, 0)) + counters(max(calls - 1, 0))
        even, odd = (behind, latest) if replays % 2 else (latest, behind)
        words = even + [struct.unpack("<q", struct.pack("<d", rng.choice([0.0, -0.0, 1.5, -2.25, rng.uniform(-9, 9)])))[0],
                        calls - rng.randint(0, 1), rng.randint(-5, 60), rng.randint(-5, 60)] + odd + [replays]
        model = CacheModel(2, 4, 4, DUEL)
        model.duel_words = list(words)
        takes_lru = model._duel_takes_lru_keys()
        assert duel_next(words) == (model.duel_words, takes_lru), trial


def test_duels_counter_copies_hold_each_shadows_running_counts():
    """Duel's shadows count their replays in two copies of their counters (docs/ops.md, Duel): over
    calls of ids and of none, with and without shadows, and invalidations, the pool's words equal
    the reference's after every call, R counts the replayed calls, the latest copy (R % 2) holds R
    calls and the other R - 1, and the latest equals the counters of twin shadows that count with
    plain `stats` (the running sums a single copy would hold)."""
    import torch
    import ft_ops
    from ft_ops.policies import DUEL, DUEL_WORDS, HIT_DENSITY, LRU as LRU_POLICY, duel_counters
    from ft_ops.slot_pool import ExpertShape, SlotPool
    from ft_ops.testing import reference

    rng = random.Random(1)
    pool = SlotPool(ExpertShape(3, 8, 8, 8, torch.float32, False), 6, "cpu", eviction="duel")

    def copies():  # the reference's state and the twins, from the pool's
        twins = ([t.clone() for t in pool.shadows.lru], [t.clone() for t in pool.shadows.density],
                 pool.shadows.density_state.clone(), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
        return [t.clone() for t in (*pool.state, pool.policy_state, *pool.shadows.tensors)], twins, 0

    ref, (lru, density, density_state, lru_counts, density_counts), replays = copies()
    for step in range(300):
        if rng.random() < 0.03:
            pool.invalidate()
            ref, (lru, density, density_state, lru_counts, density_counts), replays = copies()
            continue
        n = 0 if rng.random() < 0.08 else rng.randint(1, 12)
        ids = torch.tensor([rng.randrange(8) for _ in range(n)], dtype=torch.int64).reshape(-1, 1)
        layer, with_shadows = rng.randrange(3), rng.random() < 0.8
        ft_ops.dedup_and_admit(*pool.state, layer, ids, 1.0, 0, 0, None, DUEL, policy_state=pool.policy_state,
                               shadows=list(pool.shadows.tensors) if with_shadows else None)
        reference.dedup_and_admit(*ref[:4], layer, ids, 1.0, 0, 0, None, DUEL, policy_state=ref[4],
                                  shadows=ref[5:] if with_shadows else None)
        assert torch.equal(pool.policy_state, ref[4]), step
        if with_shadows and n:
            replays += 1
            ft_ops.dedup_and_admit(*lru, layer, ids, 1.0, 0, 0, lru_counts, LRU_POLICY)
            ft_ops.dedup_and_admit(*density, layer, ids, 1.0, 0, 0, density_counts, HIT_DENSITY,
                                   policy_state=density_state)
        words = pool.policy_state[-DUEL_WORDS:].tolist()
        older = duel_counters(words[:20] + [words[20] + 1])  # the other copy
        assert words[20] == replays and [c[0] for c in older] == [max(replays - 1, 0)] * 2, step
        assert duel_counters(words) == (lru_counts.tolist(), density_counts.tolist()), step


def test_invalidate_resets_duels_score_and_empties_its_shadows():
    import torch
    import ft_ops
    from ft_ops.policies import DUEL_WORDS, HD_B0, HD_D0, pack_estimates
    from ft_ops.slot_pool import ExpertShape, SlotPool

    pool = SlotPool(ExpertShape(2, 8, 8, 8, torch.float32, False), 6, "cpu", eviction="duel")
    gen = torch.Generator().manual_seed(0)
    for step in range(20):
        ids = torch.randint(8, (1, 2), generator=gen)
        ft_ops.dedup_and_admit(*pool.state, step % 2, ids, 1.0, 0, 0, None, pool.policy, policy_state=pool.policy_state,
                               shadows=pool.shadows_of_call(ids))
    assert int(pool.shadows.lru_counters[0]) == int(pool.shadows.density_counters[0]) == 20
    pool.invalidate()
    assert pool.policy_state[-DUEL_WORDS:].tolist() == [0] * DUEL_WORDS
    for shadow, first_clock in ((pool.shadows.lru, 0), (pool.shadows.density, 1)):
        assert int((shadow[0] >= 0).sum()) == 0 and int((shadow[1] >= 0).sum()) == 0
        assert int(shadow[2].abs().sum()) == 0 and int(shadow[3]) == first_clock
    state = pool.shadows.density_state
    assert int(state[:16].abs().sum()) == 0 and set(state[16:].tolist()) == {pack_estimates(HD_B0, HD_D0)}
    # A call that routes no id is not a call the shadows replay, given them or not.
    nothing = torch.zeros((0, 2), dtype=torch.int64)
    assert pool.shadows_of_call(nothing) is None
    ft_ops.dedup_and_admit(*pool.state, 0, nothing, 1.0, 0, 0, None, pool.policy, policy_state=pool.policy_state,
                           shadows=pool.shadows.tensors)
    assert pool.policy_state[-DUEL_WORDS:].tolist() == [0] * DUEL_WORDS


def test_streamed_prompt_does_not_flush_the_decode_set():
    """Item 3: after a streamed prompt the candidates give streamed rows up first; LRU loses the decode set."""
    rng = random.Random(3)
    layers, experts, top_k = 4, 16, 2
    calls = random_calls(rng, layers, experts, top_k, 200)
    plain = requests_from_calls(layers, experts, calls)
    streamed = with_streams(layers, experts, calls, every=10)
    slots = 3 * experts
    lru_loss = simulate(LRU(), plain, slots).hit_rate - simulate(LRU(), streamed, slots).hit_rate
    ours_loss = simulate(RECOMMENDED(), plain, slots).hit_rate - simulate(RECOMMENDED(), streamed, slots).hit_rate
    assert lru_loss > 0.02
    assert ours_loss < lru_loss / 2


def test_decode_set_after_prompt_counts_the_hot_pairs_a_streamed_prompt_leaves(tmp_path, monkeypatch):
    """tools/decode_set_after_prompt.py (issue 23's item 3 through the runtime) on a small model:
    the prompt streams; the hot decode pairs resident after it are at most those before it, and
    under every policy it keeps each one that sat outside its regions (it writes there only into
    free slots)."""
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "tools", "decode_set_after_prompt.py")
    spec = importlib.util.spec_from_file_location("decode_set_after_prompt", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert tool.main(["--layers", "8", "--slots", "64", "--evictions", "lru,duel,hitdensity", "--decode-tokens", "40",
                      "--prompt-tokens", "64", "--hot", "32"]) == 0
    rows = json.load(open(tmp_path / "decode_set_after_prompt.json"))["rows"]
    assert [row["eviction"] for row in rows] == ["lru", "duel", "hitdensity"]
    for row in rows:
        assert row["streamed_calls"] > 0 and row["regions"] == 32 and row["hot_pairs"] == 32
        assert 0 <= row["resident_after"] <= row["resident_before"] <= 32
        assert row["outside_regions_before"] > 0 and row["outside_regions_kept"] == row["outside_regions_before"]


def test_prompt_between_decodes_measures_the_second_run_without_and_with_a_streamed_prompt(tmp_path, monkeypatch):
    """benchmarks/bench_prompt_between_decodes.py (issue 23's item 3 at full size on a GPU) on a
    tiny shape on the CPU: both cases measured, the prompt streamed and timed, rates in [0, 1]."""
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_prompt_between_decodes.py")
    spec = importlib.util.spec_from_file_location("bench_prompt_between_decodes", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.main(["--device", "cpu", "--layers", "4", "--hidden", "128", "--experts", "16", "--top-k", "2",
                       "--expert-intermediate", "64", "--cache-gib", "0.002", "--prompt", "128",
                       "--decode-tokens", "8", "--evictions", "lru"]) == 0
    (row,) = json.load(open(tmp_path / "prompt_between_decodes.json"))["rows"]
    assert row["slots"] > row["region_slots"] == 32
    assert 0 <= row["hit_rate_with"] <= 1 and 0 < row["hit_rate_without"] <= 1
    assert row["prompt_s"] > 0 and row["tok_s_with"] > 0 and row["tok_s_without"] > 0


def test_requests_from_the_fixture():
    trace = Trace.load(FIXTURE).first(2)
    decode = requests_from_trace(trace, max_tokens=20)
    assert decode.decode_calls == len(decode) == 2 * 20 * trace.layers
    assert decode.max_call == trace.top_k
    streamed = requests_from_trace(trace, prompts="stream", stream_every=8, max_tokens=20)
    # Each sequence: its prompt, then another at tokens 8 and 16.
    assert len(streamed) - streamed.decode_calls == 2 * 3 * trace.layers
    nxt = streamed.next_use()
    for i, pairs in enumerate(streamed.pairs):
        for p, n in zip(pairs, nxt[i]):
            assert n == eviction.NEVER or (n > i and not streamed.stream[n] and p in streamed.pairs[n])
    with pytest.raises(ValueError):
        simulate(LRU(), decode, trace.top_k - 1)


def test_opportunity_device_key_orders_classes_then_most_recent():
    L = 8
    key = Opportunity.device_key
    now = 100
    # One class (missed no turn yet): the most recent goes first.
    assert key(98, now, L) < key(95, now, L)
    # A slot that missed a turn goes before every slot that missed none.
    assert key(90, now, L) < key(98, now, L) and key(90, now, L) < key(93, now, L)
    assert key(0, now, L) < key(STREAMED, now, L) < min(key(s, now, L) for s in range(2, now))
    assert len({key(s, now, L) for s in range(2, now)}) == now - 2  # distinct stamps, distinct keys


@pytest.mark.parametrize("policy,simulated", [(1, eviction.Opportunity), (2, eviction.HitDensity)],
                         ids=["opportunity", "hitdensity"])
def test_cache_model_equals_the_simulators(policy, simulated):
    """The runtime's rule as the kernels implement it (CacheModel with policy 1 or 2, checked against
    the CPU and CUDA ops) hits exactly as the offline simulator's policy on the fixture's decode."""
    from ft_ops.testing.cache_model import CacheModel
    from ft_ops.traces import Trace

    trace = Trace.load(FIXTURE).first(1)
    requests = eviction.requests_from_trace(trace, prompts="skip")
    for slots in (13, 40):
        model, hits, total = CacheModel(trace.layers, trace.experts, slots, policy), 0, 0
        for step in trace.decode_steps(0):
            for layer in range(trace.layers):
                ids = step[layer].tolist()
                hits += sum((layer, e) in model.slot_of for e in set(ids))
                total += len(set(ids))
                model.admit(layer, ids, 1.0, 0, 0)
        assert hits == eviction.simulate(simulated(), requests, slots).hits and total > 0


def test_the_ops_default_to_lru_which_needs_no_state():
    """Pools name their policy (Duel unless told otherwise: ft_ops.policies.DEFAULT_EVICTION);
    the ops themselves default to LRU, the one policy that keeps no state and no clock offset."""
    import torch

    import ft_ops  # noqa: F401  (registers the ops)

    for op in (torch.ops.freetoken.dedup_and_admit.default, torch.ops.freetoken.async_layer_copy.default):
        policy = next(a for a in op._schema.arguments if a.name == "policy")
        assert policy.default_value == 0, op


def test_routing_oracle_keeps_the_popular_pair_that_lru_would_evict():
    """Two layers of four experts, top-1, no repeats: experts 0 of both layers are popular (0.7),
    the others not (0.1). After l0:[0], l1:[0], l0:[1] a cache of 3 slots is full; l1:[1] takes
    layer 0's unpopular expert 1, the most recently used pair, where LRU takes the oldest."""
    popularity = [[0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]]
    calls = [(0, [0]), (1, [0]), (0, [1]), (1, [1])]
    requests = requests_from_calls(2, 4, calls)
    for policy, evicted in ((eviction.RoutingOracle(popularity, repeat=0.0, top_k=1), 0 * 4 + 1), (LRU(), 0 * 4 + 0)):
        resident = []
        simulate(policy, requests, 3, lambda ci, chunk, slots, plan, owner: resident.append(sorted(o for o in owner if o >= 0)))
        assert evicted not in resident[-1] and evicted in resident[-2], (policy.name, resident)


def test_routing_oracle_reads_the_generators_popularity():
    """The popularity RoutingModel.popularity gives from draw's orders is what the draws follow
    (one layer, top-1, no repeats: each token one Zipf pick), and asking for the orders leaves the
    draws as they were."""
    from ft_ops.synthetic_routing import RoutingModel
    model = RoutingModel(repeat=0.0, zipf=1.5)
    orders = []
    ids = model.draw(2, 16, 1, 6000, seed=3, orders=orders)
    assert ids.equal(model.draw(2, 16, 1, 6000, seed=3))
    popularity = model.popularity(orders)
    assert popularity.shape == (2, 16) and abs(float(popularity.sum()) - 2.0) < 1e-12
    for layer in range(2):
        seen = ids[:, layer, 0].bincount(minlength=16).double() / ids.shape[0]
        assert (seen - popularity[layer]).abs().max() < 0.02, (layer, seen, popularity[layer])
        assert orders[layer][0] == int(popularity[layer].argmax())


def test_compare_eviction_puts_references_before_belady_and_judges_them():
    """tools/compare_eviction.py's run on a small synthetic trace with the generator's oracle: its row
    sits before Belady's in the table, and the goals are computed for it as for the candidates."""
    import importlib.util
    from ft_ops.synthetic_routing import RoutingModel
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "compare_eviction.py")
    spec = importlib.util.spec_from_file_location("compare_eviction", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    model, orders = RoutingModel(repeat=0.4, zipf=1.5), []
    trace = model.trace(3, 8, 2, tokens=60, seed=5, orders=orders)
    oracle = eviction.RoutingOracle(model.popularity(orders).numpy(), model.repeat, 2)
    result = tool.run_trace("tiny", requests_from_trace(trace), 3, 8, 2, {}, (oracle,))
    names = list(result["policies"])
    assert names[-2:] == ["RoutingOracle", "Belady"] and names[0] == "LRU"
    assert set(result["goals"]["RoutingOracle"]) >= {"goal1_never_1pt_below_lru", "gap_closed"}
    assert "| RoutingOracle |" in tool.table(result)


def test_routing_oracle_keeps_a_streamed_row_once_decode_hits_it():
    """A streamed prompt admits experts 0-3 of both layers (8 slots, all full); decode then hits
    layer 0's expert 0, which holds slot 0. The next miss takes a streamed row that decode never
    used, not that one (streamed rows go first, in ascending slot order)."""
    popularity = [[0.6, 0.1, 0.1, 0.1, 0.1], [0.6, 0.1, 0.1, 0.1, 0.1]]
    calls = [(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3]), (0, [0]), (1, [0]), (0, [0]), (1, [4])]
    requests = requests_from_calls(2, 5, calls, stream=[True, True, False, False, False, False])
    resident = []
    simulate(eviction.RoutingOracle(popularity, repeat=0.0, top_k=1), requests, 8,
             lambda ci, chunk, slots, plan, owner: resident.append(sorted(o for o in owner if o >= 0)))
    assert 0 in resident[-1] and 1 not in resident[-1], resident


def test_sequence_oracle_counts_each_sequences_own_turns_and_switches_at_its_end():
    """SequenceOracle's tables are each sequence's own counts of its decode steps (prompt rows left
    out): with one layer of 3 experts, top-1, sequence 0 decodes 0, 0, 1, 0 and sequence 1 decodes
    2, 2, 2. The replay switches to sequence 1's tables at its first decode call."""
    import torch

    seq0 = torch.tensor([[[2]], [[0]], [[0]], [[1]], [[0]]])  # one prompt row, then 4 decode steps
    seq1 = torch.tensor([[[1]], [[2]], [[2]], [[2]]])
    oracle = eviction.SequenceOracle(Trace([seq0, seq1], [1, 1], experts=3))
    (qz0, qp0), (qz1, qp1) = oracle.tables
    # sequence 0's 3 transitions: 0 -> 0, 0 -> 1, 1 -> 0. Expert 0: used before 2 times, used after
    # in 1; unused before once, used after once. Expert 2: never used.
    assert qp0[0] == pytest.approx(1.25 / 2.5) and qz0[0] == pytest.approx(1.025 / 1.5)
    assert qp0[2] == pytest.approx(0.25 / 0.5) and qz0[2] == pytest.approx(0.025 / 3.5)
    assert qp1[2] == pytest.approx(2.25 / 2.5) and qz1[0] == pytest.approx(0.025 / 2.5)
    assert oracle.ends == [4, 7]
    oracle.reset(2, 1)
    seen = []
    for call, expert in enumerate([0, 0, 1, 0, 2, 2, 2]):
        oracle.begin_call([expert], call, False)
        seen.append(oracle.qz is qz1)
    assert seen == [False] * 4 + [True] * 3
    result = simulate(eviction.SequenceOracle(Trace([seq0, seq1], [1, 1], experts=3)),
                      requests_from_calls(1, 3, [(0, [e]) for e in [0, 0, 1, 0, 2, 2, 2]]), 2)
    with pytest.raises(ValueError, match="more decode calls than the trace's 7"):
        simulate(eviction.SequenceOracle(Trace([seq0, seq1], [1, 1], experts=3)),
                 requests_from_calls(1, 3, [(0, [e]) for e in [0, 0, 1, 0, 2, 2, 2, 1]]), 2)
    assert 0 < result.hit_rate <= simulate(Belady(), requests_from_calls(1, 3, [(0, [e]) for e in
                                                                                 [0, 0, 1, 0, 2, 2, 2]]), 2).hit_rate
