// dedup_and_admit for decode calls (at most kDecodeIds routed ids: a token or a few) on pools of
// up to limits::kMaxRegisterPoolSlots slots: one block, one barrier whether or not the call misses
// (Opportunity and hit density add one at the start, before the wait for the previous kernel).
//
// The block is kThreads stamp threads plus a routing warp (warp 0) that holds no stamps. The ids
// fit one warp, so the routing warp does the whole dedup with warp intrinsics (the ids and the
// layer's map loaded together, duplicates found and the misses ranked with shuffles), while the
// stamp threads load their slots' stamps, key them without knowing the hits, and publish each
// warp's smallest key (its first victim level) with its member counts, and each thread's member
// bits. After the one barrier every warp reads the routing warp's hit slots, looks up which of
// them are members of the block's first level (their keyers could not leave them out), and ranks
// the level's members with those hits left out: a hit is not a victim, and each hit before a
// member in slot order moves it up one rank. Victims still come out in exact ascending
// (key, slot) order. Under LRU hits are usually far from the least recently used level, so the
// correction is normally empty; under Opportunity, after a prompt, the first level is the
// streamed rows (key 1), which decode often hits. A call whose first level holds fewer victims than it wants drops
// the hits from its keys and goes on level by level as the level kernel does (one barrier each),
// with the same pieces (admission_level.cuh). The victim's thread rewrites the maps and the slot
// ids of its expert's positions, so the call ends without another barrier.
#pragma once

#include <type_traits>

#include "../common/limits.h"
#include "admission_level.cuh"

namespace ft::cuda::admission {

constexpr int kDecodeIds = static_cast<int>(limits::kDecodeCallMaxIds);  // one routed id per lane of the routing warp
static_assert(kDecodeIds == 32, "the routing warp holds one id per lane");

// Whether a call takes the decode kernel: the routing warp holds every id, and a miss's key
// (routed count and expert) fits 32 bits. (The pool must also hold at most
// limits::kMaxRegisterPoolSlots.)
inline bool is_decode_call(int64_t numel, int64_t experts) {
  return numel <= kDecodeIds && experts < (int64_t{1} << 27);
}

// Set by the routing warp, before the barrier, once it knows that the call admits nothing (no
// miss, or none wanted); zeroed by the block before the routing starts. Stamp warps that see it
// stop keying: their keys would go unused. (Under LRU a key is the stamp itself, so its warps
// never look.)
__device__ __forceinline__ int& nothing_to_admit() {
  __shared__ int flag;
  return flag;
}

// What the routing warp hands the block at the first barrier.
struct DecodeRouting {
  int32_t by_rank[kDecodeIds];    // the missing expert admitted at each rank
  uint32_t positions[kDecodeIds]; // its positions in the call (bit i: ids[i])
  int32_t hit_slot[kDecodeIds];   // per lane: the slot its expert hit, if it is the expert's first lane; else -1
  int64_t next_estimates[kDecodeIds];  // hit density: the estimates of rank r's pair once admitted
  int wanted;                     // misses to admit (fetch_fraction of the unique missing experts)
  int unique;                     // unique routed experts
};

// Calls f(j, lane j's value) for every lane j < numel and for the rest of the last group of 8
// (f tells them apart). The shuffles of a group are issued back to back, with no branch between
// them: a loop that tested j < numel before each shuffle waited out each one's latency (~40 SM
// cycles apiece: 339 cycles for the dedup of 8 ids; __match_any_sync took 378 with every
// unrouted lane its own key, 129 with one key; measured on an H200).
template <typename T, typename F>
__device__ __forceinline__ void over_routed_lanes(T value, int numel, F f) {
  constexpr int kGroup = 8;
#pragma unroll 1
  for (int base = 0; base < numel; base += kGroup) {
    T v[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) v[j] = __shfl_sync(0xffffffffu, value, base + j);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) f(base + j, v[j]);
  }
}

// The routing warp (warp 0): dedup, hits and the misses' ranks for the call's ids (one per lane).
// `map` is the call's shared copy of the layer's map (experts entries); `hit_bits` (kSlots bits) is
// zeroed here (kSlots: the kernel's largest pool). Ids out of range are not routed (slot -1).
// The routing warp holds no stamps: loads issued beside the map's would queue behind the block's
// stamps on the SM's path to L2 and delay the map. (Hit density's pair words, one or two 8-byte
// loads a lane, follow the map's first chunk.)
template <int kSlots, typename id_t, int kPolicy>
__device__ __forceinline__ void route_in_warp(const Args<id_t, kPolicy>& a, int32_t* map, uint32_t* hit_bits,
                                              DecodeRouting& out, int64_t now) {
  const int lane = threadIdx.x & 31;
  const int32_t* layer_map = a.slot_of + a.layer * a.experts;
  const int64_t e = lane < a.numel ? static_cast<int64_t>(a.ids[lane]) : -1;
  const bool ok = e >= 0 && e < a.experts;
  // The map in chunks of kMapChunk entries per lane, each chunk's loads issued together (a loop
  // that stored each entry before loading the next made one round trip per 32 entries: this
  // phase took 1.77 us instead of 1.48 at 128 experts).
  constexpr int kMapChunk = 8;
  const auto load_chunk = [&](int64_t base, int32_t(&entry)[kMapChunk]) {
#pragma unroll
    for (int k = 0; k < kMapChunk; ++k) {
      const int64_t j = base + lane + 32 * k;
      entry[k] = j < a.experts ? layer_map[j] : -1;
    }
  };
  const auto store_chunk = [&](int64_t base, const int32_t(&entry)[kMapChunk]) {
#pragma unroll
    for (int k = 0; k < kMapChunk; ++k) {
      const int64_t j = base + lane + 32 * k;
      if (j < a.experts) map[j] = entry[k];
    }
  };
  int32_t entry[kMapChunk];
  load_chunk(0, entry);
  // Hit density: the lane's pair words, requested as soon as its id is here, while the first
  // chunk of the map is still on its way, and used only after the dedup (a hit's or an admitted
  // miss's new estimates), so their round trip overlaps the map's instead of following it.
  const PairWords words = ok ? pair_words(a, e) : PairWords{};
  // The split's counters (auto split only), requested now and used after the dedup.
  int64_t seen[3] = {0, 0, 0};
  if (lane == 0 && a.split_counters != nullptr) {
    seen[0] = a.split_counters[ft::kStatsDistinct];
    seen[1] = a.split_counters[ft::kStatsAdmitted];
    seen[2] = a.split_counters[ft::kStatsCpuExperts];
  }
  store_chunk(0, entry);
#pragma unroll 1
  for (int64_t base = 32 * kMapChunk; base < a.experts; base += 32 * kMapChunk) {
    load_chunk(base, entry);
    store_chunk(base, entry);
  }
#pragma unroll
  for (int w = lane; w < kSlots / 32; w += 32) hit_bits[w] = 0;
#pragma unroll 1
  for (int64_t i = lane; i < a.plan_len; i += 32) a.plan_e[i] = -1, a.plan_s[i] = -1;
  __syncwarp();
  const int32_t slot = ok ? map[e] : -1;
  // Lanes routed to the same expert (bit j: lane j). An unrouted lane's key is its own negative
  // number, so it matches no other lane.
  const int32_t id_key = ok ? static_cast<int32_t>(e) : -1 - lane;
  uint32_t peers = 0;
  over_routed_lanes(id_key, static_cast<int>(a.numel), [&](int j, int32_t other) {
    peers |= static_cast<uint32_t>(j < a.numel && other == id_key) << j;
  });
  const bool leader = ok && __ffs(peers) - 1 == lane;
  if (lane < a.numel) a.slot_ids[lane] = slot;  // misses are rewritten by their victim's thread
  if (leader && slot >= 0) {
    a.last_use[slot] = now;
    atomicOr(&hit_bits[slot >> 5], 1u << (slot & 31));
  }
  out.hit_slot[lane] = leader ? slot : -1;
  // Misses ranked as dedup_and_refresh ranks them: most routed first, then by expert id.
  const bool miss = leader && slot < 0;
  const uint32_t key = miss ? (static_cast<uint32_t>(a.numel - __popc(peers)) << 27) | static_cast<uint32_t>(e)
                            : 0xffffffffu;
  int rank = 0;  // lanes past numel hold no miss: their key is the largest
  over_routed_lanes(key, static_cast<int>(a.numel), [&](int, uint32_t other) { rank += other < key ? 1 : 0; });
  if constexpr (Args<id_t, kPolicy>::kHitDensity) {
    // Every leader's pair is used now if it hits; a miss's only if it is admitted (give_to_rank).
    if (leader) {
      const int64_t next = estimates_after_use(a, words, now);
      if (slot >= 0) {
        store_use(a, e, slot, now, next);
      } else {
        out.next_estimates[rank] = next;
      }
    }
  }
  if (miss) {
    out.by_rank[rank] = static_cast<int32_t>(e);
    out.positions[rank] = peers;
  }
  const int misses = __popc(__ballot_sync(0xffffffffu, miss));
  const int unique = __popc(__ballot_sync(0xffffffffu, leader));
  // Once here, not in every thread after the barrier (a chain of double conversions per warp).
  if (lane == 0) {
    FetchSplit split = a.split;
    if (a.split_counters != nullptr) {
      split.recopy = ft::recopy_share(seen[0], seen[1], seen[2], split.compulsory);
    }
    const int wanted = static_cast<int>(ft::admitted_count(misses, split));
    out.wanted = wanted, out.unique = unique;
    if constexpr (!Args<id_t, kPolicy>::kLru) {
      if (wanted == 0) *static_cast<volatile int*>(&nothing_to_admit()) = 1;
    }
  }
}

// The stamp threads' keys, row by row (two slots) until a row finds that the routing warp has set
// nothing_to_admit (the whole warp stops at the same row): false then, and the keys are not all
// written. The routing warp knows that after the map's round trip and the dedup; the stamps come
// back after one round trip too, so without the check a call that admits nothing would wait for
// all of its keys at the barrier (hit density's keys outlast the routing on large pools).
template <int kThreads, int kPerThread, typename Key, typename id_t, int kPolicy>
__device__ __forceinline__ bool key_stamps_unless_nothing_to_admit(const Args<id_t, kPolicy>& a,
                                                                   const int64_t (&stamp)[kPerThread],
                                                                   const int64_t (&estimates)[kPerThread], int64_t now,
                                                                   Key (&key)[kPerThread], int base) {
  const uint32_t excluded = with_protected<kThreads, kPerThread>(a, 0u, base);
  const volatile int& stop = nothing_to_admit();
#pragma unroll
  for (int row = 0; row < kPerThread / 2; ++row) {
    if (__any_sync(0xffffffffu, stop != 0)) return false;
#pragma unroll
    for (int u = 2 * row; u < 2 * row + 2; ++u) {
      key[u] = key_of_slot<Key>(a, stamp[u], estimates[u], now, stamp[u] < now && !((excluded >> u) & 1u));
    }
  }
  return true;
}

// Rank r's victim: slot s (its owner `owner`) goes to the missing expert of that rank, whose
// positions in the call get the slot.
template <typename id_t, int kPolicy>
__device__ __forceinline__ void give_to_rank(const Args<id_t, kPolicy>& a, const DecodeRouting& routing, int r, int32_t s,
                                             int32_t owner, int64_t now) {
  give_slot(a, r, routing.by_rank[r], s, owner, now, Args<id_t, kPolicy>::kHitDensity ? routing.next_estimates[r] : 0);
#pragma unroll 1
  for (uint32_t bits = routing.positions[r]; bits != 0; bits &= bits - 1) a.slot_ids[__ffs(bits) - 1] = s;
}

// Block size of the decode kernel for kThreads stamp threads: one more warp routes.
template <int kThreads>
__host__ __device__ constexpr int decode_block_threads() {
  return kThreads + 32;
}

template <int kThreads, int kPerThread, typename Key, typename id_t, int kPolicy>
__device__ __forceinline__ void admit_decode_with_keys(const Args<id_t, kPolicy>& a, int32_t* map, int64_t now) {
  using Traits = KeyTraits<Key>;
  using W = RowCounts<kPerThread>;
  using MemberBits = std::conditional_t<(kPerThread <= 8), uint8_t, uint16_t>;
  constexpr int kBlock = decode_block_threads<kThreads>();
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
    route_in_warp<kSlots>(a, map, hit_bits, routing, now);
    if (lane == 0) level_min[0][0] = Traits::kNone, level_count[0][0] = W{0};
  } else {
    int64_t stamp[kPerThread], estimates[kPerThread];
    load_stamps<kThreads, kPerThread>(a, stamp, estimates, kBase, false);
    if constexpr (Args<id_t, kPolicy>::kDuel) {
      // The Duel words' loads go out beside the stamps' and estimates' (one round trip for all);
      // a call that takes LRU's keys then drops the estimates.
      if (duel_lru_keys(a)) {
#pragma unroll
        for (int u = 0; u < kPerThread; ++u) estimates[u] = duel::kLruKeys;
      }
    }
    // Hits are not known yet. Under LRU every key is its stamp: nothing to stop early for.
    bool keyed = true;
    if constexpr (Args<id_t, kPolicy>::kLru) {
      key_stamps_excluding<kThreads, kPerThread>(a, stamp, estimates, now, 0u, key, kBase);
    } else {
      keyed = key_stamps_unless_nothing_to_admit<kThreads, kPerThread>(a, stamp, estimates, now, key, kBase);
    }
    if (keyed) {  // the same in the whole warp; otherwise the call reads no key, level or member
      first = publish_first_level<kBlock, kPerThread>(key);
      first_members[threadIdx.x - 32] = static_cast<MemberBits>(first.members.member);
      // If the warp's level is the block's, this slot is the first victim the thread can give: its
      // owner's round trip overlaps the routing instead of following the barrier. Only this
      // thread ever writes that slot's owner, and only after the barrier.
      first_u = __ffs(first.members.member) - 1;
      first_owner = first_u >= 0 ? a.owner_of[slot_of_stamp<kThreads>(first_u, kBase)] : -1;
    }
  }
  __syncthreads();
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

      // The thread holding a victim rewrites the maps and its expert's positions. Victims are
      // distinct, their old owners are distinct and never a miss of this call (misses own no
      // slot), so the writes of different ranks never collide.
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
  if (threadIdx.x == 0) write_call_totals(a, admitted, routing.unique, now);
}

template <int kThreads, int kPerThread, typename id_t, int kPolicy>
__device__ __forceinline__ void admit_decode(const Args<id_t, kPolicy>& a) {
  static_assert(kPerThread % 2 == 0, "whole pairs of slots per thread");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  CallState c;
  if constexpr (!Args<id_t, kPolicy>::kLru) {
    // Before the wait for the previous kernel, so this barrier overlaps it.
    if (threadIdx.x == 0) nothing_to_admit() = 0;
    __syncthreads();
  }
  const int64_t now = start_call(a, smem_raw, c, with_estimates_if_used(Args<id_t, kPolicy>::kHitDensity, true));  // only c.map is used
  // 32-bit keys while every eligible key is below 2^32 - 1 (the first four billion calls): stamps
  // are below now, the opportunity policy's keys below now + L. One comparison for every policy
  // (under LRU the layers term is 0).
  if (now < int64_t{KeyTraits<uint32_t>::kNone} - (Args<id_t, kPolicy>::kLru ? 0 : a.layers)) {
    admit_decode_with_keys<kThreads, kPerThread, uint32_t>(a, c.map, now);
  } else {
    admit_decode_with_keys<kThreads, kPerThread, int64_t>(a, c.map, now);
  }
}

template <int kThreads, int kPerThread, typename id_t, int kPolicy>
__global__ void __launch_bounds__(decode_block_threads<kThreads>(), 1) admit_decode_kernel(const Args<id_t, kPolicy> a) {
  admit_decode<kThreads, kPerThread>(a);
}

// Duel's call and its shadow caches' replay in one launch (admission_common.cuh, write_call_totals).
template <int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(decode_block_threads<kThreads>(), 1) admit_decode_with_shadows_kernel(
    const Args<id_t, kLruPolicy> lru, const Args<id_t, kHitDensityPolicy> density, const Args<id_t, kDuelPolicy> pool) {
  if (blockIdx.x == 0) {
    admit_decode<kThreads, kPerThread>(lru);
  } else if (blockIdx.x == 1) {
    admit_decode<kThreads, kPerThread>(density);
  } else {
    admit_decode<kThreads, kPerThread>(pool);
  }
}

}  // namespace ft::cuda::admission
