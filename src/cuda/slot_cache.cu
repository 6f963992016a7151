// CUDA kernels for the slot cache: slot_lookup and dedup_and_admit.
//
// dedup_and_admit is one launch of one block for the whole call: it counts routed ids in shared
// memory (dedup), refreshes hits, sorts the misses (most routed first, then by id), picks the
// least recently used victims, rewrites the maps and writes the copy plan. Pools of up to 4,096
// slots load every stamp and owner into registers at kernel start and pick victims level by level
// (select_by_level), so after the dedup only writes touch global memory; larger pools scan the
// stamps in global memory and merge per-thread sorted lists (select_victims). Nothing is read
// back to the host, and every shape comes from the inputs, so the op can be captured in a CUDA
// graph and replayed with new routing.
//
// Out-of-range expert ids cannot raise here (that would need a host sync): they are treated as
// not routed (slot -1, nothing admitted). The CPU kernel raises for them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <climits>

#include "../common/checks.h"
#include "cuda_utils.cuh"

namespace ft::cuda {
namespace {

constexpr int kAdmitThreads = 512;
constexpr int kWarps = kAdmitThreads / 32;

template <typename id_t>
__global__ void slot_lookup_kernel(const int32_t* __restrict__ layer_map, const id_t* __restrict__ ids,
                                   int32_t* __restrict__ out, int64_t n, int64_t experts) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    out[i] = (e >= 0 && e < experts) ? layer_map[e] : -1;
  }
}

// A victim candidate packed into one word, so comparing, shuffling and swapping candidates is
// one 64-bit operation: the high 40 bits hold the inverted age (now - last_use, saturated at
// 2^40 - 1), the low 24 bits the slot. Ascending keys are ascending (last_use, slot), exactly,
// for every slot touched within the last 2^40 admissions; older ones tie on age and go by slot.
constexpr int kSlotBits = 24;
constexpr uint64_t kMaxAge = (uint64_t{1} << 40) - 1;
constexpr uint64_t kNone = ~uint64_t{0};

__device__ __forceinline__ uint64_t victim_key(int64_t stamp, int64_t now, int64_t slot) {
  const uint64_t age = static_cast<uint64_t>(now - stamp);  // >= 1 for an eligible slot
  const uint64_t capped = age < kMaxAge ? age : kMaxAge;
  return ((kMaxAge - capped) << kSlotBits) | static_cast<uint64_t>(slot);
}

__device__ __forceinline__ int32_t key_slot(uint64_t key) {
  return static_cast<int32_t>(key & ((uint64_t{1} << kSlotBits) - 1));
}

// Minimum over the warp (every lane gets it); 64-bit keys or stamps.
template <typename T>
__device__ __forceinline__ T warp_min(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const T o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o < v ? o : v;
  }
  return v;
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
  __shared__ uint64_t warp_lists[kWarps][kBatch];
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
    // Block merge: lane l < kWarps walks warp l's sorted list.
    int head = 0;
    int taken = 0;
    for (int r = 0; r < want; ++r) {
      const uint64_t mine = (lane < kWarps && head < want) ? warp_lists[lane][head] : kNone;
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
__device__ __forceinline__ int select_victims(const int64_t* __restrict__ last_use, int64_t slots, int64_t now,
                              int64_t lo, int64_t hi, uint64_t floor, int want, int32_t* victims,
                              uint64_t* last_taken) {
  const int tid = threadIdx.x;
  uint64_t list[kBatch];
#pragma unroll
  for (int i = 0; i < kBatch; ++i) list[i] = kNone;
  // kBatch independent loads in flight per thread before any is used: the block lives on one
  // SM, so a loop that waits on each load in turn would be bound by memory latency.
  for (int64_t base = tid; base < slots; base += int64_t{kAdmitThreads} * kBatch) {
    int64_t stamp[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t s = base + int64_t{u} * kAdmitThreads;
      stamp[u] = s < slots ? last_use[s] : now;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t s = base + int64_t{u} * kAdmitThreads;
      if (stamp[u] >= now || (s >= lo && s < hi)) continue;  // used by this call, or protected
      const uint64_t key = victim_key(stamp[u], now, s);
      if (key > floor || floor == kNone) offer(list, key);
    }
  }
  return merge_lists(list, want, victims, last_taken);
}

// Small pools: victims level by level, from stamps in registers (stamp[u] of slot
// tid + u * kAdmitThreads; bit u of `eligible` says it may be evicted). A level is the smallest
// eligible stamp above the previous level; its slots are taken in ascending slot order, as many as
// are still wanted, so victims come out in exact ascending (last_use, slot) order. rank[u]
// receives the victim rank of slot tid + u * kAdmitThreads, or -1, so the thread holding a victim
// rewrites its maps. A level costs three barriers and no global memory access; LRU stamps come in
// groups (every slot an admission call touches gets the same stamp), so a call needs few levels.
// Returns the number of victims. Called by the whole block.
__device__ __forceinline__ int select_by_level(const int64_t (&stamp)[kBatch], uint32_t eligible, int wanted,
                                               int (&rank)[kBatch]) {
  __shared__ int64_t warp_mins[kWarps];
  __shared__ int offsets[kBatch * kWarps];  // level members before (u, warp), u-major = slot order
  __shared__ int level_total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t prev = LLONG_MIN;
  int taken = 0;
#pragma unroll
  for (int u = 0; u < kBatch; ++u) rank[u] = -1;
  while (taken < wanted) {
    int64_t mine = LLONG_MAX;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (((eligible >> u) & 1u) && stamp[u] > prev && stamp[u] < mine) mine = stamp[u];
    }
    mine = warp_min(mine);
    if (lane == 0) warp_mins[warp] = mine;
    __syncthreads();
    const int64_t level = warp_min<int64_t>(lane < kWarps ? warp_mins[lane] : LLONG_MAX);
    if (level == LLONG_MAX) break;  // no eligible slot left (the same answer in every thread)
    uint32_t member = 0;
    int before_me[kBatch];  // members of the level in my warp below my lane, per u
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool in = ((eligible >> u) & 1u) && stamp[u] == level;
      member |= static_cast<uint32_t>(in) << u;
      const uint32_t ballot = __ballot_sync(0xffffffffu, in);
      before_me[u] = __popc(ballot & ((1u << lane) - 1u));
      if (lane == 0) offsets[u * kWarps + warp] = __popc(ballot);
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the kBatch * kWarps counts (4 per lane)
      constexpr int kPer = kBatch * kWarps / 32;
      int c[kPer], sum = 0;
#pragma unroll
      for (int j = 0; j < kPer; ++j) c[j] = offsets[lane * kPer + j], sum += c[j];
      int incl = sum;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += o;
      }
      int run = incl - sum;
#pragma unroll
      for (int j = 0; j < kPer; ++j) offsets[lane * kPer + j] = run, run += c[j];
      if (lane == 31) level_total = incl;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if ((member >> u) & 1u) {
        const int r = taken + offsets[u * kWarps + warp] + before_me[u];
        if (r < wanted) rank[u] = r;
      }
    }
    taken += level_total;
    prev = level;
  }
  return taken < wanted ? taken : wanted;
}

// Pools of at most this many slots keep every slot's stamp and owner in registers, loaded at
// kernel start: those loads overlap the dedup instead of following it, and neither the victim
// search nor the map rewrite waits on global memory again.
constexpr int64_t kPrefetchSlots = int64_t{kAdmitThreads} * kBatch;

template <typename id_t>
__global__ void __launch_bounds__(kAdmitThreads)
    dedup_and_admit_kernel(int32_t* __restrict__ slot_of, int32_t* __restrict__ owner_of,
                           int64_t* __restrict__ last_use, int64_t* __restrict__ clock,
                           const id_t* __restrict__ ids, int64_t numel, int64_t layer,
                           int64_t experts, int64_t slots, double fetch_fraction, int64_t lo,
                           int64_t hi, int32_t* __restrict__ slot_ids, int32_t* __restrict__ plan_e,
                           int32_t* __restrict__ plan_s, int32_t* __restrict__ num_copies,
                           int64_t plan_len, int sort_len, int64_t* __restrict__ stats) {
  extern __shared__ unsigned char smem_raw[];
  // keys[sort_len] (8-byte aligned), victims[sort_len], count[experts], routed_slot[experts].
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem_raw);
  int32_t* victims = reinterpret_cast<int32_t*>(keys + sort_len);
  int* count = victims + sort_len;
  int32_t* routed_slot = count + experts;  // slot of each routed expert after this call
  __shared__ uint32_t hit_bits[kPrefetchSlots / 32];  // slots hit by this call (small pools)
  __shared__ int num_misses;
  __shared__ int num_hits;
  __shared__ uint64_t last_victim;

  const int tid = threadIdx.x;
  const bool prefetched = slots <= kPrefetchSlots;
  int64_t stamp[kBatch];
  int32_t owner[kBatch];
  if (prefetched) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t s = tid + int64_t{u} * kAdmitThreads;
      stamp[u] = s < slots ? last_use[s] : LLONG_MAX;
      owner[u] = s < slots ? owner_of[s] : -1;
    }
    for (int i = tid; i < kPrefetchSlots / 32; i += kAdmitThreads) hit_bits[i] = 0;
  }
  const int64_t now = clock[0] + 1;
  int32_t* layer_map = slot_of + layer * experts;

  for (int64_t e = tid; e < experts; e += kAdmitThreads) count[e] = 0;
  if (tid == 0) num_misses = 0, num_hits = 0;
  __syncthreads();
  for (int64_t i = tid; i < numel; i += kAdmitThreads) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    if (e >= 0 && e < experts) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Hits refresh their stamp (so no victim search below can pick them); misses queue up with a
  // key that sorts most-routed first, then by expert id.
  for (int64_t e = tid; e < experts; e += kAdmitThreads) {
    const int c = count[e];
    if (c == 0) continue;
    const int32_t s = layer_map[e];
    routed_slot[e] = s;
    if (s >= 0) {
      last_use[s] = now;
      if (prefetched) atomicOr(&hit_bits[s >> 5], 1u << (s & 31));
      if (stats != nullptr) atomicAdd(&num_hits, 1);
    } else {
      const int idx = atomicAdd(&num_misses, 1);
      keys[idx] = (static_cast<uint64_t>(numel - c) << 32) | static_cast<uint64_t>(e);
    }
  }
  __syncthreads();
  const int misses = num_misses;
  const int64_t wanted = ft::admitted_count(misses, fetch_fraction);

  int admitted = 0;
  if (wanted > 0) {
    // Bitonic sort of the miss keys, padded to sort_len (a power of two >= misses).
    for (int i = misses + tid; i < sort_len; i += kAdmitThreads) keys[i] = ~uint64_t{0};
    __syncthreads();
    for (int k = 2; k <= sort_len; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = tid; i < sort_len; i += kAdmitThreads) {
          const int partner = i ^ j;
          if (partner > i) {
            const bool ascending = (i & k) == 0;
            const uint64_t a = keys[i], b = keys[partner];
            if ((a > b) == ascending) {
              keys[i] = b;
              keys[partner] = a;
            }
          }
        }
        __syncthreads();
      }
    }
    // Assign victim i to the i-th miss. Victims are distinct, their old owners are distinct and
    // never a miss of this call (misses own no slot), so these writes do not collide.
    const auto assign = [&](int i, int32_t v, int32_t old) {
      const int32_t e = static_cast<int32_t>(keys[i] & 0xffffffffu);
      if (old >= 0) slot_of[old] = -1;
      owner_of[v] = static_cast<int32_t>(layer * experts + e);
      layer_map[e] = v;
      last_use[v] = now;
      routed_slot[e] = v;
      plan_e[i] = e;
      plan_s[i] = v;
    };
    if (prefetched) {
      uint32_t eligible = 0;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t s = tid + int64_t{u} * kAdmitThreads;
        const bool hit = s < slots && ((hit_bits[s >> 5] >> (s & 31)) & 1u);
        eligible |= static_cast<uint32_t>(stamp[u] < now && !hit && !(s >= lo && s < hi)) << u;
      }
      int rank[kBatch];
      admitted = select_by_level(stamp, eligible, static_cast<int>(wanted), rank);
      // The thread that loaded a victim's owner rewrites its maps.
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (rank[u] >= 0) assign(rank[u], static_cast<int32_t>(tid + u * kAdmitThreads), owner[u]);
      }
    } else {
      // Victims in ascending (last_use, slot) order, kBatch per pass over the pool.
      uint64_t floor = kNone;  // kNone here: no floor yet
      while (admitted < wanted) {
        const int want = wanted - admitted < kBatch ? static_cast<int>(wanted - admitted) : kBatch;
        const int got = select_victims(last_use, slots, now, lo, hi, floor, want, victims + admitted, &last_victim);
        admitted += got;
        floor = last_victim;
        if (got < want) break;  // no eligible slot left
      }
      for (int i = tid; i < admitted; i += kAdmitThreads) assign(i, victims[i], owner_of[victims[i]]);
    }
  }
  __syncthreads();
  for (int64_t i = tid; i < numel; i += kAdmitThreads) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    slot_ids[i] = (e >= 0 && e < experts) ? routed_slot[e] : -1;
  }
  for (int64_t i = admitted + tid; i < plan_len; i += kAdmitThreads) {
    plan_e[i] = -1;
    plan_s[i] = -1;
  }
  if (tid == 0) {
    num_copies[0] = admitted;
    clock[0] = now;
    if (stats != nullptr) {  // the call's counters, with no launch of their own
      stats[0] += 1;
      stats[1] += numel;
      stats[2] += num_hits + misses;
      stats[3] += admitted;
    }
  }
}

int next_pow2(int64_t n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

at::Tensor slot_lookup(const at::Tensor& slot_of, int64_t layer, const at::Tensor& expert_ids) {
  TORCH_CHECK(slot_of.dim() == 2 && slot_of.is_contiguous(),
              "slot_of must be a contiguous [layers, experts] tensor, got shape ", slot_of.sizes());
  check_dtype(slot_of, at::kInt, "slot_of");
  check_routed_ids(expert_ids, slot_of);
  check_layer(layer, PoolShape{slot_of.size(0), slot_of.size(1), 0});
  const c10::cuda::CUDAGuard guard(slot_of.device());
  const auto ids = expert_ids.contiguous();
  auto out = at::empty(expert_ids.sizes(), expert_ids.options().dtype(at::kInt));
  const int64_t n = ids.numel();
  if (n == 0) return out;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 1024));
  const int32_t* layer_map = slot_of.data_ptr<int32_t>() + layer * slot_of.size(1);
  if (ids.scalar_type() == at::kLong) {
    slot_lookup_kernel<<<blocks, threads, 0, current_stream()>>>(layer_map, ids.data_ptr<int64_t>(),
                                                                 out.data_ptr<int32_t>(), n, slot_of.size(1));
  } else {
    slot_lookup_kernel<<<blocks, threads, 0, current_stream()>>>(layer_map, ids.data_ptr<int32_t>(),
                                                                 out.data_ptr<int32_t>(), n, slot_of.size(1));
  }
  FT_CHECK_LAUNCH();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_and_admit(
    const at::Tensor& slot_of, const at::Tensor& owner_of, const at::Tensor& last_use,
    const at::Tensor& clock, int64_t layer, const at::Tensor& expert_ids, double fetch_fraction,
    int64_t protect_lo, int64_t protect_hi, const c10::optional<at::Tensor>& stats) {
  const PoolShape pool = check_admission_inputs(slot_of, owner_of, last_use, clock, layer, expert_ids,
                                                fetch_fraction, protect_lo, protect_hi, stats);
  TORCH_CHECK(pool.slots < (int64_t{1} << kSlotBits), "the slot pool has ", pool.slots,
              " slots; dedup_and_admit supports fewer than 2^24");
  const c10::cuda::CUDAGuard guard(slot_of.device());

  const auto ids = expert_ids.contiguous();
  const int64_t numel = ids.numel();
  TORCH_CHECK(numel < (int64_t{1} << 31), "too many routed ids in one call: ", numel);
  const int64_t plan_len = std::min(numel, pool.experts);
  auto opts = slot_of.options();
  auto slot_ids = at::empty(expert_ids.sizes(), opts);
  auto plan_e = at::empty({plan_len}, opts);
  auto plan_s = at::empty({plan_len}, opts);
  auto num_copies = at::empty({1}, opts);

  const int sort_len = next_pow2(std::max<int64_t>(plan_len, 1));
  const size_t smem = sort_len * (sizeof(uint64_t) + sizeof(int32_t)) + 2 * pool.experts * sizeof(int);
  int max_smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        slot_of.get_device()));
  TORCH_CHECK(static_cast<int64_t>(smem) + 4096 <= max_smem, "dedup_and_admit needs ", smem,
              " bytes of shared memory for ", pool.experts, " experts and ", numel,
              " routed ids; this GPU allows ", max_smem, ". Split the call into fewer ids.");
  const auto launch = [&](auto kernel, const auto* id_ptr) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    kernel<<<1, kAdmitThreads, smem, current_stream()>>>(
        slot_of.data_ptr<int32_t>(), owner_of.data_ptr<int32_t>(), last_use.data_ptr<int64_t>(),
        clock.data_ptr<int64_t>(), id_ptr, numel, layer, pool.experts, pool.slots, fetch_fraction,
        protect_lo, protect_hi, slot_ids.data_ptr<int32_t>(), plan_e.data_ptr<int32_t>(),
        plan_s.data_ptr<int32_t>(), num_copies.data_ptr<int32_t>(), plan_len, sort_len,
        stats.has_value() ? stats->data_ptr<int64_t>() : nullptr);
    FT_CHECK_LAUNCH();
  };
  if (ids.scalar_type() == at::kLong) {
    launch(dedup_and_admit_kernel<int64_t>, ids.data_ptr<int64_t>());
  } else {
    launch(dedup_and_admit_kernel<int32_t>, ids.data_ptr<int32_t>());
  }
  return {slot_ids, plan_e, plan_s, num_copies};
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) {
  m.impl("slot_lookup", &slot_lookup);
  m.impl("dedup_and_admit", &dedup_and_admit);
}

}  // namespace ft::cuda
