"""Eviction through the plugin: pools evict by Duel unless told otherwise, every policy generates
the same tokens, and Duel's shadows count and exist only where they can matter."""

import pytest
import torch

import freetoken_plugin
from freetoken_plugin.tiny import tiny_model
from ft_ops.policies import DUEL_WORDS, POLICIES
from helpers import greedy_tokens, require

E = 8


@pytest.mark.parametrize("options", [{}, {"eviction": None}], ids=["unset", "None"])
def test_pools_evict_by_duel_unless_told_otherwise(options):
    require("cpu", "expert_gemm")
    handle = freetoken_plugin.offload_experts(tiny_model("qwen3_moe"), cache_slots=2 * E + 2, device="cpu",
                                              progress=False, **options)
    pool = handle.runtime.pool
    assert pool.policy == POLICIES["duel"] and pool.policy_state is not None and pool.shadows is not None


@pytest.mark.parametrize("eviction", ["opportunity", "duel"])
def test_every_policy_generates_the_same_tokens(eviction):
    """Eviction decides what stays resident, never what is computed. Under "duel" the shadow caches
    replay every admission call (their counters move with the pool's)."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    want = greedy_tokens(model, prompt)
    handle = freetoken_plugin.offload_experts(model, cache_slots=2 * E + 2, device="cpu", progress=False,
                                              eviction=eviction)
    assert torch.equal(greedy_tokens(model, prompt), want)
    pool = handle.runtime.pool
    stats = freetoken_plugin.stats(model)
    assert stats["pool"]["eviction"] == eviction
    if eviction == "duel":
        assert int(pool.shadows.lru_counters[0]) == int(pool.shadows.density_counters[0]) > 0
        # The last admission call saw every shadow replay but its own (which follows it).
        assert int(pool.policy_state[-DUEL_WORDS + 9]) == int(pool.shadows.lru_counters[0]) - 1
        duel = stats["duel"]
        assert duel["shadow_calls"] == int(pool.shadows.lru_counters[0])
        assert duel["next_keys"] == ("lru" if duel["score"] > 0 else "hitdensity")
        assert 0 <= duel["lru_shadow_hit_rate"] <= 1 and 0 <= duel["hitdensity_shadow_hit_rate"] <= 1
    else:
        assert "duel" not in stats


def test_duel_shadow_hit_rates_count_no_miss_that_found_no_slot():
    """A call of more distinct experts than the pool has slots leaves some misses out in either
    shadow (no slot can take them): they are misses, not hits. A 40-token prompt admitted into an
    empty 3-slot pool hits nothing, in the pool and in both shadows; a reset forgets the count."""
    require("cpu", "expert_gemm")
    model = tiny_model("mixtral")
    handle = freetoken_plugin.offload_experts(model, cache_slots=3, device="cpu", progress=False, eviction="duel",
                                              stream_prefill=False)
    with torch.no_grad():
        model(torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(0)))
    stats = freetoken_plugin.stats(model)
    assert stats["admit"]["hit_rate"] == 0.0
    assert stats["duel"]["lru_shadow_hit_rate"] == stats["duel"]["hitdensity_shadow_hit_rate"] == 0.0
    assert int(handle.runtime.pool.shadows.unadmittable) > 0
    handle.runtime.pool.invalidate()
    assert int(handle.runtime.pool.shadows.unadmittable) == 0


def test_distinct_experts_counts_the_ids_in_range_without_a_sync():
    from ft_ops.shadow_caches import distinct_experts

    ids = torch.tensor([[3, 1], [3, 7], [-1, 8], [1, 0]])
    assert int(distinct_experts(ids, 8)) == 4  # 0, 1, 3, 7; -1 and 8 are outside [0, 8)
    assert int(distinct_experts(ids[:0], 8)) == 0


@pytest.mark.parametrize("options", [dict(cache_slots=1000), dict(cache_slots=2 * E + 2, fetch_fraction=0.0),
                                     dict(cache_slots=2 * E + 2, fetch_fraction=0.4 / E)],
                         ids=["every-expert", "admits-none", "admits-round-to-none"])
def test_a_duel_pool_that_never_evicts_keeps_no_shadows(options):
    """Nothing is ever evicted from a pool of every expert (more slots than experts), nor from one
    whose calls admit no miss (fetch_fraction 0, or below 0.5 / E: round(misses x fetch_fraction)
    of at most E misses is 0): no shadows replayed, the score stays 0."""
    require("cpu", "expert_gemm")
    model = tiny_model("qwen3_moe")
    prompt = torch.randint(1, 512, (1, 6), generator=torch.Generator().manual_seed(4))
    want = greedy_tokens(model, prompt)
    handle = freetoken_plugin.offload_experts(model, device="cpu", progress=False, eviction="duel", **options)
    assert torch.equal(greedy_tokens(model, prompt), want)
    assert handle.runtime.pool.shadows is None
    assert freetoken_plugin.stats(model)["duel"] == dict(score=0.0, next_keys="hitdensity", shadow_calls=0,
                                                        lru_shadow_hit_rate=None, hitdensity_shadow_hit_rate=None)
