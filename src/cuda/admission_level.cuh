// dedup_and_admit for pools of up to kThreads * kPerThread slots (4,096 at most): one block;
// thread t holds the stamps and owners of slots [t * kPerThread, (t + 1) * kPerThread) in
// registers, and victims are chosen level by level.
//
// A call that hits everything never reads the stamps. A call with misses issues their loads as
// soon as the count shows a miss (hits of the call are excluded through a bitmap, since their
// stamps may be rewritten while the loads are in flight), then takes victims level by level: a
// level is the smallest key left; its slots go in ascending slot order, so victims come out in
// exact ascending (last_use, slot) order. LRU stamps come in groups (every slot one admission call
// touches gets the same stamp; free slots all have 0), so a call needs few levels. One barrier per
// level: the pass that takes a level's members also finds the next level, and the per-warp
// results are double-buffered.
//
// Keys are 32 bits (the age of the stamp, inverted), so that warp minima and sums are single
// REDUX instructions; a pool where some eligible stamp is 2^32 - 2 or more calls old (after
// four billion calls) takes the same path on raw 64-bit stamps instead, so the order stays exact.
//
// Kept small on purpose: the miss path of the session-3 kernel executed ~950 instructions per
// warp, and its time grew with the pool size, not the number of misses.
#pragma once

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

// Takes up to `wanted` victims in ascending key order, then slot order; writes c.victim and
// c.victim_owner by rank and returns how many it took. Returns -1 without taking any if some
// thread passes `give_up` (decided at the first barrier, so every thread returns -1).
template <int kThreads, int kPerThread, typename Key>
__device__ __forceinline__ int take_by_level(Key (&key)[kPerThread], const int32_t (&owner)[kPerThread],
                                             bool give_up, int wanted, CallState& c) {
  using Traits = KeyTraits<Key>;
  constexpr int kWarps = kThreads / 32;
  __shared__ Key level_min[2][kWarps];  // per warp: the smallest key it has left
  __shared__ int level_count[2][kWarps];  // per warp: members of the current level
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  Key next = Traits::kNone;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) next = key[u] < next ? key[u] : next;
  next = Traits::warp_min(next);
  if (lane == 0) level_min[0][warp] = next;
  if (__syncthreads_or(give_up)) return -1;

  int taken = 0;
  for (int p = 0;; p ^= 1) {
    const Key level = Traits::warp_min(lane < kWarps ? level_min[p][lane] : Traits::kNone);
    if (level == Traits::kNone) break;  // nothing eligible left (the same in every thread)
    uint32_t member = 0;
    next = Traits::kNone;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const bool in = key[u] == level;
      member |= static_cast<uint32_t>(in) << u;
      key[u] = in ? Traits::kNone : key[u];
      next = key[u] < next ? key[u] : next;
    }
    const int mine = __popc(member);
    const int warp_total = __reduce_add_sync(0xffffffffu, mine);
    int before_lane = 0;  // members of this level in lanes below mine
    if (warp_total > 0) {
      int inclusive = mine;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += o;
      }
      before_lane = inclusive - mine;
    }
    next = Traits::warp_min(next);
    if (lane == 0) {
      level_count[p][warp] = warp_total;
      level_min[p ^ 1][warp] = next;
    }
    __syncthreads();
    const int count = lane < kWarps ? level_count[p][lane] : 0;
    const int before_warp = __reduce_add_sync(0xffffffffu, lane < warp ? count : 0);
    const int level_total = __reduce_add_sync(0xffffffffu, count);
    if (member != 0) {
      int r = taken + before_warp + before_lane;
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        if ((member >> u) & 1u) {
          if (r < wanted) {
            c.victim[r] = tid * kPerThread + u;
            c.victim_owner[r] = owner[u];
          }
          ++r;
        }
      }
    }
    taken += level_total;
    if (taken >= wanted) break;
  }
  return taken < wanted ? taken : wanted;
}

template <int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(kThreads) admit_by_level_kernel(const Args<id_t> a) {
  static_assert(kPerThread % 4 == 0 && 32 % kPerThread == 0, "whole int4 loads, one bitmap word");
  constexpr int kSlots = kThreads * kPerThread;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint32_t hit_bits[kSlots / 32];  // slots hit by this call

  const int tid = threadIdx.x;
  const int first = tid * kPerThread;  // my slots: [first, first + kPerThread)
  CallState c;
  carve(smem_raw, a.experts, a.plan_len, c);
  if (tid < kSlots / 32) hit_bits[tid] = 0;
  const int64_t now = a.clock[0] + 1;

  int64_t stamp[kPerThread];
  int32_t owner[kPerThread];
  dedup_and_refresh<kThreads>(a, c, now, hit_bits, [&](bool any_miss) {
    if (!any_miss) return;
    if (a.vector_slots && first + kPerThread <= a.slots) {
#pragma unroll
      for (int u = 0; u < kPerThread; u += 2) {
        const longlong2 v = *reinterpret_cast<const longlong2*>(a.last_use + first + u);
        stamp[u] = v.x, stamp[u + 1] = v.y;
      }
#pragma unroll
      for (int u = 0; u < kPerThread; u += 4) {
        const int4 v = *reinterpret_cast<const int4*>(a.owner_of + first + u);
        owner[u] = v.x, owner[u + 1] = v.y, owner[u + 2] = v.z, owner[u + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        const bool in = first + u < a.slots;
        stamp[u] = in ? a.last_use[first + u] : LLONG_MAX;
        owner[u] = in ? a.owner_of[first + u] : -1;
      }
    }
  });
  const int wanted = static_cast<int>(ft::admitted_count(c.misses, a.fetch_fraction));

  int admitted = 0;
  if (wanted > 0) {
    const uint32_t hits = hit_bits[first >> 5] >> (first & 31);
    const uint32_t lo = static_cast<uint32_t>(a.protect_lo);
    const uint32_t span = static_cast<uint32_t>(a.protect_hi > a.protect_lo ? a.protect_hi - a.protect_lo : 0);
    uint32_t eligible = 0;
    uint32_t key32[kPerThread];
    bool wide = false;
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const uint32_t s = static_cast<uint32_t>(first + u);
      const bool ok = stamp[u] < now && !((hits >> u) & 1u) && s - lo >= span;
      const int64_t age = now - 1 - stamp[u];  // >= 0 when eligible
      eligible |= static_cast<uint32_t>(ok) << u;
      wide |= ok && age >= 0xfffffffe;
      key32[u] = ok ? 0xfffffffeu - static_cast<uint32_t>(age) : KeyTraits<uint32_t>::kNone;
    }
    admitted = take_by_level<kThreads, kPerThread>(key32, owner, wide, wanted, c);
    if (admitted < 0) {  // some stamp too old for 32-bit ages: the same search on raw stamps
      int64_t key64[kPerThread];
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) key64[u] = (eligible >> u) & 1u ? stamp[u] : KeyTraits<int64_t>::kNone;
      admitted = take_by_level<kThreads, kPerThread>(key64, owner, false, wanted, c);
    }
    __syncthreads();
#pragma unroll 1
    for (int r = tid; r < admitted; r += kThreads) assign(a, c, r, c.victim[r], c.victim_owner[r], now);
  }
  __syncthreads();
  finish<kThreads>(a, c, admitted, now);
}

}  // namespace ft::cuda::admission
