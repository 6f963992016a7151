// Decode kernels for MXFP4 experts (uint8 pairs of e2m1 values, one e8m0 scale per 32 values of a
// row; src/common/mxfp4_format.h), reading the selected slot rows in place and dequantizing in
// registers; the "packed" kernels also take int4 experts (Int4Codes: 4-bit integers with a float32
// scale per group of a multiple of 32 values; src/common/int4_format.h). One token reads ~0.53 bytes a value, so the kernels are bound by instructions unless
// decoding is cheap: a word's eight values become four exact f16x2 in eleven instructions
// (e2m1x8_as_half2x4, the values times 2^-14), and a group's sum is scaled once.
//   gate_up_act_mxfp4_mma_wide_kernel (16-bit hidden states, H a multiple of 64): tensor cores
//     (decode_tensor_core.cuh's structure) on 64-column steps of two groups, each lane loading 8
//     bytes of a row a step and a warp several steps before using any; each m16n8k16 step's 16
//     columns lie in one group, so the per-row scales multiply the step's result.
//   gate_up_act_mxfp4_one_token_kernel: the wide kernel's products for a one-token call (the decode
//     step), its B operand staged once in shared memory and each warp's rows streamed into a ring
//     of shared memory by cp.async ahead of their use (a lane reads its words there: no exchange).
//   gate_up_act_packed_mma_kernel (16-bit hidden states, other H): the same, a 32-column group at a
//     time, 4 bytes of a row per lane; on MXFP4 or int4 codes (int4 pools' tensor-core gate_up).
//   gate_up_act_packed_kernel: one warp per (slot, intermediate row i), every pair routed to the slot
//     served by one read of gate row i and up row I + i; a lane takes whole 32-value chunks (one
//     16-byte load and one scale each), sums code x hidden over the chunk and scales the sum once.
//     On MXFP4 (Mxfp4Codes) or int4 (Int4Codes) rows.
//   down_combine_packed_mma_kernel (16-bit hidden states, I a multiple of 64; MXFP4 or int4 rows):
//     down projection + weighted combine on tensor cores, a block per (16 hidden rows, expert,
//     token), its 64-column chunks dealt to 4 warps, act staged in shared memory as f16; the last
//     of a tile's blocks adds their partial sums in expert order.
//   down_combine_packed_kernel: decode_fma.cuh's down projection + weighted combine on MXFP4 or int4
//     rows.
// kVector: the rows and the hidden state allow 16-byte loads; otherwise value by value (any
// alignment). A 32-value group (one scale) is one 16-byte load.
//
// Two groups in one load (the wide gate_up kernel and the down mma kernel). In a 32-byte span of
// a row (64 columns: groups A and B, 4 words of 8 columns each), lane (g = lane / 4, q4 = lane % 4)
// loads the 8 bytes at byte 8 q4 of rows g and g + 8: a warp instruction reads 8 rows x 32
// contiguous bytes, whole sectors. Lanes q4 = 0, 1 then hold words 2h, 2h + 1 (h = q4 & 1) of A,
// lanes 2, 3 those of B; one exchange with lane q4 ^ 2 a row (exchange_words) leaves lane q4 with
// word j = 2 (q4 & 1) + (q4 >> 1) of both groups (j = 0, 2, 1, 3 for q4 = 0..3). An m16n8k16 step
// needs its 16 k slots in one group (the scale is applied to its result), so a group is two steps
// (mma_packed_group) in which lane q4's k slots 2 q4, 2 q4 + 1 | 2 q4 + 8, 2 q4 + 9 take the columns
// (8j + 3, 8j + 7) | (8j + 2, 8j + 6), then (8j + 1, 8j + 5) | (8j + 0, 8j + 4) of the group (the
// nibble order e2m1x8_as_half2x4 yields), in A (rows g and g + 8) and B (column g) alike: across the
// quad's four j every column of the group lands in one k slot of one of the two steps.
// Included once, by expert_gemm.cu.
#pragma once

#include "../common/int4_format.h"
#include "../common/mxfp4_format.h"
#include "activation.cuh"
#include "cuda_utils.cuh"
#include "decode_fma.cuh"
#include "decode_fp8.cuh"  // floats_to_half2_saturated, Mma16x8x16Half
#include "decode_tensor_core.cuh"
#include "int4.cuh"
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

constexpr int kMxfp4SpanCols = 64;  // two groups: 32 bytes of a row, 8 bytes a lane (file comment)

// 8 bytes the kernel will not reuse soon (streamed weights); p is 8-byte aligned.
__device__ __forceinline__ uint2 load_streaming_8(const uint8_t* p) { return __ldcs(reinterpret_cast<const uint2*>(p)); }

// The e8m0 scales of two consecutive groups of a row (p 2-byte aligned): the first in the low byte.
__device__ __forceinline__ uint32_t load_scale_pair(const uint8_t* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}

// v: this lane's 8 bytes of a 32-byte span (words 2h, 2h + 1, h = q4 & 1, of group A for q4 < 2, of
// group B for q4 >= 2; `upper` is q4 >= 2). One word goes to lane q4 ^ 2 and one comes back, so that
// the lane holds word j = 2h + (q4 >> 1) of both groups: `a` of group A, `b` of group B. Lanes
// q4 < 2 keep A.w[2h] and receive B.w[2h]; lanes q4 >= 2 keep B.w[2h + 1] and receive A.w[2h + 1].
// Called by the whole warp.
__device__ __forceinline__ void exchange_words(uint2 v, bool upper, uint32_t& a, uint32_t& b) {
  const uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? v.x : v.y, 2);
  a = upper ? got : v.x;
  b = upper ? v.y : got;
}


// 8 consecutive values in mma_packed_group's B order, in f16 (saturated, as the FP8 mma kernel's
// hidden state).
__device__ __forceinline__ uint4 floats_to_mxfp4_b_order(const float (&f)[8]) {
  return make_uint4(floats_to_half2_saturated(f[3], f[7]), floats_to_half2_saturated(f[2], f[6]),
                    floats_to_half2_saturated(f[1], f[5]), floats_to_half2_saturated(f[0], f[4]));
}

// The value v of lane `which` (0-3) of this lane's quad (a shuffle within segments of 4 lanes,
// `which` an immediate). Called by the whole warp.
__device__ __forceinline__ uint32_t quad_value(uint32_t v, int which) { return __shfl_sync(0xffffffffu, v, which, 4); }

// Byte `which` (0 or 1) of a scale pair as a float, 2^(s - 127), in two instructions: the byte
// becomes the float's exponent field. Scale 0 gives 0 where e8m0_to_float gives the subnormal
// 2^-127, which the mma kernels' products (fmaf under --use_fast_math: .ftz) flush to 0 anyway.
__device__ __forceinline__ float scale_of_pair(uint32_t pair, int which) {
  return __uint_as_float((pair << (23 - 8 * which)) & 0x7f800000u);
}

// How the kernels read a format of two 4-bit codes a byte, by 32-value chunks (one 16-byte load,
// inside one scale group): decode32 gives a chunk's values times 1 / kUnit; scale_index(chunk,
// groups_per_scale) where a row's scale of the chunk lies (Codes::PerScale: G / 32 as a divider,
// int4.cuh's GroupsPerScale, or MXFP4's identity), scale(p) its value; value(...) one dequantized
// value.
// The tensor-core kernels take decode8: a word's 8 codes as 4 f16x2 (times 1 / kUnit) in
// e2m1x8_as_half2x4's order.
struct Mxfp4Codes {  // e2m1 codes, an e8m0 scale per 32 values
  using scale_t = uint8_t;
  // A group's scale is the group's own (the identity). `group` (32) stays a runtime value: as a
  // compile-time 32 it changed the kernels' register allocation, and the down mma kernel spilled
  // 28 bytes instead of 4 (a one-token call ~5 % slower on an H100).
  struct PerScale {
    int64_t group;
    __host__ __device__ uint32_t div(uint32_t g) const { return g; }
  };
  // Scales a row of `values` values.
  __device__ static int64_t scales_per_row(int64_t values, PerScale per_scale) { return values / per_scale.group; }
  static constexpr float kUnit = kE2m1HalfScale;
  __device__ static void decode8(uint32_t w, uint32_t (&h)[4]) { e2m1x8_as_half2x4(w, h); }
  __device__ static void decode32(const uint4& v, float (&out)[32]) { e2m1x32_to_float_scaled(v, out); }
  __device__ static int64_t scale_index(int64_t chunk, PerScale) { return chunk; }
  __device__ static float scale(const scale_t* p) { return e8m0_to_float(__ldg(p)); }
  // The scales of groups 2c and 2c + 1 of a row (the down mma kernel's 64-column chunk c), loaded
  // together (2-byte aligned), and one of them.
  using ScalePair = uint32_t;
  __device__ static ScalePair load_pair(const scale_t* row, int64_t group, PerScale) {
    return load_scale_pair(row + group);
  }
  __device__ static float of_pair(ScalePair pair, int which) { return scale_of_pair(pair, which); }
  __device__ static float value(const uint8_t* row, const scale_t* scale_row, int64_t c, PerScale) {
    return mxfp4_value(row, scale_row, c);
  }
};

struct Int4Codes {  // int4 codes (value code - 8), a float32 scale per group of G values
  using scale_t = float;
  using PerScale = GroupsPerScale;  // G / 32 groups a scale
  __device__ static int64_t scales_per_row(int64_t values, const PerScale& per_scale) {
    return per_scale.div(static_cast<uint32_t>(values / 32));
  }
  static constexpr float kUnit = 1.f;
  __device__ static void decode8(uint32_t w, uint32_t (&h)[4]) { int4x8_as_half2x4(w, h); }
  __device__ static void decode32(const uint4& v, float (&out)[32]) { int4x32_to_float(v, out); }
  __device__ static int64_t scale_index(int64_t chunk, const PerScale& per_scale) {
    return per_scale.div(static_cast<uint32_t>(chunk));
  }
  __device__ static float scale(const scale_t* p) { return __ldg(p); }
  using ScalePair = float2;
  __device__ static ScalePair load_pair(const scale_t* row, int64_t group, const PerScale& per_scale) {
    return make_float2(__ldg(row + per_scale.div(static_cast<uint32_t>(group))),
                       __ldg(row + per_scale.div(static_cast<uint32_t>(group + 1))));
  }
  __device__ static float of_pair(ScalePair pair, int which) { return which == 0 ? pair.x : pair.y; }
  __device__ static float value(const uint8_t* row, const scale_t* scale_row, int64_t c, const PerScale& per_scale) {
    const uint32_t byte = row[c >> 1];
    const uint32_t code = (c & 1) != 0 ? byte >> 4 : byte & 0xfu;
    return static_cast<float>(static_cast<int>(code) - static_cast<int>(kInt4Offset)) *
           scale_row[per_scale.div(static_cast<uint32_t>(c >> 5))];
  }
};

// A group's two m16n8k16 steps (file comment) accumulated in d, times 1 / Codes::kUnit (2^-14 for
// MXFP4): w_g and w_g8 are this lane's word j of the group in rows g and g + 8 (columns 8j..8j+7 of
// the group, column 8j + n in nibble n), b the B values of the same 8 columns as f16x2 (8j+3, 8j+7),
// (8j+2, 8j+6), (8j+1, 8j+5), (8j+0, 8j+4) (low half first), the pairs Codes::decode8(w) yields.
template <typename Codes>
__device__ __forceinline__ void mma_packed_group(float (&d)[4], uint32_t w_g, uint32_t w_g8, const uint4& b) {
  uint32_t a[4], a8[4];
  Codes::decode8(w_g, a);
  Codes::decode8(w_g8, a8);
  Mma16x8x16Half::run(d, a[0], a8[0], a[1], a8[1], b.x, b.y);
  Mma16x8x16Half::run(d, a[2], a8[2], a[3], a8[3], b.z, b.w);
}

// The shapes the wide kernel takes: whole 16-row tiles, rows of whole 64-column spans (so a row's
// scales are whole pairs; the caller checks that the scale bank is 2-byte aligned).
inline bool mxfp4_wide_tensor_core_decode_applies(int64_t H, int64_t I) {
  return H % kMxfp4SpanCols == 0 && I % kMmaRows == 0;
}

// Grid (I / 16, pairs), as gate_up_act_mma_kernel: the block of the pair that leads its slot serves
// every pair routed to it, in passes of up to 8 (the mma's N). A warp takes a contiguous range of
// groups; per group, lane (g, q) loads the 4 bytes at byte 4q of the group (its columns 8q..8q+7)
// in gate rows g and g + 8 and up rows g and g + 8, and member g's hidden values at those columns.
// A group is two m16n8k16 steps whose k slots take, per lane, the column pairs (3, 7), (2, 6), then
// (1, 5), (0, 4) of its 8 columns (the order e2m1x8_as_half2x4 yields), in the weights and the
// hidden vector alike; the dot product is the same for any such permutation. The hidden state
// enters in f16, exact for 16-bit values in [2^-14, 65504] (larger ones saturate), as in the FP8
// mma kernel. Needs 4-byte aligned rows (the vector condition) and 16-byte aligned hidden rows.
// Templated on the codes (Mxfp4Codes, Int4Codes; `groups_per_scale`: G / 32, MXFP4's identity): a
// 32-column group lies inside one scale group either way.
template <typename scalar_t, typename Codes>
__global__ void __launch_bounds__(kMmaThreads, 3)
    gate_up_act_packed_mma_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                                  const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k, int64_t num_slots,
                                  const uint8_t* __restrict__ w13, int64_t w13_stride,
                                  const typename Codes::scale_t* __restrict__ scale, int64_t scale_stride,
                                  typename Codes::PerScale groups_per_scale, const scalar_t* __restrict__ b13,
                                  int64_t b13_stride, int64_t H, int64_t I, DeviceActivation act,
                                  float* __restrict__ act_out,
                                  unsigned* __restrict__ down_counters, int64_t down_counter_words) {
  zero_with_grid(down_counters, down_counter_words);  // the down kernel's, which waits for this kernel
  static_assert(Vec16<scalar_t>::kElems == 8, "16-bit hidden states: one 16-byte load is a lane's 8 columns");
  extern __shared__ int32_t pair_slot[];
  __shared__ MmaGateUpPass pass;

  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  const int64_t groups = H / 32, row_bytes = H / 2;
  const int64_t per_row = Codes::scales_per_row(H, groups_per_scale);
  const uint8_t* gate_g = w13 + s * w13_stride + (row0 + g) * row_bytes + 4 * q4;
  const uint8_t* gate_g8 = gate_g + 8 * row_bytes;
  const uint8_t* up_g = gate_g + I * row_bytes;
  const uint8_t* up_g8 = up_g + 8 * row_bytes;
  using scale_t = typename Codes::scale_t;
  const scale_t* gate_sc = scale + s * scale_stride + (row0 + g) * per_row;
  const scale_t* gate_sc8 = gate_sc + 8 * per_row;
  const scale_t* up_sc = gate_sc + I * per_row;
  const scale_t* up_sc8 = up_sc + 8 * per_row;
  // Contiguous groups per warp: the two halves of a 32-byte sector of a row are read back to back.
  const int64_t per_warp = (groups + kMmaWarps - 1) / kMmaWarps;
  const int64_t grp_begin = warp * per_warp;
  const int64_t grp_end = grp_begin + per_warp < groups ? grp_begin + per_warp : groups;
  if (threadIdx.x == 0) pass.next_pair = p;

  while (true) {
    const int count = pass.next(pair_slot, pairs, s, top_k);
    if (count == 0) break;
    const scalar_t* x = g < count ? hidden + pass.member_token[g] * hidden_stride + 8 * q4 : nullptr;
    float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
    for (int64_t grp = grp_begin; grp < grp_end; ++grp) {
      uint32_t b[4] = {0u, 0u, 0u, 0u};  // hidden column pairs (3, 7), (2, 6), (1, 5), (0, 4)
      if (x != nullptr) {
        float f[8];
        Vec16<scalar_t>::to_float(__ldg(reinterpret_cast<const uint4*>(x + grp * 32)), f);
#pragma unroll
        for (int k = 0; k < 4; ++k) b[k] = floats_to_half2_saturated(f[3 - k], f[7 - k]);
      }
      const uint32_t wg = __ldg(reinterpret_cast<const uint32_t*>(gate_g + grp * 16));
      const uint32_t wg8 = __ldg(reinterpret_cast<const uint32_t*>(gate_g8 + grp * 16));
      const uint32_t wu = __ldg(reinterpret_cast<const uint32_t*>(up_g + grp * 16));
      const uint32_t wu8 = __ldg(reinterpret_cast<const uint32_t*>(up_g8 + grp * 16));
      float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
      uint32_t ag[4], ag8[4], au[4], au8[4];
      Codes::decode8(wg, ag);
      Codes::decode8(wg8, ag8);
      Codes::decode8(wu, au);
      Codes::decode8(wu8, au8);
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const int k0 = 2 * step, k1 = 2 * step + 1;
        Mma16x8x16Half::run(tg, ag[k0], ag8[k0], ag[k1], ag8[k1], b[k0], b[k1]);
        Mma16x8x16Half::run(tu, au[k0], au8[k0], au[k1], au8[k1], b[k0], b[k1]);
      }
      // tg[0], tg[1]: row g (members 2q, 2q + 1); tg[2], tg[3]: row g + 8.
      const int64_t si = Codes::scale_index(grp, groups_per_scale);
      const float sg = Codes::scale(gate_sc + si), sg8 = Codes::scale(gate_sc8 + si);
      const float su = Codes::scale(up_sc + si), su8 = Codes::scale(up_sc8 + si);
      dg[0] = fmaf(sg, tg[0] * Codes::kUnit, dg[0]);
      dg[1] = fmaf(sg, tg[1] * Codes::kUnit, dg[1]);
      dg[2] = fmaf(sg8, tg[2] * Codes::kUnit, dg[2]);
      dg[3] = fmaf(sg8, tg[3] * Codes::kUnit, dg[3]);
      du[0] = fmaf(su, tu[0] * Codes::kUnit, du[0]);
      du[1] = fmaf(su, tu[1] * Codes::kUnit, du[1]);
      du[2] = fmaf(su8, tu[2] * Codes::kUnit, du[2]);
      du[3] = fmaf(su8, tu[3] * Codes::kUnit, du[3]);
    }
    pass.finish(dg, du, 1.f, count, s, row0, b13, b13_stride, I, act, act_out);
  }
}

// One 64-column step of the wide gate_up kernel (file comment): this lane's 8 bytes of gate rows
// g, g + 8 and up rows g, g + 8 exchanged into word j of both groups, the quad's 4 scale pairs
// shared, each group's two mma steps from zero scaled by their row's scale into dg, du (times
// 2^-14). Called by the whole warp.
__device__ __forceinline__ void mxfp4_gate_up_step(float (&dg)[4], float (&du)[4], uint2 wg, uint2 wg8, uint2 wu,
                                                   uint2 wu8, uint32_t scale_pair, bool upper, const uint4& ba,
                                                   const uint4& bb) {
  uint32_t gate_a, gate_b, gate8_a, gate8_b, up_a, up_b, up8_a, up8_b;
  exchange_words(wg, upper, gate_a, gate_b);
  exchange_words(wg8, upper, gate8_a, gate8_b);
  exchange_words(wu, upper, up_a, up_b);
  exchange_words(wu8, upper, up8_a, up8_b);
  const uint32_t sg = quad_value(scale_pair, 0), sg8 = quad_value(scale_pair, 1);
  const uint32_t su = quad_value(scale_pair, 2), su8 = quad_value(scale_pair, 3);
#pragma unroll
  for (int grp = 0; grp < 2; ++grp) {
    float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
    mma_packed_group<Mxfp4Codes>(tg, grp == 0 ? gate_a : gate_b, grp == 0 ? gate8_a : gate8_b, grp == 0 ? ba : bb);
    mma_packed_group<Mxfp4Codes>(tu, grp == 0 ? up_a : up_b, grp == 0 ? up8_a : up8_b, grp == 0 ? ba : bb);
    // tg[0], tg[1]: row g (members 2 q4, 2 q4 + 1); tg[2], tg[3]: row g + 8.
    const float scale_g = scale_of_pair(sg, grp), scale_g8 = scale_of_pair(sg8, grp);
    const float scale_u = scale_of_pair(su, grp), scale_u8 = scale_of_pair(su8, grp);
    dg[0] = fmaf(scale_g, tg[0], dg[0]);
    dg[1] = fmaf(scale_g, tg[1], dg[1]);
    dg[2] = fmaf(scale_g8, tg[2], dg[2]);
    dg[3] = fmaf(scale_g8, tg[3], dg[3]);
    du[0] = fmaf(scale_u, tu[0], du[0]);
    du[1] = fmaf(scale_u, tu[1], du[1]);
    du[2] = fmaf(scale_u8, tu[2], du[2]);
    du[3] = fmaf(scale_u8, tu[3], du[3]);
  }
}

// A lane's loads for one 64-column step of the wide gate_up kernels (file comment): its 8 bytes of
// gate rows g, g + 8 (r, r + row8) and up rows g, g + 8 (up bytes further), and its scale pair.
__device__ __forceinline__ void load_mxfp4_gate_up_step(const uint8_t* r, int64_t row8, int64_t up,
                                                        const uint8_t* scale_pair_at, uint2& wg, uint2& wg8,
                                                        uint2& wu, uint2& wu8, uint32_t& scale_pair) {
  wg = load_streaming_8(r);
  wg8 = load_streaming_8(r + row8);
  wu = load_streaming_8(r + up);
  wu8 = load_streaming_8(r + up + row8);
  scale_pair = load_scale_pair(scale_pair_at);
}

// 64-column steps a warp of the wide gate_up kernel loads before using any: 4 KB of gate and up rows
// a warp in flight, 64 KB an SM at the 2 blocks its 125 registers allow. (3 blocks an SM, 80
// registers, spilled already at 2 steps a batch.)
constexpr int kMxfp4GateUpStepsPerBatch = 4;

// gate_up_act_packed_mma_kernel on 64-column steps (two groups, one 8-byte load per lane and row; file
// comment): grid (I / 16, pairs), the leader's block serving every pair routed to its slot in passes
// of up to 8. A warp takes a contiguous range of steps and loads the gate and up rows (g, g + 8),
// their scale pairs and member g's hidden values of kMxfp4GateUpStepsPerBatch steps before using
// any, where gate_up_act_packed_mma_kernel loads a group at a time, 4 bytes a row a lane (16 bytes
// of 8 rows a warp instruction: half sectors).
// Member g's hidden values at this lane's word j of a group, columns 8j..8j+7 (one 16-byte load),
// enter B in f16 (saturated) in mma_mxfp4_group's order. A group's two steps accumulate from zero
// and are scaled by their row's scale; the sums stay times 2^-14 until the block's reduction.
// Needs 16-bit hidden rows 16-byte aligned and w13 8-byte aligned (the vector condition), and
// 2-byte aligned scale slots.
template <typename scalar_t>
__global__ void __launch_bounds__(kMmaThreads, 2)
    gate_up_act_mxfp4_mma_wide_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                                      const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k,
                                      int64_t num_slots, const uint8_t* __restrict__ w13, int64_t w13_stride,
                                      const uint8_t* __restrict__ scale, int64_t scale_stride,
                                      const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                                      DeviceActivation act, float* __restrict__ act_out,
                                      unsigned* __restrict__ down_counters, int64_t down_counter_words) {
  zero_with_grid(down_counters, down_counter_words);  // the down kernel's, which waits for this kernel
  static_assert(Vec16<scalar_t>::kElems == 8, "16-bit hidden states: one 16-byte load is a word's 8 columns");
  constexpr int U = kMxfp4GateUpStepsPerBatch;
  extern __shared__ int32_t pair_slot[];
  __shared__ MmaGateUpPass pass;

  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const bool upper = q4 >= 2;
  const int j = 2 * (q4 & 1) + (q4 >> 1);  // the word of each group this lane holds after the exchange
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  const int64_t groups = H / kMxfp4Group, row_bytes = H / 2, steps = H / kMxfp4SpanCols;
  // A contiguous range of steps per warp; step n of the warp: bytes 32 n + 8 q4 of gate row g from
  // `rows`; gate row g + 8 is row8 bytes further, the up rows `up` bytes further.
  const int64_t per_warp = (steps + kMmaWarps - 1) / kMmaWarps;
  const int64_t st_begin = warp * per_warp;
  const int my_steps = static_cast<int>(st_begin + per_warp < steps ? per_warp : (steps > st_begin ? steps - st_begin : 0));
  const uint8_t* rows = w13 + s * w13_stride + (row0 + g) * row_bytes + 32 * st_begin + 8 * q4;
  const int64_t row8 = 8 * row_bytes, up = I * row_bytes;
  // The 4 lanes of a quad need the same 4 scale pairs a step (gate and up rows g and g + 8): lane q4
  // loads that of gate (q4 < 2) or up, row g (q4 even) or g + 8, and the quad shares them (quad_value).
  const uint8_t* scales = scale + s * scale_stride + (row0 + g + 8 * (q4 & 1) + (q4 >= 2 ? I : 0)) * groups + 2 * st_begin;
  if (threadIdx.x == 0) pass.next_pair = p;

  while (true) {
    const int count = pass.next(pair_slot, pairs, s, top_k);
    if (count == 0) break;
    // B column g: member g's hidden row at word j's columns. The columns past the members repeat the
    // last member's (column n of the result depends on column n of B only, and those are not read):
    // no lane is idle or branches, and the repeated loads hit the same addresses as that member's.
    const scalar_t* x = hidden + pass.member_token[g < count ? g : count - 1] * hidden_stride +
                        kMxfp4SpanCols * st_begin + 8 * j;
    float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};  // times 2^-14
    for (int n0 = 0; n0 < my_steps; n0 += U) {
      uint2 wg[U], wg8[U], wu[U], wu8[U];
      uint32_t scale_pair[U];
      uint4 xa[U], xb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int n = n0 + u;
        if (n < my_steps) {
          load_mxfp4_gate_up_step(rows + 32 * n, row8, up, scales + 2 * n, wg[u], wg8[u], wu[u], wu8[u], scale_pair[u]);
          xa[u] = __ldg(reinterpret_cast<const uint4*>(x + kMxfp4SpanCols * n));
          xb[u] = __ldg(reinterpret_cast<const uint4*>(x + kMxfp4SpanCols * n + kMxfp4Group));
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (n0 + u >= my_steps) break;  // the same for the whole warp: the exchanges below are warp-wide
        float f[8];
        Vec16<scalar_t>::to_float(xa[u], f);
        const uint4 ba = floats_to_mxfp4_b_order(f);
        Vec16<scalar_t>::to_float(xb[u], f);
        const uint4 bb = floats_to_mxfp4_b_order(f);
        mxfp4_gate_up_step(dg, du, wg[u], wg8[u], wu[u], wu8[u], scale_pair[u], upper, ba, bb);
      }
    }
    pass.finish(dg, du, kE2m1HalfScale, count, s, row0, b13, b13_stride, I, act, act_out);
  }
}

// One token (its top_k pairs), the wide kernel's shapes: the wide kernel's products and sums
// without its passes, one pair a block (a slot routed twice for the token is read twice), the
// token's B operand converted once per block into shared memory (for each 64-column step and word
// j, the two groups' 8 hidden values in mma_packed_group's B order as f16: 2H bytes), and each
// warp's rows streamed into its own ring of shared memory by cp.async, kMxfp4RingSteps - 1 steps
// ahead of its arithmetic (no registers held by loads in flight, and the loads of later steps
// overlap the decoding of earlier ones). A ring stage is one 64-column step of the tile's 32 rows
// (gate rows 0-15, then up rows 0-15), 32 bytes a row at a pitch of 48 bytes, so that a lane reads
// word j of each group of its rows g and g + 8 directly (8 rows' 4 words on 32 distinct banks) where
// the register-loading kernels exchange words between lanes (exchange_words).
// Four warps a block, each taking the steps of two of the general kernel's eight warps in turn and
// keeping their sums apart (OneTokenGateUpSums::store), so that the result is the general kernel's
// column 0 bit for bit; six blocks an SM (78 registers for bf16, 80 for f16) hold GPT-OSS-120B's 720 (tile, pair) blocks
// in one wave. H200, that shape with the down kernel, 16 calls a graph (2026-12-04, a standalone
// program, tag experiment/mxfp4-one-token-ring): 29.5 us against 31.2 for eight warps loading 3
// steps a batch into registers; the ring at eight warps 30.1, at 3 / 6 stages 29.5 / 33.9 (6 stages
// fit 5 blocks an SM: two waves), the hidden values loaded before the slot id 30.6.
// Needs 16-byte aligned w13 slots and rows (the vector condition) for the cp.async copies.
constexpr int kMxfp4OneTokenWarps = 4;
constexpr int kMxfp4OneTokenThreads = kMxfp4OneTokenWarps * 32;
constexpr int kMxfp4RingSteps = 3;
constexpr int kMxfp4RingRows = 2 * kMmaRows;  // gate rows 0-15, up rows 0-15
constexpr int kMxfp4RingPitch = 48;           // 32 bytes of a step + 16: 8 rows' word reads on distinct banks
constexpr int kMxfp4RingStage = kMxfp4RingRows * kMxfp4RingPitch;
constexpr int64_t kMxfp4OneTokenRingBytes = int64_t(kMxfp4OneTokenWarps) * kMxfp4RingSteps * kMxfp4RingStage;
static_assert(kMmaWarps % kMxfp4OneTokenWarps == 0, "each warp takes whole ranges of the general kernel's warps");

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most n of this thread's newest commit groups are still in flight.
template <int n>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

template <typename scalar_t>
__global__ void __launch_bounds__(kMxfp4OneTokenThreads, 6)
    gate_up_act_mxfp4_one_token_kernel(const scalar_t* __restrict__ hidden, const int32_t* __restrict__ slots,
                                       int64_t num_slots, const uint8_t* __restrict__ w13, int64_t w13_stride,
                                       const uint8_t* __restrict__ scale, int64_t scale_stride,
                                       const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                                       DeviceActivation act, float* __restrict__ act_out,
                                       unsigned* __restrict__ down_counters, int64_t down_counter_words) {
  zero_with_grid(down_counters, down_counter_words);  // the down kernel's, which waits for this kernel
  static_assert(Vec16<scalar_t>::kElems == 8, "16-bit hidden states: one 16-byte load is a word's 8 columns");
  constexpr int R = kMxfp4RingSteps;
  constexpr int kRangesPerWarp = kMmaWarps / kMxfp4OneTokenWarps;
  extern __shared__ __align__(16) uint4 ring_and_b[];  // the warps' rings, then B [steps][4 words][2 groups]
  __shared__ OneTokenGateUpSums sums;
  let_next_kernel_start();  // the down kernel loads its weights while this one runs
  const int64_t p = blockIdx.y;
  const int32_t s = slots[p];
  if (s < 0 || s >= num_slots) return;  // the down kernel skips the pair
  const int64_t groups = H / kMxfp4Group, row_bytes = H / 2, steps = H / kMxfp4SpanCols;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int j = 2 * (q4 & 1) + (q4 >> 1);  // the word of each group this lane reads
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  // The general kernel's warp ranges (per_range steps each), kRangesPerWarp of them a warp, in turn.
  const int64_t per_range = (steps + kMmaWarps - 1) / kMmaWarps;
  const int64_t st_begin = warp * kRangesPerWarp * per_range;
  const int64_t st_end = st_begin + kRangesPerWarp * per_range < steps ? st_begin + kRangesPerWarp * per_range : steps;
  const int my_steps = static_cast<int>(st_end > st_begin ? st_end - st_begin : 0);
  uint8_t* ring = reinterpret_cast<uint8_t*>(ring_and_b) + warp * (R * kMxfp4RingStage);
  uint4* b_stage = reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(ring_and_b) + kMxfp4OneTokenRingBytes);
  // A step's 32 rows x 32 bytes are 64 pieces of 16 bytes: lane's pieces lane and lane + 32 (row
  // piece / 2, half piece % 2).
  const uint8_t* src[2];
  int dst[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int piece = lane + 32 * h, r = piece >> 1, half = piece & 1;
    const int64_t row = r < kMmaRows ? row0 + r : I + row0 + (r - kMmaRows);
    src[h] = w13 + s * w13_stride + row * row_bytes + 32 * st_begin + 16 * half;
    dst[h] = r * kMxfp4RingPitch + 16 * half;
  }
  // The 4 lanes of a quad need the same 4 scale pairs a step (gate and up rows g and g + 8): lane q4
  // loads that of gate (q4 < 2) or up, row g (q4 even) or g + 8, and the quad shares them (quad_value).
  const uint8_t* scales = scale + s * scale_stride + (row0 + g + 8 * (q4 & 1) + (q4 >= 2 ? I : 0)) * groups + 2 * st_begin;
  uint32_t scale_pair[R];  // of the step in each stage
  // Step n into stage `stage` (nothing past the warp's steps), one commit group either way.
  const auto request = [&](int n, int stage) {
    if (n < my_steps) {
      cp_async_16(ring + stage * kMxfp4RingStage + dst[0], src[0] + 32 * n);
      cp_async_16(ring + stage * kMxfp4RingStage + dst[1], src[1] + 32 * n);
      scale_pair[stage] = load_scale_pair(scales + 2 * n);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int u = 0; u < R - 1; ++u) request(u, u);
  // Item (n, j, half): the 8 hidden values at column 64 n + 32 half + 8 j, while the first steps'
  // rows are on their way.
  for (int64_t item = threadIdx.x; item < steps * 8; item += kMxfp4OneTokenThreads) {
    const int64_t n = item / 8;
    const int jj = static_cast<int>(item / 2) % 4, half = static_cast<int>(item % 2);
    float f[8];
    Vec16<scalar_t>::to_float(__ldg(reinterpret_cast<const uint4*>(hidden + kMxfp4SpanCols * n + kMxfp4Group * half + 8 * jj)), f);
    b_stage[item] = floats_to_mxfp4_b_order(f);
  }
  __syncthreads();
  const uint4* b_of_step = b_stage + st_begin * 8 + 2 * j;  // step n of the warp: [8 n], [8 n + 1]
  float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};  // times 2^-14
  int range = 0;  // of the warp's ranges, the one being summed
  for (int n0 = 0; n0 < my_steps; n0 += R) {
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int n = n0 + u;
      if (n >= my_steps) break;  // the same for the whole warp
      if (n == (range + 1) * per_range) {  // the next range: its sums start from zero
        sums.store<true>(warp * kRangesPerWarp + range, dg, du, kE2m1HalfScale);
        ++range;
#pragma unroll
        for (int e = 0; e < 4; ++e) dg[e] = du[e] = 0.f;
      }
      request(n + R - 1, (u + R - 1) % R);  // into the stage step n - 1 used (the warp is past it)
      cp_async_wait<R - 1>();               // this lane's pieces of step n have landed
      __syncwarp();                         // and the other lanes'
      const uint8_t* stage = ring + u * kMxfp4RingStage + 4 * j;
      const auto word = [&](int r, int grp) {
        return *reinterpret_cast<const uint32_t*>(stage + r * kMxfp4RingPitch + 16 * grp);
      };
      const uint32_t gate_a = word(g, 0), gate_b = word(g, 1), gate8_a = word(g + 8, 0), gate8_b = word(g + 8, 1);
      const uint32_t up_a = word(kMmaRows + g, 0), up_b = word(kMmaRows + g, 1);
      const uint32_t up8_a = word(kMmaRows + g + 8, 0), up8_b = word(kMmaRows + g + 8, 1);
      const uint32_t sg = quad_value(scale_pair[u], 0), sg8 = quad_value(scale_pair[u], 1);
      const uint32_t su = quad_value(scale_pair[u], 2), su8 = quad_value(scale_pair[u], 3);
      const uint4 ba = b_of_step[8 * n], bb = b_of_step[8 * n + 1];
#pragma unroll
      for (int grp = 0; grp < 2; ++grp) {
        float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
        mma_packed_group<Mxfp4Codes>(tg, grp == 0 ? gate_a : gate_b, grp == 0 ? gate8_a : gate8_b, grp == 0 ? ba : bb);
        mma_packed_group<Mxfp4Codes>(tu, grp == 0 ? up_a : up_b, grp == 0 ? up8_a : up8_b, grp == 0 ? ba : bb);
        // tg[0]: row g, tg[2]: row g + 8 (column 0).
        dg[0] = fmaf(scale_of_pair(sg, grp), tg[0], dg[0]);
        dg[2] = fmaf(scale_of_pair(sg8, grp), tg[2], dg[2]);
        du[0] = fmaf(scale_of_pair(su, grp), tu[0], du[0]);
        du[2] = fmaf(scale_of_pair(su8, grp), tu[2], du[2]);
      }
      __syncwarp();  // every lane has read the stage before a later request overwrites it
    }
  }
  cp_async_wait<0>();  // the empty groups past the warp's steps
  // The last range this warp summed, and zeros for ranges past H's steps (as the general kernel's
  // warps without steps).
  sums.store<true>(warp * kRangesPerWarp + range, dg, du, kE2m1HalfScale);
  for (int r = range + 1; r < kRangesPerWarp; ++r) {
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    sums.store<true>(warp * kRangesPerWarp + r, zero, zero, kE2m1HalfScale);
  }
  sums.finish_stored(s, p, row0, b13, b13_stride, I, act, act_out);  // times 2^14 already
}

// Whether a one-token call on the wide kernel's shapes takes the one-token kernel: its rings and
// staged B (2H bytes) beside the static partial sums fit the 48 KiB a block gets without opting in.
// (H <= 14,848.)
inline bool mxfp4_one_token_gate_up_applies(int64_t tokens, int64_t H) {
  constexpr int64_t kStaticBytes = int64_t(sizeof(OneTokenGateUpSums));
  return tokens == 1 && kMxfp4OneTokenRingBytes + 2 * H + kStaticBytes <= 48 * 1024;
}

// The one-token kernel's dynamic shared memory.
inline size_t mxfp4_one_token_gate_up_smem(int64_t H) { return static_cast<size_t>(kMxfp4OneTokenRingBytes + 2 * H); }
// w13 [S, 2I, H/2] with scales [S, 2I, H/G]: gate rows, then up rows (G: 32 for MXFP4; the kernel
// takes G / 32 as groups_per_scale).
template <typename scalar_t, bool kVector, typename Codes>
__global__ void __launch_bounds__(kThreads)
    gate_up_act_packed_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                              const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k, int64_t num_slots,
                              const uint8_t* __restrict__ w13, int64_t w13_stride,
                              const typename Codes::scale_t* __restrict__ scale, int64_t scale_stride,
                              typename Codes::PerScale groups_per_scale, const scalar_t* __restrict__ b13,
                              int64_t b13_stride, int64_t H, int64_t I,
                              DeviceActivation act, float* __restrict__ act_out, unsigned* __restrict__ down_counters,
                              int64_t down_counter_words) {
  zero_with_grid(down_counters, down_counter_words);  // the down kernel's, which waits for this kernel
  extern __shared__ int32_t pair_slot[];
  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= I) return;
  const int64_t chunks = H / 32, per_row = Codes::scales_per_row(H, groups_per_scale);
  const uint8_t* gate_row = w13 + s * w13_stride + row * (H / 2);
  const uint8_t* up_row = gate_row + I * (H / 2);
  const typename Codes::scale_t* gate_scale = scale + s * scale_stride + row * per_row;
  const typename Codes::scale_t* up_scale = gate_scale + I * per_row;

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
    int32_t token_of[kMaxMembers];  // each member's token, divided once (top_k is a runtime value)
#pragma unroll
    for (int m = 0; m < kMaxMembers; ++m) token_of[m] = static_cast<int32_t>(member[m] / top_k);
    float acc_g[kMaxMembers], acc_u[kMaxMembers];
#pragma unroll
    for (int m = 0; m < kMaxMembers; ++m) acc_g[m] = acc_u[m] = 0.f;
    if constexpr (kVector) {
      constexpr int V = Vec16<scalar_t>::kElems;
#pragma unroll 2
      for (int64_t grp = lane; grp < chunks; grp += 32) {
        float g[32], u[32];  // times 1 / Codes::kUnit
        Codes::decode32(load_streaming(gate_row + grp * 16), g);
        Codes::decode32(load_streaming(up_row + grp * 16), u);
        const int64_t si = Codes::scale_index(grp, groups_per_scale);
        const float sg = Codes::scale(gate_scale + si), su = Codes::scale(up_scale + si);
#pragma unroll
        for (int m = 0; m < kMaxMembers; ++m) {
          if (m < count) {
            const scalar_t* xr = hidden + token_of[m] * hidden_stride + grp * kMxfp4Group;
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
            acc_g[m] = fmaf(sg, pg * Codes::kUnit, acc_g[m]);
            acc_u[m] = fmaf(su, pu * Codes::kUnit, acc_u[m]);
          }
        }
      }
    } else {
      for (int64_t c = lane; c < H; c += 32) {
        const float g = Codes::value(gate_row, gate_scale, c, groups_per_scale);
        const float u = Codes::value(up_row, up_scale, c, groups_per_scale);
#pragma unroll
        for (int m = 0; m < kMaxMembers; ++m) {
          if (m < count) {
            const float x = to_float(hidden[token_of[m] * hidden_stride + c]);
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

// down_combine_kernel (decode_fma.cuh) on MXFP4 or int4 rows: w2 [S, H, I/2] with scales [S, H,
// I/G].
template <typename scalar_t, bool kVector, typename Codes>
__global__ void __launch_bounds__(kThreads)
    down_combine_packed_kernel(const float* __restrict__ act, const int32_t* __restrict__ slots,
                               const float* __restrict__ weights, int64_t top_k, int64_t num_slots,
                               const uint8_t* __restrict__ w2, int64_t w2_stride,
                               const typename Codes::scale_t* __restrict__ scale, int64_t scale_stride,
                               typename Codes::PerScale groups_per_scale, const scalar_t* __restrict__ b2,
                               int64_t b2_stride, int64_t H, int64_t I,
                               scalar_t* __restrict__ out, int64_t out_stride) {
  __shared__ float partial[kWarpsPerBlock][kDownRows];
  const int64_t t = blockIdx.y;
  const int64_t h0 = int64_t(blockIdx.x) * kDownRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows = H - h0 < kDownRows ? static_cast<int>(H - h0) : kDownRows;
  const int64_t chunks = I / 32, per_row = Codes::scales_per_row(I, groups_per_scale);
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
    const typename Codes::scale_t* base_scale = scale + s * scale_stride + h0 * per_row;
    const float* a = act + (t * top_k + k) * I;
    float dot[kDownRows];
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) dot[r] = 0.f;
    if constexpr (kVector) {
#pragma unroll 2
      for (int64_t grp = lane; grp < chunks; grp += 32) {
        uint4 raw[kDownRows];
        float sc[kDownRows];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            raw[r] = load_streaming(base + r * (I / 2) + grp * 16);
            sc[r] = Codes::scale(base_scale + r * per_row + Codes::scale_index(grp, groups_per_scale));
          }
        }
        float av[32];
#pragma unroll
        for (int v = 0; v < 32; v += 4) {
          const float4 q = *reinterpret_cast<const float4*>(a + grp * 32 + v);
          av[v] = q.x, av[v + 1] = q.y, av[v + 2] = q.z, av[v + 3] = q.w;
        }
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            float wv[32];  // times 1 / Codes::kUnit
            Codes::decode32(raw[r], wv);
            float part = 0.f;
#pragma unroll
            for (int v = 0; v < 32; ++v) part = fmaf(wv[v], av[v], part);
            dot[r] = fmaf(sc[r], part * Codes::kUnit, dot[r]);
          }
        }
      }
    } else {
      for (int64_t c = lane; c < I; c += 32) {
        const float av = a[c];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            dot[r] = fmaf(Codes::value(base + r * (I / 2), base_scale + r * per_row, c, groups_per_scale), av, dot[r]);
          }
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

// The down mma kernel: a block is 4 warps (its rows of one expert are few, and 6 such blocks an SM
// spread GPT-OSS's 720 (tile, expert) blocks evenly: 1.36 tiles an SM left the 16-row tiles' blocks
// of 8 warps unevenly spread, 2 on some SMs, 1 on others), each warp loading 4 items (64-column
// chunks) before using any.
constexpr int kMxfp4DownWarps = 4;
constexpr int kMxfp4DownThreads = kMxfp4DownWarps * 32;
constexpr int kMxfp4DownItemsPerBatch = 4;
constexpr int64_t kMxfp4DownStaticSmem = kMxfp4DownWarps * kMmaRows * sizeof(float) + 16;

// The dynamic shared memory of the down mma kernel: one expert's act row in f16.
inline int64_t mxfp4_tensor_core_down_smem(int64_t I) { return I * 2; }

// The down mma kernel's workspace, per token of a launch: its (tile, expert) blocks' partial sums
// (float) and a counter per tile (zeroed by the gate_up kernel before it, which the down kernel
// waits for), in 32-bit words.
inline int64_t mxfp4_down_partial_words(int64_t H, int64_t top_k) { return (H / kMmaRows) * top_k * kMmaRows; }
inline int64_t mxfp4_down_counter_words(int64_t H) { return H / kMmaRows; }

// The shapes the down mma kernel takes: 16-row tiles of the hidden dimension, whole 64-column chunks
// of I (so a row's scales are whole pairs; the caller checks that the scale bank is 2-byte aligned),
// and an act row within the 48 KB a block gets without opting in.
inline bool mxfp4_tensor_core_down_applies(int64_t H, int64_t I) {
  return H % kMmaRows == 0 && I % kMxfp4SpanCols == 0 &&
         mxfp4_tensor_core_down_smem(I) + kMxfp4DownStaticSmem <= 48 * 1024;
}

// down_combine on MXFP4 rows with tensor cores. Grid (H / 16, top_k, tokens), 4 warps: block
// (tile, k, t) computes w_k (w2[s_k] rows h0..h0+15 . act_k) for token t, its I / 64 items (64-column
// chunks c) dealt to the warps in turn. An item is the 32-byte span of chunk c in rows g and g + 8
// (one 8-byte load per lane and row, file comment) as A: two groups, two m16n8k16 steps each. B is
// act_k, staged in shared memory as f16 (saturated, as gate_up's hidden state), each 8 columns in
// mma_packed_group's B order; every lane with the same q4 reads the same values, so column 0 of the
// result is used (lanes q4 = 0: d0 row g, d2 row g + 8). A group's result, from zero, is multiplied
// by w_k times its row's scale and added to the warp's sum (times 2^-14 until the reduction). The
// warps' sums are added in warp order into the block's 16 partial sums, written to `partial`; the
// last of the tile's top_k blocks (a per-tile counter, zeroed by gate_up) adds the top_k partials in
// k order, plus the biases, and writes the output: the same result whatever order the blocks end
// in, and the same for a token whatever the call's token count.
// Each warp loads its first items' rows and scale pairs before waiting for gate_up
// (launch_dependent's contract: the slots, the routing weights and w2 were final when gate_up
// started); the counters and partial sums are touched after the wait only. A skipped pair (slot -1
// or out of range) adds zeros.
template <typename scalar_t, typename Codes>
__global__ void __launch_bounds__(kMxfp4DownThreads, 6)
    down_combine_packed_mma_kernel(const float* __restrict__ act, const int32_t* __restrict__ slots,
                                   const float* __restrict__ weights, int64_t top_k, int64_t num_slots,
                                   const uint8_t* __restrict__ w2, int64_t w2_stride,
                                   const typename Codes::scale_t* __restrict__ scale, int64_t scale_stride,
                                   typename Codes::PerScale groups_per_scale, const scalar_t* __restrict__ b2,
                                   int64_t b2_stride, int64_t H,
                                   int64_t I, scalar_t* __restrict__ out, int64_t out_stride,
                                   float* __restrict__ partial_sums, unsigned* __restrict__ counters) {
  extern __shared__ uint4 staged_act[];  // [I / 8]: 8 columns of act_k in B order, f16
  __shared__ float partial[kMxfp4DownWarps][kMmaRows];
  __shared__ bool last;
  constexpr int U = kMxfp4DownItemsPerBatch;
  const int64_t tile = blockIdx.x, k = blockIdx.y, t = blockIdx.z;
  const int64_t tiles = gridDim.x;
  const int64_t h0 = tile * kMmaRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const bool upper = q4 >= 2;
  const int j = 2 * (q4 & 1) + (q4 >> 1);  // the word of each group this lane holds after the exchange
  const int chunks = static_cast<int>(I / kMxfp4SpanCols), words_per_row = static_cast<int>(I / 8);
  const int64_t row_bytes = I / 2, per_row = Codes::scales_per_row(I, groups_per_scale);
  const int32_t s = slots[t * top_k + k];
  const bool valid = s >= 0 && s < num_slots;
  const float w = valid ? weights[t * top_k + k] : 0.f;
  // Chunk c: bytes 32 c + 8 q4 of rows h0 + g and h0 + g + 8, the scales of groups 2 c and 2 c + 1.
  const uint8_t* w2_g = w2 + (valid ? s : 0) * w2_stride + (h0 + g) * row_bytes + 8 * q4;
  const typename Codes::scale_t* scale_g = scale + (valid ? s : 0) * scale_stride + (h0 + g) * per_row;

  uint2 rows_g[U], rows_g8[U];
  typename Codes::ScalePair scales_g[U], scales_g8[U];
  int chunk_of[U];  // the item's chunk, or -1: nothing to do
  int c = warp;     // the warp's next chunk
  const auto load_batch = [&]() {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      chunk_of[u] = -1;
      if (valid && c < chunks) {
        const uint8_t* r = w2_g + 32 * c;
        rows_g[u] = load_streaming_8(r);
        rows_g8[u] = load_streaming_8(r + 8 * row_bytes);
        scales_g[u] = Codes::load_pair(scale_g, 2 * c, groups_per_scale);
        scales_g8[u] = Codes::load_pair(scale_g + 8 * per_row, 2 * c, groups_per_scale);
        chunk_of[u] = c;
      }
      c += kMxfp4DownWarps;
    }
  };

  load_batch();
  wait_for_previous_kernel();  // act, the counters and the partial sums follow gate_up
  if (valid) {
    const float* a = act + (t * top_k + k) * I;
    for (int i = threadIdx.x; i < words_per_row; i += kMxfp4DownThreads) {
      const float4 lo = *reinterpret_cast<const float4*>(a + 8 * i);
      const float4 hi = *reinterpret_cast<const float4*>(a + 8 * i + 4);
      const float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      staged_act[i] = floats_to_mxfp4_b_order(f);
    }
  }
  __syncthreads();

  float acc_g = 0.f, acc_g8 = 0.f;  // column 0 of rows g and g + 8, times 1 / Codes::kUnit
  while (true) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (chunk_of[u] < 0) continue;  // the same for the whole warp: the exchanges below are warp-wide
      uint32_t a_g, b_g, a_g8, b_g8;  // word j of groups A and B in rows g and g + 8
      exchange_words(rows_g[u], upper, a_g, b_g);
      exchange_words(rows_g8[u], upper, a_g8, b_g8);
#pragma unroll
      for (int grp = 0; grp < 2; ++grp) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma_packed_group<Codes>(d, grp == 0 ? a_g : b_g, grp == 0 ? a_g8 : b_g8,
                                staged_act[8 * chunk_of[u] + 4 * grp + j]);
        acc_g = fmaf(w * Codes::of_pair(scales_g[u], grp), d[0], acc_g);
        acc_g8 = fmaf(w * Codes::of_pair(scales_g8[u], grp), d[2], acc_g8);
      }
    }
    if (!valid || c >= chunks) break;
    load_batch();
  }
  if (q4 == 0) {
    partial[warp][g] = acc_g * Codes::kUnit;
    partial[warp][g + 8] = acc_g8 * Codes::kUnit;
  }
  __syncthreads();
  float* tile_sums = partial_sums + (t * tiles + tile) * top_k * kMmaRows;
  if (threadIdx.x < kMmaRows) {
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < kMxfp4DownWarps; ++q) sum += partial[q][threadIdx.x];  // fixed order
    tile_sums[k * kMmaRows + threadIdx.x] = sum;
    __threadfence();  // the sum is visible before the counter says so
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // release: the block's sums (fenced by their writers, then the barrier) before the count
    last = atomicAdd(counters + t * tiles + tile, 1u) == static_cast<unsigned>(top_k - 1);
    __threadfence();  // acquire: the other blocks' sums after their counts
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other blocks' sums, published before their increments, are read after ours
  if (threadIdx.x < kMmaRows) {
    const int r = threadIdx.x;
    float sum = 0.f;
    for (int64_t kk = 0; kk < top_k; ++kk) sum += __ldcg(tile_sums + kk * kMmaRows + r);  // k order: deterministic
    if (b2 != nullptr) {  // sum_k w_k * b2[s_k][h]
      for (int64_t kk = 0; kk < top_k; ++kk) {
        const int32_t sk = slots[t * top_k + kk];
        if (sk >= 0 && sk < num_slots) sum = fmaf(weights[t * top_k + kk], to_float(b2[sk * b2_stride + h0 + r]), sum);
      }
    }
    out[t * out_stride + h0 + r] = static_cast<scalar_t>(sum);
  }
}

}  // namespace
}  // namespace ft::cuda
