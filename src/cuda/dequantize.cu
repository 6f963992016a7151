// CUDA kernels of dequantize_experts: FP8 (block or row scales), MXFP4 or int4 expert rows to
// bf16/fp16/float32 (the prefill path of a quantized pool dequantizes a layer's experts into a scratch
// bank and runs the grouped GEMM on it). Memory-bound: each thread converts one 16-byte load (16 e4m3
// values, exactly through f16, inside one scale block; or 32 e2m1 values, one e8m0 scale; or 32 int4
// values, one float32 scale) and writes its outputs.
// Slots that are -1 are skipped.
#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include "../common/quantized_weights.h"
#include "cuda_utils.cuh"
#include "dequantize.h"
#include "int4.cuh"
#include "mxfp4.cuh"

namespace ft::cuda {
namespace {

constexpr int kThreads = 256;

template <typename out_t>
__device__ __forceinline__ out_t from_float(float v) {
  return static_cast<out_t>(v);
}

template <typename out_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    dequantize_experts_kernel(const uint8_t* __restrict__ weight, int64_t weight_stride, const float* __restrict__ scale,
                              int64_t scale_stride, Fp8ScaleIndex index, const int64_t* __restrict__ slots,
                              int64_t num_slots, int64_t rows, int64_t cols, out_t* __restrict__ out) {
  const int64_t i = blockIdx.y;
  const int64_t s = slots[i];
  if (s < 0 || s >= num_slots) return;  // left unwritten (out-of-range slots cannot raise: no sync)
  const uint8_t* w = weight + s * weight_stride;
  const float* sc = scale + s * scale_stride;
  out_t* o = out + i * rows * cols;
  constexpr int64_t kPer = kVector ? 16 : 1;
  const int64_t units = rows * cols / kPer;
  for (int64_t u = int64_t(blockIdx.x) * kThreads + threadIdx.x; u < units; u += int64_t(gridDim.x) * kThreads) {
    const int64_t e = u * kPer, r = e / cols, c = e % cols;
    const float f = sc[index(r, c)];
    if constexpr (kVector) {
      const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(w + e));
      const uint32_t word[4] = {raw.x, raw.y, raw.z, raw.w};
      alignas(16) out_t vals[16];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const __half2_raw pair =
              __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word[k] >> (16 * h)), __NV_E4M3);
          const float2 v = __half22float2(__half2(pair));
          vals[4 * k + 2 * h] = from_float<out_t>(v.x * f);
          vals[4 * k + 2 * h + 1] = from_float<out_t>(v.y * f);
        }
      }
      uint4* dst = reinterpret_cast<uint4*>(o + e);
      const uint4* src = reinterpret_cast<const uint4*>(vals);
#pragma unroll
      for (int k = 0; k < int(16 * sizeof(out_t) / 16); ++k) dst[k] = src[k];
    } else {
      const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(w[e]), __NV_E4M3);
      o[e] = from_float<out_t>(__half2float(__half(h)) * f);
    }
  }
}

// MXFP4 [S, rows, cols / 2] with e8m0 scales [S, rows, cols / 32]. Each value is the e2m1 value times
// its scale in float32, as the CPU kernel computes it (subnormal products kept), then rounded to out_t.
template <typename out_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    dequantize_mxfp4_kernel(const uint8_t* __restrict__ weight, int64_t weight_stride, const uint8_t* __restrict__ scale,
                            int64_t scale_stride, const int64_t* __restrict__ slots, int64_t num_slots, int64_t rows,
                            int64_t cols, out_t* __restrict__ out) {
  const int64_t i = blockIdx.y;
  const int64_t s = slots[i];
  if (s < 0 || s >= num_slots) return;  // left unwritten (out-of-range slots cannot raise: no sync)
  const uint8_t* w = weight + s * weight_stride;
  const uint8_t* sc = scale + s * scale_stride;
  out_t* o = out + i * rows * cols;
  constexpr int64_t kPer = kVector ? kMxfp4Group : 2;  // values per unit: a group, or one byte
  const int64_t units = rows * cols / kPer;
  for (int64_t u = int64_t(blockIdx.x) * kThreads + threadIdx.x; u < units; u += int64_t(gridDim.x) * kThreads) {
    const int64_t e = u * kPer;  // the unit's first value; rows hold whole groups, so e / 32 is its scale
    const float f = e8m0_to_float(sc[e / kMxfp4Group]);
    if constexpr (kVector) {
      float v[kMxfp4Group];
      e2m1x32_to_float_scaled(__ldcs(reinterpret_cast<const uint4*>(w + e / 2)), v);
      alignas(16) out_t vals[kMxfp4Group];
#pragma unroll
      for (int k = 0; k < kMxfp4Group; ++k) vals[k] = from_float<out_t>(mul_keep_subnormals(v[k] * kE2m1HalfScale, f));
      uint4* dst = reinterpret_cast<uint4*>(o + e);
      const uint4* src = reinterpret_cast<const uint4*>(vals);
#pragma unroll
      for (int k = 0; k < int(kMxfp4Group * sizeof(out_t) / 16); ++k) dst[k] = src[k];
    } else {
      const uint32_t byte = w[e / 2];
      o[e] = from_float<out_t>(mul_keep_subnormals(e2m1_to_float(byte & 0xfu), f));
      o[e + 1] = from_float<out_t>(mul_keep_subnormals(e2m1_to_float(byte >> 4), f));
    }
  }
}

// int4 [S, rows, cols / 2] with float32 scales [S, rows, cols / G] (G a multiple of 32). Each value is
// (code - 8) times its scale in float32, as the CPU kernel computes it, then rounded to out_t.
template <typename out_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    dequantize_int4_kernel(const uint8_t* __restrict__ weight, int64_t weight_stride, const float* __restrict__ scale,
                           int64_t scale_stride, const int64_t* __restrict__ slots, int64_t num_slots, int64_t rows,
                           int64_t cols, GroupsPerScale groups_per_scale, out_t* __restrict__ out) {
  const int64_t i = blockIdx.y;
  const int64_t s = slots[i];
  if (s < 0 || s >= num_slots) return;  // left unwritten (out-of-range slots cannot raise: no sync)
  const uint8_t* w = weight + s * weight_stride;
  const float* sc = scale + s * scale_stride;
  out_t* o = out + i * rows * cols;
  constexpr int64_t kPer = kVector ? 32 : 2;  // values per unit: 16 bytes (within one group), or one byte
  const int64_t units = rows * cols / kPer;
  for (int64_t u = int64_t(blockIdx.x) * kThreads + threadIdx.x; u < units; u += int64_t(gridDim.x) * kThreads) {
    const int64_t e = u * kPer;  // the unit's first value; rows hold whole groups, so e / G is its scale
    const float f = sc[groups_per_scale.div(static_cast<uint32_t>(e >> 5))];
    if constexpr (kVector) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(w + e / 2));
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      alignas(16) out_t vals[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        const int code = static_cast<int>((words[k / 8] >> (4 * (k % 8))) & 0xfu);
        vals[k] = from_float<out_t>(mul_keep_subnormals(static_cast<float>(code - 8), f));
      }
      uint4* dst = reinterpret_cast<uint4*>(o + e);
      const uint4* src = reinterpret_cast<const uint4*>(vals);
#pragma unroll
      for (int k = 0; k < int(32 * sizeof(out_t) / 16); ++k) dst[k] = src[k];
    } else {
      const uint32_t byte = w[e / 2];
      o[e] = from_float<out_t>(mul_keep_subnormals(static_cast<float>(static_cast<int>(byte & 0xfu) - 8), f));
      o[e + 1] = from_float<out_t>(mul_keep_subnormals(static_cast<float>(static_cast<int>(byte >> 4) - 8), f));
    }
  }
}

void dequantize_int4(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& ids, int64_t rows,
                     int64_t cols, at::ScalarType dtype, at::Tensor& out) {
  // 16 bytes start at a multiple of 16 within the slot (rows are whole groups of a multiple of 32).
  const bool vector = weight.stride(0) % 16 == 0 && aligned16(weight.data_ptr());
  const int64_t units = rows * cols / (vector ? 32 : 2);
  const GroupsPerScale groups_per_scale(static_cast<unsigned>(cols / scale.size(2) / 32));
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((units + kThreads - 1) / kThreads, 1024)),
                  static_cast<unsigned>(ids.numel()));
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto launch = [&](auto vector_tag) {
      dequantize_int4_kernel<scalar_t, decltype(vector_tag)::value><<<grid, kThreads, 0, current_stream()>>>(
          weight.data_ptr<uint8_t>(), weight.stride(0), scale.data_ptr<float>(), scale.stride(0),
          ids.data_ptr<int64_t>(), weight.size(0), rows, cols, groups_per_scale, out.data_ptr<scalar_t>());
    };
    if (vector) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
  };
  switch (dtype) {  // the three dtypes check_dequantize_inputs accepts
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: run(at::BFloat16{});
  }
  FT_CHECK_LAUNCH();
}

void dequantize_mxfp4(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& ids, int64_t rows,
                      int64_t cols, at::ScalarType dtype, at::Tensor& out) {
  // A group's 16 bytes start at a multiple of 16 within the slot (rows are whole groups).
  const bool vector = weight.stride(0) % 16 == 0 && aligned16(weight.data_ptr());
  const int64_t units = rows * cols / (vector ? kMxfp4Group : 2);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((units + kThreads - 1) / kThreads, 1024)),
                  static_cast<unsigned>(ids.numel()));
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto launch = [&](auto vector_tag) {
      dequantize_mxfp4_kernel<scalar_t, decltype(vector_tag)::value><<<grid, kThreads, 0, current_stream()>>>(
          weight.data_ptr<uint8_t>(), weight.stride(0), scale.data_ptr<uint8_t>(), scale.stride(0),
          ids.data_ptr<int64_t>(), weight.size(0), rows, cols, out.data_ptr<scalar_t>());
    };
    if (vector) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
  };
  switch (dtype) {  // the three dtypes check_dequantize_inputs accepts
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: run(at::BFloat16{});
  }
  FT_CHECK_LAUNCH();
}

}  // namespace

void dequantize_experts_into(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& ids, int64_t parts,
                             at::Tensor& out) {
  const bool packed = weight.scalar_type() == at::kByte;  // MXFP4 (uint8 scales) or int4 (float32 scales)
  const int64_t n = ids.numel(), rows = weight.size(1), cols = packed ? 2 * weight.size(2) : weight.size(2);
  const at::ScalarType dtype = out.scalar_type();
  if (n == 0 || rows * cols == 0) return;
  if (packed && scale.scalar_type() == at::kFloat) {
    dequantize_int4(weight, scale, ids, rows, cols, dtype, out);
    return;
  }
  if (packed) {
    dequantize_mxfp4(weight, scale, ids, rows, cols, dtype, out);
    return;
  }
  const bool vector = cols % 16 == 0 && weight.stride(0) % 16 == 0 && aligned16(weight.data_ptr());
  const Fp8ScaleIndex index = fp8_scale_index(weight, scale, parts);
  const int64_t units = rows * cols / (vector ? 16 : 1);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((units + kThreads - 1) / kThreads, 1024)),
                  static_cast<unsigned>(n));
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const auto launch = [&](auto vector_tag) {
      dequantize_experts_kernel<scalar_t, decltype(vector_tag)::value><<<grid, kThreads, 0, current_stream()>>>(
          reinterpret_cast<const uint8_t*>(weight.data_ptr()), weight.stride(0), scale.data_ptr<float>(),
          scale.stride(0), index, ids.data_ptr<int64_t>(), weight.size(0), rows, cols, out.data_ptr<scalar_t>());
    };
    if (vector) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
  };
  switch (dtype) {  // the three dtypes check_dequantize_inputs accepts
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: run(at::BFloat16{});
  }
  FT_CHECK_LAUNCH();
}

namespace {

at::Tensor dequantize_experts(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& slots,
                              int64_t parts, at::ScalarType dtype) {
  const WeightFormat format = check_dequantize_inputs(weight, scale, slots, parts, dtype);
  const c10::cuda::CUDAGuard guard(weight.device());
  const auto ids = slots.to(at::kLong).contiguous();
  const int64_t cols = is_packed(format) ? 2 * weight.size(2) : weight.size(2);
  auto out = at::empty({ids.numel(), weight.size(1), cols}, weight.options().dtype(dtype));
  dequantize_experts_into(weight, scale, ids, parts, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) { m.impl("dequantize_experts", &dequantize_experts); }

}  // namespace ft::cuda
