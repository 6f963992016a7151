// Decode kernels for FP8 experts (float8_e4m3fn weights, float32 scale_inv per 128 x 128 block, or
// one a row; ft_ops/formats.py), reading the selected slot rows in place and dequantizing in registers.
// Every kernel takes kRowScales: with row scales a row's products are summed unscaled and multiplied
// by its scale once, where block scales multiply each block's sums (or each value; the
// element-by-element down projection multiplies each value by its row's scale either way). Scale offsets
// are computed from constants: a 64-bit division by a runtime value (Fp8ScaleIndex's) is a called
// routine, and made the FMA kernels spill.
//
// gate_up_act_fp8_mma_kernel: the tensor-core decode kernel of decode_tensor_core.cuh for FP8
//   weights. An e4m3 value converts exactly to f16 (one cvt per two values), so the weights enter
//   f16 mma.sync m16n8k16 as they are; the 16-bit hidden vector is converted to f16 (exact for
//   bf16 values with |x| in [2^-14, 65504], where a normalized MoE input lies; larger values
//   saturate). float32 hidden states take the FMA kernel. Each warp takes whole 128-column blocks: a block's products accumulate in a
//   temporary fragment that is multiplied by the block's scale and added to the result, so the
//   scaling costs 8 FMAs per 128 columns and the dot products stay in float32.
// down_combine_fp8_kernel: decode_fma.cuh's down projection + weighted combine on FP8 rows, each
//   lane's 16 consecutive columns inside one scale block.
// gate_up_act_fp8_one_token_kernel: the mma kernel for a one-token call (the decode step), leaner.
// gate_up_act_fp8_kernel / the scalar path: any shape (one warp per slot row, element by element).
//
// Fragment mapping of the mma kernel: lane (g = lane / 4, q = lane % 4) loads 16 consecutive
// weights at column 16q of rows g and g + 8 of a 64-column chunk (16 bytes each) and the same
// 16 hidden columns of member g. mma step j (0-3) takes elements 4j, 4j+1 (k = 2q, 2q+1) and
// 4j+2, 4j+3 (k = 2q+8, 2q+9) of both operands: the same permutation of k for A and B, and the
// 16 lanes' columns cover the chunk once. Included once, by expert_gemm.cu.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "activation.cuh"
#include "cuda_utils.cuh"
#include "decode_fma.cuh"
#include "decode_tensor_core.cuh"
#include "wait_for_previous_kernel.cuh"

namespace ft::cuda {
namespace {

constexpr int kFp8Block = 128;      // scale block (ft_ops/formats.py FP8_BLOCK)
constexpr int kFp8ChunkCols = 64;   // columns per warp step: 4 lanes x 16 fp8

// Four e4m3 values (a word, low byte first) as two f16x2 registers, exactly: the word's halves are
// taken as 16-bit registers, so the high pair needs no shift (one conversion instruction each).
__device__ __forceinline__ void e4m3x4_to_half2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

// 16 e4m3 values (one 16-byte load) as 8 f16x2 registers, in element order.
__device__ __forceinline__ void e4m3x16_to_half2(const uint4& v, uint32_t (&out)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) e4m3x4_to_half2(w[i], out[2 * i], out[2 * i + 1]);
}

// A hint that the 128-byte line at p be fetched into L2.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// One e4m3 value as a float.
__device__ __forceinline__ float e4m3_to_float(uint8_t v) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(v), __NV_E4M3);
  return __half2float(__half(h));
}

// (a, b) as an f16x2 (a in the low half), rounded to nearest, finite values beyond 65504 saturated
// (NaN stays NaN): one instruction.
__device__ __forceinline__ uint32_t floats_to_half2_saturated(float a, float b) {
  uint32_t h;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(b), "f"(a));
  return h;
}

struct Mma16x8x16Half {
  __device__ __forceinline__ static void run(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                             uint32_t a3, uint32_t b0, uint32_t b1) {
    Mma16x8x16<at::Half>::run(d, a0, a1, a2, a3, b0, b1);
  }
};

// One 64-column chunk of one 16-row tile (the fragment mapping of the file comment): this lane's
// 16 weights of rows g (w) and g + 8 (w8) against the B values b, into t.
__device__ __forceinline__ void mma_fp8_tile_chunk(float (&t)[4], const uint4& w, const uint4& w8, const uint32_t (&b)[8]) {
  uint32_t a[8], a8[8];
  e4m3x16_to_half2(w, a);
  e4m3x16_to_half2(w8, a8);
#pragma unroll
  for (int j = 0; j < 4; ++j) Mma16x8x16Half::run(t, a[2 * j], a8[2 * j], a[2 * j + 1], a8[2 * j + 1], b[2 * j], b[2 * j + 1]);
}

// The row scales of rows g and g + 8 (row_scale_g[0] and row_scale_g[8]), loaded when a kernel
// starts: at its end their latency would add to the call's.
struct FragmentRowScales {
  float lo = 1.f, hi = 1.f;
  __device__ __forceinline__ void load(const float* __restrict__ row_scale_g) {
    lo = __ldg(row_scale_g), hi = __ldg(row_scale_g + 8);
  }
  // Rows g and g + 8 of an mma fragment (d[0..1], d[2..3]) times their scales: fp8_rows' scaling,
  // once after the rows' products are summed.
  __device__ __forceinline__ void apply(float (&d)[4]) const { d[0] *= lo, d[1] *= lo, d[2] *= hi, d[3] *= hi; }
};

// The same chunk of the gate tile (rows g, g + 8: wg, wg8) into tg and of the up tile into tu.
__device__ __forceinline__ void mma_fp8_chunk(float (&tg)[4], float (&tu)[4], const uint4& wg, const uint4& wg8,
                                              const uint4& wu, const uint4& wu8, const uint32_t (&b)[8]) {
  mma_fp8_tile_chunk(tg, wg, wg8, b);
  mma_fp8_tile_chunk(tu, wu, wu8, b);
}

// The 16 f16 values at `at` (8 pairs, 16-byte aligned shared memory) as an mma chunk's B registers.
__device__ __forceinline__ void load_b_pairs(const uint32_t* at, uint32_t (&b)[8]) {
  const uint4 lo = *reinterpret_cast<const uint4*>(at), hi = *reinterpret_cast<const uint4*>(at + 4);
  b[0] = lo.x, b[1] = lo.y, b[2] = lo.z, b[3] = lo.w, b[4] = hi.x, b[5] = hi.y, b[6] = hi.z, b[7] = hi.w;
}

// The shapes the FP8 mma kernel takes: whole 16-row tiles (inside one 128-row scale block),
// whole 64-column chunks, 16-byte rows.
inline bool fp8_tensor_core_decode_applies(int64_t H, int64_t I) {
  return H % kFp8ChunkCols == 0 && I % kMmaRows == 0;
}

// The general FP8 mma kernel stages its members' hidden values a window of columns at a time: one
// 128-column scale block per warp (1,024 columns), each member's row of the window as f16 pairs, 4
// words of padding a row so that the rows of members g and g + 1 fall in other banks.
constexpr int kFp8WindowCols = kMmaWarps * kFp8Block;
constexpr int kFp8WindowStride = kFp8WindowCols / 2 + 4;  // 32-bit words a member's row
constexpr int64_t kFp8WindowBytes = int64_t(kMmaMembers) * kFp8WindowStride * sizeof(uint32_t);

// The dynamic shared memory of gate_up_act_fp8_mma_kernel: the window, then the chunk's slot ids.
inline int64_t fp8_mma_gate_up_smem(int64_t pairs) { return kFp8WindowBytes + pairs * int64_t(sizeof(int32_t)); }

// Grid (I / 16, pairs), as gate_up_act_mma_kernel: the block of the pair that leads its slot
// serves every pair routed to it, in passes of up to 8. w13 is [S, 2I, H] e4m3 with scale_inv
// [S, 2 ceil(I/128), ceil(H/128)] (gate's row blocks, then up's). A pass walks the hidden dimension
// a window at a time: each warp issues the loads of its block of the window, then the block stages
// the members' hidden values of the window in shared memory as f16 (holding them in registers beside
// the weights made the kernel spill at 3 blocks an SM), then each warp multiplies. A warp takes the
// blocks warp, warp + 8, ... in order, as the one-token kernel does: the same products and sums.
// Every FP8 gate_up kernel takes kGated: false for ungated experts (w13 the up rows alone, its scale
// one projection's row blocks), whose one product a row is taken as both gate and up.
// kRowScales: scale [S, 2I] (or [S, I] ungated), one a row.
template <typename scalar_t, bool kGated, bool kRowScales>
__global__ void __launch_bounds__(kMmaThreads, 3)
    gate_up_act_fp8_mma_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                               const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k,
                               int64_t num_slots, const uint8_t* __restrict__ w13, int64_t w13_stride,
                               const float* __restrict__ scale, int64_t scale_stride,
                               const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                               DeviceActivation act, float* __restrict__ act_out) {
  static_assert(Vec16<scalar_t>::kElems == 8, "16-bit hidden states: one 16-byte load is 8 columns");
  extern __shared__ __align__(16) uint32_t dynamic_smem[];
  uint32_t* window = dynamic_smem;  // [kMmaMembers][kFp8WindowStride]
  int32_t* pair_slot = reinterpret_cast<int32_t*>(dynamic_smem + kMmaMembers * kFp8WindowStride);
  __shared__ MmaGateUpPass pass;

  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  const uint8_t* gate_g = w13 + s * w13_stride + (row0 + g) * H + 16 * q4;
  const uint8_t* gate_g8 = gate_g + 8 * H;
  const uint8_t* up_g = gate_g + up_row_of<kGated>(I) * H;
  const uint8_t* up_g8 = up_g + 8 * H;
  const int64_t col_blocks = (H + kFp8Block - 1) / kFp8Block;
  const int64_t row_blocks = (I + kFp8Block - 1) / kFp8Block;  // per projection
  // Block scales: the tile's scale row (its 16 rows lie in one row block); row scales: row g's.
  const float* gate_scale =
      scale + s * scale_stride + (kRowScales ? row0 + g : (row0 / kFp8Block) * col_blocks);
  const float* up_scale = gate_scale + (kRowScales ? up_row_of<kGated>(I) : kGated ? row_blocks * col_blocks : 0);
  FragmentRowScales gate_rows, up_rows;
  if constexpr (kRowScales) {
    gate_rows.load(gate_scale);
    if constexpr (kGated) up_rows.load(up_scale);
  }
  if (threadIdx.x == 0) pass.next_pair = p;

  while (true) {
    const int count = pass.next(pair_slot, pairs, s, top_k);
    if (count == 0) break;
    float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int64_t w0 = 0; w0 < H; w0 += kFp8WindowCols) {
      const int64_t blk = w0 / kFp8Block + warp;
      const bool has_block = blk < col_blocks;
      // Every load of the warp's block is issued first (both chunks, the two scales): in flight
      // while the block stages the window.
      constexpr int kChunks = kFp8Block / kFp8ChunkCols;
      uint4 wg[kChunks], wg8[kChunks], wu[kChunks], wu8[kChunks];
      float sg = 0.f, su = 0.f;
      if (has_block) {
#pragma unroll
        for (int ch = 0; ch < kChunks; ++ch) {
          const int64_t c = blk * kFp8Block + ch * kFp8ChunkCols;
          if (c < H) {  // a partial last block has fewer chunks
            wg[ch] = load_streaming(gate_g + c);
            wg8[ch] = load_streaming(gate_g8 + c);
            if constexpr (kGated) {  // ungated: the gate's product is the up's
              wu[ch] = load_streaming(up_g + c);
              wu8[ch] = load_streaming(up_g8 + c);
            }
          }
        }
        if constexpr (!kRowScales) {
          sg = __ldg(gate_scale + blk);
          if constexpr (kGated) su = __ldg(up_scale + blk);
        }
      }
      // The members' hidden columns [w0, w0 + cols) as f16 pairs (H % 64 == 0: whole 16-byte loads).
      const int vectors = static_cast<int>((H - w0 < kFp8WindowCols ? H - w0 : kFp8WindowCols) / 8);
      for (int i = threadIdx.x; i < count * vectors; i += kMmaThreads) {
        const int m = i / vectors, v = i - m * vectors;
        const scalar_t* x = hidden + pass.member_token[m] * hidden_stride + w0 + 8 * v;
        float f[8];
        Vec16<scalar_t>::to_float(__ldg(reinterpret_cast<const uint4*>(x)), f);
        *reinterpret_cast<uint4*>(window + m * kFp8WindowStride + 4 * v) =
            make_uint4(floats_to_half2_saturated(f[0], f[1]), floats_to_half2_saturated(f[2], f[3]),
                       floats_to_half2_saturated(f[4], f[5]), floats_to_half2_saturated(f[6], f[7]));
      }
      __syncthreads();
      if (has_block) {
        float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ch = 0; ch < kChunks; ++ch) {
          const int64_t c = blk * kFp8Block + ch * kFp8ChunkCols;
          if (c >= H) break;
          // B column g: member g's 16 values at this lane's columns c + 16 q4 (zeros past the members).
          uint32_t b[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
          if (g < count) load_b_pairs(window + g * kFp8WindowStride + (c - w0 + 16 * q4) / 2, b);
          if constexpr (kGated) {
            mma_fp8_chunk(tg, tu, wg[ch], wg8[ch], wu[ch], wu8[ch], b);
          } else {
            mma_fp8_tile_chunk(tg, wg[ch], wg8[ch], b);
          }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          dg[i] = kRowScales ? dg[i] + tg[i] : fmaf(sg, tg[i], dg[i]);
          if constexpr (kGated) du[i] = kRowScales ? du[i] + tu[i] : fmaf(su, tu[i], du[i]);
        }
      }
      __syncthreads();  // every warp has read the window before the next one overwrites it
    }
    if constexpr (kRowScales) {
      gate_rows.apply(dg);
      if constexpr (kGated) up_rows.apply(du);
    }
    pass.finish<scalar_t, kGated>(dg, kGated ? du : dg, 1.f, count, s, row0, b13, b13_stride, I, act, act_out);
  }
}

// One token (its top_k pairs), the shapes of gate_up_act_fp8_mma_kernel: the same products without
// its passes. Each block serves its own pair (a slot routed twice for the token is read twice), so
// there is no leader test and no member scan; the token's hidden state is converted to f16 once per
// block into shared memory (H / 2 words of dynamic shared memory), which frees the registers the
// general kernel holds its hidden loads in (it spills at 3 blocks an SM; this one does not); row
// offsets are 32-bit (a slot's w13 is below 4 GiB); the epilogue reduces only the mma's column 0
// (the token). The same products and sums as the general kernel, bit for bit. Measured on the H200
// for 8 Qwen3-30B-A3B experts, 16 calls a CUDA graph (a standalone harness): 9.4-9.6 us against
// 11.8-11.9 us for the general kernel; with the down kernel 16.4-16.5 against 18.5-18.6 us.
// Each warp's first weights are loaded before the block stages the hidden state (their latency
// overlaps the staging's): the one-token call 15.9 / 16.6 against 16.9 / 17.6 us in two rounds of
// bench_fp8.py on one H200.
template <typename scalar_t, bool kGated, bool kRowScales>
__global__ void __launch_bounds__(kMmaThreads, 3)
    gate_up_act_fp8_one_token_kernel(const scalar_t* __restrict__ hidden, const int32_t* __restrict__ slots,
                                     int64_t num_slots, const uint8_t* __restrict__ w13, int64_t w13_stride,
                                     const float* __restrict__ scale, int64_t scale_stride,
                                     const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                                     DeviceActivation act, float* __restrict__ act_out) {
  extern __shared__ __align__(16) uint32_t x_half[];  // the hidden state as f16 pairs, [H / 2]
  __shared__ OneTokenGateUpSums sums;
  let_next_kernel_start();  // the down kernel loads its weights while this one runs
  const int64_t p = blockIdx.y;
  const int32_t s = slots[p];
  if (s < 0 || s >= num_slots) return;  // the down kernel skips the pair
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q4 = lane & 3;
  const int64_t row0 = int64_t(blockIdx.x) * kMmaRows;
  // Gate row g from `rows`; gate row g + 8, up row g and up row g + 8 at 32-bit offsets from it.
  const uint8_t* rows = w13 + s * w13_stride + (row0 + g) * H + 16 * q4;
  const uint32_t off8 = static_cast<uint32_t>(8 * H), off_up = static_cast<uint32_t>(up_row_of<kGated>(I) * H);
  const int col_blocks = static_cast<int>((H + kFp8Block - 1) / kFp8Block);
  const int64_t row_blocks = (I + kFp8Block - 1) / kFp8Block;
  const float* gate_scale =
      scale + s * scale_stride + (kRowScales ? row0 + g : (row0 / kFp8Block) * col_blocks);
  const float* up_scale = gate_scale + (kRowScales ? up_row_of<kGated>(I) : kGated ? row_blocks * col_blocks : 0);
  FragmentRowScales gate_rows, up_rows;
  if constexpr (kRowScales) {
    gate_rows.load(gate_scale);
    if constexpr (kGated) up_rows.load(up_scale);
  }
  // This warp's weights of one 128-column block (a partial last block has fewer chunks). The
  // first block's are in flight while the block stages the hidden state, each next block's while
  // the warp waits for nothing else.
  constexpr int kChunks = kFp8Block / kFp8ChunkCols;
  uint4 wg[kChunks], wg8[kChunks], wu[kChunks], wu8[kChunks];
  auto load_block = [&](int blk) {
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const uint32_t c = static_cast<uint32_t>(blk * kFp8Block + ch * kFp8ChunkCols);
      if (c < H) {
        wg[ch] = load_streaming(rows + c);
        wg8[ch] = load_streaming(rows + (c + off8));
        if constexpr (kGated) {  // ungated: the gate's product is the up's
          wu[ch] = load_streaming(rows + (c + off_up));
          wu8[ch] = load_streaming(rows + (c + off_up + off8));
        }
      }
    }
  };
  if (warp < col_blocks) load_block(warp);
  for (int64_t i = threadIdx.x; i < H / 2; i += kMmaThreads)
    x_half[i] = floats_to_half2_saturated(to_float(hidden[2 * i]), to_float(hidden[2 * i + 1]));
  __syncthreads();
  float dg[4] = {0.f, 0.f, 0.f, 0.f}, du[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (int blk = warp; blk < col_blocks; blk += kMmaWarps) {
    const float sg = kRowScales ? 1.f : __ldg(gate_scale + blk);
    const float su = kGated && !kRowScales ? __ldg(up_scale + blk) : 0.f;
    float tg[4] = {0.f, 0.f, 0.f, 0.f}, tu[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ch = 0; ch < kChunks; ++ch) {
      const int c = blk * kFp8Block + ch * kFp8ChunkCols;
      if (c >= H) break;
      // B column 0 is the token (lanes g == 0): its 16 values at this lane's columns c + 16 q4.
      uint32_t b[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
      if (g == 0) load_b_pairs(x_half + (c + 16 * q4) / 2, b);
      if constexpr (kGated) {
        mma_fp8_chunk(tg, tu, wg[ch], wg8[ch], wu[ch], wu8[ch], b);
      } else {
        mma_fp8_tile_chunk(tg, wg[ch], wg8[ch], b);
      }
    }
    if (blk + kMmaWarps < col_blocks) load_block(blk + kMmaWarps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dg[i] = kRowScales ? dg[i] + tg[i] : fmaf(sg, tg[i], dg[i]);
      if constexpr (kGated) du[i] = kRowScales ? du[i] + tu[i] : fmaf(su, tu[i], du[i]);
    }
  }
  if constexpr (kRowScales) {
    gate_rows.apply(dg);
    if constexpr (kGated) up_rows.apply(du);
  }
  sums.finish<false, scalar_t, kGated>(dg, kGated ? du : dg, 1.f, s, p, row0, b13, b13_stride, I, act, act_out);
}

// Whether a one-token call takes gate_up_act_fp8_one_token_kernel: its hidden state as f16 beside
// the kernel's static partial sums fits the 48 KiB of shared memory a block gets without opting in,
// and a slot's gate and up rows lie within 4 GiB (the 32-bit offsets).
inline bool fp8_one_token_gate_up_applies(int64_t tokens, int64_t H, int64_t I) {
  constexpr int64_t kStaticBytes = int64_t(sizeof(float)) * kMmaWarps * 2 * kMmaRows;
  return tokens == 1 && H * 2 + kStaticBytes <= 48 * 1024 && 2 * I * H < (int64_t(1) << 32);
}

// Any shape: one warp per (slot, intermediate row), element by element, every pair routed to the
// slot served by one read of its weights (as gate_up_act_kernel).
template <typename scalar_t, bool kGated, bool kRowScales>
__global__ void __launch_bounds__(kThreads)
    gate_up_act_fp8_kernel(const scalar_t* __restrict__ hidden, int64_t hidden_stride,
                           const int32_t* __restrict__ slots, int64_t pairs, int64_t top_k,
                           int64_t num_slots, const uint8_t* __restrict__ w13, int64_t w13_stride,
                           const float* __restrict__ scale, int64_t scale_stride,
                           const scalar_t* __restrict__ b13, int64_t b13_stride, int64_t H, int64_t I,
                           DeviceActivation act, float* __restrict__ act_out) {
  extern __shared__ int32_t pair_slot[];
  const int32_t s = stage_slots_and_lead(slots, pairs, num_slots, pair_slot);
  if (s < 0) return;
  const int64_t p = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= I) return;
  const uint8_t* gate_row = w13 + s * w13_stride + row * H;
  const uint8_t* up_row = gate_row + up_row_of<kGated>(I) * H;
  const int64_t col_blocks = (H + kFp8Block - 1) / kFp8Block;
  const int64_t row_blocks = (I + kFp8Block - 1) / kFp8Block;
  // Block scales: the row's scale row, a scale a 128-column block; row scales: the row's one scale.
  const float* gate_scale = scale + s * scale_stride + (kRowScales ? row : (row / kFp8Block) * col_blocks);
  const float* up_scale = gate_scale + (kRowScales ? up_row_of<kGated>(I) : kGated ? row_blocks * col_blocks : 0);

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
    for (int64_t c = lane; c < H; c += 32) {
      const float g = kRowScales ? e4m3_to_float(gate_row[c]) : e4m3_to_float(gate_row[c]) * gate_scale[c / kFp8Block];
      const float u = !kGated      ? 0.f
                      : kRowScales ? e4m3_to_float(up_row[c])
                                   : e4m3_to_float(up_row[c]) * up_scale[c / kFp8Block];
#pragma unroll
      for (int m = 0; m < kMaxMembers; ++m) {
        if (m < count) {
          const float x = to_float(hidden[(member[m] / top_k) * hidden_stride + c]);
          acc_g[m] = fmaf(g, x, acc_g[m]);
          if constexpr (kGated) acc_u[m] = fmaf(u, x, acc_u[m]);  // ungated: the gate's product is the up's
        }
      }
    }
    const float bias_g = b13 != nullptr ? to_float(b13[s * b13_stride + row]) : 0.f;
    const float bias_u = b13 != nullptr ? to_float(b13[s * b13_stride + up_row_of<kGated>(I) + row]) : 0.f;
#pragma unroll
    for (int m = 0; m < kMaxMembers; ++m) {
      if (m < count) {
        const float g = warp_sum(acc_g[m]) * (kRowScales ? gate_scale[0] : 1.f) + bias_g;
        const float u = kGated ? warp_sum(acc_u[m]) * (kRowScales ? up_scale[0] : 1.f) + bias_u : g;
        if (lane == 0) act_out[member[m] * I + row] = activate(g, u, act);
      }
    }
  }
}

// down_combine_kernel (decode_fma.cuh) on FP8 rows: w2 [S, H, I] e4m3 with scale_inv
// [S, ceil(H/128), ceil(I/128)], or [S, H] (kRowScales). kVector: I % 16 == 0
// (a lane's 16 columns lie in one scale block and one 16-byte load); otherwise element by element.
// 4 blocks an SM (64 registers): a one-token call's H / 4 blocks fit the GPU in one wave.
template <typename scalar_t, bool kVector, bool kRowScales>
__global__ void __launch_bounds__(kThreads, 4)
    down_combine_fp8_kernel(const float* __restrict__ act, const int32_t* __restrict__ slots,
                            const float* __restrict__ weights, int64_t top_k, int64_t num_slots,
                            const uint8_t* __restrict__ w2, int64_t w2_stride, const float* __restrict__ scale,
                            int64_t scale_stride, const scalar_t* __restrict__ b2, int64_t b2_stride,
                            int64_t H, int64_t I, scalar_t* __restrict__ out, int64_t out_stride) {
  __shared__ float partial[kWarpsPerBlock][kDownRows];
  const int64_t t = blockIdx.y;
  const int64_t h0 = int64_t(blockIdx.x) * kDownRows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rows = H - h0 < kDownRows ? static_cast<int>(H - h0) : kDownRows;
  const int64_t col_blocks = (I + kFp8Block - 1) / kFp8Block;
  // Launched dependent on gate_up (launch_dependent): until the wait, gate_up may still run. It was
  // launched the ordinary way, after every earlier kernel had finished, so the slots and the w2 rows
  // are final: pull this block's rows toward L2 while gate_up finishes; only act is gate_up's.
  for (int64_t k = warp; k < top_k; k += kWarpsPerBlock) {
    const int32_t s = slots[t * top_k + k];
    if (s < 0 || s >= num_slots) continue;
    const uint8_t* base = w2 + s * w2_stride + h0 * I;
    for (int64_t off = int64_t(lane) * 128; off < rows * I; off += 32 * 128) prefetch_l2(base + off);
  }
  wait_for_previous_kernel();
  float acc[kDownRows];
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) acc[r] = 0.f;
  for (int64_t k = warp; k < top_k; k += kWarpsPerBlock) {
    const int32_t s = slots[t * top_k + k];
    if (s < 0 || s >= num_slots) continue;
    const float w = weights[t * top_k + k];
    const uint8_t* base = w2 + s * w2_stride + h0 * I;
    const float* a = act + (t * top_k + k) * I;
    float dot[kDownRows];
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) dot[r] = 0.f;
    if constexpr (kVector) {
      // Block scales: rows h0..h0+3 share one row block (kDownRows divides 128); row scales: row h0's
      // (row h0 + r's r further; loaded after the products: held through them, they made it spill).
      const float* row_scale = scale + s * scale_stride + (kRowScales ? h0 : (h0 / kFp8Block) * col_blocks);
#pragma unroll 2
      for (int64_t c = lane * 16; c < I; c += 32 * 16) {
        uint4 raw[kDownRows];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) raw[r] = load_streaming(base + r * I + c);
        }
        float av[16];
#pragma unroll
        for (int v = 0; v < 16; v += 4) {
          const float4 q = *reinterpret_cast<const float4*>(a + c + v);
          av[v] = q.x, av[v + 1] = q.y, av[v + 2] = q.z, av[v + 3] = q.w;
        }
        const float sc = kRowScales ? 1.f : __ldg(row_scale + c / kFp8Block);
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            uint32_t h2[8];
            e4m3x16_to_half2(raw[r], h2);
            float part = 0.f;
#pragma unroll
            for (int v = 0; v < 8; ++v) {
              const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2[v]));
              part = fmaf(f.x, av[2 * v], part);
              part = fmaf(f.y, av[2 * v + 1], part);
            }
            dot[r] = kRowScales ? dot[r] + part : fmaf(sc, part, dot[r]);
          }
        }
      }
      if constexpr (kRowScales) {
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) dot[r] *= __ldg(row_scale + r);
        }
      }
    } else {
      for (int64_t c = lane; c < I; c += 32) {
        const float av = a[c];
#pragma unroll
        for (int r = 0; r < kDownRows; ++r) {
          if (r < rows) {
            const float sc = scale[s * scale_stride + (kRowScales ? h0 + r
                                                                  : ((h0 + r) / kFp8Block) * col_blocks + c / kFp8Block)];
            dot[r] = fmaf(e4m3_to_float(base[r * I + c]) * sc, av, dot[r]);
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
    if (b2 != nullptr) {
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t s = slots[t * top_k + k];
        if (s >= 0 && s < num_slots) sum = fmaf(weights[t * top_k + k], to_float(b2[s * b2_stride + h0 + r]), sum);
      }
    }
    out[t * out_stride + h0 + r] = static_cast<scalar_t>(sum);
  }
}


// The down projection + weighted combine on tensor cores (the decode step on an FP8 pool, 16-bit
// hidden states, top_k <= 8): a block per (16 hidden rows, token), kSplit warps serving the
// token's pair k (warp k + 8 j takes the j-th contiguous share of I's 64-column chunks), its 16
// rows of w2 as the mma's A (mma_fp8_tile_chunk: rows g and g + 8, 16 bytes of each chunk a lane),
// the pair's activations as f16 in B's column 0; the block then adds the warps' weighted results
// in pair order, shares in order (no atomics, no counters).
// Before the wait for gate_up (the slots and w2 are final; only act is gate_up's) each warp loads
// its first U chunks into registers and pulls the rest of its rows toward L2; after
// it, the next batch's loads are issued before the current batch's products. Against
// down_combine_fp8_kernel (per value an FMA, an f16-to-float conversion and half an F2FP): an F2FP
// per two values and an mma per 256 of a warp. act enters B as f16 (saturated at 65504), as the
// FP8 gate_up kernels read the hidden state. Dynamic shared memory: fp8_rows_mma_down_smem(I).
constexpr int kFp8RowsDownWarps = 8;  // the most pairs (top_k) a call may have
// What the decode call launches: one 64-column chunk a warp in flight, three warps a pair (768
// threads a block). H200, 8 pairs of Qwen3-30B-A3B's shape after the one-token gate_up kernel,
// 16 calls a graph (a standalone program, 2026-12-04): 14.53-14.57 us; U = 2 with one warp a pair
// 16.80-16.89, two 14.78-14.94; U = 1 with four warps a pair 14.53-14.56; the FMA down kernel
// (down_combine_fp8_kernel) 15.30-15.34.
constexpr int kFp8RowsDownChunks = 1;
constexpr int kFp8RowsDownSplit = 3;

inline int64_t fp8_rows_mma_down_smem(int64_t I) { return int64_t(kFp8RowsDownWarps) * I * 2; }

// Its shared memory (the dynamic part beside the static partial sums) within the 48 KiB a block
// gets without opting in.
inline bool fp8_rows_mma_down_applies(int64_t top_k, int64_t H, int64_t I) {
  constexpr int64_t kStaticBytes = int64_t(sizeof(float)) * kFp8RowsDownSplit * kFp8RowsDownWarps * kMmaRows;
  return top_k <= kFp8RowsDownWarps && H % kMmaRows == 0 && I % kFp8ChunkCols == 0 &&
         fp8_rows_mma_down_smem(I) + kStaticBytes <= 48 * 1024;
}

template <typename scalar_t, bool kRowScales>
__global__ void __launch_bounds__(kFp8RowsDownWarps * 32 * kFp8RowsDownSplit, 1)
    down_combine_fp8_rows_mma_kernel(const float* __restrict__ act, const int32_t* __restrict__ slots,
                                     const float* __restrict__ weights, int64_t top_k, int64_t num_slots,
                                     const uint8_t* __restrict__ w2, int64_t w2_stride,
                                     const float* __restrict__ scale, int64_t scale_stride,
                                     const scalar_t* __restrict__ b2, int64_t b2_stride, int64_t H, int64_t I,
                                     scalar_t* __restrict__ out, int64_t out_stride) {
  // U: 64-column chunks of each row a warp has in flight (twice that while the next batch loads).
  // kSplit: warps a pair (each a contiguous share of I's chunks); a block has 8 kSplit warps.
  constexpr int U = kFp8RowsDownChunks, kSplit = kFp8RowsDownSplit;
  extern __shared__ __align__(16) uint32_t rows_down_act[];  // [warp][I / 2]: each warp's pair's act as f16
  __shared__ float partial[kSplit][kFp8RowsDownWarps][kMmaRows];
  const int lane = threadIdx.x & 31;
  const int warp = (threadIdx.x >> 5) % kFp8RowsDownWarps, part = (threadIdx.x >> 5) / kFp8RowsDownWarps;
  const int g = lane >> 2, q4 = lane & 3;
  const int64_t h0 = int64_t(blockIdx.x) * kMmaRows;
  const int64_t t = blockIdx.y;
  const int64_t p = t * top_k + warp;  // this warp's pair
  slots += t * top_k;
  weights += t * top_k;
  const int32_t s = warp < top_k ? slots[warp] : -1;
  const bool valid = s >= 0 && s < num_slots;
  const int all_chunks = static_cast<int>(I / kFp8ChunkCols);
  const int c_begin = part * all_chunks / kSplit, chunks = (part + 1) * all_chunks / kSplit;
  // Row g of the tile at this lane's 16 bytes; row g + 8 is 8 I bytes further.
  const uint8_t* rows = w2 + (valid ? s : 0) * w2_stride + (h0 + g) * I + 16 * q4;
  const int64_t row8 = 8 * I;
  uint4 w[U], w8[U];
  FragmentRowScales row_scales;  // (the scales are final too)
  if (valid) {
    if constexpr (kRowScales) row_scales.load(scale + s * scale_stride + h0 + g);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c_begin + u < chunks) {
        w[u] = load_streaming(rows + (c_begin + u) * kFp8ChunkCols);
        w8[u] = load_streaming(rows + row8 + (c_begin + u) * kFp8ChunkCols);
      }
    }
    // The warp's 16 rows (contiguous) toward L2, a 128-byte line a lane at a time (the lines
    // loaded above among them).
    const uint8_t* tile = w2 + s * w2_stride + h0 * I;
    if (int64_t(U) * kFp8ChunkCols * kSplit < I) {
      for (int64_t off = int64_t(lane + 32 * part) * 128; off < kMmaRows * I; off += 32 * 128 * kSplit)
        prefetch_l2(tile + off);
    }
  }
  wait_for_previous_kernel();
  float d0 = 0.f, d2 = 0.f;  // column 0 (the token) of rows g and g + 8, on lanes q4 == 0
  if (valid) {
    // The warp's pair's activations as f16 pairs (only this warp reads them).
    uint32_t* x = rows_down_act + int64_t(warp) * (I / 2);
    const float2* a = reinterpret_cast<const float2*>(act + p * I);
    for (int64_t i = c_begin * (kFp8ChunkCols / 2) + lane; i < chunks * (kFp8ChunkCols / 2); i += 32) {
      const float2 v = a[i];
      x[i] = floats_to_half2_saturated(v.x, v.y);
    }
    __syncwarp();
    const int64_t col_blocks = (I + kFp8Block - 1) / kFp8Block;
    const float* row_scale = scale + s * scale_stride + (h0 / kFp8Block) * col_blocks;  // block scales: the tile's
    float acc[4] = {0.f, 0.f, 0.f, 0.f};  // the current 128-column scale block
    for (int c0 = c_begin; c0 < chunks; c0 += U) {
      uint4 nw[U], nw8[U];  // the next batch, in flight during this one's products
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (c0 + U + u < chunks) {
          nw[u] = load_streaming(rows + (c0 + U + u) * kFp8ChunkCols);
          nw8[u] = load_streaming(rows + row8 + (c0 + U + u) * kFp8ChunkCols);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int ch = c0 + u;
        if (ch < chunks) {
          // B column 0 is the pair's activations (lanes g == 0): its 16 values at this lane's columns.
          uint32_t b[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
          if (g == 0) load_b_pairs(x + (ch * kFp8ChunkCols + 16 * q4) / 2, b);
          mma_fp8_tile_chunk(acc, w[u], w8[u], b);
          // The scale block ends after an odd chunk (2 chunks a block) or at the row's end.
          if ((ch & 1) == 1 || ch == chunks - 1) {
            const float sc = kRowScales ? 1.f : __ldg(row_scale + ch / 2);
            d0 = kRowScales ? d0 + acc[0] : fmaf(sc, acc[0], d0);
            d2 = kRowScales ? d2 + acc[2] : fmaf(sc, acc[2], d2);
            acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) w[u] = nw[u], w8[u] = nw8[u];
    }
    if constexpr (kRowScales) {
      d0 *= row_scales.lo;
      d2 *= row_scales.hi;
    }
  }
  if (q4 == 0) {
    const float wk = valid ? weights[warp] : 0.f;
    partial[part][warp][g] = wk * d0;
    partial[part][warp][g + 8] = wk * d2;
  }
  __syncthreads();
  if (threadIdx.x < kMmaRows) {
    const int r = threadIdx.x;
    float sum = 0.f;
    for (int k = 0; k < top_k; ++k) {
#pragma unroll
      for (int q = 0; q < kSplit; ++q) sum += partial[q][k][r];
    }
    if (b2 != nullptr) {
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t sk = slots[k];
        if (sk >= 0 && sk < num_slots) sum = fmaf(weights[k], to_float(b2[sk * b2_stride + h0 + r]), sum);
      }
    }
    out[t * out_stride + h0 + r] = static_cast<scalar_t>(sum);
  }
}

}  // namespace
}  // namespace ft::cuda
