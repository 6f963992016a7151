// dedup_and_admit for decode calls (at most kDecodeIds routed ids: a token or a few) on pools of
// up to 8,192 slots: one block, two barriers on the miss path, one without misses.
//
// The level kernel (admission_level.cuh) learns whether a call misses before it loads the stamps:
// map into shared memory, barrier, ids counted, barrier, stamps loaded and keyed, barrier, ranks,
// barrier. Here the ids fit one warp, so the routing warp does the whole dedup with warp
// intrinsics (ids and the layer's map loaded together, duplicates found and the misses ranked with
// shuffles) while every other warp loads its stamps at once, whether or not
// the call misses; one barrier hands the routing warp's results (hit slots, misses by rank and
// their positions) to the block. A call without misses ends there; one with misses keys its
// stamps, publishes the first victim level, and after the second barrier takes victims level by
// level as the level kernel does (take_by_level), the victim's thread rewriting the maps and the
// slot ids of its expert's positions.
//
// Loading the stamps before knowing whether they are needed costs a call without misses ~0.3 us
// against the level kernel (2.0-2.2 us, goal 2.5), and saves a call with misses 0.2-0.4 us
// (docs/benchmarks.md, session 6; FT_ADMIT_DECODE=0 turns this kernel off).
#pragma once

#include "admission_level.cuh"

namespace ft::cuda::admission {

constexpr int kDecodeIds = 32;  // one routed id per lane of the routing warp

// Whether a call takes the decode kernel: the routing warp holds every id, and a miss's key
// (routed count and expert) fits 32 bits. (The pool must also hold at most 8,192 slots.)
inline bool is_decode_call(int64_t numel, int64_t experts) {
  return numel <= kDecodeIds && experts < (int64_t{1} << 27);
}

// What the routing warp hands the block at the first barrier.
struct DecodeRouting {
  int32_t by_rank[kDecodeIds];    // the missing expert admitted at each rank
  uint32_t positions[kDecodeIds]; // its positions in the call (bit i: ids[i])
  int32_t hit_slot[kDecodeIds];   // per lane: the slot its expert hit, if it is the expert's first lane; else -1
  int wanted;                     // misses to admit (fetch_fraction of the unique missing experts)
  int unique;                     // unique routed experts
};

// Calls f(j, lane j's value) for every lane j < numel and for the rest of the last group of 8
// (f tells them apart). The shuffles of a group are issued back to back, with no branch between
// them: a loop that tested j < numel before each shuffle waited out each one's latency (~40 SM
// cycles apiece: 339 cycles for the dedup of 8 ids; __match_any_sync took 378 with every
// unrouted lane its own key, 129 with one key; benchmarks/probe_admission_floor.cu).
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
// `after_map()` runs once the map is here, before the dedup: the decode kernel loads the warp's
// own stamps there (issued before the map's loads, they put those behind the block's 32 KB of
// stamps on the SM's link to L2: the map's round trip went from 0.53 to 0.94-1.12 us);
// admission_decode_early.cuh's routing warp holds no stamps.
template <int kSlots, typename id_t, typename AfterMap>
__device__ __forceinline__ void route_in_warp(const Args<id_t>& a, int32_t* map, uint32_t* hit_bits,
                                              DecodeRouting& out, int64_t now, AfterMap after_map) {
  const int lane = threadIdx.x & 31;
  const int32_t* layer_map = a.slot_of + a.layer * a.experts;
  const int64_t e = lane < a.numel ? static_cast<int64_t>(a.ids[lane]) : -1;
  // The map in chunks of kMapChunk entries per lane, each chunk's loads issued together (a loop
  // that stored each entry before loading the next made one round trip per 32 entries: this
  // phase took 1.77 us instead of 1.48 at 128 experts).
  constexpr int kMapChunk = 8;
#pragma unroll 1
  for (int64_t base = 0; base < a.experts; base += 32 * kMapChunk) {
    int32_t entry[kMapChunk];
#pragma unroll
    for (int k = 0; k < kMapChunk; ++k) {
      const int64_t j = base + lane + 32 * k;
      entry[k] = j < a.experts ? layer_map[j] : -1;
    }
#pragma unroll
    for (int k = 0; k < kMapChunk; ++k) {
      const int64_t j = base + lane + 32 * k;
      if (j < a.experts) map[j] = entry[k];
    }
  }
#pragma unroll
  for (int w = lane; w < kSlots / 32; w += 32) hit_bits[w] = 0;
#pragma unroll 1
  for (int64_t i = lane; i < a.plan_len; i += 32) a.plan_e[i] = -1, a.plan_s[i] = -1;
  __syncwarp();
  FT_ADMIT_MARK(2);  // the ids and the map are here (the probe's thread 0 is in this warp)
  after_map();
  const bool ok = e >= 0 && e < a.experts;
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
  if (miss) {
    out.by_rank[rank] = static_cast<int32_t>(e);
    out.positions[rank] = peers;
  }
  const int misses = __popc(__ballot_sync(0xffffffffu, miss));
  const int unique = __popc(__ballot_sync(0xffffffffu, leader));
  // Once here, not in every thread after the barrier (a chain of double conversions per warp).
  if (lane == 0) out.wanted = static_cast<int>(ft::admitted_count(misses, a.fetch_fraction)), out.unique = unique;
  FT_ADMIT_MARK(3);  // routed
}

// Rank r's victim: slot s (its owner `owner`) goes to the missing expert of that rank, whose
// positions in the call get the slot.
template <typename id_t>
__device__ __forceinline__ void give_to_rank(const Args<id_t>& a, const DecodeRouting& routing, int r, int32_t s,
                                             int32_t owner, int64_t now) {
  give_slot(a, r, routing.by_rank[r], s, owner, now);
#pragma unroll 1
  for (uint32_t bits = routing.positions[r]; bits != 0; bits &= bits - 1) a.slot_ids[__ffs(bits) - 1] = s;
}

// After the first barrier, with misses: victims for `wanted` of them, with keys of type Key (see
// admission_level.cuh). Returns how many were admitted.
template <int kThreads, int kPerThread, typename Key, typename id_t>
__device__ __forceinline__ int admit_decode_misses(const Args<id_t>& a, const int64_t (&stamp)[kPerThread],
                                                   int64_t now, const uint32_t* hit_bits,
                                                   const DecodeRouting& routing, int wanted) {
  Key key[kPerThread];
  key_stamps<kThreads, kPerThread>(a, stamp, now, hit_bits, key);
  const auto first = publish_first_level<kThreads, kPerThread>(key);
  // The owner of this thread's first member of its warp's first level, loaded before the barrier:
  // if the level is the block's, that slot is the first victim this thread can give, and its
  // owner's round trip (~0.2 us, the take phase) then overlaps the barrier and the ranks. Only
  // this thread ever writes that slot's owner, and only after the barrier.
  const int first_u = __ffs(first.members.member) - 1;  // -1: no member
  const int32_t first_owner = first_u >= 0 ? a.owner_of[slot_of_stamp<kThreads>(first_u)] : -1;
  FT_ADMIT_MARK(10);  // keyed, first level published
  __syncthreads();
  // The thread holding a victim rewrites the maps and its expert's positions. Victims are
  // distinct, their old owners are distinct and never a miss of this call (misses own no slot),
  // so the writes of different ranks never collide. The owner is read by the victim's thread only.
  return take_by_level<kThreads, kPerThread>(key, first, wanted, [&](int r, int u) {
    const int32_t s = slot_of_stamp<kThreads>(u);
    give_to_rank(a, routing, r, s, u == first_u ? first_owner : a.owner_of[s], now);
  });
}

template <int kThreads, int kPerThread, typename id_t>
__device__ __forceinline__ void admit_decode(const Args<id_t>& a) {
  static_assert(kPerThread % 2 == 0, "whole pairs of slots per thread");
  constexpr int kSlots = kThreads * kPerThread;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint32_t hit_bits[kSlots / 32];
  __shared__ DecodeRouting routing;
  CallState c;
  const int64_t now = start_call(a, smem_raw, c);  // only c.map is used
  int64_t stamp[kPerThread];
  if (threadIdx.x < 32) {
    // The warp's stamps arrive during the dedup and the first barrier.
    route_in_warp<kSlots>(a, c.map, hit_bits, routing, now, [&] { load_stamps<kThreads, kPerThread>(a, stamp); });
  } else {
    load_stamps<kThreads, kPerThread>(a, stamp);
  }
  __syncthreads();
  FT_ADMIT_MARK(4);  // every warp has routed or loaded (the level kernel's marks 2-4: map, count, hits)
  const int wanted = routing.wanted;
  int admitted = 0;
  if (wanted > 0) {
    admitted = now < int64_t{KeyTraits<uint32_t>::kNone}  // 32-bit keys for the first four billion calls
                   ? admit_decode_misses<kThreads, kPerThread, uint32_t>(a, stamp, now, hit_bits, routing, wanted)
                   : admit_decode_misses<kThreads, kPerThread, int64_t>(a, stamp, now, hit_bits, routing, wanted);
  }
  FT_ADMIT_MARK(5);  // victims taken
  FT_ADMIT_MARK(6);  // (no slot ids left to rewrite)
  if (threadIdx.x == 0) write_call_totals(a, admitted, routing.unique, now);
  FT_ADMIT_MARK(7);  // done (its stores may still be draining)
}

template <int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(kThreads, 1) admit_decode_kernel(const Args<id_t> a) {
  admit_decode<kThreads, kPerThread>(a);
}

}  // namespace ft::cuda::admission
