// Decode kernels with FMAs (float32 weights, and 16-bit shapes the tensor-core kernel does not
// take), reading the selected slot rows in place:
//   gate_up_act_kernel: one warp per (slot, intermediate row i) computes gate row i and up row
//     I+i against every pair routed to that slot (the weights are read once per slot, not once
//     per pair), applies the activation and writes act[pair, i] in float32.
//   down_combine_kernel (also after the tensor-core gate_up): one block per (token, 4 hidden
//     rows), one warp per routed expert, sums weights[t,k] * (w2[s_k][h] . act[t,k] + b2) over k
//     in a fixed order: the weighted combine needs no atomics and no extra pass.
// Included once, by expert_gemm.cu.
#pragma once

#include "activation.cuh"
#include "cuda_utils.cuh"

namespace ft::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;
constexpr int kMaxMembers = 8;       // pairs sharing a slot handled per pass over its weights
constexpr int64_t kDecodeChunk = 64;  // tokens per decode launch pair (bounds the leader scan)

// Dot products of one lane's share of a row with up to kMaxMembers vectors (kGated: gate and up
// rows; otherwise the up rows alone: one product a row, its value taken as both gate and up).
template <typename scalar_t, bool kVector, bool kGated>
__global__ void __launch_bounds__(kThreads)
    gate_up_act_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                       const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k,
                       int64_t num_slots, const scalar_t* __restrict__ w13, int64_t w13_stride,
                       const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                       DeviceActivation act, float* __restrict__ act_out) {
  extern __shared__ int32_t pair_slot[];  // the chunk's slot ids
  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= I) return;
  const scalar_t* gate_row = w13 + s * w13_stride + row * H;
  const scalar_t* up_row = gate_row + up_row_of<kGated>(I) * H;
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
        if constexpr (kGated) Vec16<scalar_t>::to_float(load_streaming(up_row + c), u);
#pragma unroll
        for (int m = 0; m < kMaxMembers; ++m) {
          if (m < count) {
            float x[V];
            Vec16<scalar_t>::to_float(
                *reinterpret_cast<const uint4*>(hidden + (member[m] / top_k) * hidden_stride + c), x);
#pragma unroll
            for (int v = 0; v < V; ++v) {
              acc_g[m] = fmaf(g[v], x[v], acc_g[m]);
              if constexpr (kGated) acc_u[m] = fmaf(u[v], x[v], acc_u[m]);
            }
          }
        }
      }
    } else {
      for (int64_t c = lane; c < H; c += 32) {
        const float g = to_float(gate_row[c]);
        const float u = kGated ? to_float(up_row[c]) : 0.f;
#pragma unroll
        for (int m = 0; m < kMaxMembers; ++m) {
          if (m < count) {
            const float x = to_float(hidden[(member[m] / top_k) * hidden_stride + c]);
            acc_g[m] = fmaf(g, x, acc_g[m]);
            if constexpr (kGated) acc_u[m] = fmaf(u, x, acc_u[m]);
          }
        }
      }
    }
    const float bias_g = b13 != nullptr ? to_float(b13[s * b13_stride + row]) : 0.f;
    const float bias_u = b13 != nullptr ? to_float(b13[s * b13_stride + up_row_of<kGated>(I) + row]) : 0.f;
#pragma unroll
    for (int m = 0; m < kMaxMembers; ++m) {
      if (m < count) {
        const float g = warp_sum(acc_g[m]) + bias_g;
        const float u = kGated ? warp_sum(acc_u[m]) + bias_u : g;  // ungated: the same row and bias
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
  // Launched dependent on gate_up (launch_dependent): until the wait, gate_up may still run. It was
  // launched the ordinary way, after every earlier kernel had finished, so the slots and the w2 rows
  // are final: pull this block's rows toward L2 while gate_up finishes; only act is gate_up's.
  for (int64_t k = warp; k < top_k; k += kWarpsPerBlock) {
    const int32_t s = slots[t * top_k + k];
    if (s < 0 || s >= num_slots) continue;
    const char* rows_begin = reinterpret_cast<const char*>(w2 + s * w2_stride + h0 * I);
    const int64_t bytes = int64_t(rows) * I * int64_t(sizeof(scalar_t));
    for (int64_t off = int64_t(lane) * 128; off < bytes; off += 32 * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(rows_begin + off));
  }
  wait_for_previous_kernel();
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

}  // namespace
}  // namespace ft::cuda
