// dedup_and_admit for pools of more than 8,192 slots (limits::kMaxRegisterPoolSlots): one block of kScanThreads; the victim
// search scans the stamps in global memory (hits of the call are already stamped `now` there),
// keys them by the policy (src/common/eviction_policy.h), each thread keeping its kBatch smallest
// keys in registers, and merges the threads' sorted lists;
// one pass of the pool yields up to kBatch victims, so a call scans it ceil(wanted / kBatch) times.
#pragma once

#include "../common/limits.h"
#include "admission_common.cuh"

namespace ft::cuda::admission {

constexpr int kScanThreads = 512;
constexpr int kScanWarps = kScanThreads / 32;

// A victim candidate packed into one word, so comparing, shuffling and swapping candidates is
// one 64-bit operation: the high 40 bits hold the inverted age (origin - key, saturated at
// 2^40 - 1), the low 24 bits the slot. Ascending words are ascending (key, slot), exactly, for
// every slot touched within the last 2^40 admissions; older ones tie on age and go by slot.
constexpr int kSlotBits = limits::kSlotBits;
constexpr uint64_t kMaxAge = (uint64_t{1} << 40) - 1;
constexpr uint64_t kNone = ~uint64_t{0};

// `key` is the slot's victim key (key_of_stamp): the stamp itself under LRU (below now), below
// now + L under the opportunity policy, below 2^30 + 3 under hit density; its age counts from that
// bound (`origin`), so the LRU age is now - last_use, as it always was.
__device__ __forceinline__ uint64_t packed_victim_key(int64_t key, int64_t origin, int64_t slot) {
  const uint64_t age = static_cast<uint64_t>(origin - key);  // >= 1 for an eligible slot
  const uint64_t capped = age < kMaxAge ? age : kMaxAge;
  return ((kMaxAge - capped) << kSlotBits) | static_cast<uint64_t>(slot);
}

__device__ __forceinline__ int32_t key_slot(uint64_t key) {
  return static_cast<int32_t>(key & ((uint64_t{1} << kSlotBits) - 1));
}

constexpr int kBatch = 8;  // victims chosen per scan of the pool

// Keeps list[] (sorted, kBatch entries, in registers: every index is a compile-time constant)
// holding the smallest keys offered so far.
__device__ __forceinline__ void offer(uint64_t (&list)[kBatch], uint64_t key) {
  if (key >= list[kBatch - 1]) return;
  list[kBatch - 1] = key;
#pragma unroll
  for (int i = kBatch - 1; i > 0; --i) {
    const uint64_t lo = list[i] < list[i - 1] ? list[i] : list[i - 1];
    const uint64_t hi = list[i] < list[i - 1] ? list[i - 1] : list[i];
    list[i - 1] = lo;
    list[i] = hi;
  }
}

// Merges the threads' sorted lists (kBatch keys each, ascending) into victims[] (the `want`
// smallest keys of the block, ascending) and returns how many it found. Each warp merges its lanes'
// lists with shuffles (`want` rounds of argmin over the heads), then warp 0 merges the warps'
// lists. Called by the whole block; victims[] and *last_taken are in shared memory.
__device__ __forceinline__ int merge_lists(uint64_t (&list)[kBatch], int want, int32_t* victims, uint64_t* last_taken) {
  __shared__ uint64_t warp_lists[kScanWarps][kBatch];
  __shared__ int found;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int r = 0; r < kBatch; ++r) {
    if (r < want) {
      const uint64_t w = warp_min(list[0]);
      if (lane == 0) warp_lists[warp][r] = w;
      if (list[0] == w && w != kNone) {
#pragma unroll
        for (int i = 0; i + 1 < kBatch; ++i) list[i] = list[i + 1];
        list[kBatch - 1] = kNone;
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    // Block merge: lane l < kScanWarps walks warp l's sorted list.
    int head = 0;
    int taken = 0;
    for (int r = 0; r < want; ++r) {
      const uint64_t mine = (lane < kScanWarps && head < want) ? warp_lists[lane][head] : kNone;
      const uint64_t w = warp_min(mine);
      if (w == kNone) break;
      if (lane == 0) {
        victims[r] = key_slot(w);
        *last_taken = w;
      }
      if (mine == w) ++head;
      taken = r + 1;
    }
    if (lane == 0) found = taken;
  }
  __syncthreads();
  const int n = found;
  __syncthreads();  // `found` and warp_lists are reused by the next call
  return n;
}

// Large pools: appends to victims[] the next min(kBatch, want) eligible slots with keys above
// `floor`, in ascending key order, reading the stamps from global memory (hits of this call are
// already stamped `now` there). Every thread keeps its best kBatch keys in registers.
// `lru_keys`: a Duel call that takes LRU's keys (duel_lru_keys, read by every thread at the call's start).
template <typename id_t, int kPolicy>
__device__ __forceinline__ int select_victims(const Args<id_t, kPolicy>& a, int64_t now, uint64_t floor, int want,
                                              int32_t* victims, uint64_t* last_taken, bool lru_keys) {
  const int64_t* __restrict__ last_use = a.last_use;
  const int64_t slots = a.slots, lo = a.protect_lo, hi = a.protect_hi;
  using A = Args<id_t, kPolicy>;
  // Keys are below the origin: stamps below now (LRU, and Duel's calls that take LRU's keys), below
  // now + L (opportunity), below 2^30 + 3 (hit density).
  const int64_t origin = A::kLru || lru_keys ? now : A::kHitDensity ? (int64_t{1} << 31) : now + a.layers;
  const int tid = threadIdx.x;
  uint64_t list[kBatch];
#pragma unroll
  for (int i = 0; i < kBatch; ++i) list[i] = kNone;
  // kBatch independent loads in flight per thread before any is used: the block lives on one
  // SM, so a loop that waits on each load in turn would be bound by memory latency.
  for (int64_t base = tid; base < slots; base += int64_t{kScanThreads} * kBatch) {
    int64_t stamp[kBatch], estimates[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t s = base + int64_t{u} * kScanThreads;
      stamp[u] = s < slots ? last_use[s] : now;
      estimates[u] = lru_keys ? duel::kLruKeys : A::kHitDensity && s < slots ? a.slot_estimates[s] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t s = base + int64_t{u} * kScanThreads;
      if (stamp[u] >= now || (s >= lo && s < hi)) continue;  // used by this call, or protected
      const uint64_t key =
          packed_victim_key(key_of_stamp(a, stamp[u], now, estimates[u]), origin, s);
      if (key > floor || floor == kNone) offer(list, key);
    }
  }
  return merge_lists(list, want, victims, last_taken);
}

template <typename id_t, int kPolicy>
__device__ __forceinline__ void admit_by_scan(const Args<id_t, kPolicy>& a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t last_victim;
  const int tid = threadIdx.x;
  CallState c;
  const int64_t now = start_call(a, smem_raw, c, with_estimates_if_used(Args<id_t, kPolicy>::kHitDensity, false));
  // Every thread reads the split's counters before the call's first barrier: thread 0 adds to
  // them at the end, and a call that admits nothing may reach that without another barrier.
  const FetchSplit split = split_of(a);
  // Duel's words likewise (thread 0 stores the call's in finish()).
  const bool lru_keys = duel_lru_keys(a);
  dedup_and_refresh<kScanThreads>(a, c, now, nullptr, [](bool) {});
  const int64_t wanted = ft::admitted_count(c.misses, split);
  int admitted = 0;
  uint64_t floor = kNone;  // no floor yet
  while (admitted < wanted) {
    const int want = wanted - admitted < kBatch ? static_cast<int>(wanted - admitted) : kBatch;
    const int got = select_victims(a, now, floor, want, c.victim + admitted, &last_victim, lru_keys);
    admitted += got;
    floor = last_victim;
    if (got < want) break;  // no eligible slot left
  }
#pragma unroll 1
  for (int r = tid; r < admitted; r += kScanThreads) assign(a, c, r, c.victim[r], a.owner_of[c.victim[r]], now);
  if (rewrites_in_finish(a)) __syncthreads();
  finish<kScanThreads>(a, c, admitted, now);
}

template <typename id_t, int kPolicy>
__global__ void __launch_bounds__(kScanThreads, 1) admit_by_scan_kernel(const Args<id_t, kPolicy> a) {
  admit_by_scan(a);
}

// Duel's call and its shadow caches' replay in one launch (admission_common.cuh, write_call_totals).
template <typename id_t>
__global__ void __launch_bounds__(kScanThreads, 1) admit_by_scan_with_shadows_kernel(
    const Args<id_t, kLruPolicy> lru, const Args<id_t, kHitDensityPolicy> density, const Args<id_t, kDuelPolicy> pool) {
  if (blockIdx.x == 0) {
    admit_by_scan(lru);
  } else if (blockIdx.x == 1) {
    admit_by_scan(density);
  } else {
    admit_by_scan(pool);
  }
}

}  // namespace ft::cuda::admission
