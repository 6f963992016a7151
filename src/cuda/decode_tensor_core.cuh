// Decode gate_up + activation on tensor cores, for 16-bit weights (bf16, fp16).
//
// Why: the FMA kernel (gate_up_act_kernel) spends ~40 instructions per 32 bytes of weights per
// lane (conversions, FMAs, hidden loads), so at one token it is bound by instruction latency at
// ~40 % of HBM bandwidth. Here one mma.sync.m16n8k16 consumes the 16 bytes a lane loaded, with
// the pairs routed to the slot (up to 8) as the mma's N columns: ~2.5 instructions per 16 bytes,
// and the kernel is bound by memory.
//
// Fragment mapping. A block computes a tile of 16 rows (gate rows row0..row0+15 and the same up
// rows) of one slot for up to 8 member pairs; its warps split the hidden dimension in chunks of
// 32 columns. In a chunk, lane (g = lane / 4, q = lane % 4) loads 8 consecutive elements at
// column 8q of rows g and g + 8 (one 16-byte load each). The dot product sums over columns, so
// the mma's k order may be any permutation applied to both operands: mma step 1 takes elements
// 0-3 of each load (k = 2q, 2q+1, 2q+8, 2q+9 of the m16n8k16 fragment), step 2 elements 4-7.
// The hidden vector of member n is loaded by the lanes with g = n at the same columns, which is
// exactly the B fragment under the same permutation. Products of 16-bit values are exact in the
// float32 accumulator, so this is as accurate as the FMA kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "activation.cuh"
#include "cuda_utils.cuh"

namespace ft::cuda {

template <typename scalar_t>
struct Mma16x8x16;

template <>
struct Mma16x8x16<at::BFloat16> {
  __device__ __forceinline__ static void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma16x8x16<at::Half> {
  __device__ __forceinline__ static void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

constexpr int kMmaRows = 16;     // the mma's M: rows of gate (and of up) per block
constexpr int kMmaMembers = 8;   // the mma's N: pairs sharing the slot per pass over its rows
constexpr int kMmaCols = 32;     // columns per warp step: 4 lanes x 8 elements
constexpr int kMmaWarps = 8;     // warps of a block split the hidden dimension
constexpr int kMmaThreads = kMmaWarps * 32;

// The shapes this kernel takes: whole 16-row tiles, whole 32-column chunks, 16-byte rows.
inline bool tensor_core_decode_applies(int64_t H, int64_t I) {
  return H % kMmaCols == 0 && I % kMmaRows == 0;
}

// What a gate_up mma block (grid (I / 16, pairs), 16 rows of gate and of up) shares over its passes
// over one slot's rows: the pairs of the pass (up to the mma's 8 columns, routed to the slot) and
// each warp's partial sums. Every gate_up mma kernel (bf16, FP8, MXFP4) declares one __shared__.
struct MmaGateUpPass {
  float partial[kMmaWarps][2][kMmaRows][kMmaMembers];
  int64_t member_pair[kMmaMembers];
  int64_t member_token[kMmaMembers];  // member_pair / top_k: the row of its hidden state
  int64_t next_pair;  // thread 0 sets it to the block's own pair before the first pass
  int members;

  // Thread 0 lists the next pass's pairs (those routed to slot s from next_pair on) and their tokens;
  // every thread returns their count, 0 when none is left. Its first barrier also frees partial[] of
  // the last pass. The tokens are counted along, one division a pass: the kernels divided each
  // member's pair by top_k, a runtime value (a 64-bit division is a called routine of dozens of
  // instructions), per thread and, in the FP8 kernel, per window of columns.
  __device__ __forceinline__ int next(const int32_t* pair_slot, int64_t pairs, int32_t s, int64_t top_k) {
    __syncthreads();
    if (threadIdx.x == 0) {
      int count = 0;
      int64_t q = next_pair;
      int64_t token = q / top_k, k = q - token * top_k;  // q = token * top_k + k
      for (; q < pairs && count < kMmaMembers; ++q) {
        if (pair_slot[q] == s) {
          member_pair[count] = q;
          member_token[count++] = token;
        }
        if (++k == top_k) {
          k = 0;
          ++token;
        }
      }
      members = count;
      next_pair = q;
    }
    __syncthreads();
    return members;
  }

  // Ends a pass: every warp's accumulator fragments (d0, d1 = row g, members 2q and 2q + 1; d2, d3
  // = row g + 8), times `scale`, summed over the warps in a fixed order (deterministic), plus the
  // biases; act_out[member pair, row] = act(gate, up) for rows row0 .. row0 + 15 of slot s (kGated:
  // b13 holds the gate's biases then the up's; otherwise the up's alone, the gate's too).
  template <typename scalar_t, bool kGated = true>
  __device__ __forceinline__ void finish(const float (&dg)[4], const float (&du)[4], float scale, int count,
                                         int32_t s, int64_t row0, const scalar_t* __restrict__ b13, int64_t b13_stride,
                                         int64_t I, DeviceActivation act, float* __restrict__ act_out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, q4 = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows g and g + 8
      partial[warp][0][g + 8 * h][2 * q4] = dg[2 * h] * scale;
      partial[warp][0][g + 8 * h][2 * q4 + 1] = dg[2 * h + 1] * scale;
      partial[warp][1][g + 8 * h][2 * q4] = du[2 * h] * scale;
      partial[warp][1][g + 8 * h][2 * q4 + 1] = du[2 * h + 1] * scale;
    }
    __syncthreads();
    if (threadIdx.x < kMmaRows * kMmaMembers) {
      const int r = threadIdx.x / kMmaMembers, m = threadIdx.x % kMmaMembers;
      if (m < count) {
        float sg = 0.f, su = 0.f;
#pragma unroll
        for (int w = 0; w < kMmaWarps; ++w) {
          sg += partial[w][0][r][m];
          su += partial[w][1][r][m];
        }
        const int64_t row = row0 + r;
        if (b13 != nullptr) {
          sg += to_float(b13[s * b13_stride + row]);
          su += to_float(b13[s * b13_stride + up_row_of<kGated>(I) + row]);
        }
        act_out[member_pair[m] * I + row] = activate(sg, su, act);
      }
    }
  }
};

// The one-token gate_up kernels' counterpart of MmaGateUpPass (one pair a block, column 0 of the
// mma's result): each warp's partial sums of rows g and g + 8 (lanes q4 == 0: d[0], d[2]), times
// `scale` when kScaled, summed over the warps in MmaGateUpPass::finish's order (so the one-token
// kernels give the general kernels' results bit for bit), plus the biases;
// act_out[p, row0 + r] = act(gate, up). Every one-token gate_up kernel declares one __shared__.
struct OneTokenGateUpSums {
  float partial[kMmaWarps][2][kMmaRows];

  // The partial sums of the warp range `range` (0 to kMmaWarps - 1; a kernel of fewer warps gives
  // each warp several ranges, so that the sums stay those of kMmaWarps warps).
  template <bool kScaled>
  __device__ __forceinline__ void store(int range, const float (&dg)[4], const float (&du)[4], float scale) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, q4 = lane & 3;
    if (q4 == 0) {
      partial[range][0][g] = kScaled ? dg[0] * scale : dg[0];
      partial[range][0][g + 8] = kScaled ? dg[2] * scale : dg[2];
      partial[range][1][g] = kScaled ? du[0] * scale : du[0];
      partial[range][1][g + 8] = kScaled ? du[2] * scale : du[2];
    }
  }

  template <bool kScaled, typename scalar_t, bool kGated = true>
  __device__ __forceinline__ void finish(const float (&dg)[4], const float (&du)[4], float scale, int32_t s,
                                         int64_t p, int64_t row0, const scalar_t* __restrict__ b13,
                                         int64_t b13_stride, int64_t I, DeviceActivation act,
                                         float* __restrict__ act_out) {
    store<kScaled>(threadIdx.x >> 5, dg, du, scale);
    finish_stored<scalar_t, kGated>(s, p, row0, b13, b13_stride, I, act, act_out);
  }

  // Every range stored (by any of the block's threads): their sums, the biases, the activation.
  template <typename scalar_t, bool kGated = true>
  __device__ __forceinline__ void finish_stored(int32_t s, int64_t p, int64_t row0, const scalar_t* __restrict__ b13,
                                                int64_t b13_stride, int64_t I, DeviceActivation act,
                                                float* __restrict__ act_out) {
    __syncthreads();
    if (threadIdx.x < kMmaRows) {
      const int r = threadIdx.x;
      float sg = 0.f, su = 0.f;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        sg += partial[w][0][r];
        su += partial[w][1][r];
      }
      const int64_t row = row0 + r;
      if (b13 != nullptr) {
        sg += to_float(b13[s * b13_stride + row]);
        su += to_float(b13[s * b13_stride + up_row_of<kGated>(I) + row]);
      }
      act_out[p * I + row] = activate(sg, su, act);
    }
  }
};

// Grid (I / 16, pairs). The block of pair p returns at once unless p leads its slot (the first
// pair routed to it in the chunk); the leader's block serves every pair routed to the slot, in
// passes of up to 8. act_out[pair, i] receives act(gate_i . x + b, up_i . x + b) in float32
// (ungated, !kGated: w13 holds the up rows alone, whose one product is taken as both gate and up).
template <typename scalar_t, bool kGated>
__global__ void __launch_bounds__(kMmaThreads, 3)
    gate_up_act_mma_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                           const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k,
                           int64_t num_slots, const scalar_t* __restrict__ w13, int64_t w13_stride,
                           const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                           DeviceActivation act, float* __restrict__ act_out) {
  extern __shared__ int32_t pair_slot[];  // the chunk's slot ids (the leader test reads them often)
  __shared__ MmaGateUpPass pass;

  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  const scalar_t* gate = w13 + s * w13_stride + row0 * H;
  const scalar_t* gate_g = gate + g * H + 8 * q4;
  const scalar_t* gate_g8 = gate_g + 8 * H;
  const scalar_t* up_g = gate_g + up_row_of<kGated>(I) * H;
  const scalar_t* up_g8 = up_g + 8 * H;
  if (threadIdx.x == 0) pass.next_pair = p;

  while (true) {
    const int count = pass.next(pair_slot, pairs, s, top_k);
    if (count == 0) break;
    // B column g: the hidden row of member g (zeros for the columns past the members).
    const scalar_t* x = g < count ? hidden + pass.member_token[g] * hidden_stride + 8 * q4 : nullptr;
    float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int64_t c = int64_t(warp) * kMmaCols; c < H; c += kMmaWarps * kMmaCols) {
      const uint4 a_g = load_streaming(gate_g + c);
      const uint4 a_g8 = load_streaming(gate_g8 + c);
      uint4 u_g, u_g8;
      if constexpr (kGated) {  // ungated: the gate's product is the up's
        u_g = load_streaming(up_g + c);
        u_g8 = load_streaming(up_g8 + c);
      }
      const uint4 b = x != nullptr ? __ldg(reinterpret_cast<const uint4*>(x + c)) : make_uint4(0, 0, 0, 0);
      Mma16x8x16<scalar_t>::run(dg, a_g.x, a_g8.x, a_g.y, a_g8.y, b.x, b.y);
      Mma16x8x16<scalar_t>::run(dg, a_g.z, a_g8.z, a_g.w, a_g8.w, b.z, b.w);
      if constexpr (kGated) {
        Mma16x8x16<scalar_t>::run(du, u_g.x, u_g8.x, u_g.y, u_g8.y, b.x, b.y);
        Mma16x8x16<scalar_t>::run(du, u_g.z, u_g8.z, u_g.w, u_g8.w, b.z, b.w);
      }
    }
    pass.finish<scalar_t, kGated>(dg, kGated ? du : dg, 1.f, count, s, row0, b13, b13_stride, I, act, act_out);
  }
}

}  // namespace ft::cuda
