// dedup_and_admit for pools of up to kThreads * kPerThread slots (8,192 at most): one block;
// each thread holds the stamps of kPerThread slots in registers (pairs of slots kThreads pairs
// apart, so that the loads are coalesced; see slot_of_stamp), and victims are chosen level by
// level.
//
// A call that hits everything never reads the stamps. A call with misses loads them as soon as
// the count shows a miss and publishes the first level before the barrier that ends the hits,
// then takes victims level by level: a level is the smallest key left (the policy's key of the
// stamp, src/common/eviction_policy.h); its slots go in ascending slot order, so victims come out
// in exact ascending (key, slot) order, and the thread that
// holds a victim rewrites the maps at once (and, for calls of up to kDirectRewrite ids, the slot
// ids of its expert's positions, so the call ends without another barrier). LRU stamps come in
// groups (every slot one admission call touches gets the same stamp; free slots all have 0), so
// a call needs few levels. Each warp publishes its first-level member count with its minimum
// before the barrier that ends the hits, so the first level needs no pass of its own (one barrier,
// after which the misses' block-wide ranks are read). Each further level has one barrier: the pass
// that takes a level's members also finds the next level, and the per-warp results are
// double-buffered. Decode calls take admission_decode.cuh, built from the same pieces.
//
// Keys are 32 bits while every eligible key fits (now + L < 2^32 - 1: the first four billion
// calls), so that warp minima are single REDUX instructions; after that the same code runs on
// 64-bit keys. Either way the order is exact. Under LRU a key is the stamp; under Opportunity it
// is a one-to-one function of the stamp within a call, so a call still walks one level per
// distinct stamp among its victims.
//
#pragma once

#include <type_traits>

#include "admission_common.cuh"

namespace ft::cuda::admission {

template <typename Key>
struct KeyTraits;

template <>
struct KeyTraits<uint32_t> {
  static constexpr uint32_t kNone = 0xffffffffu;  // not eligible, or already taken
  __device__ static uint32_t warp_min(uint32_t v) { return __reduce_min_sync(0xffffffffu, v); }
};

template <>
struct KeyTraits<int64_t> {
  static constexpr int64_t kNone = LLONG_MAX;
  __device__ static int64_t warp_min(int64_t v) { return admission::warp_min(v); }
};

// Each warp's smallest key, double-buffered by level parity (one array per key type).
template <typename Key, int kWarps>
__device__ __forceinline__ Key (&level_minima())[2][kWarps] {
  __shared__ Key minima[2][kWarps];
  return minima;
}

// Slot of a thread's u-th stamp: thread t holds the pairs t, t + kThreads, t + 2 kThreads, ...
// (pair q = slots 2q and 2q + 1), so that each warp's 16-byte loads of a row of pairs read 512
// bytes in a row: coalesced loads of the stamps take half the time of per-thread contiguous
// ranges (measured on an H200). In slot order the pairs go row by row (c), then
// thread by thread, then within the pair (j).
// `base`: the slot of stamp thread 0's first pair, shifted (admission_decode.cuh's stamp threads
// start at thread 32, so it passes -64).
template <int kThreads>
__device__ __forceinline__ int slot_of_stamp(int u, int base = 0) {
  return base + 2 * ((u >> 1) * kThreads + static_cast<int>(threadIdx.x)) + (u & 1);
}

// Field c of counters packed 8 bits (per warp) or 16 bits (per block) apiece.
__device__ __forceinline__ int field8(uint32_t v, int c) { return static_cast<int>((v >> (8 * c)) & 0xffu); }
__device__ __forceinline__ int field8(uint64_t v, int c) { return static_cast<int>((v >> (8 * c)) & 0xffu); }

// The word that holds per-row member counts in 8-bit fields (a row is a pair of slots per thread):
// 32 bits for up to 4 rows (8 stamps per thread), 64 bits for up to 8.
template <int kPerThread>
using RowCounts = std::conditional_t<(kPerThread / 2 <= 4), uint32_t, uint64_t>;

// The warp's sum of per-row counts (no field overflows: a warp has at most 64 members per row).
__device__ __forceinline__ uint32_t warp_sum(uint32_t v) { return __reduce_add_sync(0xffffffffu, v); }
__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
  const uint32_t lo = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(v));
  const uint32_t hi = __reduce_add_sync(0xffffffffu, static_cast<uint32_t>(v >> 32));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Each warp's member count of a level, per row in 8-bit fields, double-buffered by level parity.
template <int kWarps, typename W = uint32_t>
__device__ __forceinline__ W (&level_counts())[2][kWarps] {
  __shared__ W counts[2][kWarps];
  return counts;
}

// A level as one thread sees it: its members (bit u: its u-th stamp), per row the members in
// lanes below it (8-bit fields; a warp has at most 64 per row), and the warp's count per row.
template <typename W = uint32_t>
struct LevelMembersOf {
  uint32_t member = 0;
  W before_lane = 0, warp_rows = 0;
};
using LevelMembers = LevelMembersOf<uint32_t>;

template <int kPerThread, typename Key>
__device__ __forceinline__ LevelMembersOf<RowCounts<kPerThread>> members_of(const Key (&key)[kPerThread], Key level) {
  using W = RowCounts<kPerThread>;
  LevelMembersOf<W> m;
  W rows = 0;  // field c: my members in row c
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const bool in = key[u] == level;
    m.member |= static_cast<uint32_t>(in) << u;
    rows += static_cast<W>(in) << (8 * (u >> 1));
  }
  m.warp_rows = warp_sum(rows);
  if (m.warp_rows != 0) {
    const int lane = threadIdx.x & 31;
    W inclusive = rows;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const W o = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += o;
    }
    m.before_lane = inclusive - rows;
  }
  return m;
}

// Drops a level's members (bit u of `member`: the thread's u-th key) from the keys and returns
// the thread's smallest key left (the next level's candidate).
template <int kPerThread, typename Key>
__device__ __forceinline__ Key drop_members(Key (&key)[kPerThread], uint32_t member) {
  Key least = KeyTraits<Key>::kNone;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    key[u] = (member >> u) & 1u ? KeyTraits<Key>::kNone : key[u];
    least = key[u] < least ? key[u] : least;
  }
  return least;
}

// The first level's candidate from each warp: its smallest key and, with it, the warp's members
// of that key, so that if it is the block's level no second barrier is needed to rank them.
template <typename Key, typename W = uint32_t>
struct FirstLevel {
  Key least;
  LevelMembersOf<W> members;
};

// Sets `f` to this warp's first-level candidate: its smallest key and that key's members.
template <int kPerThread, typename Key, typename W>
__device__ __forceinline__ void find_first_level(const Key (&key)[kPerThread], FirstLevel<Key, W>& f) {
  using Traits = KeyTraits<Key>;
  f.least = Traits::kNone;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) f.least = key[u] < f.least ? key[u] : f.least;
  f.least = Traits::warp_min(f.least);
  if (f.least != Traits::kNone) f.members = members_of<kPerThread>(key, f.least);
}

// Finds and publishes this warp's smallest key and its member count (a barrier must follow).
template <int kThreads, int kPerThread, typename Key>
__device__ __forceinline__ FirstLevel<Key, RowCounts<kPerThread>> publish_first_level(const Key (&key)[kPerThread]) {
  using W = RowCounts<kPerThread>;
  constexpr int kWarps = kThreads / 32;
  FirstLevel<Key, W> f;
  find_first_level<kPerThread>(key, f);
  if ((threadIdx.x & 31) == 0) {
    level_minima<Key, kWarps>()[0][threadIdx.x >> 5] = f.least;
    level_counts<kWarps, W>()[0][threadIdx.x >> 5] = f.members.warp_rows;
  }
  return f;
}

// Ranks one level's members in slot order and calls take(rank, u) for those below `wanted`;
// returns the level's size. `count`: in lane w, warp w's members of the level per row (8-bit
// fields). A member's rank counts the members before it: those of earlier rows, those of its
// row in lower warps and lanes, and the pair's first slot if it is the second.
template <int kThreads, int kPerThread, typename W, typename Take>
__device__ __forceinline__ int take_members(const LevelMembersOf<W>& m, W count, int taken, int wanted, Take take) {
  constexpr int kRows = kPerThread / 2, kPairs = (kRows + 1) / 2, kWords = (kRows + 3) / 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Rows 2p and 2p + 1 as the 16-bit fields of word p (a block row has up to 2 * kThreads
  // members); the block's members before my warp and in all warps, per word.
  uint32_t pair[kPairs], before[kPairs], total[kPairs];
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const uint32_t rows = static_cast<uint32_t>(count >> (16 * p));  // rows 2p, 2p + 1 in its low 16 bits
    pair[p] = (rows & 0xffu) | ((rows & 0xff00u) << 8);
  }
#pragma unroll
  for (int p = 0; p < kPairs; ++p) before[p] = __reduce_add_sync(0xffffffffu, lane < warp ? pair[p] : 0u);
#pragma unroll
  for (int p = 0; p < kPairs; ++p) total[p] = __reduce_add_sync(0xffffffffu, pair[p]);
  // Field c % 4 of word c / 4 (16 bits; ranks stay below 2^16): the rank of my first member in
  // row c, if any.
  uint64_t row_first[kWords] = {};
  int level_total = 0;
#pragma unroll
  for (int c = 0; c < kRows; ++c) {
    const int shift = 16 * (c & 1);
    const int first = taken + level_total + static_cast<int>((before[c / 2] >> shift) & 0xffffu) + field8(m.before_lane, c);
    row_first[c / 4] |= static_cast<uint64_t>(first & 0xffff) << (16 * (c % 4));
    level_total += static_cast<int>((total[c / 2] >> shift) & 0xffffu);
  }
  // My members in slot order have increasing ranks: stop at the first one not wanted.
#pragma unroll 1
  for (uint32_t bits = m.member; bits != 0; bits &= bits - 1) {  // a runtime loop: one copy of take()
    const int u = __ffs(bits) - 1, c = u >> 1;
    uint64_t word = row_first[0];  // u is known only here: a select, not an indexed (local) array
    if constexpr (kWords > 1) word = c < 4 ? row_first[0] : row_first[kWords - 1];
    int r = static_cast<int>((word >> (16 * (c & 3))) & 0xffffu);
    if (u & 1) r += static_cast<int>((m.member >> (u - 1)) & 1u);  // after the pair's first slot
    if (r >= wanted) break;
    take(r, u);
  }
  return level_total;
}

// After a first level whose members of this thread were `member` (already given, `taken` of
// them in the block): takes the further levels' victims until `wanted`, one barrier per level,
// and returns how many the call took in all. Every thread of the block must call it. The pass
// that takes a level's members also finds the next level; the per-warp results are
// double-buffered (level_min[1] first: [0] may still be read until the first barrier here).
template <int kThreads, int kPerThread, typename Key, typename Take>
__device__ __forceinline__ int take_further_levels(Key (&key)[kPerThread], uint32_t member, int taken, int wanted,
                                                   Take take) {
  using Traits = KeyTraits<Key>;
  using W = RowCounts<kPerThread>;
  constexpr int kWarps = kThreads / 32;
  Key(&level_min)[2][kWarps] = level_minima<Key, kWarps>();
  W(&level_count)[2][kWarps] = level_counts<kWarps, W>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Key next = Traits::warp_min(drop_members(key, member));
  if (lane == 0) level_min[1][warp] = next;
  __syncthreads();
  for (int p = 1;; p ^= 1) {
    const Key lvl = Traits::warp_min(lane < kWarps ? level_min[p][lane] : Traits::kNone);
    if (lvl == Traits::kNone) break;  // nothing eligible left
    const LevelMembersOf<W> m = members_of<kPerThread>(key, lvl);
    next = Traits::warp_min(drop_members(key, m.member));
    if (lane == 0) {
      level_count[p][warp] = m.warp_rows;
      level_min[p ^ 1][warp] = next;
    }
    __syncthreads();
    taken += take_members<kThreads, kPerThread>(m, lane < kWarps ? level_count[p][lane] : W{0}, taken, wanted, take);
    if (taken >= wanted) break;
  }
  return taken < wanted ? taken : wanted;
}

// Takes up to `wanted` victims in ascending key order, then slot order, calling take(rank, u)
// in the thread that holds each (u: its index among the thread's stamps), and returns how many
// it took. publish_first_level (its result is `first`) and a barrier must come first.
//
// The first level needs no barrier of its own: the warps whose smallest key is the block's level
// published their member counts with it. A call that needs more levels (the first one holds
// fewer than `wanted` slots) goes on in take_further_levels.
template <int kThreads, int kPerThread, typename Key, typename Take>
__device__ __forceinline__ int take_by_level(Key (&key)[kPerThread],
                                             const FirstLevel<Key, RowCounts<kPerThread>>& first, int wanted,
                                             Take take) {
  using Traits = KeyTraits<Key>;
  using W = RowCounts<kPerThread>;
  constexpr int kWarps = kThreads / 32;
  static_assert(kPerThread / 2 >= 1 && kPerThread / 2 <= 8 && kThreads * 2 < 65536, "8-bit fields per row in one word");
  Key(&level_min)[2][kWarps] = level_minima<Key, kWarps>();
  W(&level_count)[2][kWarps] = level_counts<kWarps, W>();
  const int lane = threadIdx.x & 31;

  const Key level = Traits::warp_min(lane < kWarps ? level_min[0][lane] : Traits::kNone);
  if (level == Traits::kNone) return 0;  // nothing eligible (the same in every thread)
  const LevelMembersOf<W> members = first.least == level ? first.members : LevelMembersOf<W>{};
  const W count = lane < kWarps && level_min[0][lane] == level ? level_count[0][lane] : W{0};
  const int taken = take_members<kThreads, kPerThread>(members, count, 0, wanted, take);
  if (taken >= wanted) return wanted;
  return take_further_levels<kThreads, kPerThread>(key, members.member, taken, wanted, take);
}

// Loads this thread's stamps (pairs of slots a block apart from `base` on; LLONG_MAX past the pool)
// and, under hit density, the slots' mirrored estimates with them (one round trip for both).
// `lru_keys`: a Duel call that takes LRU's keys (duel_lru_keys), whose estimates become
// duel::kLruKeys.
template <int kThreads, int kPerThread, typename id_t, int kPolicy>
__device__ __forceinline__ void load_stamps(const Args<id_t, kPolicy>& a, int64_t (&stamp)[kPerThread],
                                            int64_t (&estimates)[kPerThread], int base, bool lru_keys) {
  constexpr bool kDensity = Args<id_t, kPolicy>::kHitDensity;
  // Under Duel a call that takes LRU's keys loads no estimates (the flag is dead after this).
  const bool density_loads = kDensity && !(Args<id_t, kPolicy>::kDuel && lru_keys);
  const int64_t no_estimates = Args<id_t, kPolicy>::kDuel ? duel::kLruKeys : 0;  // unused by LRU, Opportunity
#pragma unroll
  for (int row = 0; row < kPerThread / 2; ++row) {
    const int s = slot_of_stamp<kThreads>(2 * row, base);  // the pair's first slot (even)
    estimates[2 * row] = estimates[2 * row + 1] = no_estimates;
    if (a.vector_slots && s + 1 < a.slots) {
      const longlong2 v = *reinterpret_cast<const longlong2*>(a.last_use + s);
      stamp[2 * row] = v.x, stamp[2 * row + 1] = v.y;
      if (density_loads) {  // the state tensor's slot part starts at an even entry: 16-byte aligned
        const longlong2 w = *reinterpret_cast<const longlong2*>(a.slot_estimates + s);
        estimates[2 * row] = w.x, estimates[2 * row + 1] = w.y;
      }
    } else {
      stamp[2 * row] = s < a.slots ? a.last_use[s] : LLONG_MAX;
      stamp[2 * row + 1] = s + 1 < a.slots ? a.last_use[s + 1] : LLONG_MAX;
      if (density_loads) {
        estimates[2 * row] = s < a.slots ? a.slot_estimates[s] : 0;
        estimates[2 * row + 1] = s + 1 < a.slots ? a.slot_estimates[s + 1] : 0;
      }
    }
  }
}

// Bit u: this thread's u-th slot is hit by this call (hit_bits: one bit per slot).
template <int kThreads, int kPerThread>
__device__ __forceinline__ uint32_t hit_stamps(const uint32_t* hit_bits, int base = 0) {
  uint32_t hit = 0;
#pragma unroll
  for (int row = 0; row < kPerThread / 2; ++row) {
    const int s = slot_of_stamp<kThreads>(2 * row, base);  // even, so the pair's bits share a word
    hit |= ((hit_bits[s >> 5] >> (s & 31)) & 3u) << (2 * row);
  }
  return hit;
}

// `excluded` (bit u: the u-th slot) with the thread's protected slots added.
template <int kThreads, int kPerThread, typename id_t, int kPolicy>
__device__ __forceinline__ uint32_t with_protected(const Args<id_t, kPolicy>& a, uint32_t excluded, int base) {
  if (a.protect_lo < a.protect_hi) {
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int s = slot_of_stamp<kThreads>(u, base);
      excluded |= static_cast<uint32_t>(s >= a.protect_lo && s < a.protect_hi) << u;
    }
  }
  return excluded;
}

// One slot's key: its stamp's where the slot may be evicted (`ok`: older than `now`, not excluded,
// not protected), kNone where not.
template <typename Key, typename id_t, int kPolicy>
__device__ __forceinline__ Key key_of_slot(const Args<id_t, kPolicy>& a, int64_t stamp, int64_t estimates, int64_t now, bool ok) {
  if constexpr (std::is_same_v<Key, uint32_t>) {
    return ok ? key32_of_stamp(a, stamp, now, estimates) : KeyTraits<Key>::kNone;
  } else {
    return ok ? static_cast<Key>(key_of_stamp(a, stamp, now, estimates)) : KeyTraits<Key>::kNone;
  }
}

// Keys of this thread's slots: the stamp where the slot may be evicted (older than `now`, not in
// `excluded` (bit u: the u-th slot), not protected), kNone where not.
template <int kThreads, int kPerThread, typename Key, typename id_t, int kPolicy>
__device__ __forceinline__ void key_stamps_excluding(const Args<id_t, kPolicy>& a, const int64_t (&stamp)[kPerThread],
                                                     const int64_t (&estimates)[kPerThread], int64_t now,
                                                     uint32_t excluded, Key (&key)[kPerThread], int base = 0) {
  excluded = with_protected<kThreads, kPerThread>(a, excluded, base);
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    key[u] = key_of_slot<Key>(a, stamp[u], estimates[u], now, stamp[u] < now && !((excluded >> u) & 1u));
  }
}

// The same with this call's hits excluded through hit_bits (one bit per slot), since their stamps
// may be rewritten while the loads are in flight.
template <int kThreads, int kPerThread, typename Key, typename id_t, int kPolicy>
__device__ __forceinline__ void key_stamps(const Args<id_t, kPolicy>& a, const int64_t (&stamp)[kPerThread],
                                           const int64_t (&estimates)[kPerThread], int64_t now,
                                           const uint32_t* hit_bits, Key (&key)[kPerThread], int base = 0) {
  key_stamps_excluding<kThreads, kPerThread>(a, stamp, estimates, now, hit_stamps<kThreads, kPerThread>(hit_bits, base),
                                             key, base);
}

// The whole call with keys of type Key: the stamps' keys, as 32 bits while they fit
// (now + L < 2^32 - 1 under Opportunity and hit density, now < 2^32 - 1 under LRU), as 64 bits
// after that.
template <int kThreads, int kPerThread, typename Key, typename id_t, int kPolicy>
__device__ __forceinline__ void admit_with_keys(const Args<id_t, kPolicy>& a, CallState& c, int64_t now,
                                                const FetchSplit& split) {
  using Traits = KeyTraits<Key>;
  constexpr int kSlots = kThreads * kPerThread;
  __shared__ uint32_t hit_bits[kSlots / 32];  // slots hit by this call
  // Duel: whether the call takes LRU's keys, decided by thread 0 before the dedup's first barrier
  // (the 1,024-thread kernel has no registers to spare for every thread to decide it beside its
  // stamps) and read after its second, where the stamps are loaded.
  __shared__ bool duel_lru;
  const int tid = threadIdx.x;
  if (tid < kSlots / 32) hit_bits[tid] = 0;
  if constexpr (Args<id_t, kPolicy>::kDuel) {
    if (tid == 0) duel_lru = duel_lru_keys(a);
  }

  Key key[kPerThread];
  FirstLevel<Key, RowCounts<kPerThread>> first{};
  // Once the count shows a miss: load my slots' stamps, key them, and publish the first level, all
  // before the barrier that ends the hits.
  dedup_and_refresh<kThreads>(a, c, now, hit_bits, [&](bool any_miss) {
    if (!any_miss) return;
    int64_t stamp[kPerThread], estimates[kPerThread];
    load_stamps<kThreads, kPerThread>(a, stamp, estimates, 0, Args<id_t, kPolicy>::kDuel && duel_lru);
    key_stamps<kThreads, kPerThread>(a, stamp, estimates, now, hit_bits, key);
    first = publish_first_level<kThreads, kPerThread>(key);
  });
  const int wanted = static_cast<int>(ft::admitted_count(c.misses, split));
  int admitted = 0;
  if (wanted > 0) {
    // The misses were ranked after the hits' barrier: the first level's victims read by_rank
    // after another. (admission_decode.cuh ranks decode calls' misses before it.)
    __syncthreads();
    // The thread holding a victim rewrites the maps.
    // The victim's owner is read here, by its thread only: loading every slot's owner with the
    // stamps would add a third to the bytes one SM loads on the miss path.
    admitted = take_by_level<kThreads, kPerThread>(key, first, wanted, [&](int r, int u) {
      const int s = slot_of_stamp<kThreads>(u);
      assign(a, c, r, s, a.owner_of[s], now);
    });
  }
  if (rewrites_in_finish(a)) __syncthreads();
  finish<kThreads>(a, c, admitted, now);
}

// The whole call, by the whole block.
template <int kThreads, int kPerThread, typename id_t, int kPolicy>
__device__ __forceinline__ void admit_by_level(const Args<id_t, kPolicy>& a) {
  static_assert(kPerThread % 2 == 0, "whole pairs of slots per thread");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  CallState c;
  const int64_t now = start_call(a, smem_raw, c, with_estimates_if_used(Args<id_t, kPolicy>::kHitDensity, false));
  // Every thread reads the split's counters before the call's first barrier: thread 0 adds to
  // them at the end, and a call that admits nothing may reach that without another barrier.
  const FetchSplit split = split_of(a);
  // 32-bit keys while every eligible key is below 2^32 - 1 (the first four billion calls): stamps
  // are below now, the opportunity policy's keys below now + L. One comparison for every policy
  // (under LRU the layers term is 0).
  if (now < int64_t{KeyTraits<uint32_t>::kNone} - (Args<id_t, kPolicy>::kLru ? 0 : a.layers)) {
    admit_with_keys<kThreads, kPerThread, uint32_t>(a, c, now, split);
  } else {
    admit_with_keys<kThreads, kPerThread, int64_t>(a, c, now, split);
  }
}

template <int kThreads, int kPerThread, typename id_t, int kPolicy>
__global__ void __launch_bounds__(kThreads, 1) admit_by_level_kernel(const Args<id_t, kPolicy> a) {
  admit_by_level<kThreads, kPerThread>(a);
}

// Duel's call and its shadow caches' replay in one launch (admission_common.cuh, write_call_totals).
template <int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(kThreads, 1) admit_by_level_with_shadows_kernel(
    const Args<id_t, kLruPolicy> lru, const Args<id_t, kHitDensityPolicy> density, const Args<id_t, kDuelPolicy> pool) {
  if (blockIdx.x == 0) {
    admit_by_level<kThreads, kPerThread>(lru);
  } else if (blockIdx.x == 1) {
    admit_by_level<kThreads, kPerThread>(density);
  } else {
    admit_by_level<kThreads, kPerThread>(pool);
  }
}

}  // namespace ft::cuda::admission
