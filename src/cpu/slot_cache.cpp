// CPU kernels for the slot cache: slot_lookup and dedup_and_admit.
//
// Plain sequential code: the state is a few KB and the CPU path serves tests, CPU-only models
// and the oracle role; the contract (docs/ops.md) is what the CUDA kernels must reproduce.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

// The admission rules (admitted_count.h, eviction_policy.h) round each product and sum alone, as
// the GPU does: no FMA contraction in this file. GCC contracts a * b + c across the rules' helper
// calls on targets with FMA (aarch64 among them); clang contracts only inside one expression.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#include "../common/checks.h"
#include "cpu_kernels.h"

namespace ft::cpu {
namespace {

// Reads routed ids as int64 and rejects any outside [0, experts), naming the first offender.
std::vector<int64_t> read_expert_ids(const at::Tensor& expert_ids, int64_t experts) {
  const auto flat = expert_ids.contiguous().to(at::kLong);
  const int64_t* data = flat.data_ptr<int64_t>();
  std::vector<int64_t> ids(data, data + flat.numel());
  for (size_t i = 0; i < ids.size(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < experts, "expert_ids[", i, "] (flat) is ", ids[i],
                ", outside [0, ", experts, "); expert ids must index the layer's experts");
  }
  return ids;
}

}  // namespace

// Duel's shadow caches replay the pool's call after it, each admitting every miss a slot can take
// and counting its call in the pool's Duel words (duel::count_replay, src/common/eviction_policy.h),
// which the pool's next call reads. A call of no ids is not replayed (the offline model counts none).
static void replay_in_shadows(at::TensorList s, const at::Tensor& policy_state, int64_t layer,
                              const at::Tensor& expert_ids) {
  int64_t* words = policy_state.data_ptr<int64_t>() + policy_state.numel() - duel::kWords;
  for (int shadow = 0; shadow < 2; ++shadow) {
    const auto calls = at::zeros({4}, policy_state.options());  // this replay's (1, routed, distinct, admitted)
    if (shadow == 0) {
      dedup_and_admit(s[0], s[1], s[2], s[3], layer, expert_ids, 1.0, 0, 0, calls,
                      static_cast<int64_t>(EvictionPolicy::kLru));
    } else {
      dedup_and_admit(s[4], s[5], s[6], s[7], layer, expert_ids, 1.0, 0, 0, calls,
                      static_cast<int64_t>(EvictionPolicy::kHitDensity), 0.0, 0.0, s[8]);
    }
    const int64_t* c = calls.data_ptr<int64_t>();
    duel::count_replay(words, shadow, c[1], c[2], c[3]);
  }
}

// Duel with shadows: the pool uses its shadows' counters copy R % 2 while a replay writes the copy
// with the fewer calls, so copy R % 2 must hold more calls than the other, or as many with R even
// (eviction_policy.h); every state the rules make from zeros does. On the GPU this would cost a
// host sync, so only the CPU checks it.
static void check_duel_copies(const at::Tensor& policy_state) {
  const int64_t* w = policy_state.data_ptr<int64_t>() + policy_state.numel() - duel::kWords;
  const int latest = static_cast<int>(w[duel::kReplays] & 1);
  for (int shadow = 0; shadow < 2; ++shadow) {
    const int64_t mine = w[duel::counters_at(shadow, latest)], other = w[duel::counters_at(shadow, 1 - latest)];
    TORCH_CHECK(latest == 1 ? mine > other : mine >= other, "policy_state's Duel words are inconsistent: after ",
                w[duel::kReplays], " replays the ", shadow == 0 ? "LRU" : "hit-density", " shadow's latest counters (copy ",
                latest, ") count ", mine, " calls, the other copy ", other,
                "; SlotPool.invalidate() resets them (docs/ops.md, Duel)");
  }
}

at::Tensor slot_lookup(const at::Tensor& slot_of, int64_t layer, const at::Tensor& expert_ids) {
  TORCH_CHECK(slot_of.dim() == 2, "slot_of must be [layers, experts], got shape ", slot_of.sizes());
  check_dtype(slot_of, at::kInt, "slot_of");
  check_routed_ids(expert_ids, slot_of);
  PoolShape pool{slot_of.size(0), slot_of.size(1), 0};
  check_layer(layer, pool);
  const auto ids = read_expert_ids(expert_ids, pool.experts);
  auto out = at::empty(expert_ids.sizes(), expert_ids.options().dtype(at::kInt));
  const auto row = slot_of.select(0, layer).contiguous();
  const int32_t* map = row.data_ptr<int32_t>();
  int32_t* dst = out.data_ptr<int32_t>();
  for (size_t i = 0; i < ids.size(); ++i) dst[i] = map[ids[i]];
  return out;
}

void check_pool_maps(const at::Tensor& slot_of, const at::Tensor& owner_of, int64_t layer, const PoolShape& pool) {
  const int32_t* row = slot_of.data_ptr<int32_t>() + layer * pool.experts;
  for (int64_t e = 0; e < pool.experts; ++e) {
    TORCH_CHECK(row[e] >= -1 && row[e] < pool.slots, "slot_of[", layer, ", ", e, "] is ", row[e],
                ", outside [-1, ", pool.slots, "): the pool state is corrupt (SlotPool.invalidate() resets it)");
  }
  const int32_t* owner = owner_of.data_ptr<int32_t>();
  const int64_t pairs = pool.layers * pool.experts;
  for (int64_t s = 0; s < pool.slots; ++s) {
    TORCH_CHECK(owner[s] >= -1 && owner[s] < pairs, "owner_of[", s, "] is ", owner[s], ", outside [-1, ", pairs,
                "): the pool state is corrupt (SlotPool.invalidate() resets it)");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_and_admit(
    const at::Tensor& slot_of, const at::Tensor& owner_of, const at::Tensor& last_use,
    const at::Tensor& clock, int64_t layer, const at::Tensor& expert_ids, double fetch_fraction,
    int64_t protect_lo, int64_t protect_hi, const c10::optional<at::Tensor>& stats, int64_t policy,
    double cpu_expert_cost, double cpu_call_cost, const c10::optional<at::Tensor>& policy_state,
    c10::optional<at::TensorList> shadows) {
  const PoolShape pool = check_admission_inputs(slot_of, owner_of, last_use, clock, layer, expert_ids,
                                                fetch_fraction, protect_lo, protect_hi, stats);
  check_fetch_split(fetch_fraction, cpu_expert_cost, cpu_call_cost);
  const EvictionPolicy kind = check_policy(policy);
  check_policy_state(kind, policy_state, slot_of, pool.slots);
  check_shadows(kind, shadows, slot_of, owner_of, last_use, clock, policy_state, pool);
  const bool opportunity = kind == EvictionPolicy::kOpportunity;
  const auto ids = read_expert_ids(expert_ids, pool.experts);
  check_pool_maps(slot_of, owner_of, layer, pool);
  if (shadows.has_value()) {  // before the pool's call writes anything
    check_pool_maps((*shadows)[0], (*shadows)[1], layer, pool);
    check_pool_maps((*shadows)[4], (*shadows)[5], layer, pool);
    check_duel_copies(*policy_state);
  }

  int32_t* slot_map = slot_of.data_ptr<int32_t>();  // flat [L * E]
  int32_t* owner = owner_of.data_ptr<int32_t>();
  int64_t* stamp = last_use.data_ptr<int64_t>();
  const int64_t now = ++clock.data_ptr<int64_t>()[0];
  int32_t* layer_map = slot_map + layer * pool.experts;
  // Hit density and Duel: pair p's clock at state[p], its estimates at state[LE + p], slot s's
  // mirror at state[2 LE + s]. A decode use (hit or admission) of pair p into slot s updates all three.
  int64_t* state = keeps_hit_density(kind) ? policy_state->data_ptr<int64_t>() : nullptr;
  const int64_t pairs = pool.layers * pool.experts;
  // Duel: the shadows' hits since the last call move the score, which picks this call's keys.
  int64_t* duel_words = kind == EvictionPolicy::kDuel ? state + 2 * pairs + pool.slots : nullptr;
  const duel::Next duel_call = duel_words != nullptr ? duel::next(duel_words) : duel::Next{};
  if (duel_words != nullptr) duel::store(duel_words, duel_call, shadows.has_value() && !ids.empty());
  const bool density_keys = state != nullptr && !duel_call.lru_keys;
  const auto used = [&](int64_t e, int64_t s) {
    if (state == nullptr) return;
    const int64_t p = layer * pool.experts + e;
    const hit_density::Estimates est =
        hit_density::after_use(hit_density::unpack(state[pairs + p]), state[p], now, pool.layers);
    state[p] = now;
    state[pairs + p] = state[2 * pairs + s] = hit_density::pack(est);
  };

  // Dedup by counting: each unique expert is handled once; its count orders the misses.
  std::vector<int64_t> count(pool.experts, 0);
  for (int64_t id : ids) ++count[id];
  std::vector<int64_t> misses;
  int64_t distinct = 0;
  for (int64_t e = 0; e < pool.experts; ++e) {
    if (count[e] == 0) continue;
    ++distinct;
    const int32_t s = layer_map[e];
    if (s >= 0) {
      stamp[s] = now;  // hit: refresh before victims are chosen, so it cannot be evicted
      used(e, s);
    } else {
      misses.push_back(e);
    }
  }
  // Admission order: most-routed misses first (they save the most CPU work), ties by expert id.
  std::stable_sort(misses.begin(), misses.end(),
                   [&](int64_t a, int64_t b) { return count[a] > count[b]; });
  const int64_t wanted =
      admitted_count(static_cast<int64_t>(misses.size()),
                     FetchSplit{fetch_fraction, cpu_expert_cost, cpu_call_cost,
                                recopy_share(split_counters(cpu_expert_cost, stats),
                                             compulsory_misses(pool.slots, pool.layers))});

  // Victims: the `wanted` slots of least key not touched by this call and not protected, in
  // ascending (key, slot) order; LRU's key is last_use. Free slots (last_use 0) come first.
  std::vector<int64_t> victims;
  if (wanted > 0) {
    std::vector<int64_t> keys(pool.slots);
    for (int64_t s = 0; s < pool.slots; ++s) {
      if (stamp[s] >= now || (s >= protect_lo && s < protect_hi)) continue;
      victims.push_back(s);
      keys[s] = density_keys
                    ? hit_density::key(stamp[s], now, pool.layers, hit_density::unpack(state[2 * pairs + s]))
                    : victim_key(stamp[s], now, pool.layers, opportunity);
    }
    const auto older = [&](int64_t a, int64_t b) { return keys[a] != keys[b] ? keys[a] < keys[b] : a < b; };
    const int64_t keep = std::min<int64_t>(wanted, victims.size());
    std::partial_sort(victims.begin(), victims.begin() + keep, victims.end(), older);
    victims.resize(keep);
  }

  const int64_t plan_len = std::min<int64_t>(static_cast<int64_t>(ids.size()), pool.experts);
  auto int_opts = slot_of.options();
  auto copy_experts = at::full({plan_len}, -1, int_opts);
  auto copy_slots = at::full({plan_len}, -1, int_opts);
  auto num_copies = at::zeros({1}, int_opts);
  int32_t* plan_e = copy_experts.data_ptr<int32_t>();
  int32_t* plan_s = copy_slots.data_ptr<int32_t>();
  for (size_t i = 0; i < victims.size(); ++i) {
    const int64_t e = misses[i];
    const int64_t v = victims[i];
    if (owner[v] >= 0) slot_map[owner[v]] = -1;  // the old owner (any layer) loses its slot
    owner[v] = static_cast<int32_t>(layer * pool.experts + e);
    layer_map[e] = static_cast<int32_t>(v);
    stamp[v] = now;
    used(e, v);
    plan_e[i] = static_cast<int32_t>(e);
    plan_s[i] = static_cast<int32_t>(v);
  }
  num_copies.data_ptr<int32_t>()[0] = static_cast<int32_t>(victims.size());
  if (stats.has_value()) {
    int64_t* counters = stats->data_ptr<int64_t>();
    counters[0] += 1;
    counters[1] += static_cast<int64_t>(ids.size());
    counters[2] += distinct;
    counters[3] += static_cast<int64_t>(victims.size());
  }

  auto slot_ids = at::empty(expert_ids.sizes(), int_opts);
  int32_t* dst = slot_ids.data_ptr<int32_t>();
  for (size_t i = 0; i < ids.size(); ++i) dst[i] = layer_map[ids[i]];
  if (shadows.has_value() && !ids.empty()) replay_in_shadows(*shadows, *policy_state, layer, expert_ids);
  return {slot_ids, copy_experts, copy_slots, num_copies};
}

TORCH_LIBRARY_IMPL(freetoken, CPU, m) {
  m.impl("slot_lookup", &slot_lookup);
  m.impl("dedup_and_admit", &dedup_and_admit);
}

}  // namespace ft::cpu
