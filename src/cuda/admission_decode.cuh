// dedup_and_admit for decode calls (at most kDecodeIds routed ids: a token or a few) on pools of
// up to 8,192 slots: one block, two barriers on the miss path, one without misses.
//
// The level kernel (admission_level.cuh) learns whether a call misses before it loads the stamps:
// map into shared memory, barrier, ids counted, barrier, stamps loaded and keyed, barrier, ranks,
// barrier. Here the ids fit one warp, so the routing warp does the whole dedup with warp
// intrinsics (ids and the layer's map loaded together, duplicates found with __match_any_sync,
// the misses ranked with shuffles) while every other warp loads its stamps at once, whether or not
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

// How the decode kernel's stamps arrive (FT_DECODE_STAMPS; bench_slot_cache.py compares):
//   kStampsAtOnce: every warp but the routing warp loads its stamps at kernel start;
//   kStampsAfterRouting: they wait (named barrier 1) until the routing warp is done, so its
//     shared-memory and shuffle instructions do not queue behind 32 KB of loads on its SM;
//   kStampsBulk: one thread starts a bulk copy (TMA) of all stamps into shared memory at kernel
//     start; after the first barrier every thread reads its stamps from there (needs last_use
//     16-byte aligned and an even slot count; the host falls back to kStampsAtOnce otherwise).
enum StampMode : int { kStampsAtOnce = 0, kStampsAfterRouting = 1, kStampsBulk = 2 };

// Bytes of dynamic shared memory the decode kernel needs beyond the call state: the stamps, for
// kStampsBulk (placed at the first 16-byte boundary after the call state).
inline size_t decode_stamp_bytes(int stamp_mode, int64_t slots) {
  return stamp_mode == kStampsBulk ? static_cast<size_t>(slots) * sizeof(int64_t) + 16 : 0;
}

// Whether a call takes the decode kernel: the routing warp holds every id, and a miss's key
// (routed count and expert) fits 32 bits. (The pool must also hold at most 8,192 slots.)
__host__ __device__ inline bool is_decode_call(int64_t numel, int64_t experts) {
  return numel <= kDecodeIds && experts < (int64_t{1} << 27);
}

// What the routing warp hands the block at the first barrier.
struct DecodeRouting {
  int32_t by_rank[kDecodeIds];    // the missing expert admitted at each rank
  uint32_t positions[kDecodeIds]; // its positions in the call (bit i: ids[i])
  int misses;                     // unique missing experts
  int unique;                     // unique routed experts
};

// The routing warp (warp 0): dedup, hits and the misses' ranks for the call's ids (one per lane).
// `map` is the call's shared copy of the layer's map (experts entries); `hit_bits` (kSlots bits) is
// zeroed here. Ids out of range are not routed (slot -1).
template <int kSlots, typename id_t>
__device__ __forceinline__ void route_in_warp(const Args<id_t>& a, int32_t* map, uint32_t* hit_bits,
                                              DecodeRouting& out, int64_t now) {
  const int lane = threadIdx.x & 31;
  const int32_t* layer_map = a.slot_of + a.layer * a.experts;
  const int64_t e = lane < a.numel ? static_cast<int64_t>(a.ids[lane]) : -1;  // with the map: one round trip
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
  const bool ok = e >= 0 && e < a.experts;
  const int32_t slot = ok ? map[e] : -1;
  // Lanes routed to the same expert; an unrouted lane is alone (its key is negative and its own).
  const uint32_t peers = __match_any_sync(0xffffffffu, ok ? static_cast<int>(e) : -1 - lane);
  const bool leader = ok && __ffs(peers) - 1 == lane;
  if (lane < a.numel) a.slot_ids[lane] = slot;  // misses are rewritten by their victim's thread
  if (leader && slot >= 0) {
    a.last_use[slot] = now;
    atomicOr(&hit_bits[slot >> 5], 1u << (slot & 31));
  }
  // Misses ranked as dedup_and_refresh ranks them: most routed first, then by expert id.
  const bool miss = leader && slot < 0;
  const uint32_t key = miss ? (static_cast<uint32_t>(a.numel - __popc(peers)) << 27) | static_cast<uint32_t>(e)
                            : 0xffffffffu;
  int rank = 0;  // the shuffles are independent; only the call's numel lanes can hold a miss
#pragma unroll
  for (int j = 0; j < kDecodeIds; ++j) {
    if (j >= a.numel) break;  // the same in every lane
    rank += __shfl_sync(0xffffffffu, key, j) < key ? 1 : 0;
  }
  if (miss) {
    out.by_rank[rank] = static_cast<int32_t>(e);
    out.positions[rank] = peers;
  }
  const int misses = __popc(__ballot_sync(0xffffffffu, miss));
  const int unique = __popc(__ballot_sync(0xffffffffu, leader));
  if (lane == 0) out.misses = misses, out.unique = unique;
  FT_ADMIT_MARK(3);  // routed
  if (a.stamp_mode == kStampsAfterRouting) {
    asm volatile("bar.arrive 1, %0;" ::"r"(static_cast<int>(blockDim.x)) : "memory");
  }
}

// kStampsBulk: thread `issuer` starts one bulk copy of the pool's stamps into `dst`, completing
// on `bar` (phase 0).
__device__ __forceinline__ void start_stamp_copy(int64_t* dst, const int64_t* src, int64_t slots,
                                                 unsigned long long* bar) {
  const unsigned bar_s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  const unsigned dst_s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const unsigned bytes = static_cast<unsigned>(slots * sizeof(int64_t));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_s) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_s), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst_s), "l"(src), "r"(bytes), "r"(bar_s) : "memory");
}

__device__ __forceinline__ void wait_stamp_copy(unsigned long long* bar) {
  const unsigned bar_s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar_s) : "memory");
  }
}

// This thread's stamps from the bulk copy in shared memory (the layout of load_stamps).
template <int kThreads, int kPerThread>
__device__ __forceinline__ void read_staged_stamps(const int64_t* staged, int64_t slots, int64_t (&stamp)[kPerThread]) {
#pragma unroll
  for (int row = 0; row < kPerThread / 2; ++row) {
    const int s = slot_of_stamp<kThreads>(2 * row);
    if (s + 1 < slots) {
      const longlong2 v = *reinterpret_cast<const longlong2*>(staged + s);
      stamp[2 * row] = v.x, stamp[2 * row + 1] = v.y;
    } else {
      stamp[2 * row] = LLONG_MAX, stamp[2 * row + 1] = LLONG_MAX;  // slots is even: both past the pool
    }
  }
}

// After the first barrier, with misses: victims for `wanted` of them, with keys of type Key (see
// admission_level.cuh). Returns how many were admitted.
template <int kThreads, int kPerThread, typename Key, typename id_t>
__device__ __forceinline__ int admit_decode_misses(const Args<id_t>& a, const int64_t (&stamp)[kPerThread],
                                                   int64_t now, const uint32_t* hit_bits,
                                                   const DecodeRouting& routing, int wanted) {
  Key key[kPerThread];
  key_stamps<kThreads, kPerThread>(a, stamp, now, hit_bits, key);
  const FirstLevel<Key> first = publish_first_level<kThreads, kPerThread>(key);
  __syncthreads();
  // The thread holding a victim rewrites the maps and its expert's positions. Victims are
  // distinct, their old owners are distinct and never a miss of this call (misses own no slot),
  // so the writes of different ranks never collide. The owner is read by the victim's thread only.
  return take_by_level<kThreads, kPerThread>(key, first, wanted, [&](int r, int u) {
    const int32_t s = slot_of_stamp<kThreads>(u);
    give_slot(a, r, routing.by_rank[r], s, a.owner_of[s], now);
#pragma unroll 1
    for (uint32_t bits = routing.positions[r]; bits != 0; bits &= bits - 1) a.slot_ids[__ffs(bits) - 1] = s;
  });
}

template <int kThreads, int kPerThread, typename id_t>
__device__ __forceinline__ void admit_decode(const Args<id_t>& a) {
  static_assert(kPerThread % 2 == 0, "whole pairs of slots per thread");
  constexpr int kSlots = kThreads * kPerThread;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint32_t hit_bits[kSlots / 32];
  __shared__ DecodeRouting routing;
  __shared__ __align__(8) unsigned long long stamps_ready;  // kStampsBulk's mbarrier
  CallState c;
  carve(smem_raw, a.experts, a.plan_len, c);  // only c.map is used
  // kStampsBulk: the stamps' copy in shared memory, after the call state.
  const size_t state_bytes = call_state_bytes(a.experts, a.plan_len);
  int64_t* staged = reinterpret_cast<int64_t*>(smem_raw + ((state_bytes + 15) & ~size_t{15}));
  FT_ADMIT_MARK(0);  // the block runs
  wait_for_previous_kernel();
  FT_ADMIT_MARK(1);  // the previous kernel is done
  const bool bulk = a.stamp_mode == kStampsBulk;
  if (bulk && threadIdx.x == 32) start_stamp_copy(staged, a.last_use, a.slots, &stamps_ready);
  const int64_t now = a.clock[0] + 1;
  int64_t stamp[kPerThread];
  if (threadIdx.x < 32) {
    route_in_warp<kSlots>(a, c.map, hit_bits, routing, now);
  } else if (a.stamp_mode == kStampsAfterRouting) {
    asm volatile("bar.sync 1, %0;" ::"r"(static_cast<int>(blockDim.x)) : "memory");
  }
  if (!bulk) load_stamps<kThreads, kPerThread>(a, stamp);  // the routing warp's after its ids and map
  __syncthreads();
  if (bulk) wait_stamp_copy(&stamps_ready);  // in every call: the copy must land before the block exits
  FT_ADMIT_MARK(4);  // every warp has routed or loaded (the level kernel's marks 2-4: map, count, hits)
  const int misses = routing.misses;
  const int wanted = static_cast<int>(ft::admitted_count(misses, a.fetch_fraction));
  int admitted = 0;
  if (wanted > 0) {
    if (bulk) read_staged_stamps<kThreads, kPerThread>(staged, a.slots, stamp);
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
