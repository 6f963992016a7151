// Pieces shared by the dedup_and_admit kernels (admission_decode.cuh for decode calls,
// admission_level.cuh for other calls on pools of up to 8,192 slots, admission_scan.cuh for
// larger pools): the call's arguments, its shared-memory layout, the
// dedup-and-refresh prologue (not used by the decode kernel), the map rewrite of one admitted
// expert, and the epilogue. Every step below is run by a whole block.
#pragma once

#include <climits>
#include <cstdint>

#include "../common/admitted_count.h"
#include "../common/eviction_policy.h"
#include "wait_for_previous_kernel.cuh"

namespace ft::cuda::admission {

constexpr int kLruPolicy = static_cast<int>(EvictionPolicy::kLru);
constexpr int kHitDensityPolicy = static_cast<int>(EvictionPolicy::kHitDensity);
constexpr int kDuelPolicy = static_cast<int>(EvictionPolicy::kDuel);

// The call's arguments. kPolicy (an EvictionPolicy, src/common/eviction_policy.h) selects the
// eviction policy at compile time, so LRU calls run none of the other policies' work.
template <typename id_t, int kPolicy>
struct Args {
  using Id = id_t;
  static constexpr int kPolicyId = kPolicy;
  static constexpr bool kLru = kPolicy == static_cast<int>(EvictionPolicy::kLru);
  // Hit density's state and keys: hit density's and Duel's calls (Duel's unless it takes LRU's keys).
  static constexpr bool kHitDensity = keeps_hit_density(static_cast<EvictionPolicy>(kPolicy));
  static constexpr bool kDuel = kPolicy == static_cast<int>(EvictionPolicy::kDuel);
  int32_t* slot_of;
  int32_t* owner_of;
  int64_t* last_use;
  int64_t* clock;
  const id_t* ids;
  int64_t numel;
  int64_t layer;
  int64_t experts;
  int64_t slots;
  FetchSplit split;
  int64_t protect_lo, protect_hi;
  int32_t* slot_ids;
  int32_t* plan_e;
  int32_t* plan_s;
  int32_t* num_copies;
  int64_t plan_len;  // min(numel, experts): the most misses a call can have
  int64_t* stats;    // nullptr, or the layer's counters
  const int64_t* split_counters;  // the same row where the split reads it (checks.h), else nullptr
  bool vector_slots; // last_use and owner_of are 16-byte aligned (vector loads allowed)
  int64_t layers;    // L, which the opportunity policy's keys need
  double inv_layers; // 1 / L, so keying a stamp needs no 64-bit division
  uint32_t layers_reciprocal;  // min(floor(2^32 / L), 2^32 - 1): 32-bit keys' quotient by a multiply-high
  // Hit density's state (the pool's policy_state; nullptr under the other policies): per pair its
  // last decode clock and estimates, per slot its owner's estimates (src/common/eviction_policy.h).
  int64_t* pair_clock;
  int64_t* pair_estimates;
  int64_t* slot_estimates;
  // Duel's words (duel::kWords after the slots' mirrors; nullptr under the other policies).
  int64_t* duel;
  // A launch of Duel's call with its shadow caches' replay (admit_*_with_shadows_kernel): in all
  // three blocks the pool's Duel words (nullptr otherwise), and which block this is (0 the LRU
  // shadow, 1 the hit-density shadow, -1 the pool).
  int64_t* launch_words;
  int shadow;
};

// Whether this Duel call takes LRU's keys (duel::next of the words before the call). Read by the
// threads that key slots before a barrier that precedes thread 0's write_call_totals, which stores
// the call's words.
template <typename id_t, int kPolicy>
__device__ __forceinline__ bool duel_lru_keys(const Args<id_t, kPolicy>& a) {
  if constexpr (Args<id_t, kPolicy>::kDuel) {
    return duel::next(a.duel).lru_keys;
  } else {
    return false;
  }
}

// The call's split with its recopy share, read from the layer's counters before the call adds to
// them (admitted_count.h): by every thread before the call's first barrier.
template <typename A>
__device__ __forceinline__ FetchSplit split_of(const A& a) {
  FetchSplit s = a.split;
  s.recopy = ft::recopy_share(a.split_counters, s.compulsory);
  return s;
}

// Hit density: pair (layer, e) was used in decode at `now` (a hit, or its admission into slot s):
// its clock and estimates move on (estimates_after_use of its words), and the slot mirrors the
// estimates (store_use). One thread per pair and call, so no other thread writes these words
// during the call. The kernels load a pair's words early (pair_words: the decode kernel's routing
// warp as soon as its id arrives, the other kernels every expert's with the map), so no dependent
// round trip follows the dedup or the victim search.
struct PairWords {
  int64_t clock = 0, estimates = 0;
};

template <typename id_t, int kPolicy>
__device__ __forceinline__ PairWords pair_words(const Args<id_t, kPolicy>& a, int64_t e) {
  if constexpr (Args<id_t, kPolicy>::kHitDensity) {
    const int64_t p = a.layer * a.experts + e;
    return PairWords{a.pair_clock[p], a.pair_estimates[p]};
  } else {
    return PairWords{};
  }
}

// q = age / L and r = age % L for 0 <= age < 2^52 without a 64-bit division (emulated: about a
// hundred instructions, on the admission's latency path): the quotient of a double product,
// corrected by one step.
template <typename id_t, int kPolicy>
__device__ __forceinline__ void divide_by_layers(const Args<id_t, kPolicy>& a, int64_t age, int64_t& q, int64_t& r) {
  q = static_cast<int64_t>(static_cast<double>(age) * a.inv_layers);
  r = age - q * a.layers;
  if (r < 0) {
    --q;
    r += a.layers;
  } else if (r >= a.layers) {
    ++q;
    r -= a.layers;
  }
}

// The pair's estimates after its use at `now`, from its words before it (its clock w.clock < now).
template <typename id_t, int kPolicy>
__device__ __forceinline__ int64_t estimates_after_use(const Args<id_t, kPolicy>& a, PairWords w, int64_t now) {
  int64_t turns = 0, rest = 0;
  if (w.clock != 0) divide_by_layers(a, now - w.clock, turns, rest);
  return hit_density::pack(hit_density::after_turns(hit_density::unpack(w.estimates), w.clock, turns));
}

template <typename id_t, int kPolicy>
__device__ __forceinline__ void store_use(const Args<id_t, kPolicy>& a, int64_t e, int32_t s, int64_t now, int64_t next) {
  if constexpr (Args<id_t, kPolicy>::kHitDensity) {
    const int64_t p = a.layer * a.experts + e;
    a.pair_clock[p] = now;
    a.pair_estimates[p] = next;
    a.slot_estimates[s] = next;
  }
}

// A slot's victim key as the call's keys are ordered: victim_key (src/common/eviction_policy.h)
// for an eligible stamp (< now), without its 64-bit division and remainder (emulated, about a
// hundred instructions, for each of up to 16 stamps a thread keys on the admission's latency
// path): the quotient comes from a double product and is corrected by one step, exact for ages
// below 2^52 calls. `estimates`: the slot's mirrored word (hit density; under Duel duel::kLruKeys keys by the stamp).
template <typename id_t, int kPolicy>
__device__ __forceinline__ int64_t key_of_stamp(const Args<id_t, kPolicy>& a, int64_t stamp, int64_t now,
                                                int64_t estimates = 0) {
  if constexpr (Args<id_t, kPolicy>::kLru) {
    return stamp;
  } else {
    if (stamp <= kStreamedStamp) return stamp;
    if constexpr (Args<id_t, kPolicy>::kDuel) {
      if (estimates == duel::kLruKeys) return stamp;
    }
    // Opportunity counts the age from the call before (now - 1), hit density from this one.
    const int64_t age = Args<id_t, kPolicy>::kHitDensity ? now - stamp : now - 1 - stamp;
    int64_t q, r;
    divide_by_layers(a, age, q, r);
    if constexpr (Args<id_t, kPolicy>::kHitDensity) {
      return hit_density::key_from_age(q, r, hit_density::unpack(estimates), a.layers);
    } else {
      return now - a.layers * q + r;
    }
  }
}

// key_of_stamp while keys are 32 bits (now < 2^32 - L, so the age fits 32 bits): the quotient
// age / L from one multiply-high by floor(2^32 / L), which is the quotient or one below it (the
// reciprocal's error times an age below 2^32 is below one), then one correction step. A few 32-bit
// instructions instead of the double product's conversions, for each of up to 16 stamps a thread.
template <typename id_t, int kPolicy>
__device__ __forceinline__ uint32_t key32_of_stamp(const Args<id_t, kPolicy>& a, int64_t stamp, int64_t now,
                                                   int64_t estimates = 0) {
  if constexpr (Args<id_t, kPolicy>::kLru) {
    return static_cast<uint32_t>(stamp);
  } else {
    if (stamp <= kStreamedStamp) return static_cast<uint32_t>(stamp);
    if constexpr (Args<id_t, kPolicy>::kDuel) {
      if (estimates == duel::kLruKeys) return static_cast<uint32_t>(stamp);
    }
    const uint32_t layers = static_cast<uint32_t>(a.layers);
    const uint32_t age = static_cast<uint32_t>(Args<id_t, kPolicy>::kHitDensity ? now - stamp : now - 1 - stamp);
    uint32_t q = __umulhi(age, a.layers_reciprocal);
    uint32_t r = age - q * layers;
    if (r >= layers) {
      ++q;
      r -= layers;
    }
    if constexpr (Args<id_t, kPolicy>::kHitDensity) {
      return hit_density::key_from_age(q, r, hit_density::unpack(estimates), a.layers);
    } else {
      return static_cast<uint32_t>(now) - layers * q + r;
    }
  }
}

// The call's dynamic shared memory. The 8-byte arrays (the misses' keys, then under hit density
// in the level and scan kernels estimates_if_used) come first, for their alignment.
struct CallState {
  uint64_t* keys;        // [plan_len] miss keys: (numel - routed count) << 32 | expert
  int* count;            // [experts] routed ids per expert
  int32_t* map;          // [experts] the layer's map, read once; admitted experts get their slot
  int32_t* position;     // [experts] one position routed to the expert (calls of <= kDirectRewrite ids)
  int32_t* by_rank;      // [plan_len] the missing expert admitted at each rank
  int32_t* victim;       // [plan_len] the slot taken at each rank (admission_scan.cuh only)
  int misses;            // unique routed experts without a slot
  int unique;            // unique routed experts (for the counters)
  int64_t first_expert;  // this thread's expert of ids[threadIdx.x] (-1: none), kept for finish()
};

// Calls with at most this many routed ids (decode: one or two tokens) keep each position's expert
// in shared memory, so the thread that takes a victim also writes the slot ids of its expert's
// positions, and the call ends without another barrier; larger calls rewrite their slot ids in
// finish() (at 64 ids, victims' threads scanning the positions of repeated experts cost 4-5 us).
constexpr int kDirectRewrite = 16;

__device__ __forceinline__ int32_t (&position_experts())[kDirectRewrite] {
  __shared__ int32_t experts[kDirectRewrite];  // -1: position not routed
  return experts;
}

// Whether finish() needs a barrier before it (it reads the map the victims' threads wrote).
template <typename id_t, int kPolicy>
__device__ __forceinline__ bool rewrites_in_finish(const Args<id_t, kPolicy>& a) {
  return a.numel > kDirectRewrite;
}

// Whether a call's shared memory holds estimates_if_used: hit density's level and scan kernels
// (the decode kernel keeps its misses' estimates in its routing struct). The host's sizing and the
// kernels' carving both ask this.
__host__ __device__ constexpr bool with_estimates_if_used(bool hit_density, bool decode_kernel) {
  return hit_density && !decode_kernel;
}

// `with_estimates`: with_estimates_if_used.
__host__ __device__ inline size_t call_state_bytes(int64_t experts, int64_t plan_len, bool with_estimates) {
  return plan_len * (sizeof(uint64_t) + 2 * sizeof(int32_t)) + 3 * experts * sizeof(int) +
         (with_estimates ? experts * sizeof(int64_t) : 0);
}

__device__ __forceinline__ void carve(unsigned char* smem, int64_t experts, int64_t plan_len, bool with_estimates,
                                      CallState& c) {
  c.keys = reinterpret_cast<uint64_t*>(smem);
  // estimates_if_used lies between the keys and the counts.
  c.count = reinterpret_cast<int*>(reinterpret_cast<int64_t*>(c.keys + plan_len) + (with_estimates ? experts : 0));
  c.map = c.count + experts;
  c.position = c.map + experts;
  c.by_rank = c.position + experts;
  c.victim = c.by_rank + plan_len;
}

// Hit density's level and scan kernels (with_estimates_if_used): [experts] each expert's estimates
// if it is used in this call, right after the keys; computed once, with the map's loads, into
// shared memory rather than kept in registers (the 1,024-thread kernel has 64 a thread).
template <typename id_t, int kPolicy>
__device__ __forceinline__ int64_t* estimates_if_used(const Args<id_t, kPolicy>& a, const CallState& c) {
  return reinterpret_cast<int64_t*>(c.keys + a.plan_len);
}

// Minimum over the warp (every lane gets it).
template <typename T>
__device__ __forceinline__ T warp_min(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o < v ? o : v;
  }
  return v;
}

template <typename id_t, int kPolicy>
__device__ __forceinline__ bool routed(const Args<id_t, kPolicy>& a, int64_t i, int64_t* expert) {
  *expert = static_cast<int64_t>(a.ids[i]);
  return *expert >= 0 && *expert < a.experts;
}

// Dedup and hits, with one global round trip: the layer's map, the ids and the clock are read
// together; every id whose expert is resident gets its final slot at once, and hits are stamped
// `now` (so no victim search can pick them); with `hit_bits` (one bit per slot, zeroed by the
// caller before this), the hit slots are also marked there during the count. Misses are queued
// with their keys and ranked: most routed first, then by expert id (keys are distinct, so ranks
// are a permutation). `after_count(any_miss)` runs between the count and the hits, as soon as the
// block knows whether some id missed (c.count and hit_bits are final then): a kernel starts its
// victim search there, so the search's loads and first reduction share the barrier that ends the
// hits. Out-of-range ids are treated as not routed (raising would need a host sync). Three
// barriers.
template <int kThreads, typename id_t, int kPolicy, typename AfterCount>
__device__ __forceinline__ void dedup_and_refresh(const Args<id_t, kPolicy>& a, CallState& c, int64_t now,
                                                  uint32_t* hit_bits, AfterCount after_count) {
  __shared__ int counters[3];  // misses, unique routed experts, some id missed
  const int tid = threadIdx.x;
  const int32_t* layer_map = a.slot_of + a.layer * a.experts;
  // This thread's first id is loaded together with the map (one round trip instead of two), and
  // so are hit density's words of every expert's pair: estimates_if_used gets each expert's
  // estimates if it is used now, which the hits and the admitted misses store (a dependent round
  // trip after the count otherwise; prompt-sized calls route most experts).
  const int64_t first_id = tid < a.numel ? static_cast<int64_t>(a.ids[tid]) : -1;
#pragma unroll 1
  for (int e = tid; e < a.experts; e += kThreads) {
    c.count[e] = 0;
    c.map[e] = layer_map[e];
    if constexpr (Args<id_t, kPolicy>::kHitDensity) estimates_if_used(a, c)[e] = estimates_after_use(a, pair_words(a, e), now);
  }
#pragma unroll 1
  for (int i = tid; i < a.plan_len; i += kThreads) a.plan_e[i] = -1, a.plan_s[i] = -1;
  if (tid == 0) counters[0] = 0, counters[1] = 0, counters[2] = 0;
  __syncthreads();
  c.first_expert = -1;
#pragma unroll 1
  for (int i = tid; i < a.numel; i += kThreads) {
    const int64_t e = i == tid ? first_id : static_cast<int64_t>(a.ids[i]);
    const bool ok = e >= 0 && e < a.experts;
    int32_t slot = -1;
    if (i == tid && ok) c.first_expert = e;
    if (a.numel <= kDirectRewrite) position_experts()[i] = ok ? static_cast<int32_t>(e) : -1;
    if (ok) {
      atomicAdd(&c.count[e], 1);
      if (a.numel <= kDirectRewrite) atomicExch(&c.position[e], i);  // any one of them (see assign())
      slot = c.map[e];
      if (slot < 0) {
        atomicOr(&counters[2], 1);
      } else if (hit_bits != nullptr) {
        atomicOr(&hit_bits[slot >> 5], 1u << (slot & 31));
      }
    }
    a.slot_ids[i] = slot;  // misses are rewritten in assign() or finish() if admitted
  }
  __syncthreads();
  after_count(counters[2] != 0);
#pragma unroll 1
  for (int e = tid; e < a.experts; e += kThreads) {
    const int n = c.count[e];
    if (n == 0) continue;
    const int32_t s = c.map[e];
    if (s >= 0) {
      a.last_use[s] = now;
      if constexpr (Args<id_t, kPolicy>::kHitDensity) store_use(a, e, s, now, estimates_if_used(a, c)[e]);
    } else {  // assign() stores its estimates if the miss is admitted
      c.keys[atomicAdd(&counters[0], 1)] = (static_cast<uint64_t>(a.numel - n) << 32) | static_cast<uint64_t>(e);
    }
    if (a.stats != nullptr || a.shadow >= 0) atomicAdd(&counters[1], 1);  // the distinct count
  }
  __syncthreads();
  c.misses = counters[0];
  c.unique = counters[1];
  // Rank the misses by counting (read-only, so no barrier until by_rank is read after the
  // victim search's first barrier).
#pragma unroll 1
  for (int i = tid; i < c.misses; i += kThreads) {
    const uint64_t key = c.keys[i];
    int rank = 0;
    for (int j = 0; j < c.misses; ++j) rank += c.keys[j] < key;
    c.by_rank[rank] = static_cast<int32_t>(key & 0xffffffffu);
  }
}

// The start of every one-block call: the call's shared memory carved from `smem` (with
// estimates_if_used where the host sized it so: call_state_bytes), the kernel before it waited for,
// and the call's clock value `now` returned.
template <typename id_t, int kPolicy>
__device__ __forceinline__ int64_t start_call(const Args<id_t, kPolicy>& a, unsigned char* smem, CallState& c,
                                              bool with_estimates) {
  carve(smem, a.experts, a.plan_len, with_estimates, c);
  wait_for_previous_kernel();
  return a.clock[0] + 1;
}

// Admission rank r: expert e of the call's layer takes slot v from its previous owner `old` (a flat id,
// or -1). Victims are distinct, their old owners are distinct and never a miss of this call
// (misses own no slot), so the writes of different ranks never collide.
// `next`: hit density's estimates of the pair after this use (ignored by the other policies).
template <typename id_t, int kPolicy>
__device__ __forceinline__ void give_slot(const Args<id_t, kPolicy>& a, int r, int32_t e, int32_t v, int32_t old, int64_t now,
                                          int64_t next) {
  if (old >= 0) a.slot_of[old] = -1;
  a.slot_of[a.layer * a.experts + e] = v;
  a.owner_of[v] = static_cast<int32_t>(a.layer * a.experts + e);
  a.last_use[v] = now;
  store_use(a, e, v, now, next);
  a.plan_e[r] = e;
  a.plan_s[r] = v;
}

// give_slot for the expert of rank r in the block-wide call state, plus the call's shared map and,
// for decode-sized calls, the slot ids of the expert's positions.
template <typename id_t, int kPolicy>
__device__ __forceinline__ void assign(const Args<id_t, kPolicy>& a, CallState& c, int r, int32_t v, int32_t old, int64_t now) {
  const int32_t e = c.by_rank[r];
  give_slot(a, r, e, v, old, now, Args<id_t, kPolicy>::kHitDensity ? estimates_if_used(a, c)[e] : 0);
  c.map[e] = v;
  if (!rewrites_in_finish(a)) {  // this expert's positions get their slot here
    if (c.count[e] == 1) {
      a.slot_ids[c.position[e]] = v;  // decode: each expert routed once
    } else {
#pragma unroll 1
      for (int i = 0; i < a.numel; ++i) {
        if (position_experts()[i] == e) a.slot_ids[i] = v;
      }
    }
  }
}

// By one thread, at the end of a call: the plan's length, the clock, the call's counters (with
// no launch of their own); under Duel, its score, what it saw of the shadows and, in a launch with
// them, one more replay; in a shadow's block of such a launch, the shadow's counters
// (eviction_policy.h: a copy whose words the pool's block does not use, so no block waits for another).
template <typename id_t, int kPolicy>
__device__ __forceinline__ void write_call_totals(const Args<id_t, kPolicy>& a, int admitted, int unique, int64_t now) {
  a.num_copies[0] = admitted;
  a.clock[0] = now;
  if constexpr (Args<id_t, kPolicy>::kDuel) duel::store(a.duel, duel::next(a.duel), a.launch_words != nullptr);
  if (a.shadow >= 0) duel::count_replay(a.launch_words, a.shadow, a.numel, unique, admitted);
  if (a.stats != nullptr) {
    a.stats[0] += 1;
    a.stats[1] += a.numel;
    a.stats[2] += unique;
    a.stats[3] += admitted;
  }
}

// After every assign() (and a barrier if rewrites_in_finish()): ids of admitted experts get their
// new slot unless assign() wrote them; the count, the clock and the counters are written by
// thread 0.
template <int kThreads, typename id_t, int kPolicy>
__device__ __forceinline__ void finish(const Args<id_t, kPolicy>& a, const CallState& c, int admitted, int64_t now) {
  const int tid = threadIdx.x;
  if (admitted > 0 && rewrites_in_finish(a)) {  // the first id of each thread from a register: no global read here for decode
    if (c.first_expert >= 0) a.slot_ids[tid] = c.map[c.first_expert];
#pragma unroll 1
    for (int i = tid + kThreads; i < a.numel; i += kThreads) {
      int64_t e;
      if (routed(a, i, &e)) a.slot_ids[i] = c.map[e];
    }
  }
  if (tid == 0) write_call_totals(a, admitted, c.unique, now);
}

}  // namespace ft::cuda::admission
