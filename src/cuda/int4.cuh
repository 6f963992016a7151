// int4 values on the device (src/common/int4_format.h): 4-bit codes c holding the integer c - 8.
#pragma once

#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <cuda_fp16.h>

#include <cstdint>

namespace ft::cuda {

// Where a row's scale of its 32-value group j lies: j / (G / 32). The divisor is known only at run
// time, and a 64-bit `/` by it is a called routine of dozens of instructions, which the decode
// kernels paid for every group (int4 decode took over 4x its HBM floor with it). IntDivider's
// multiply-high and shift take three; j (a row's groups) is below 2^31.
using GroupsPerScale = at::cuda::detail::IntDivider<unsigned int>;

// The word w's 8 codes (code n in bits 4n..4n+3) as 4 f16x2 in e2m1x8_as_half2x4's order (mxfp4.cuh):
// h[k] holds codes 3 - k (low half) and 7 - k (high half), each as the f16 value code - 8, exactly.
// A code placed in the mantissa of the f16 1024 is 1024 + code (the f16's unit at 1024 is 1); one
// subtraction of 1032 leaves code - 8.
__device__ __forceinline__ void int4x8_as_half2x4(uint32_t w, uint32_t (&h)[4]) {
  const __half2 bias = __halves2half2(__ushort_as_half(0x6408u), __ushort_as_half(0x6408u));  // 1032
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t biased = ((w >> (4 * (3 - k))) & 0x000F000Fu) | 0x64006400u;
    const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&biased), bias);
    h[k] = *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The 32 values of one 16-byte load (column c in byte c / 2, the low nibble first) as floats, code -
// 8, in column order.
__device__ __forceinline__ void int4x32_to_float(const uint4& v, float (&out)[32]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t pairs[4];
    int4x8_as_half2x4(w[i], pairs);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pairs[k]));
      out[8 * i + 3 - k] = f.x;
      out[8 * i + 7 - k] = f.y;
    }
  }
}

}  // namespace ft::cuda
