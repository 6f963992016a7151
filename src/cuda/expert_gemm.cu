// CUDA kernel of expert_gemm, two paths chosen by token count.
//
// Decode (few tokens): two launches that read the selected slot rows in place, memory-bound.
//   gate_up_act_mma_kernel (decode_tensor_core.cuh, bf16/fp16 weights in whole 16-row tiles):
//     the same product on tensor cores, the pairs routed to a slot as the mma's columns.
//   gate_up_act_kernel (float32, or shapes the tensor-core kernel does not take): one warp per (slot, intermediate row i) computes gate row i and up row
//     I+i against every pair routed to that slot (the weights are read once per slot, not once
//     per pair), applies the activation and writes act[pair, i] in float32.
//   down_combine_kernel: one block per (token, 4 hidden rows), one warp per routed expert, sums
//     weights[t,k] * (w2[s_k][h] . act[t,k] + b2) over k in a fixed order: the weighted combine
//     needs no atomics and no extra pass.
// Prefill (many tokens, bf16): pairs are sorted by slot on the device (no host sync), the
//   offsets found by searchsorted, and the two products run as grouped tensor-core GEMMs
//   (at::_grouped_mm, CUTLASS on sm90) straight on the bank, with the slots as groups; a fused
//   bias+activation kernel sits between them and a combine kernel gathers each token's top-k rows.
//   _grouped_mm takes fewer than 1,024 groups: larger banks are cut into windows of 1,023 slots
//   (src/common/windowed_grouped.h), each a sub-bank view with its own two products.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <type_traits>

#include "../common/checks.h"
#include "../common/windowed_grouped.h"
#include "activation.cuh"
#include "cuda_utils.cuh"
#include "decode_tensor_core.cuh"

namespace ft::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kMaxMembers = 8;       // pairs sharing a slot handled per pass over its weights
constexpr int64_t kDecodeChunk = 64;  // tokens per decode launch pair (bounds the leader scan)

// Dot products of one lane's share of a row with up to kMaxMembers vectors.
template <typename scalar_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    gate_up_act_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                       const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k,
                       int64_t num_slots, const scalar_t* __restrict__ w13, int64_t w13_stride,
                       const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                       int act, float* __restrict__ act_out) {
  // The chunk's slot ids, staged once in shared memory: the leader test and the member scan
  // below would otherwise be chains of dependent global loads.
  extern __shared__ int32_t pair_slot[];
  for (int64_t q = threadIdx.x; q < pairs; q += blockDim.x) pair_slot[q] = slots[q];
  __syncthreads();
  const int64_t p = blockIdx.y;
  const int32_t s = pair_slot[p];
  if (s < 0 || s >= num_slots) return;  // not computed here (out of range cannot raise: no sync)
  for (int64_t q = 0; q < p; ++q) {
    if (pair_slot[q] == s) return;  // an earlier pair leads this slot
  }
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= I) return;
  const scalar_t* gate_row = w13 + s * w13_stride + row * H;
  const scalar_t* up_row = gate_row + I * H;
  constexpr int V = Vec16<scalar_t>::kElems;

  int64_t next = p;
  while (next < pairs) {
    // The next kMaxMembers pairs routed to slot s (unrolled so member[] stays in registers).
    int64_t member[kMaxMembers];
    int count = 0;
#pragma unroll
    for (int m = 0; m < kMaxMembers; ++m) {
      while (next < pairs && pair_slot[next] != s) ++next;
      member[m] = next < pairs ? next : 0;
      if (next < pairs) {
        ++count;
        ++next;
      }
    }
    if (count == 0) break;
    float acc_g[kMaxMembers], acc_u[kMaxMembers];
#pragma unroll
    for (int m = 0; m < kMaxMembers; ++m) acc_g[m] = acc_u[m] = 0.f;
    if constexpr (kVector) {
#pragma unroll 4
      for (int64_t c = lane * V; c < H; c += 32 * V) {
        float g[V], u[V];
        Vec16<scalar_t>::to_float(load_streaming(gate_row + c), g);
        Vec16<scalar_t>::to_float(load_streaming(up_row + c), u);
#pragma unroll
        for (int m = 0; m < kMaxMembers; ++m) {
          if (m < count) {
            float x[V];
            Vec16<scalar_t>::to_float(
                *reinterpret_cast<const uint4*>(hidden + (member[m] / top_k) * hidden_stride + c), x);
#pragma unroll
            for (int v = 0; v < V; ++v) {
              acc_g[m] = fmaf(g[v], x[v], acc_g[m]);
              acc_u[m] = fmaf(u[v], x[v], acc_u[m]);
            }
          }
        }
      }
    } else {
      for (int64_t c = lane; c < H; c += 32) {
        const float g = to_float(gate_row[c]);
        const float u = to_float(up_row[c]);
#pragma unroll
        for (int m = 0; m < kMaxMembers; ++m) {
          if (m < count) {
            const float x = to_float(hidden[(member[m] / top_k) * hidden_stride + c]);
            acc_g[m] = fmaf(g, x, acc_g[m]);
            acc_u[m] = fmaf(u, x, acc_u[m]);
          }
        }
      }
    }
    const float bias_g = b13 != nullptr ? to_float(b13[s * b13_stride + row]) : 0.f;
    const float bias_u = b13 != nullptr ? to_float(b13[s * b13_stride + I + row]) : 0.f;
#pragma unroll
    for (int m = 0; m < kMaxMembers; ++m) {
      if (m < count) {
        const float g = warp_sum(acc_g[m]) + bias_g;
        const float u = warp_sum(acc_u[m]) + bias_u;
        if (lane == 0) act_out[member[m] * I + row] = activate(g, u, act);
      }
    }
  }
}

// One block per kDownRows hidden rows of one token; warp w takes the token's experts w, w + 8, ...
// and accumulates weights[t,k] * (w2[s_k][h] . act_k) for its rows; the block then sums the warps'
// partials in a fixed order (deterministic, no atomics) and adds the weighted biases. Per warp
// and expert that is kDownRows rows of I elements in flight at once, and a block covers all top-k
// experts, so the grid (H / kDownRows blocks per token) fills the SMs with independent loads.
constexpr int kDownRows = 4;

template <typename scalar_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    down_combine_kernel(const float* __restrict__ act, const int32_t* __restrict__ slots,
                        const float* __restrict__ weights, int64_t top_k, int64_t num_slots,
                        const scalar_t* __restrict__ w2, int64_t w2_stride,
                        const scalar_t* __restrict__ b2, int64_t b2_stride, int64_t H, int64_t I,
                        scalar_t* __restrict__ out, int64_t out_stride) {
  __shared__ float partial[kWarpsPerBlock][kDownRows];
  const int64_t t = blockIdx.y;
  const int64_t h0 = int64_t(blockIdx.x) * kDownRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows = H - h0 < kDownRows ? static_cast<int>(H - h0) : kDownRows;
  float acc[kDownRows];
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) acc[r] = 0.f;
  for (int64_t k = warp; k < top_k; k += kWarpsPerBlock) {
    const int32_t s = slots[t * top_k + k];
    if (s < 0 || s >= num_slots) continue;  // not computed here; its act row was never written
    const float w = weights[t * top_k + k];
    const scalar_t* base = w2 + s * w2_stride + h0 * I;
    const float* a = act + (t * top_k + k) * I;
    float dot[kDownRows];
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) dot[r] = 0.f;
    if constexpr (kVector) {
      constexpr int V = Vec16<scalar_t>::kElems;
#pragma unroll 4
      for (int64_t c = lane * V; c < I; c += 32 * V) {
        uint4 raw[kDownRows];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) raw[r] = load_streaming(base + r * I + c);
        }
        float av[V];
#pragma unroll
        for (int v = 0; v < V; v += 4) {
          const float4 q = *reinterpret_cast<const float4*>(a + c + v);
          av[v] = q.x, av[v + 1] = q.y, av[v + 2] = q.z, av[v + 3] = q.w;
        }
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            float wv[V];
            Vec16<scalar_t>::to_float(raw[r], wv);
#pragma unroll
            for (int v = 0; v < V; ++v) dot[r] = fmaf(wv[v], av[v], dot[r]);
          }
        }
      }
    } else {
      for (int64_t c = lane; c < I; c += 32) {
        const float av = a[c];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) dot[r] = fmaf(to_float(base[r * I + c]), av, dot[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) acc[r] = fmaf(w, dot[r], acc[r]);
  }
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) partial[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    const int r = threadIdx.x;
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < kWarpsPerBlock; ++q) sum += partial[q][r];
    if (b2 != nullptr) {  // sum_k w_k * b2[s_k][h]
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t s = slots[t * top_k + k];
        if (s >= 0 && s < num_slots) sum = fmaf(weights[t * top_k + k], to_float(b2[s * b2_stride + h0 + r]), sum);
      }
    }
    out[t * out_stride + h0 + r] = static_cast<scalar_t>(sum);
  }
}

// Grouped path, between the two products: a[j, i] = act(h[j, i] + b13, h[j, I + i] + b13).
template <typename scalar_t>
__global__ void bias_act_kernel(const scalar_t* __restrict__ h, const int32_t* __restrict__ sorted_slot,
                                int64_t rows, int64_t slots, const scalar_t* __restrict__ b13,
                                int64_t b13_stride, int64_t I, int act, scalar_t* __restrict__ a) {
  const int64_t j = blockIdx.x;
  if (j >= rows) return;
  const int32_t s = sorted_slot[j];
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
    float g = 0.f, u = 0.f;
    if (s < slots) {  // rows of -1 pairs (sorted last) are not computed by the GEMMs
      g = to_float(h[j * 2 * I + i]);
      u = to_float(h[j * 2 * I + I + i]);
      if (b13 != nullptr) {
        g += to_float(b13[s * b13_stride + i]);
        u += to_float(b13[s * b13_stride + I + i]);
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
// pair's (global) slot.
template <typename scalar_t>
__global__ void __launch_bounds__(kWindowThreads)
    window_bias_act_kernel(const scalar_t* __restrict__ h, int64_t h_stride, const int32_t* __restrict__ sorted_keys,
                           const int32_t* __restrict__ ends, int64_t a, int64_t b,
                           const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t I, int act,
                           scalar_t* __restrict__ out, int64_t out_stride) {
  int64_t begin, count;
  window_rows(ends, a, b, &begin, &count);
  for (int64_t j = blockIdx.x; j < count; j += gridDim.x) {
    const int64_t s = sorted_keys[begin + j];
    for (int64_t i = threadIdx.x; i < I; i += blockDim.x) {
      float g = to_float(h[j * h_stride + i]);
      float u = to_float(h[j * h_stride + I + i]);
      if (b13 != nullptr) {
        g += to_float(b13[s * b13_stride + i]);
        u += to_float(b13[s * b13_stride + I + i]);
      }
      out[j * out_stride + i] = static_cast<scalar_t>(activate(g, u, act));
    }
  }
}

struct CudaWindowSteps {
  const c10::optional<at::Tensor>& b13;
  int64_t intermediate;
  Activation act;

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
        static_cast<int>(act), out.data_ptr<scalar_t>(), out.stride(0));
    FT_CHECK_LAUNCH();
  }
  void scatter(const at::Tensor& y, const ft::WindowRange& r, at::Tensor& y_all) {
    move_rows(y, y_all, r, 1, /*gather=*/false);
  }
};

// Calls f(scalar_t{}) for the three dtypes expert_gemm accepts (checked before).
template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_CHECK(false, "expert_gemm: unsupported dtype ", dtype);
  }
}

constexpr int64_t kMaxGroupedSlots = 1024;

int64_t grouped_min_tokens() {
  static const int64_t v = [] {
    const char* env = std::getenv("FT_GEMM_GROUPED_MIN_TOKENS");
    return env ? std::atoll(env) : int64_t{64};
  }();
  return v;
}

bool grouped_path_applies(const at::Tensor& hidden, const GemmShape& shape) {
  if (hidden.scalar_type() != at::kBFloat16) return false;  // _grouped_mm's tensor-core dtype
  if (shape.tokens < grouped_min_tokens()) return false;
  if (shape.hidden % 8 != 0 || shape.intermediate % 8 != 0) return false;  // 16-byte rows
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, hidden.get_device()));
  return major >= 9;  // CUTLASS grouped GEMM in _grouped_mm
}

// FT_DECODE_TENSOR_CORES=0 keeps 16-bit decode on the FMA kernel (for comparing the two).
bool tensor_cores_enabled() {
  static const bool v = [] {
    const char* env = std::getenv("FT_DECODE_TENSOR_CORES");
    return env == nullptr || std::atoi(env) != 0;
  }();
  return v;
}

void decode_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                 const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                 const c10::optional<at::Tensor>& b2, Activation act, const GemmShape& shape,
                 at::Tensor& out) {
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate;
  // Tokens per launch pair: at most kDecodeChunk, and few enough that the chunk's slot ids fit
  // the shared-memory stage of gate_up_act_kernel.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(kDecodeChunk, 8192 / K));
  auto act_buf = at::empty({std::min(shape.tokens, chunk) * K, I},
                           hidden.options().dtype(at::kFloat));
  dispatch_dtype(hidden.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    constexpr int V = Vec16<scalar_t>::kElems;
    const bool vector = H % V == 0 && I % V == 0 && aligned16(hidden.data_ptr()) &&
                        hidden.stride(0) % V == 0 && aligned16(w13.data_ptr()) &&
                        w13.stride(0) % V == 0 && aligned16(w2.data_ptr()) && w2.stride(0) % V == 0;
    // 16-bit weights in whole tiles go to the tensor-core kernel (decode_tensor_core.cuh).
    const bool tensor_cores = vector && tensor_core_decode_applies(H, I) && tensor_cores_enabled();
    const scalar_t* b13_ptr = b13 ? b13->data_ptr<scalar_t>() : nullptr;
    const scalar_t* b2_ptr = b2 ? b2->data_ptr<scalar_t>() : nullptr;
    const int64_t b13_stride = b13 ? b13->stride(0) : 0;
    const int64_t b2_stride = b2 ? b2->stride(0) : 0;
    for (int64_t t0 = 0; t0 < shape.tokens; t0 += chunk) {
      const int64_t tokens = std::min(chunk, shape.tokens - t0);
      const int64_t pairs = tokens * K;
      const scalar_t* x = hidden.data_ptr<scalar_t>() + t0 * hidden.stride(0);
      const int32_t* s = slots.data_ptr<int32_t>() + t0 * K;
      const float* w = weights.data_ptr<float>() + t0 * K;
      scalar_t* o = out.data_ptr<scalar_t>() + t0 * out.stride(0);
      const dim3 grid1((I + kWarpsPerBlock - 1) / kWarpsPerBlock, pairs);
      const dim3 grid2((H + kDownRows - 1) / kDownRows, tokens);
      const size_t smem1 = pairs * sizeof(int32_t);
      const auto launch = [&](auto vector_tag) {
        constexpr bool kVector = decltype(vector_tag)::value;
        bool on_tensor_cores = false;
        if constexpr (kVector && !std::is_same_v<scalar_t, float>) {
          if (tensor_cores) {
            gate_up_act_mma_kernel<scalar_t><<<dim3(I / kMmaRows, pairs), kMmaThreads, smem1, current_stream()>>>(
                x, hidden.stride(0), s, pairs, K, shape.slots, w13.data_ptr<scalar_t>(), w13.stride(0),
                b13_ptr, b13_stride, H, I, static_cast<int>(act), act_buf.data_ptr<float>());
            on_tensor_cores = true;
          }
        }
        if (!on_tensor_cores) {
          gate_up_act_kernel<scalar_t, kVector><<<grid1, kThreads, smem1, current_stream()>>>(
              x, hidden.stride(0), s, pairs, K, shape.slots, w13.data_ptr<scalar_t>(), w13.stride(0), b13_ptr,
              b13_stride, H, I, static_cast<int>(act), act_buf.data_ptr<float>());
        }
        FT_CHECK_LAUNCH();
        down_combine_kernel<scalar_t, kVector><<<grid2, kThreads, 0, current_stream()>>>(
            act_buf.data_ptr<float>(), s, w, K, shape.slots, w2.data_ptr<scalar_t>(), w2.stride(0), b2_ptr,
            b2_stride, H, I, o, out.stride(0));
        FT_CHECK_LAUNCH();
      };
      if (vector) {
        launch(std::true_type{});
      } else {
        launch(std::false_type{});
      }
    }
  });
}

// Banks of kMaxGroupedSlots slots or more: the same products, one window of slots at a time
// (_grouped_mm takes fewer than 1,024 groups), then the combine over the pairs' rows.
void windowed_grouped_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                           const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                           const c10::optional<at::Tensor>& b2, Activation act, const GemmShape& shape,
                           at::Tensor& out) {
  using scalar_t = at::BFloat16;
  const int64_t K = shape.top_k, H = shape.hidden, pairs = shape.tokens * K;
  auto y_all = at::empty({pairs, H}, hidden.options());
  CudaWindowSteps steps{b13, shape.intermediate, act};
  ft::windowed_grouped_ffn(hidden, slots, w13, w2, K, kMaxGroupedSlots - 1, steps, y_all);
  // Row p of y_all is pair p's product (pairs of slot -1 are skipped by the combine).
  const auto position = at::arange(pairs, slots.options().dtype(at::kLong));
  combine_kernel<scalar_t><<<shape.tokens, 256, 0, current_stream()>>>(
      y_all.data_ptr<scalar_t>(), position.data_ptr<int64_t>(), slots.data_ptr<int32_t>(),
      weights.data_ptr<float>(), K, shape.slots, b2 ? b2->data_ptr<scalar_t>() : nullptr, b2 ? b2->stride(0) : 0,
      H, out.data_ptr<scalar_t>(), out.stride(0));
  FT_CHECK_LAUNCH();
}

void grouped_path(const at::Tensor& hidden, const at::Tensor& slots, const at::Tensor& weights,
                  const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                  const c10::optional<at::Tensor>& b2, Activation act, const GemmShape& shape,
                  at::Tensor& out) {
  using scalar_t = at::BFloat16;
  const int64_t K = shape.top_k, H = shape.hidden, I = shape.intermediate, S = shape.slots;
  const int64_t pairs = shape.tokens * K;
  // Pairs of slot -1 (or out of range) sort after every real slot and fall outside the last
  // group offset, so the grouped GEMMs skip them.
  const auto keys = at::where(at::logical_or(slots < 0, slots >= S), at::scalar_tensor(S, slots.options()), slots);
  auto [sorted_keys, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto group_ends = at::searchsorted(sorted_keys, at::arange(S, slots.options()),
                                           /*out_int32=*/true, /*right=*/true);
  const auto x = hidden.index_select(0, at::floor_divide(order, K));
  const auto h = at::_grouped_mm(x, w13.transpose(1, 2), group_ends);
  auto a = at::empty({pairs, I}, hidden.options());
  bias_act_kernel<scalar_t><<<pairs, 256, 0, current_stream()>>>(
      h.data_ptr<scalar_t>(), sorted_keys.data_ptr<int32_t>(), pairs, S,
      b13 ? b13->data_ptr<scalar_t>() : nullptr, b13 ? b13->stride(0) : 0, I, static_cast<int>(act),
      a.data_ptr<scalar_t>());
  FT_CHECK_LAUNCH();
  const auto y = at::_grouped_mm(a, w2.transpose(1, 2), group_ends);
  auto position = at::empty_like(order);
  position.scatter_(0, order, at::arange(pairs, order.options()));
  combine_kernel<scalar_t><<<shape.tokens, 256, 0, current_stream()>>>(
      y.data_ptr<scalar_t>(), position.data_ptr<int64_t>(), slots.data_ptr<int32_t>(),
      weights.data_ptr<float>(), K, S, b2 ? b2->data_ptr<scalar_t>() : nullptr, b2 ? b2->stride(0) : 0,
      H, out.data_ptr<scalar_t>(), out.stride(0));
  FT_CHECK_LAUNCH();
}

at::Tensor expert_gemm(const at::Tensor& hidden, const at::Tensor& slot_ids,
                       const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       c10::string_view activation) {
  const GemmShape shape = check_gemm_inputs(hidden, slot_ids, weights, w13, w2, b13, b2);
  const Activation act = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(hidden.device());
  auto out = at::empty({shape.tokens, shape.hidden}, hidden.options());
  if (shape.tokens == 0) return out;
  // Out-of-range slots cannot raise without a host sync; the kernels treat them like -1.
  const auto slots = slot_ids.to(at::kInt).contiguous().view({-1});
  const auto w = weights.to(at::kFloat).contiguous().view({-1});
  const auto x = hidden.stride(1) == 1 ? hidden : hidden.contiguous();
  if (grouped_path_applies(x, shape)) {
    if (shape.slots < kMaxGroupedSlots) {
      grouped_path(x, slots, w, w13, w2, b13, b2, act, shape, out);
    } else {
      windowed_grouped_path(x, slots, w, w13, w2, b13, b2, act, shape, out);
    }
  } else {
    decode_path(x, slots, w, w13, w2, b13, b2, act, shape, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) { m.impl("expert_gemm", &expert_gemm); }

}  // namespace ft::cuda
