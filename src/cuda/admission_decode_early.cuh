// dedup_and_admit for decode calls on pools of up to 4,096 slots, with one barrier on the miss
// path as well: the stamps are keyed and the first victim level found while the routing warp
// still routes, and the call's hits are taken out of that level afterwards.
//
// In admission_decode.cuh the other warps load their stamps during the routing, then wait at the
// first barrier; only after it do they key the stamps (a hit must not be a victim, and the hits
// are known only then), publish each warp's smallest key and its member counts, and meet at a
// second barrier before ranking the victims. Keying and the second barrier are ~0.8 us of a
// 2-miss call (benchmarks/probe_admission_phases.cu). Here the block is kThreads stamp threads
// plus a routing warp (warp 0) that holds no stamps. The stamp warps key their stamps without
// knowing the hits and publish their first level, together with each thread's member bits,
// before the one barrier. After it, every warp reads the routing warp's hit slots, looks up which
// of them are members of the block's first level (their keyers could not leave them out), and
// ranks the level's members with those hits left out: a hit is not a victim, and each hit before
// a member in slot order moves it up one rank. Victims still come out in exact ascending
// (last_use, slot) order. Hits are usually far from the least recently used level, so the
// correction is normally empty. A call whose first level holds fewer victims than it wants drops
// the hits from its keys and goes on level by level as the level kernel does (one barrier each).
//
// FT_DECODE_EARLY=0 turns this kernel off (bench_slot_cache.py compares them).
#pragma once

#include <type_traits>

#include "admission_decode.cuh"

namespace ft::cuda::admission {

// Block size of the early kernel for kThreads stamp threads: one more warp routes.
template <int kThreads>
__host__ __device__ constexpr int early_block_threads() {
  return kThreads + 32;
}

template <int kThreads, int kPerThread, typename Key, typename id_t>
__device__ __forceinline__ void admit_decode_early_keys(const Args<id_t>& a, int32_t* map, int64_t now) {
  using Traits = KeyTraits<Key>;
  using W = RowCounts<kPerThread>;
  using MemberBits = std::conditional_t<(kPerThread <= 8), uint8_t, uint16_t>;
  constexpr int kBlock = early_block_threads<kThreads>();
  constexpr int kWarps = kBlock / 32;  // warp 0 routes; warp w > 0 holds stamp threads 32 (w - 1) on
  constexpr int kSlots = kThreads * kPerThread;
  constexpr int kBase = -64;  // slot_of_stamp's base: thread 32 holds the first pair
  static_assert((kThreads & (kThreads - 1)) == 0 && kWarps <= 32, "a power of two of stamp threads, one warp of minima");
  __shared__ uint32_t hit_bits[kSlots / 32];
  __shared__ DecodeRouting routing;
  __shared__ MemberBits first_members[kThreads];  // per stamp thread: its members of its warp's first level
  Key(&level_min)[2][kWarps] = level_minima<Key, kWarps>();
  W(&level_count)[2][kWarps] = level_counts<kWarps, W>();
  const int lane = threadIdx.x & 31;
  const bool router = threadIdx.x < 32;

  Key key[kPerThread];
  FirstLevel<Key, W> first{};
  first.least = Traits::kNone;
  int first_u = -1;         // this thread's first member of its warp's first level
  int32_t first_owner = -1; // and that slot's owner, loaded before the barrier
  if (router) {
#pragma unroll
    for (int u = 0; u < kPerThread; ++u) key[u] = Traits::kNone;
    route_in_warp<kSlots>(a, map, hit_bits, routing, now, [] {});
    if (lane == 0) level_min[0][0] = Traits::kNone, level_count[0][0] = W{0};
  } else {
    int64_t stamp[kPerThread];
    load_stamps<kThreads, kPerThread>(a, stamp, kBase);
    key_stamps_excluding<kThreads, kPerThread>(a, stamp, now, 0u, key, kBase);  // hits not known yet
    first = publish_first_level<kBlock, kPerThread>(key);
    first_members[threadIdx.x - 32] = static_cast<MemberBits>(first.members.member);
    // If the warp's level is the block's, this slot is the first victim the thread can give: its
    // owner's round trip overlaps the routing instead of following the barrier. Only this
    // thread ever writes that slot's owner, and only after the barrier.
    first_u = __ffs(first.members.member) - 1;
    first_owner = first_u >= 0 ? a.owner_of[slot_of_stamp<kThreads>(first_u, kBase)] : -1;
  }
  __syncthreads();
  FT_ADMIT_MARK(4);  // routed, and the first level published
  const int wanted = routing.wanted;
  int admitted = 0;
  if (wanted > 0) {
    const Key level = Traits::warp_min(lane < kWarps ? level_min[0][lane] : Traits::kNone);
    if (level != Traits::kNone) {
      // The hits among the level's members (lanes of the routing warp whose slot is one).
      const int32_t hs = routing.hit_slot[lane];
      bool at_level = false;
      if (hs >= 0) {
        const int t = (hs >> 1) & (kThreads - 1), u = 2 * ((hs >> 1) / kThreads) + (hs & 1);
        at_level = level_min[0][1 + (t >> 5)] == level && ((first_members[t] >> u) & 1u);
      }
      const uint32_t hits_at_level = __ballot_sync(0xffffffffu, at_level);
      const int hits_in_level = __popc(hits_at_level);
      const LevelMembersOf<W> members = first.least == level ? first.members : LevelMembersOf<W>{};
      const W count = lane < kWarps && level_min[0][lane] == level ? level_count[0][lane] : W{0};
      FT_ADMIT_MARK(8);  // the first level known

      // The thread holding a victim rewrites the maps and its expert's positions (as in
      // admission_decode.cuh: the writes of different ranks never collide).
      const auto give = [&](int r, int u) {
        const int32_t s = slot_of_stamp<kThreads>(u, kBase);
        give_to_rank(a, routing, r, s, u == first_u ? first_owner : a.owner_of[s], now);
      };
      // Ranks counted with the hits in: a member's true rank is lower by the hits before it, so
      // those up to wanted + hits_in_level are the candidates.
      const int level_size = take_members<kBlock, kPerThread>(
          members, count, 0, wanted + hits_in_level, [&](int r, int u) {
            const int32_t s = slot_of_stamp<kThreads>(u, kBase);
            int before = 0;
            bool hit = false;
#pragma unroll 1
            for (uint32_t bits = hits_at_level; bits != 0; bits &= bits - 1) {
              const int32_t h = routing.hit_slot[__ffs(bits) - 1];
              before += h < s ? 1 : 0;
              hit |= h == s;
            }
            if (!hit && r - before < wanted) give(r - before, u);
          });
      const int found = level_size - hits_in_level;
      if (found >= wanted) {
        admitted = wanted;
      } else {
        // Every victim of the level is taken. The hits are left out of the further levels too.
        if (!router) {
          const uint32_t hit = hit_stamps<kThreads, kPerThread>(hit_bits, kBase);
#pragma unroll
          for (int u = 0; u < kPerThread; ++u) key[u] = (hit >> u) & 1u ? Traits::kNone : key[u];
        }
        admitted = take_further_levels<kBlock, kPerThread>(key, members.member, found, wanted, give);
      }
    }
  }
  FT_ADMIT_MARK(5);  // victims taken
  FT_ADMIT_MARK(6);  // (no slot ids left to rewrite)
  if (threadIdx.x == 0) write_call_totals(a, admitted, routing.unique, now);
  FT_ADMIT_MARK(7);  // done (its stores may still be draining)
}

template <int kThreads, int kPerThread, typename id_t>
__device__ __forceinline__ void admit_decode_early(const Args<id_t>& a) {
  static_assert(kPerThread % 2 == 0, "whole pairs of slots per thread");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  CallState c;
  const int64_t now = start_call(a, smem_raw, c);  // only c.map is used
  if (now < int64_t{KeyTraits<uint32_t>::kNone}) {  // 32-bit keys for the first four billion calls
    admit_decode_early_keys<kThreads, kPerThread, uint32_t>(a, c.map, now);
  } else {
    admit_decode_early_keys<kThreads, kPerThread, int64_t>(a, c.map, now);
  }
}

template <int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(early_block_threads<kThreads>(), 1) admit_decode_early_kernel(const Args<id_t> a) {
  admit_decode_early<kThreads, kPerThread>(a);
}

}  // namespace ft::cuda::admission
