// Kernels of the grouped prefill path around at::_grouped_mm: the fused bias + activation between
// the two products, the weighted combine after them, and the steps of the windowed path for banks
// of 1,024 slots or more (src/common/windowed_grouped.h). Included once, by expert_gemm.cu.
#pragma once

#include "../common/windowed_grouped.h"
#include "activation.cuh"
#include "cuda_utils.cuh"

namespace ft::cuda {
namespace {

// Grouped path, between the two products: a[j, i] = act(h[j, i] + b13, h[j, I + i] + b13) (ungated:
// h has I columns, the up values are the gate's too).
template <typename scalar_t>
__global__ void bias_act_kernel(const scalar_t* __restrict__ h, const int32_t* __restrict__ sorted_slot,
                                int64_t rows, int64_t slots, const scalar_t* __restrict__ b13,
                                int64_t b13_stride, int64_t I, int64_t up, DeviceActivation act,
                                scalar_t* __restrict__ a) {
  const int64_t j = blockIdx.x;
  if (j >= rows) return;
  const int32_t s = sorted_slot[j];
  const int64_t h_cols = up + I;  // up: the first up column, I (gated) or 0
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
    float g = 0.f, u = 0.f;
    if (s < slots) {  // rows of -1 pairs (sorted last) are not computed by the GEMMs
      g = to_float(h[j * h_cols + i]);
      u = to_float(h[j * h_cols + up + i]);
      if (b13 != nullptr) {
        g += to_float(b13[s * b13_stride + i]);
        u += to_float(b13[s * b13_stride + up + i]);
      }
    }
    a[j * I + i] = static_cast<scalar_t>(s < slots ? activate(g, u, act) : 0.f);
  }
}

// out[t, h] = sum_k w[t,k] * (y[position of pair (t,k) in sorted order, h] + b2[s][h]).
template <typename scalar_t>
__global__ void combine_kernel(const scalar_t* __restrict__ y, const int64_t* __restrict__ position,
                               const int32_t* __restrict__ slots, const float* __restrict__ weights,
                               int64_t top_k, int64_t num_slots, const scalar_t* __restrict__ b2,
                               int64_t b2_stride,
                               int64_t H, scalar_t* __restrict__ out, int64_t out_stride) {
  const int64_t t = blockIdx.x;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float acc = 0.f;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t p = t * top_k + k;
      const int32_t s = slots[p];
      if (s < 0 || s >= num_slots) continue;
      float v = to_float(y[position[p] * H + h]);
      if (b2 != nullptr) v += to_float(b2[s * b2_stride + h]);
      acc = fmaf(weights[p], v, acc);
    }
    out[t * out_stride + h] = static_cast<scalar_t>(acc);
  }
}

// Steps of the windowed grouped path (banks of 1,024 slots or more; src/common/windowed_grouped.h).
// Each reads its window's rows [begin, end) of the slot-sorted order from the device and loops over
// them with a fixed grid, so rows past the window's count cost nothing and the host never waits.
constexpr int kWindowBlocks = 1024;
constexpr int kWindowThreads = 256;

__device__ __forceinline__ void window_rows(const int32_t* ends, int64_t a, int64_t b, int64_t* begin,
                                            int64_t* count) {
  *begin = a == 0 ? 0 : ends[a - 1];
  *count = ends[b - 1] - *begin;
}

// dst row j <- src row index(j) for j < count, `row_bytes` per row (16-byte chunks when kVector).
template <bool kVector, bool kGather>
__global__ void __launch_bounds__(kWindowThreads)
    window_move_rows_kernel(const char* __restrict__ src, int64_t src_stride, char* __restrict__ dst,
                            int64_t dst_stride, const int64_t* __restrict__ order, const int32_t* __restrict__ ends,
                            int64_t a, int64_t b, int64_t top_k, int64_t row_bytes) {
  int64_t begin, count;
  window_rows(ends, a, b, &begin, &count);
  for (int64_t j = blockIdx.x; j < count; j += gridDim.x) {
    // Gather: window row j comes from token order[begin + j] / top_k. Scatter: it goes to pair
    // order[begin + j].
    const int64_t pair = order[begin + j];
    const char* from = kGather ? src + (pair / top_k) * src_stride : src + j * src_stride;
    char* to = kGather ? dst + j * dst_stride : dst + pair * dst_stride;
    if constexpr (kVector) {
      for (int64_t c = threadIdx.x * 16; c < row_bytes; c += kWindowThreads * 16) {
        *reinterpret_cast<uint4*>(to + c) = *reinterpret_cast<const uint4*>(from + c);
      }
    } else {
      for (int64_t c = threadIdx.x; c < row_bytes; c += kWindowThreads) to[c] = from[c];
    }
  }
}

// a[j, i] = act(h[j, i] + b13[s, i], h[j, I + i] + b13[s, I + i]) for the window's rows, s the
// pair's (global) slot (ungated: the up columns are the gate's, I + i -> i).
template <typename scalar_t>
__global__ void __launch_bounds__(kWindowThreads)
    window_bias_act_kernel(const scalar_t* __restrict__ h, int64_t h_stride, const int32_t* __restrict__ sorted_keys,
                           const int32_t* __restrict__ ends, int64_t a, int64_t b,
                           const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t I, int64_t up,
                           DeviceActivation act, scalar_t* __restrict__ out, int64_t out_stride) {
  int64_t begin, count;
  window_rows(ends, a, b, &begin, &count);
  for (int64_t j = blockIdx.x; j < count; j += gridDim.x) {
    const int64_t s = sorted_keys[begin + j];
    for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
      float g = to_float(h[j * h_stride + i]);
      float u = to_float(h[j * h_stride + up + i]);
      if (b13 != nullptr) {
        g += to_float(b13[s * b13_stride + i]);
        u += to_float(b13[s * b13_stride + up + i]);
      }
      out[j * out_stride + i] = static_cast<scalar_t>(activate(g, u, act));
    }
  }
}

struct CudaWindowSteps {
  const c10::optional<at::Tensor>& b13;
  int64_t intermediate;
  int64_t up_row;  // the first up column of a product row: I (gated) or 0
  DeviceActivation act;

  static void move_rows(const at::Tensor& src, at::Tensor& dst, const ft::WindowRange& r, int64_t top_k,
                        bool gather) {
    const int64_t row_bytes = dst.size(1) * dst.element_size();
    const int64_t src_stride = src.stride(0) * src.element_size(), dst_stride = dst.stride(0) * dst.element_size();
    const bool vector = row_bytes % 16 == 0 && src_stride % 16 == 0 && dst_stride % 16 == 0 &&
                        aligned16(src.data_ptr()) && aligned16(dst.data_ptr()) && src.stride(1) == 1 &&
                        dst.stride(1) == 1;
    const auto* from = static_cast<const char*>(src.data_ptr());
    auto* to = static_cast<char*>(dst.data_ptr());
    const auto* order = r.order.data_ptr<int64_t>();
    const auto* ends = r.ends.data_ptr<int32_t>();
    const auto launch = [&](auto kernel) {
      kernel<<<kWindowBlocks, kWindowThreads, 0, current_stream()>>>(from, src_stride, to, dst_stride, order, ends,
                                                                     r.a, r.b, top_k, row_bytes);
      FT_CHECK_LAUNCH();
    };
    if (gather) {
      vector ? launch(window_move_rows_kernel<true, true>) : launch(window_move_rows_kernel<false, true>);
    } else {
      vector ? launch(window_move_rows_kernel<true, false>) : launch(window_move_rows_kernel<false, false>);
    }
  }
  void gather(const at::Tensor& hidden, const ft::WindowRange& r, int64_t top_k, at::Tensor& x) {
    move_rows(hidden, x, r, top_k, /*gather=*/true);
  }
  void bias_act(const at::Tensor& h, const ft::WindowRange& r, at::Tensor& out) {
    using scalar_t = at::BFloat16;
    window_bias_act_kernel<scalar_t><<<kWindowBlocks, kWindowThreads, 0, current_stream()>>>(
        h.data_ptr<scalar_t>(), h.stride(0), r.sorted_keys.data_ptr<int32_t>(), r.ends.data_ptr<int32_t>(), r.a,
        r.b, b13 ? b13->data_ptr<scalar_t>() : nullptr, b13 ? b13->stride(0) : 0, intermediate,
        up_row, act, out.data_ptr<scalar_t>(), out.stride(0));
    FT_CHECK_LAUNCH();
  }
  void scatter(const at::Tensor& y, const ft::WindowRange& r, at::Tensor& y_all) {
    move_rows(y, y_all, r, 1, /*gather=*/false);
  }
};

}  // namespace
}  // namespace ft::cuda
