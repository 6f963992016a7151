// dedup_and_admit for pools of up to kThreads * kPerThread slots (4,096 at most): one block,
// every slot's stamp and owner in registers, victims chosen level by level.
//
// A call that hits everything never touches the stamps: dedup_and_refresh, then finish. A call
// with misses loads the stamps and owners once (thread t holds slots t + u * kThreads), then
// takes victims level by level: a level is the smallest eligible stamp left; its slots go in
// ascending slot order, so victims come out in exact ascending (last_use, slot) order on the raw
// 64-bit stamps. LRU stamps come in groups (every slot one admission call touches gets the same
// stamp; free slots all have 0), so a call needs few levels. One barrier per level: the pass
// that finds a level's members also finds the next level's candidates, and the per-warp results
// are double-buffered, so a level's counts are read after the barrier that publishes them while
// the next level's are written to the other buffer.
//
// Kept small on purpose: a single-block kernel runs on one SM whose instruction cache is often
// cold, so code that is not executed still costs (session-3 kernel: 71 KB of SASS and a fixed
// ~4.5 us on every call with a miss).
#pragma once

#include "admission_common.cuh"

namespace ft::cuda::admission {

template <int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(kThreads) admit_by_level_kernel(const Args<id_t> a) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kPerThread <= 32 && kWarps <= 32, "bit masks and one-warp reductions");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ int64_t level_min[2][kWarps];                    // per warp, double-buffered
  __shared__ __align__(16) int level_count[2][kPerThread][kWarps];  // members per (u, warp)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  CallState c;
  carve(smem_raw, a.experts, a.plan_len, c);
  const int64_t now = a.clock[0] + 1;
  dedup_and_refresh<kThreads>(a, c, now);
  const int wanted = static_cast<int>(ft::admitted_count(c.misses, a.fetch_fraction));

  int admitted = 0;
  if (wanted > 0) {
    // Stamps and owners; hits were stamped `now` before the last barrier, so `< now` excludes
    // them along with every slot this call already touched.
    int64_t stamp[kPerThread];
    int32_t owner[kPerThread];
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int64_t s = tid + int64_t{u} * kThreads;
      stamp[u] = s < a.slots ? a.last_use[s] : LLONG_MAX;
      owner[u] = s < a.slots ? a.owner_of[s] : -1;
    }
    uint32_t eligible = 0;
    int64_t next = LLONG_MAX;  // the smallest eligible stamp of this thread
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) {
      const int64_t s = tid + int64_t{u} * kThreads;
      const bool ok = stamp[u] < now && !(s >= a.protect_lo && s < a.protect_hi);
      eligible |= static_cast<uint32_t>(ok) << u;
      if (ok && stamp[u] < next) next = stamp[u];
    }
    next = warp_min(next);
    if (lane == 0) level_min[0][warp] = next;
    __syncthreads();

    int taken = 0;
    const uint32_t below_me = (1u << lane) - 1u;
    for (int p = 0;; p ^= 1) {
      const int64_t level = warp_min(lane < kWarps ? level_min[p][lane] : LLONG_MAX);
      if (level == LLONG_MAX) break;  // no eligible slot left (the same answer in every thread)
      uint32_t ballot[kPerThread];
      uint32_t member = 0;
      next = LLONG_MAX;
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        const bool ok = (eligible >> u) & 1u;
        const bool in = ok && stamp[u] == level;
        ballot[u] = __ballot_sync(0xffffffffu, in);
        member |= static_cast<uint32_t>(in) << u;
        if (ok && !in && stamp[u] < next) next = stamp[u];
      }
      eligible &= ~member;
      next = warp_min(next);
      if (lane < kPerThread) {
        uint32_t mine = 0;
#pragma unroll
        for (int u = 0; u < kPerThread; ++u) mine = lane == u ? ballot[u] : mine;
        level_count[p][lane][warp] = __popc(mine);
      }
      if (lane == 0) level_min[p ^ 1][warp] = next;
      __syncthreads();
      // Slot order is (u, warp, lane). Lane u sums column u over all warps and over the warps
      // before this one; an exclusive scan over lanes turns that into the number of members
      // before (u, this warp).
      int column = 0, before = 0;
      if (lane < kPerThread) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const int n = level_count[p][lane][w];
          column += n;
          before += w < warp ? n : 0;
        }
      }
      int inclusive = column;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += o;
      }
      const int level_total = __shfl_sync(0xffffffffu, inclusive, 31);
      const int first = taken + inclusive - column + before;  // rank of (u = lane, warp, lane 0)
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        const int r = __shfl_sync(0xffffffffu, first, u) + __popc(ballot[u] & below_me);
        if (((member >> u) & 1u) && r < wanted) {
          c.victim[r] = static_cast<int32_t>(tid + u * kThreads);
          c.victim_owner[r] = owner[u];
        }
      }
      taken += level_total;
      if (taken >= wanted) break;
    }
    admitted = taken < wanted ? taken : wanted;
    __syncthreads();
#pragma unroll 1
    for (int r = tid; r < admitted; r += kThreads) assign(a, c, r, c.victim[r], c.victim_owner[r], now);
  }
  __syncthreads();
  finish<kThreads>(a, c, admitted, now);
}

}  // namespace ft::cuda::admission
