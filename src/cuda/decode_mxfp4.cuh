// Decode kernels for MXFP4 experts (uint8 pairs of e2m1 values, one e8m0 scale per 32 values of a
// row; src/common/mxfp4_format.h), reading the selected slot rows in place and dequantizing in
// registers. One token reads ~0.53 bytes a value, so the kernels are bound by instructions unless
// decoding is cheap: two values become an exact f16x2 in three instructions (e2m1x2_as_half2, the
// values times 2^-14), and a group's sum is scaled once.
//   gate_up_act_mxfp4_mma_kernel (16-bit hidden states): decode_tensor_core.cuh's tensor-core
//     kernel on MXFP4 rows; each m16n8k16 step's 16 columns lie in one group, so the per-row
//     scales multiply the step's result.
//   gate_up_act_mxfp4_kernel: one warp per (slot, intermediate row i), every pair routed to the slot
//     served by one read of gate row i and up row I + i; a lane takes whole 32-value groups (one
//     16-byte load and one scale each), sums e2m1 x hidden over the group and scales the sum once.
//   down_combine_mxfp4_kernel: decode_fma.cuh's down projection + weighted combine on MXFP4 rows.
// kVector: the rows and the hidden state allow 16-byte loads; otherwise value by value (any
// alignment). A 32-value group (one scale) is one 16-byte load. Included once, by expert_gemm.cu.
#pragma once

#include "../common/mxfp4_format.h"
#include "activation.cuh"
#include "cuda_utils.cuh"
#include "decode_fma.cuh"
#include "decode_fp8.cuh"  // floats_to_half2_saturated, Mma16x8x16Half
#include "decode_tensor_core.cuh"
#include "mxfp4.cuh"

namespace ft::cuda {
namespace {

// The value at column c of an MXFP4 row (bytes `row`, scales `scale_row`), dequantized.
__device__ __forceinline__ float mxfp4_value(const uint8_t* row, const uint8_t* scale_row, int64_t c) {
  const uint32_t byte = row[c >> 1];
  return e2m1_to_float((c & 1) != 0 ? byte >> 4 : byte & 0xfu) * e8m0_to_float(scale_row[c / kMxfp4Group]);
}

// The shapes the tensor-core kernel takes: whole 16-row tiles (H is whole groups already).
inline bool mxfp4_tensor_core_decode_applies(int64_t I) { return I % kMmaRows == 0; }

// Grid (I / 16, pairs), as gate_up_act_mma_kernel: the block of the pair that leads its slot serves
// every pair routed to it, in passes of up to 8 (the mma's N). A warp takes a contiguous range of
// groups; per group, lane (g, q) loads the 4 bytes at byte 4q of the group (its columns 8q..8q+7)
// in gate rows g and g + 8 and up rows g and g + 8, and member g's hidden values at those columns.
// A group is two m16n8k16 steps whose k slots take, per lane, the column pairs (3, 7), (2, 6), then
// (1, 5), (0, 4) of its 8 columns (the order e2m1x2_as_half2 yields), in the weights and the
// hidden vector alike; the dot product is the same for any such permutation. The hidden state
// enters in f16, exact for 16-bit values in [2^-14, 65504] (larger ones saturate), as in the FP8
// mma kernel. Needs 4-byte aligned rows (the vector condition) and 16-byte aligned hidden rows.
template <typename scalar_t>
__global__ void __launch_bounds__(kMmaThreads, 3)
    gate_up_act_mxfp4_mma_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                                 const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k, int64_t num_slots,
                                 const uint8_t* __restrict__ w13, int64_t w13_stride,
                                 const uint8_t* __restrict__ scale, int64_t scale_stride,
                                 const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                                 DeviceActivation act, float* __restrict__ act_out) {
  static_assert(Vec16<scalar_t>::kElems == 8, "16-bit hidden states: one 16-byte load is a lane's 8 columns");
  extern __shared__ int32_t pair_slot[];
  __shared__ float partial[kMmaWarps][2][kMmaRows][kMmaMembers];
  __shared__ int64_t member_pair[kMmaMembers];
  __shared__ int members;
  __shared__ int64_t next_pair;

  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  const int64_t groups = H / kMxfp4Group, row_bytes = H / 2;
  const uint8_t* gate_g = w13 + s * w13_stride + (row0 + g) * row_bytes + 4 * q4;
  const uint8_t* gate_g8 = gate_g + 8 * row_bytes;
  const uint8_t* up_g = gate_g + I * row_bytes;
  const uint8_t* up_g8 = up_g + 8 * row_bytes;
  const uint8_t* gate_sc = scale + s * scale_stride + (row0 + g) * groups;
  const uint8_t* gate_sc8 = gate_sc + 8 * groups;
  const uint8_t* up_sc = gate_sc + I * groups;
  const uint8_t* up_sc8 = up_sc + 8 * groups;
  // Contiguous groups per warp: the two halves of a 32-byte sector of a row are read back to back.
  const int64_t per_warp = (groups + kMmaWarps - 1) / kMmaWarps;
  const int64_t grp_begin = warp * per_warp;
  const int64_t grp_end = grp_begin + per_warp < groups ? grp_begin + per_warp : groups;
  if (threadIdx.x == 0) next_pair = p;

  while (true) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int count = 0;
      int64_t q = next_pair;
      for (; q < pairs && count < kMmaMembers; ++q) {
        if (pair_slot[q] == s) member_pair[count++] = q;
      }
      members = count;
      next_pair = q;
    }
    __syncthreads();
    const int count = members;
    if (count == 0) break;
    const scalar_t* x = g < count ? hidden + (member_pair[g] / top_k) * hidden_stride + 8 * q4 : nullptr;
    float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int64_t grp = grp_begin; grp < grp_end; ++grp) {
      uint32_t b[4] = {0u, 0u, 0u, 0u};  // hidden column pairs (3, 7), (2, 6), (1, 5), (0, 4)
      if (x != nullptr) {
        float f[8];
        Vec16<scalar_t>::to_float(__ldg(reinterpret_cast<const uint4*>(x + grp * kMxfp4Group)), f);
#pragma unroll
        for (int k = 0; k < 4; ++k) b[k] = floats_to_half2_saturated(f[3 - k], f[7 - k]);
      }
      const uint32_t wg = __ldg(reinterpret_cast<const uint32_t*>(gate_g + grp * 16));
      const uint32_t wg8 = __ldg(reinterpret_cast<const uint32_t*>(gate_g8 + grp * 16));
      const uint32_t wu = __ldg(reinterpret_cast<const uint32_t*>(up_g + grp * 16));
      const uint32_t wu8 = __ldg(reinterpret_cast<const uint32_t*>(up_g8 + grp * 16));
      float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const int k0 = 2 * step, k1 = 2 * step + 1;
        Mma16x8x16Half::run(tg, e2m1x2_as_half2(wg, k0), e2m1x2_as_half2(wg8, k0), e2m1x2_as_half2(wg, k1),
                            e2m1x2_as_half2(wg8, k1), b[k0], b[k1]);
        Mma16x8x16Half::run(tu, e2m1x2_as_half2(wu, k0), e2m1x2_as_half2(wu8, k0), e2m1x2_as_half2(wu, k1),
                            e2m1x2_as_half2(wu8, k1), b[k0], b[k1]);
      }
      // tg[0], tg[1]: row g (members 2q, 2q + 1); tg[2], tg[3]: row g + 8.
      const float sg = e8m0_to_float(__ldg(gate_sc + grp)), sg8 = e8m0_to_float(__ldg(gate_sc8 + grp));
      const float su = e8m0_to_float(__ldg(up_sc + grp)), su8 = e8m0_to_float(__ldg(up_sc8 + grp));
      dg[0] = fmaf(sg, tg[0] * kE2m1HalfScale, dg[0]);
      dg[1] = fmaf(sg, tg[1] * kE2m1HalfScale, dg[1]);
      dg[2] = fmaf(sg8, tg[2] * kE2m1HalfScale, dg[2]);
      dg[3] = fmaf(sg8, tg[3] * kE2m1HalfScale, dg[3]);
      du[0] = fmaf(su, tu[0] * kE2m1HalfScale, du[0]);
      du[1] = fmaf(su, tu[1] * kE2m1HalfScale, du[1]);
      du[2] = fmaf(su8, tu[2] * kE2m1HalfScale, du[2]);
      du[3] = fmaf(su8, tu[3] * kE2m1HalfScale, du[3]);
    }
    partial[warp][0][g][2 * q4] = dg[0];
    partial[warp][0][g][2 * q4 + 1] = dg[1];
    partial[warp][0][g + 8][2 * q4] = dg[2];
    partial[warp][0][g + 8][2 * q4 + 1] = dg[3];
    partial[warp][1][g][2 * q4] = du[0];
    partial[warp][1][g][2 * q4 + 1] = du[1];
    partial[warp][1][g + 8][2 * q4] = du[2];
    partial[warp][1][g + 8][2 * q4 + 1] = du[3];
    __syncthreads();
    if (threadIdx.x < kMmaRows * kMmaMembers) {
      const int r = threadIdx.x / kMmaMembers, m = threadIdx.x % kMmaMembers;
      if (m < count) {
        float sgate = 0.f, sup = 0.f;
#pragma unroll
        for (int w = 0; w < kMmaWarps; ++w) {  // fixed order: deterministic
          sgate += partial[w][0][r][m];
          sup += partial[w][1][r][m];
        }
        const int64_t row = row0 + r;
        if (b13 != nullptr) {
          sgate += to_float(b13[s * b13_stride + row]);
          sup += to_float(b13[s * b13_stride + I + row]);
        }
        act_out[member_pair[m] * I + row] = activate(sgate, sup, act);
      }
    }
  }
}

// w13 [S, 2I, H/2] with scales [S, 2I, H/32]: gate rows, then up rows.
template <typename scalar_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    gate_up_act_mxfp4_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                             const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k, int64_t num_slots,
                             const uint8_t* __restrict__ w13, int64_t w13_stride, const uint8_t* __restrict__ scale,
                             int64_t scale_stride, const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H,
                             int64_t I, DeviceActivation act, float* __restrict__ act_out) {
  extern __shared__ int32_t pair_slot[];
  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= I) return;
  const int64_t groups = H / kMxfp4Group;
  const uint8_t* gate_row = w13 + s * w13_stride + row * (H / 2);
  const uint8_t* up_row = gate_row + I * (H / 2);
  const uint8_t* gate_scale = scale + s * scale_stride + row * groups;
  const uint8_t* up_scale = gate_scale + I * groups;

  int64_t next = p;
  while (next < pairs) {
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
      constexpr int V = Vec16<scalar_t>::kElems;
#pragma unroll 2
      for (int64_t grp = lane; grp < groups; grp += 32) {
        float g[kMxfp4Group], u[kMxfp4Group];  // times 2^-14
        e2m1x32_to_float_scaled(load_streaming(gate_row + grp * 16), g);
        e2m1x32_to_float_scaled(load_streaming(up_row + grp * 16), u);
        const float sg = e8m0_to_float(__ldg(gate_scale + grp)), su = e8m0_to_float(__ldg(up_scale + grp));
#pragma unroll
        for (int m = 0; m < kMaxMembers; ++m) {
          if (m < count) {
            const scalar_t* xr = hidden + (member[m] / top_k) * hidden_stride + grp * kMxfp4Group;
            float pg = 0.f, pu = 0.f;
#pragma unroll
            for (int i = 0; i < kMxfp4Group / V; ++i) {
              float x[V];
              Vec16<scalar_t>::to_float(__ldg(reinterpret_cast<const uint4*>(xr + i * V)), x);
#pragma unroll
              for (int v = 0; v < V; ++v) {
                pg = fmaf(g[i * V + v], x[v], pg);
                pu = fmaf(u[i * V + v], x[v], pu);
              }
            }
            acc_g[m] = fmaf(sg, pg * kE2m1HalfScale, acc_g[m]);
            acc_u[m] = fmaf(su, pu * kE2m1HalfScale, acc_u[m]);
          }
        }
      }
    } else {
      for (int64_t c = lane; c < H; c += 32) {
        const float g = mxfp4_value(gate_row, gate_scale, c);
        const float u = mxfp4_value(up_row, up_scale, c);
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

// down_combine_kernel (decode_fma.cuh) on MXFP4 rows: w2 [S, H, I/2] with scales [S, H, I/32].
template <typename scalar_t, bool kVector>
__global__ void __launch_bounds__(kThreads)
    down_combine_mxfp4_kernel(const float* __restrict__ act, const int32_t* __restrict__ slots,
                              const float* __restrict__ weights, int64_t top_k, int64_t num_slots,
                              const uint8_t* __restrict__ w2, int64_t w2_stride, const uint8_t* __restrict__ scale,
                              int64_t scale_stride, const scalar_t* __restrict__ b2, int64_t b2_stride, int64_t H,
                              int64_t I, scalar_t* __restrict__ out, int64_t out_stride) {
  __shared__ float partial[kWarpsPerBlock][kDownRows];
  const int64_t t = blockIdx.y;
  const int64_t h0 = int64_t(blockIdx.x) * kDownRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows = H - h0 < kDownRows ? static_cast<int>(H - h0) : kDownRows;
  const int64_t groups = I / kMxfp4Group;
  // Launched dependent on gate_up, as down_combine_fp8_kernel (decode_fp8.cuh): the slots and the w2
  // rows are final before the wait, only act is gate_up's; pull this block's rows toward L2.
  for (int64_t k = warp; k < top_k; k += kWarpsPerBlock) {
    const int32_t s = slots[t * top_k + k];
    if (s < 0 || s >= num_slots) continue;
    const uint8_t* base = w2 + s * w2_stride + h0 * (I / 2);
    for (int64_t off = int64_t(lane) * 128; off < rows * (I / 2); off += 32 * 128) prefetch_l2(base + off);
  }
  wait_for_previous_kernel();
  float acc[kDownRows];
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) acc[r] = 0.f;
  for (int64_t k = warp; k < top_k; k += kWarpsPerBlock) {
    const int32_t s = slots[t * top_k + k];
    if (s < 0 || s >= num_slots) continue;  // not computed here; its act row was never written
    const float w = weights[t * top_k + k];
    const uint8_t* base = w2 + s * w2_stride + h0 * (I / 2);
    const uint8_t* base_scale = scale + s * scale_stride + h0 * groups;
    const float* a = act + (t * top_k + k) * I;
    float dot[kDownRows];
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) dot[r] = 0.f;
    if constexpr (kVector) {
#pragma unroll 2
      for (int64_t grp = lane; grp < groups; grp += 32) {
        uint4 raw[kDownRows];
        float sc[kDownRows];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            raw[r] = load_streaming(base + r * (I / 2) + grp * 16);
            sc[r] = e8m0_to_float(__ldg(base_scale + r * groups + grp));
          }
        }
        float av[kMxfp4Group];
#pragma unroll
        for (int v = 0; v < kMxfp4Group; v += 4) {
          const float4 q = *reinterpret_cast<const float4*>(a + grp * kMxfp4Group + v);
          av[v] = q.x, av[v + 1] = q.y, av[v + 2] = q.z, av[v + 3] = q.w;
        }
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            float wv[kMxfp4Group];  // times 2^-14
            e2m1x32_to_float_scaled(raw[r], wv);
            float part = 0.f;
#pragma unroll
            for (int v = 0; v < kMxfp4Group; ++v) part = fmaf(wv[v], av[v], part);
            dot[r] = fmaf(sc[r], part * kE2m1HalfScale, dot[r]);
          }
        }
      }
    } else {
      for (int64_t c = lane; c < I; c += 32) {
        const float av = a[c];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) dot[r] = fmaf(mxfp4_value(base + r * (I / 2), base_scale + r * groups, c), av, dot[r]);
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
