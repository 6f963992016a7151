// Small helpers shared by the CUDA kernels: error checks, 16-byte vector loads, warp reductions,
// the decode kernels' leader test.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "wait_for_previous_kernel.cuh"

namespace ft::cuda {

// Checks the launch that just happened (every kernel launch is followed by this).
#define FT_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// `kernel`'s attributes on `device` (its static shared memory, PTX version, ...), asked once per
// kernel and device: a host-side query, no sync, allowed during graph capture.
inline cudaFuncAttributes kernel_attributes(const void* kernel, int device) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, cudaFuncAttributes> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(kernel, device);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  cudaFuncAttributes attributes = {};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return known[key] = attributes;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Converts 16 bytes of scalar_t (8 halfs / 8 bf16 / 4 floats) to floats.
template <typename scalar_t>
struct Vec16;

template <>
struct Vec16<float> {
  static constexpr int kElems = 4;
  __device__ static void to_float(const uint4& v, float* out) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
  }
};

template <>
struct Vec16<at::Half> {
  static constexpr int kElems = 8;
  __device__ static void to_float(const uint4& v, float* out) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <>
struct Vec16<at::BFloat16> {
  static constexpr int kElems = 8;
  __device__ static void to_float(const uint4& v, float* out) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
};

template <typename scalar_t>
__device__ __forceinline__ float to_float(scalar_t v) {
  return static_cast<float>(v);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Loads 16 bytes that the kernel will not reuse soon (streamed weights).
__device__ __forceinline__ uint4 load_streaming(const void* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// Decode kernels, grid (row tiles, pairs): stages the chunk's slot ids in shared memory (the
// leader test and the member scans read them often; from global memory they would be chains of
// dependent loads) and returns the slot of this block's pair if that pair leads it (the first
// pair routed to the slot), else -1: the block then has nothing to do. Out-of-range slots give -1
// (they cannot raise: no sync). Called by the whole block, first: it also lets the down kernel
// after it start early (let_next_kernel_start), which loads its weights before waiting.
__device__ __forceinline__ int32_t stage_slots_and_lead(const int32_t* __restrict__ slots, int64_t pairs,
                                                       int64_t num_slots, int32_t* pair_slot) {
  let_next_kernel_start();
  for (int64_t q = threadIdx.x; q < pairs; q += blockDim.x) pair_slot[q] = slots[q];
  __syncthreads();
  const int64_t p = blockIdx.y;
  const int32_t s = pair_slot[p];
  if (s < 0 || s >= num_slots) return -1;
  for (int64_t q = 0; q < p; ++q) {
    if (pair_slot[q] == s) return -1;  // an earlier pair leads this slot
  }
  return s;
}

// Zeroes words [0, n) of p (null: nothing) with every thread of a 2-D grid: a dependent kernel's
// counters, which it touches only after waiting for this kernel.
__device__ __forceinline__ void zero_with_grid(unsigned* p, int64_t n) {
  if (p == nullptr) return;
  const int64_t threads = int64_t(gridDim.x) * gridDim.y * blockDim.x;
  const int64_t first = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < n; i += threads) p[i] = 0u;
}

}  // namespace ft::cuda
