// dedup_and_admit for pools of 1,025-8,192 slots as one cluster of n = ceil(S / 1,024) blocks
// (thread block clusters, sm_90): block r keys slots [r * 1,024, (r + 1) * 1,024), so the
// per-slot passes of a call with misses (keys, levels, ranks) are spread over n SMs instead of
// one (docs/perf_notes.md, session 5: those passes, not memory, are the miss path's cost).
//
// Every block runs the same prologue (map, ids, count, misses ranked) on its own copy of the call
// state, so no block waits for another before its victim search; only block 0 writes the call's
// global results (hits' stamps, slot ids, plan init, count, clock, counters). Levels are combined
// through distributed shared memory: each warp writes its minimum and member counts into every
// block's arrays, then one cluster barrier per level, after which every block reads all warps'
// entries (at most 64) and ranks its own members in slot order. A call without misses has no
// cluster barrier. Victims' threads rewrite the maps as in the one-block kernels.
#pragma once

#include <cooperative_groups.h>

#include "admission_level.cuh"

namespace ft::cuda::admission {

constexpr int kClusterThreads = 256;  // per block
constexpr int kClusterPerThread = 4;  // stamps per thread: two rows of pairs
constexpr int kClusterBlockSlots = kClusterThreads * kClusterPerThread;  // 1,024
constexpr int kMaxClusterBlocks = 8;  // the portable cluster size
constexpr int kMaxClusterSlots = kClusterBlockSlots * kMaxClusterBlocks;  // 8,192
constexpr int kClusterWarps = kClusterThreads / 32;                      // per block
constexpr int kMaxClusterWarps = kClusterWarps * kMaxClusterBlocks;      // 64

// Cluster barrier halves (PTX barrier.cluster): arrive (release; relaxed where nothing needs to be
// published) and wait (acquire). Each thread arrives once per phase; exited threads do not count.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}

// Slot of a thread's u-th stamp in block `rank`: pairs a block apart within the block's range,
// as in the one-block kernel (coalesced loads); slot order is block, row, thread, pair member.
__device__ __forceinline__ int cluster_slot(int rank, int u) {
  return slot_of_stamp<kClusterThreads>(u, rank * kClusterBlockSlots);
}

// Ranks one level's members and calls take(rank, u) for those below `wanted`; returns the level's
// size. `count_of` is this block's copy of every warp's member counts per row (8-bit fields);
// with `min_of` (the first level, whose counts are each warp's count of its own minimum) a warp's
// entry counts only if its minimum is the level; without it (later levels) every entry is a count
// of `level`'s members. A member's rank counts the members of earlier blocks, of earlier rows of
// its block, of its row in lower warps and lanes of its block, and the pair's first slot.
template <typename Key, typename Take>
__device__ __forceinline__ int take_cluster_members(const LevelMembers& m, const Key* min_of, const uint32_t* count_of,
                                                    Key level, int rank, int blocks, int taken, int wanted,
                                                    Take take) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int first_warp = rank * kClusterWarps, my_warp = first_warp + warp;
  uint32_t before_blocks = 0, in_block = 0, before_warp = 0, all = 0;  // rows 0 and 1 as 16-bit fields
#pragma unroll
  for (int k = 0; k < kMaxClusterWarps / 32; ++k) {
    const int e = lane + 32 * k;
    const uint32_t count =
        e < blocks * kClusterWarps && (min_of == nullptr || min_of[e] == level) ? count_of[e] : 0u;
    const uint32_t rows = (count & 0xffu) | ((count & 0xff00u) << 8);
    before_blocks += e < first_warp ? rows : 0u;
    in_block += e >= first_warp && e < first_warp + kClusterWarps ? rows : 0u;
    before_warp += e >= first_warp && e < my_warp ? rows : 0u;
    all += rows;
  }
  before_blocks = __reduce_add_sync(0xffffffffu, before_blocks);
  in_block = __reduce_add_sync(0xffffffffu, in_block);
  before_warp = __reduce_add_sync(0xffffffffu, before_warp);
  all = __reduce_add_sync(0xffffffffu, all);
  const int earlier = taken + static_cast<int>((before_blocks & 0xffffu) + (before_blocks >> 16));
  const int row_first[2] = {
      earlier + static_cast<int>(before_warp & 0xffffu) + field8(m.before_lane, 0),
      earlier + static_cast<int>(in_block & 0xffffu) + static_cast<int>(before_warp >> 16) + field8(m.before_lane, 1)};
  // My members in slot order have increasing ranks: stop at the first one not wanted.
#pragma unroll 1
  for (uint32_t bits = m.member; bits != 0; bits &= bits - 1) {
    const int u = __ffs(bits) - 1;
    int r = (u >> 1) ? row_first[1] : row_first[0];
    if (u & 1) r += static_cast<int>((m.member >> (u - 1)) & 1u);  // after the pair's first slot
    if (r >= wanted) break;
    take(r, u);
  }
  return static_cast<int>((all & 0xffffu) + (all >> 16));
}

// The smallest of the cluster's warp entries (every block's copy holds all of them).
template <typename Key>
__device__ __forceinline__ Key least_entry(const Key* entries, int blocks) {
  const int lane = threadIdx.x & 31;
  Key least = KeyTraits<Key>::kNone;
#pragma unroll
  for (int k = 0; k < kMaxClusterWarps / 32; ++k) {
    const int e = lane + 32 * k;
    if (e < blocks * kClusterWarps) least = entries[e] < least ? entries[e] : least;
  }
  return KeyTraits<Key>::warp_min(least);
}

// Writes this warp's entry (minimum, member counts) for a level into every block's arrays; lane
// d writes block d's copy.
template <typename Key>
__device__ __forceinline__ void publish_to_cluster(cooperative_groups::cluster_group& cluster, Key* min_slot,
                                                   uint32_t* count_slot, Key least, uint32_t count, int blocks,
                                                   bool with_count) {
  const int lane = threadIdx.x & 31;
  if (lane < blocks) {
    *cluster.map_shared_rank(min_slot, lane) = least;
    if (with_count) *cluster.map_shared_rank(count_slot, lane) = count;
  }
}

template <typename Key, typename id_t>
__device__ __forceinline__ void admit_in_cluster(const Args<id_t>& a, CallState& c, int64_t now,
                                                 cooperative_groups::cluster_group& cluster, int rank, int blocks) {
  using Traits = KeyTraits<Key>;
  __shared__ uint32_t hit_bits[kMaxClusterSlots / 32];  // the whole pool's hit slots
  __shared__ Key level_min[2][kMaxClusterWarps];        // every warp's entry, double-buffered
  __shared__ uint32_t level_count[2][kMaxClusterWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int my_warp = rank * kClusterWarps + warp;
  for (int i = tid; i < kMaxClusterSlots / 32; i += kClusterThreads) hit_bits[i] = 0;

  Key key[kClusterPerThread];
  FirstLevel<Key> first{};
  dedup_and_refresh<kClusterThreads>(a, c, now, hit_bits, [&](bool any_miss) {
    if (!any_miss) return;
    int64_t stamp[kClusterPerThread];
    load_stamps<kClusterThreads, kClusterPerThread>(a, stamp, rank * kClusterBlockSlots);
    key_stamps<kClusterThreads, kClusterPerThread>(a, stamp, now, hit_bits, key, rank * kClusterBlockSlots);
    find_first_level<kClusterPerThread>(key, first);
    cluster_wait();  // every block has started (they arrived at kernel start): its shared memory exists
    publish_to_cluster(cluster, &level_min[0][my_warp], &level_count[0][my_warp], first.least,
                       first.members.warp_rows, blocks, true);
  }, rank == 0);

  const int wanted = static_cast<int>(ft::admitted_count(c.misses, a.fetch_fraction));
  int admitted = 0;
  if (c.misses == 0) {
    cluster_wait();  // balances the arrival at kernel start
  } else {
    cluster_sync();  // every warp's first entry is in every block
    const auto take = [&](int r, int u) {
      const int s = cluster_slot(rank, u);
      assign(a, c, r, s, a.owner_of[s], now);
      // Block 0 rewrites the slot ids of large calls from its map: give it this one.
      if (rewrites_in_finish(a) && rank != 0) *cluster.map_shared_rank(&c.map[c.by_rank[r]], 0) = s;
    };
    const Key level = least_entry(level_min[0], blocks);
    if (wanted > 0 && level != Traits::kNone) {
      const LevelMembers members = first.least == level ? first.members : LevelMembers{};
      int taken = take_cluster_members(members, level_min[0], level_count[0], level, rank, blocks, 0, wanted, take);
      if (taken < wanted) {
        // Further levels, one cluster barrier each: drop the level's members, publish the next
        // minimum (buffer 1), then take levels as the one-block kernel does.
        const Key next = drop_members(key, members.member);
        publish_to_cluster(cluster, &level_min[1][my_warp], &level_count[1][my_warp], Traits::warp_min(next), 0u,
                           blocks, false);
        cluster_sync();
        for (int p = 1;; p ^= 1) {
          const Key lvl = least_entry(level_min[p], blocks);
          if (lvl == Traits::kNone) break;  // nothing eligible left
          const LevelMembers m = members_of<kClusterPerThread>(key, lvl);
          const Key next = drop_members(key, m.member);
          // This level's counts (every warp's entry is for `lvl`: its minimum is `lvl` or it has
          // no member) and the next level's minimum, then the barrier.
          if (lane < blocks) *cluster.map_shared_rank(&level_count[p][my_warp], lane) = m.warp_rows;
          publish_to_cluster(cluster, &level_min[p ^ 1][my_warp], &level_count[p][my_warp], Traits::warp_min(next),
                             0u, blocks, false);
          cluster_sync();
          // No minimum is read after the barrier: the next level's writers may be rewriting them.
          taken += take_cluster_members(m, static_cast<const Key*>(nullptr), level_count[p], lvl, rank, blocks, taken,
                                        wanted, take);
          if (taken >= wanted) break;
        }
      }
      admitted = taken < wanted ? taken : wanted;
    }
    if (rewrites_in_finish(a)) cluster_sync();  // block 0's map holds every admitted expert's slot
  }
  if (rank == 0) finish<kClusterThreads>(a, c, admitted, now);
}

template <typename id_t>
__global__ void __launch_bounds__(kClusterThreads, 1) admit_by_cluster_kernel(const Args<id_t> a) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  CallState c;
  carve(smem_raw, a.experts, a.plan_len, c);
  cluster_arrive_relaxed();  // waited on before the first access to another block's shared memory
  wait_for_previous_kernel();
  const int rank = static_cast<int>(cluster.block_rank()), blocks = static_cast<int>(cluster.num_blocks());
  const int64_t now = a.clock[0] + 1;
  if (now < int64_t{KeyTraits<uint32_t>::kNone}) {  // the first four billion calls
    admit_in_cluster<uint32_t>(a, c, now, cluster, rank, blocks);
  } else {
    admit_in_cluster<int64_t>(a, c, now, cluster, rank, blocks);
  }
}

}  // namespace ft::cuda::admission
