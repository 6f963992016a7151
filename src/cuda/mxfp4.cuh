// MXFP4 values on the device (src/common/mxfp4_format.h): e2m1 codes and e8m0 scales to float32,
// exactly. The build flushes float32 subnormals (--use_fast_math): dequantize_experts multiplies with
// mul_keep_subnormals to equal the CPU bit for bit; the GEMM kernels' products below 2^-126 flush,
// far below their rounding.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace ft::cuda {

// The e2m1 code's value (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa): exponent e > 0
// is the float 2^(e-1) (1 + m/2), built from its bits; e = 0 is 0 or 0.5. No subnormal on the way.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float magnitude = e != 0u ? __uint_as_float(((e + 126u) << 23) | (m << 22)) : 0.5f * static_cast<float>(m);
  return (code & 8u) != 0u ? -magnitude : magnitude;
}

// 2^(s - 127); s = 0 is the subnormal 2^-127, s = 255 infinity (as the CPU kernels' ldexp; the OCP
// format reserves 255 for NaN, which no checkpoint stores for a weight).
__device__ __forceinline__ float e8m0_to_float(uint32_t s) {
  return s != 0u ? __uint_as_float(s << 23) : __uint_as_float(0x00400000u);
}

// a * b rounded to nearest without flushing subnormal operands or results (mul.rn.f32 has no .ftz),
// so a dequantized value equals the CPU's a * b in float32 even under --use_fast_math.
__device__ __forceinline__ float mul_keep_subnormals(float a, float b) {
  float d;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// e2m1x8_as_half2x4 yields values times 2^-14; a sum of such products is multiplied back once.
constexpr float kE2m1HalfScale = 16384.f;

// The word w's 8 codes (code n in bits 4n..4n+3) as 4 f16x2, h[k] holding codes 3 - k (low half)
// and 7 - k (high half), each its e2m1 value times 2^-14, exactly: a code's sign bit lands on the
// f16 sign, its exponent and mantissa bits on the f16's two low exponent bits and top mantissa bit
// (so code 1, 0.5, becomes the f16 subnormal 2^-15, and code 7, 6, is 1.5 x 2^-12); an f16's low
// byte is 0. Eleven instructions (a shift and two masks for each k took fifteen): the high bytes
// of the bytes' low codes (`low`) and of their high codes (`high`) are built four at a time, and
// one byte permute places a pair's two high bytes (selector 4 picks the zero operand).
__device__ __forceinline__ void e2m1x8_as_half2x4(uint32_t w, uint32_t (&h)[4]) {
  const uint32_t low = ((w << 4) & 0x80808080u) | ((w << 1) & 0x0E0E0E0Eu);
  const uint32_t high = (w & 0x80808080u) | ((w >> 3) & 0x0E0E0E0Eu);
  h[0] = __byte_perm(high, 0u, 0x3414);  // codes 3, 7
  h[1] = __byte_perm(low, 0u, 0x3414);   // codes 2, 6
  h[2] = __byte_perm(high, 0u, 0x2404);  // codes 1, 5
  h[3] = __byte_perm(low, 0u, 0x2404);   // codes 0, 4
}

// The 32 values of one 16-byte load (column c in byte c / 2, the low nibble first) as floats times
// 2^-14, in column order.
__device__ __forceinline__ void e2m1x32_to_float_scaled(const uint4& v, float (&out)[32]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t pairs[4];
    e2m1x8_as_half2x4(w[i], pairs);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pairs[k]));
      out[8 * i + 3 - k] = f.x;
      out[8 * i + 7 - k] = f.y;
    }
  }
}

}  // namespace ft::cuda
