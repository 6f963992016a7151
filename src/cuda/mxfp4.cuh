// MXFP4 values on the device (src/common/mxfp4_format.h): e2m1 codes and e8m0 scales to float32,
// exactly, whatever the compiler's flush-to-zero setting (the build uses --use_fast_math).
#pragma once

#include <cstdint>

namespace ft::cuda {

// The e2m1 code's value (bit 3 sign, bits 2-1 exponent with bias 1, bit 0 mantissa): exponent e > 0
// is the float 2^(e-1) (1 + m/2), built from its bits; e = 0 is 0 or 0.5. No subnormal on the way.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float magnitude = e != 0u ? __uint_as_float(((e + 126u) << 23) | (m << 22)) : 0.5f * static_cast<float>(m);
  return (code & 8u) != 0u ? -magnitude : magnitude;
}

// 2^(s - 127); s = 0 is the subnormal 2^-127, s = 255 infinity (as the CPU kernels' ldexp).
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

// The 32 values of one 16-byte load (16 bytes, the low nibble first) as floats, unscaled.
__device__ __forceinline__ void e2m1x32_to_float(const uint4& v, float (&out)[32]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int n = 0; n < 8; ++n) out[8 * i + n] = e2m1_to_float((w[i] >> (4 * n)) & 0xfu);
  }
}

}  // namespace ft::cuda
