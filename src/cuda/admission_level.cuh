// dedup_and_admit for pools of up to kThreads * kPerThread slots (4,096 at most): one block;
// thread t holds the stamps and owners of slots [t * kPerThread, (t + 1) * kPerThread) in
// registers, and victims are chosen level by level.
//
// A call that hits everything never reads the stamps. A call with misses loads them as soon as
// the count shows a miss and publishes the first level before the barrier that ends the hits,
// then takes victims level by level: a level is the smallest key left; its slots go in ascending
// slot order, so victims come out in exact ascending (last_use, slot) order, and the thread that
// holds a victim rewrites the maps at once. LRU stamps come in groups (every slot one admission
// call touches gets the same stamp; free slots all have 0), so a call needs few levels. One
// barrier per level: the pass that takes a level's members also finds the next level, and the
// per-warp results are double-buffered. With one level, a call with misses has two barriers more
// than one without.
//
// Keys are the stamps as 32 bits while the clock is below 2^32 - 1 (the first four billion calls),
// so that warp minima are single REDUX instructions; after that the same code runs on 64-bit
// stamps. Either way the order is exact.
//
// Measured (docs/perf_notes.md): a call without misses ~2.3 us per graph-replayed launch; with
// misses ~2.2 us more at 4,096 slots whatever their number (1.3 us at 1,024), little of it
// instruction count (cutting ~19 to ~5 instructions per slot before the level loop gained ~0.2 us).
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

// Each warp's smallest key, double-buffered by level parity (one array per key type).
template <typename Key, int kWarps>
__device__ __forceinline__ Key (&level_minima())[2][kWarps] {
  __shared__ Key minima[2][kWarps];
  return minima;
}

// Publishes this warp's smallest key as the first level's candidate (a barrier must follow).
template <int kThreads, int kPerThread, typename Key>
__device__ __forceinline__ void publish_first_level(const Key (&key)[kPerThread]) {
  using Traits = KeyTraits<Key>;
  Key least = Traits::kNone;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) least = key[u] < least ? key[u] : least;
  least = Traits::warp_min(least);
  if ((threadIdx.x & 31) == 0) level_minima<Key, kThreads / 32>()[0][threadIdx.x >> 5] = least;
}

// Takes up to `wanted` victims in ascending key order, then slot order, calling take(rank, u)
// in the thread that holds each (u: its index among the thread's slots), and returns how many it
// took. publish_first_level and a barrier must come first.
template <int kThreads, int kPerThread, typename Key, typename Take>
__device__ __forceinline__ int take_by_level(Key (&key)[kPerThread], int wanted, Take take) {
  using Traits = KeyTraits<Key>;
  constexpr int kWarps = kThreads / 32;
  Key(&level_min)[2][kWarps] = level_minima<Key, kWarps>();
  __shared__ int level_count[2][kWarps];  // per warp: members of the current level
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int taken = 0;
  for (int p = 0;; p ^= 1) {
    const Key level = Traits::warp_min(lane < kWarps ? level_min[p][lane] : Traits::kNone);
    if (level == Traits::kNone) break;  // nothing eligible left (the same in every thread)
    uint32_t member = 0;
    Key next = Traits::kNone;
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
    int r = taken + before_warp + before_lane;
#pragma unroll 1
    for (uint32_t m = member; m != 0 && r < wanted; m &= m - 1, ++r) take(r, __ffs(m) - 1);
    taken += level_total;
    if (taken >= wanted) break;
  }
  return taken < wanted ? taken : wanted;
}

// The whole call with keys of type Key: the stamps themselves, as 32 bits while the clock is
// below 2^32 - 1 (every stamp then fits), as 64 bits after that.
template <int kThreads, int kPerThread, typename Key, typename id_t>
__device__ __forceinline__ void admit_with_keys(const Args<id_t>& a, CallState& c, int64_t now) {
  using Traits = KeyTraits<Key>;
  constexpr int kSlots = kThreads * kPerThread;
  __shared__ uint32_t hit_bits[kSlots / 32];  // slots hit by this call
  const int tid = threadIdx.x;
  const int first = tid * kPerThread;  // my slots: [first, first + kPerThread)
  if (tid < kSlots / 32) hit_bits[tid] = 0;

  Key key[kPerThread];
  int32_t owner[kPerThread];
  // Once the count shows a miss: load my slots' stamps and owners, key the ones that may be
  // evicted (older than `now`, not hit by this call, not protected), and publish the first level,
  // all before the barrier that ends the hits. Hits are excluded through hit_bits, since their
  // stamps may be rewritten while the loads are in flight.
  dedup_and_refresh<kThreads>(a, c, now, hit_bits, [&](bool any_miss) {
    if (!any_miss) return;
    int64_t stamp[kPerThread];
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
    uint32_t excluded = hit_bits[first >> 5] >> (first & 31);
    if (first < a.protect_hi && first + kPerThread > a.protect_lo) {  // rare: the range is mine
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        excluded |= static_cast<uint32_t>(first + u >= a.protect_lo && first + u < a.protect_hi) << u;
      }
    }
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const bool ok = stamp[u] < now && !((excluded >> u) & 1u);
      key[u] = ok ? static_cast<Key>(stamp[u]) : Traits::kNone;
    }
    publish_first_level<kThreads, kPerThread>(key);
  });
  const int wanted = static_cast<int>(ft::admitted_count(c.misses, a.fetch_fraction));
  int admitted = 0;
  if (wanted > 0) {
    // The thread holding a victim rewrites the maps (by_rank was written before the level's barrier).
    admitted = take_by_level<kThreads, kPerThread>(key, wanted, [&](int r, int u) {
      int32_t old = owner[0];
#pragma unroll
      for (int i = 1; i < kPerThread; ++i) old = i == u ? owner[i] : old;
      assign(a, c, r, first + u, old, now);
    });
  }
  FT_ADMIT_MARK(5);  // victims taken
  __syncthreads();
  finish<kThreads>(a, c, admitted, now);
}

template <int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(kThreads) admit_by_level_kernel(const Args<id_t> a) {
  static_assert(kPerThread % 4 == 0 && 32 % kPerThread == 0, "whole int4 loads, a thread's hit bits in one word");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  CallState c;
  carve(smem_raw, a.experts, a.plan_len, c);
  FT_ADMIT_MARK(0);  // the block runs
  wait_for_previous_kernel();
  FT_ADMIT_MARK(1);  // the previous kernel is done
  if (a.prefetch_slots) {
    // Non-blocking: if the call has a miss, its stamp and owner loads then hit L1 instead of
    // waiting on L2 after the count (each line starts at some thread's first slot).
    const int64_t first = static_cast<int64_t>(threadIdx.x) * kPerThread;
    if (first < a.slots) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(a.last_use + first));
      asm volatile("prefetch.global.L1 [%0];" ::"l"(a.owner_of + first));
    }
  }
  const int64_t now = a.clock[0] + 1;
  if (now < int64_t{KeyTraits<uint32_t>::kNone}) {  // the first four billion calls
    admit_with_keys<kThreads, kPerThread, uint32_t>(a, c, now);
  } else {
    admit_with_keys<kThreads, kPerThread, int64_t>(a, c, now);
  }
  FT_ADMIT_MARK(7);  // done (its stores may still be draining)
}

}  // namespace ft::cuda::admission
