// CUDA kernels that move expert rows from the pinned host pool into the slot banks.
//
// copy_experts executes a decode copy plan whose length lives on the device: a small-grid kernel
// reads pinned host memory through its device address, so no host sync is needed to learn the
// count, and few SMs are taken from the GEMMs it overlaps (a copy that takes many SMs serializes
// with them). async_layer_copy rewrites the maps in one single-block kernel, then moves
// the rows: the whole layer through the copy engine (one cudaMemcpyAsync per bank; the region is
// contiguous in both places), or, with skip_resident, only the rows the map kernel marked, with
// the same copy kernel (which rows that is, only the device knows).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/limits.h"
#include "cuda_utils.cuh"

namespace ft::cuda {
namespace {

constexpr int kMaxBanks = 8;
constexpr int kCopyThreads = 512;
constexpr int kUnroll = 4;                 // 16-byte loads in flight per thread
constexpr int64_t kChunkBytes = 64 << 10;  // one block's unit of work

struct BankSet {
  char* dst[kMaxBanks];
  const char* src[kMaxBanks];  // device address of host row 0 of the layer
  int64_t row_bytes[kMaxBanks];
  int64_t chunks[kMaxBanks];  // chunks per row
  int count;
  int64_t chunks_per_copy;
};

BankSet make_bank_set(at::TensorList banks, at::TensorList host_rows, bool* vectorizable) {
  TORCH_CHECK(static_cast<int>(banks.size()) <= kMaxBanks, "at most ", kMaxBanks,
              " banks are supported, got ", banks.size());
  BankSet set{};
  set.count = static_cast<int>(banks.size());
  *vectorizable = true;
  for (int j = 0; j < set.count; ++j) {
    set.row_bytes[j] = banks[j].stride(0) * banks[j].element_size();
    set.dst[j] = static_cast<char*>(banks[j].data_ptr());
    void* host_ptr = host_rows[j].data_ptr();
    if (host_rows[j].is_cuda()) {
      set.src[j] = static_cast<const char*>(host_ptr);
    } else {
      void* device_ptr = nullptr;
      if (cudaHostGetDevicePointer(&device_ptr, host_ptr, 0) != cudaSuccess) {
        // A pointer inside (not at the start of) a pinned allocation can be refused; with
        // unified addressing (every 64-bit CUDA platform) the host address is the device one.
        (void)cudaGetLastError();
        device_ptr = host_ptr;
      }
      set.src[j] = static_cast<const char*>(device_ptr);
    }
    set.chunks[j] = (set.row_bytes[j] + kChunkBytes - 1) / kChunkBytes;
    set.chunks_per_copy += set.chunks[j];
    *vectorizable &= set.row_bytes[j] % 16 == 0 && aligned16(set.dst[j]) && aligned16(set.src[j]);
  }
  return set;
}

// For i < n (n = *num if given, else plan_len): for every bank, row plan_s[i] <- host row
// plan_e[i]. Entries with a negative expert or slot are skipped.
template <bool kVector>
__global__ void __launch_bounds__(kCopyThreads, 4)
    copy_rows_kernel(BankSet set, const int32_t* __restrict__ plan_e,
                     const int32_t* __restrict__ plan_s, const int32_t* __restrict__ num,
                     int64_t plan_len) {
  const int64_t n = num != nullptr ? static_cast<int64_t>(num[0]) : plan_len;
  const int64_t items = n * set.chunks_per_copy;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t i = item / set.chunks_per_copy;
    int64_t chunk = item - i * set.chunks_per_copy;
    const int32_t e = plan_e[i];
    const int32_t s = plan_s[i];
    if (e < 0 || s < 0) continue;
    int j = 0;
    while (chunk >= set.chunks[j]) chunk -= set.chunks[j++];
    const int64_t offset = chunk * kChunkBytes;
    const int64_t bytes = min(kChunkBytes, set.row_bytes[j] - offset);
    const char* src = set.src[j] + e * set.row_bytes[j] + offset;
    char* dst = set.dst[j] + s * set.row_bytes[j] + offset;
    if constexpr (kVector) {
      const uint4* src4 = reinterpret_cast<const uint4*>(src);
      uint4* dst4 = reinterpret_cast<uint4*>(dst);
      const int64_t vecs = bytes / 16;
      const int64_t stride = blockDim.x;
      for (int64_t base = threadIdx.x; base < vecs; base += kUnroll * stride) {
        uint4 r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = base + u * stride;
          if (v < vecs) r[u] = src4[v];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = base + u * stride;
          if (v < vecs) dst4[v] = r[u];
        }
      }
    } else {
      for (int64_t b = threadIdx.x; b < bytes; b += blockDim.x) dst[b] = src[b];
    }
  }
}

// Each copy block asks for all of an SM's shared memory, so no block of another kernel shares its
// SM: the in-place decode GEMM beside copy_experts went from 1.16-1.17 to 1.09-1.13 of the longer
// alone (H200); the grouped GEMM cannot share an SM with it anyway (prefill leaves it the copy's SMs:
// ft_ops/sm_share.py).
// The dynamic shared memory of a copy block: the device's per-block maximum (set on the kernel
// once per device).
template <bool kVector>
int copy_block_smem() {
  constexpr int kMaxDevices = 64;
  static int bytes[kMaxDevices] = {};  // 0: not set yet on that device
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices) return 0;
  if (bytes[device] == 0) {
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    C10_CUDA_CHECK(cudaFuncSetAttribute(copy_rows_kernel<kVector>, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    bytes[device] = optin;
  }
  return bytes[device];
}

template <bool kVector>
void launch_copy_kernel(const BankSet& set, const int32_t* plan_e, const int32_t* plan_s, const int32_t* num,
                        int64_t plan_len, int blocks, int threads) {
  copy_rows_kernel<kVector><<<blocks, threads, copy_block_smem<kVector>(), current_stream()>>>(
      set, plan_e, plan_s, num, plan_len);
}

void launch_copy(const BankSet& set, bool vectorizable, const int32_t* plan_e,
                 const int32_t* plan_s, const int32_t* num, int64_t plan_len, int blocks,
                 int threads) {
  if (plan_len == 0) return;
  if (vectorizable) {
    launch_copy_kernel<true>(set, plan_e, plan_s, num, plan_len, blocks, threads);
  } else {
    launch_copy_kernel<false>(set, plan_e, plan_s, num, plan_len, blocks, threads);
  }
  FT_CHECK_LAUNCH();
}

// Rewrites the maps for streaming `layer` into [first_slot, first_slot + E) (see the CPU kernel
// for the same two phases) and writes the copy plan: plan_e[e] = e when row e must cross, else -1.
__global__ void __launch_bounds__(1024)
    layer_map_kernel(int32_t* __restrict__ slot_of, int32_t* __restrict__ owner_of,
                     int64_t* __restrict__ last_use, int64_t* __restrict__ clock, int64_t layer,
                     int64_t experts, int64_t first_slot, bool skip_resident,
                     int64_t reclaim_lo, int64_t reclaim_hi, bool opportunity, int32_t* __restrict__ plan_e,
                     int32_t* __restrict__ plan_s, int32_t* __restrict__ layer_map_out) {
  const int64_t now = clock[0] + 1;
  const int64_t base = layer * experts;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const int64_t s = first_slot + e;
    const int32_t o = owner_of[s];
    if (o < 0 || (skip_resident && o == base + e)) continue;
    slot_of[o] = -1;
    owner_of[s] = -1;
    last_use[s] = 0;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    const int32_t cur = slot_of[base + e];
    const bool reclaimed = cur >= reclaim_lo && cur < reclaim_hi && cur != first_slot + e;
    if (skip_resident && cur >= 0 && !reclaimed) {
      if (!opportunity) last_use[cur] = now;  // the opportunity policy leaves decode stamps alone
      plan_e[e] = -1;
      plan_s[e] = -1;
      continue;
    }
    if (cur >= 0) {  // outside the region (its owners were released above): dropped
      owner_of[cur] = -1;
      last_use[cur] = 0;
    }
    const int32_t target = static_cast<int32_t>(first_slot + e);
    slot_of[base + e] = target;
    owner_of[target] = static_cast<int32_t>(base + e);
    last_use[target] = opportunity ? kStreamedStamp : now;
    plan_e[e] = static_cast<int32_t>(e);
    plan_s[e] = target;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) layer_map_out[e] = slot_of[base + e];
  if (threadIdx.x == 0) clock[0] = now;
}

void copy_experts(at::TensorList banks, at::TensorList host_rows, const at::Tensor& copy_experts,
                  const at::Tensor& copy_slots, const at::Tensor& num_copies) {
  TORCH_CHECK(!host_rows.empty(), "host_rows must hold at least one tensor");
  check_banks(banks, host_rows, host_rows[0].size(0), banks[0]);
  check_copy_plan(copy_experts, copy_slots, num_copies, banks[0]);
  const c10::cuda::CUDAGuard guard(banks[0].device());
  bool vectorizable = false;
  const BankSet set = make_bank_set(banks, host_rows, &vectorizable);
  launch_copy(set, vectorizable, copy_experts.data_ptr<int32_t>(), copy_slots.data_ptr<int32_t>(),
              num_copies.data_ptr<int32_t>(), copy_experts.numel(), limits::kCopyBlocks, kCopyThreads);
}

at::Tensor async_layer_copy(const at::Tensor& slot_of, const at::Tensor& owner_of,
                            const at::Tensor& last_use, const at::Tensor& clock,
                            at::TensorList banks, at::TensorList host_rows, int64_t layer,
                            int64_t first_slot, bool skip_resident, int64_t reclaim_lo,
                            int64_t reclaim_hi, int64_t policy) {
  const PoolShape pool = check_layer_copy_inputs(slot_of, owner_of, last_use, clock, banks,
                                                 host_rows, layer, first_slot, reclaim_lo, reclaim_hi);
  const bool opportunity = check_policy(policy) == EvictionPolicy::kOpportunity;
  const c10::cuda::CUDAGuard guard(slot_of.device());
  auto opts = slot_of.options();
  auto plan_e = at::empty({pool.experts}, opts);
  auto plan_s = at::empty({pool.experts}, opts);
  auto layer_map = at::empty({pool.experts}, opts);
  const int threads = static_cast<int>(std::min<int64_t>(1024, ((pool.experts + 31) / 32) * 32));
  layer_map_kernel<<<1, threads, 0, current_stream()>>>(
      slot_of.data_ptr<int32_t>(), owner_of.data_ptr<int32_t>(), last_use.data_ptr<int64_t>(),
      clock.data_ptr<int64_t>(), layer, pool.experts, first_slot, skip_resident, reclaim_lo,
      reclaim_hi, opportunity, plan_e.data_ptr<int32_t>(), plan_s.data_ptr<int32_t>(), layer_map.data_ptr<int32_t>());
  FT_CHECK_LAUNCH();
  if (skip_resident) {
    bool vectorizable = false;
    const BankSet set = make_bank_set(banks, host_rows, &vectorizable);
    launch_copy(set, vectorizable, plan_e.data_ptr<int32_t>(), plan_s.data_ptr<int32_t>(), nullptr,
                pool.experts, limits::kLayerCopyBlocks, kCopyThreads);
  } else {
    // Every row crosses: the region is contiguous in the bank and the layer in the host pool.
    for (size_t j = 0; j < banks.size(); ++j) {
      const int64_t row_bytes = banks[j].stride(0) * banks[j].element_size();
      char* dst = static_cast<char*>(banks[j].data_ptr()) + first_slot * row_bytes;
      C10_CUDA_CHECK(cudaMemcpyAsync(dst, host_rows[j].data_ptr(), pool.experts * row_bytes,
                                     host_rows[j].is_cuda() ? cudaMemcpyDeviceToDevice
                                                            : cudaMemcpyHostToDevice,
                                     current_stream()));
    }
  }
  return layer_map;
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) {
  m.impl("copy_experts", &copy_experts);
  m.impl("async_layer_copy", &async_layer_copy);
}

}  // namespace ft::cuda
