// expert_gemm's decode-sized groups on the CPU (a few tokens an expert: the CPU share of decode, the
// CPU-only strategy, CPU models in decode). A group's product is memory-bound: each weight row is
// read once, dequantized in registers (bf16, FP8, MXFP4, int4) and multiplied with the
// group's tokens at the same time, in float32. In the CPU share's thread on the H200's host ATen's
// bf16 GEMMs read 14 GB/s, and quantized weights went through a float32 copy of the whole expert
// (docs/performance.md, bench_cpu_share.py and bench_cpu_gemv.py).
//
// Rows of all groups are one parallel loop (gate_up), then the activation over all pairs at once,
// then a second parallel loop (down). The row loops are compiled for AVX-512, AVX2 + FMA and the
// baseline, and the first call picks by the CPU's features (not its model name, which a virtual
// machine often hides).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../common/checks.h"
#include "../common/quantized_weights.h"
#include "cpu_kernels.h"
#include "spin_pool.h"

// The row loops are templates and lambdas inlined into one entry that is compiled per instruction
// set: anything left out of line would be compiled for the baseline only.
#define FT_INLINE inline __attribute__((always_inline))
#define FT_LAMBDA_INLINE __attribute__((always_inline))

namespace ft::cpu {
namespace {

constexpr int kLanes = 16;  // values a load takes: one AVX-512 vector, two AVX2 vectors

// Values a row step takes: independent accumulators, so the FMAs do not wait on one another's
// latency, few enough to stay in registers on AVX2.
template <int N>
constexpr int row_step() {
  return N == 1 ? 4 * kLanes : N == 2 ? 2 * kLanes : kLanes;
}

// Bit casts (C++17: torch builds extensions without std::bit_cast on some versions).
FT_INLINE float as_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
FT_INLINE uint32_t as_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

FT_INLINE float bf16_value(uint16_t v) { return as_float(static_cast<uint32_t>(v) << 16); }

// The decoders below build each value's float32 bits with integer operations, choosing between
// candidates with masks, not branches or ternaries: GCC leaves a loop with any control flow in it
// scalar (it would have to speculate a float operation under its default -ftrapping-math), which
// these loops were. Subnormal codes are made as (2^k + m 2^j) - 2^k, with no float32 subnormal on
// the way (a thread that flushes denormals would read one as zero).
FT_INLINE uint32_t pick(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

// float8_e4m3fn: bias 7 (normal: exponent + 120), subnormals m * 2^-9, 0x7F is NaN.
FT_INLINE float e4m3_value(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24, em = v & 0x7Fu;
  const float subnormal = as_float((em << 20) + (121u << 23)) - 0x1p-6f;  // exact for em < 8
  uint32_t bits = pick(em < 8u, as_bits(subnormal), (em << 20) + (120u << 23));
  bits |= pick(em == 0x7Fu, 0x7FC00000u, 0u);
  return as_float(bits | sign);
}

// The same decodes sixteen values at a time in GCC's generic vectors: code the compiler turns into
// AVX-512 instructions (two AVX2 ones, four SSE ones in the other entries) without intrinsics,
// whose target attributes the shared templates could not carry. Sixteen, one 64-byte vector, and
// not twice eight: the row loops load w[0..16) as one AVX-512 vector, and a load that two 32-byte
// stores wrote cannot be forwarded from them (each such load waited for the stores to reach the
// cache).
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16 __attribute__((vector_size(64)));

// Sixteen e4m3 bytes times `scale` into w[0..16), as e4m3_value does them one by one.
FT_INLINE void e4m3_times16(const uint8_t* p, float scale, float* w) {
  // Widened by a plain loop: GCC turns it into vpmovzx, but __builtin_convertvector of bytes into
  // byte-at-a-time moves.
  uint32_t wide[16];
  for (int j = 0; j < 16; ++j) wide[j] = p[j];
  u32x16 v;
  std::memcpy(&v, wide, sizeof v);
  const u32x16 em = v & 0x7Fu, sign = (v & 0x80u) << 24;
  const f32x16 subnormal = (f32x16)((em << 20) + (121u << 23)) - 0x1p-6f;
  const u32x16 is_subnormal = (u32x16)(em < 8u);
  u32x16 bits = ((u32x16)subnormal & is_subnormal) | (((em << 20) + (120u << 23)) & ~is_subnormal);
  bits |= (u32x16)(em == 0x7Fu) & 0x7FC00000u;
  const f32x16 f = (f32x16)(bits | sign) * scale;
  std::memcpy(w, &f, sizeof f);
}

// The instruction set an entry is compiled for (FT_ROWS_ENTRY): the FP8 decoder differs by it.
constexpr int kIsaBaseline = 0, kIsaAvx2 = 1, kIsaAvx512 = 2;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FT_E4M3_THROUGH_F16 1
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

// The same sixteen values through float16, for the AVX2 and AVX-512 entries (F16C): a code's bits
// placed in an f16 (its sign on the sign, its exponent and mantissa bits on the f16's low exponent
// bits and top mantissa bits) are its value times 2^-8 exactly, subnormals included, so one
// hardware conversion, times 2^8 (exact) and then times the scale, gives e4m3_times16's products
// bit for bit in half its vector operations. 0x7F (NaN) gets the f16's all-ones exponent with a
// nonzero mantissa: a NaN. The conversion is vcvtph2ps in assembly ({AT&T|Intel} operand orders):
// GCC 12 converts _Float16 vectors element by element without AVX512-FP16 (4x slower than
// e4m3_times16, measured), and intrinsics cannot be inlined into these loops, which carry no target
// attribute of their own. GCC only: clang checks the operands against its default target.
template <int kIsa>
FT_INLINE void e4m3_times16_f16c(const uint8_t* p, float scale, float* w) {
  uint16_t wide[16];  // a plain loop: vpmovzxbw
  for (int j = 0; j < 16; ++j) wide[j] = p[j];
  u16x16 v;
  std::memcpy(&v, wide, sizeof v);
  const u16x16 em = v & 0x7Fu;
  const u16x16 bits = (em << 7) | ((v & 0x80u) << 8) | ((u16x16)(em == 0x7Fu) & 0x7E00u);
  if constexpr (kIsa == kIsaAvx512) {
    f32x16 f;
    asm("vcvtph2ps {%1, %0|%0, %1}" : "=v"(f) : "v"(bits));
    f = (f * 256.0f) * scale;
    std::memcpy(w, &f, sizeof f);  // one 64-byte store: the row loop's 64-byte load is forwarded from it
  } else {
    u16x8 lo, hi;
    std::memcpy(&lo, &bits, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&bits) + sizeof lo, sizeof hi);
    f32x8 a, b;
    asm("vcvtph2ps {%1, %0|%0, %1}" : "=x"(a) : "x"(lo));
    asm("vcvtph2ps {%1, %0|%0, %1}" : "=x"(b) : "x"(hi));
    a = (a * 256.0f) * scale;
    b = (b * 256.0f) * scale;
    std::memcpy(w, &a, sizeof a);
    std::memcpy(w + 8, &b, sizeof b);
  }
}
#endif

// Sixteen looked-up int8 values as floats times `scale`.
FT_INLINE void int8x16_times(i8x16 v, float scale, float* w) {
  int8_t bytes[16];
  std::memcpy(bytes, &v, sizeof bytes);
  int32_t wide[16];  // a plain loop, as in e4m3_times16
  for (int j = 0; j < 16; ++j) wide[j] = bytes[j];
  i32x16 h;
  std::memcpy(&h, wide, sizeof h);
  const f32x16 f = __builtin_convertvector(h, f32x16) * scale;
  std::memcpy(w, &f, sizeof f);
}

// Sixteen MXFP4 bytes times `scale`: lo[j] the low nibble of byte j (value 2j), hi[j] the high one.
// The e2m1 values doubled are integers, looked up 16 at a time (pshufb on SSSE3 and later).
FT_INLINE void e2m1_times16(const uint8_t* p, float scale, float* lo, float* hi) {
  const i8x16 doubled = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const float half_scale = scale * 0.5f;
#if defined(__GNUC__) && !defined(__clang__)
  u8x16 b;
  std::memcpy(&b, p, sizeof b);
  const i8x16 low = __builtin_shuffle(doubled, (i8x16)(b & 0x0F));
  const i8x16 high = __builtin_shuffle(doubled, (i8x16)(b >> 4));
  int8x16_times(low, half_scale, lo);
  int8x16_times(high, half_scale, hi);
#else  // no variable shuffle of GCC's kind: one lookup a value
  for (int j = 0; j < 16; ++j) {
    lo[j] = static_cast<float>(doubled[p[j] & 0x0F]) * half_scale;
    hi[j] = static_cast<float>(doubled[p[j] >> 4]) * half_scale;
  }
#endif
}

// Sixteen int4 bytes: lo[j] the low nibble's value of byte j (value 2j), hi[j] the high one's, code -
// 8, looked up as e2m1_times16 looks them up (the group's scale is applied to the group's sums).
FT_INLINE void int4_times16(const uint8_t* p, float* lo, float* hi) {
  const i8x16 value = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
#if defined(__GNUC__) && !defined(__clang__)
  u8x16 b;
  std::memcpy(&b, p, sizeof b);
  int8x16_times(__builtin_shuffle(value, (i8x16)(b & 0x0F)), 1.0f, lo);
  int8x16_times(__builtin_shuffle(value, (i8x16)(b >> 4)), 1.0f, hi);
#else
  for (int j = 0; j < 16; ++j) {
    lo[j] = static_cast<float>(value[p[j] & 0x0F]);
    hi[j] = static_cast<float>(value[p[j] >> 4]);
  }
#endif
}

// The e8m0 scales as floats, computed as dequantize_mxfp4_slot computes them.
const std::array<float, 256>& e8m0_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int s = 0; s < 256; ++s) t[s] = std::ldexp(1.0f, s - 127);
    return t;
  }();
  return table;
}

// One matrix of a slot: `rows` rows of `cols` values, row r at data + r * row_bytes.
struct Matrix {
  const uint8_t* data;
  int64_t row_bytes;
  int64_t rows;
  int64_t cols;
  const float* fp8_scale;      // FP8: the slot's scales (128 x 128 blocks, or one a row)
  Fp8ScaleIndex fp8_index;     // where row r's scales lie among them
  const uint8_t* mx_scale;     // MXFP4: the slot's e8m0 scales [rows, cols / 32]
  const float* int4_scale;     // int4: the slot's float32 scales [rows, cols / int4_group]
  int64_t int4_group;
};

// The sum of a step's accumulators: lane-wise vector adds of 16-value pieces, then a halving tree.
// Summed one by one, left to right (the order GCC must keep without -ffast-math), a row's end took
// a scalar add per accumulator: as long as the step loop of a 768-value row.
template <int kStep>
FT_INLINE float sum_of(const float* a) {
  float v[kLanes];
  for (int j = 0; j < kLanes; ++j) v[j] = a[j];
  for (int k = kLanes; k < kStep; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) v[j] += a[k + j];
  }
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) v[j] += v[j + width];
  }
  return v[0];
}

// out[t * ldo + r] = dot(row r, x[t * ldx ...]) for t < N, r in [r0, r1): a row is read once for
// all N tokens. `load(row, c, w)` fills w[0..16) with the row's values c..c+16 (c a multiple of 16),
// `one(row, c)` gives one value of the tail.
template <int N, typename Load, typename One>
FT_INLINE void rows_dot(const Matrix& m, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out,
                        int64_t ldo, Load load, One one) {
  constexpr int kStep = row_step<N>();
  // The hardware's prefetcher alone left these loops waiting on memory (a third of the rate, FP8),
  // and it stops at every 4 KiB page (a bf16 row of 2,048 values is one): each step asks for the two
  // cache lines 32 steps ahead (past a row's end: the next rows'), 4 KiB in flight for one bf16
  // token. 8 steps ahead (1 KiB) held one thread to ~10 GB/s; 32 made one-token bf16 calls 1.2x
  // faster on one thread and 1.08x on 16 (8 experts, the H200's host).
  const int64_t value_bytes = m.row_bytes / std::max<int64_t>(m.cols, 1);
  const int64_t ahead = 32 * kStep * value_bytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = m.data + r * m.row_bytes;
    float acc[N][kStep] = {};
    int64_t c = 0;
    for (; c + kStep <= m.cols; c += kStep) {
      __builtin_prefetch(row + c * value_bytes + ahead);
      __builtin_prefetch(row + c * value_bytes + ahead + 64);
      float w[kStep];
      for (int part = 0; part < kStep; part += kLanes) load(r, row, c + part, w + part);
      for (int t = 0; t < N; ++t) {
        const float* xt = x + t * ldx + c;
        for (int j = 0; j < kStep; ++j) acc[t][j] += w[j] * xt[j];
      }
    }
    for (; c + kLanes <= m.cols; c += kLanes) {
      float w[kLanes];
      load(r, row, c, w);
      for (int t = 0; t < N; ++t) {
        const float* xt = x + t * ldx + c;
        for (int j = 0; j < kLanes; ++j) acc[t][j] += w[j] * xt[j];
      }
    }
    for (int t = 0; t < N; ++t) {
      float sum = sum_of<kStep>(acc[t]);
      for (int64_t cc = c; cc < m.cols; ++cc) sum += one(r, row, cc) * x[t * ldx + cc];
      out[t * ldo + r] = sum;
    }
  }
}

template <int N, typename Value>
FT_INLINE void dense_rows(const Matrix& m, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out,
                          int64_t ldo, Value value) {
  rows_dot<N>(
      m, r0, r1, x, ldx, out, ldo,
      [&](int64_t, const uint8_t* row, int64_t c, float* w) FT_LAMBDA_INLINE {
        const auto* p = reinterpret_cast<const uint16_t*>(row) + c;
        for (int j = 0; j < kLanes; ++j) w[j] = value(p[j]);
      },
      [&](int64_t, const uint8_t* row, int64_t c) FT_LAMBDA_INLINE { return value(reinterpret_cast<const uint16_t*>(row)[c]); });
}

template <int N, int kIsa>
FT_INLINE void fp8_rows(const Matrix& m, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out,
                        int64_t ldo) {
  // The row's scales, found once a row (fp8_scale_row divides; per 16 values it cost more than the
  // decoding); a column's is block (c / 128) * step of them (step 0: one scale a row).
  const int64_t step = m.fp8_index.col_step();
  int64_t scale_r = -1;
  const float* srow = nullptr;
  const auto scales_of = [&](int64_t r) FT_LAMBDA_INLINE {
    if (r != scale_r) {
      scale_r = r;
      srow = m.fp8_scale + m.fp8_index.row(r);
    }
    return srow;
  };
  rows_dot<N>(
      m, r0, r1, x, ldx, out, ldo,
      [&](int64_t r, const uint8_t* row, int64_t c, float* w) FT_LAMBDA_INLINE {
        const float s = scales_of(r)[c / kFp8Block * step];  // 16 values never straddle a 128 block
#ifdef FT_E4M3_THROUGH_F16
        if constexpr (kIsa != kIsaBaseline) {
          e4m3_times16_f16c<kIsa>(row + c, s, w);
        } else {
          e4m3_times16(row + c, s, w);
        }
#else
        e4m3_times16(row + c, s, w);
#endif
      },
      [&](int64_t r, const uint8_t* row, int64_t c) FT_LAMBDA_INLINE { return e4m3_value(row[c]) * scales_of(r)[c / kFp8Block * step]; });
}

// MXFP4 and int4 (kInt4): byte j of a row holds values 2j (low nibble) and 2j + 1; x comes with its
// even values first and its odd values after them (x[t * ldx + j] is value 2j, x[t * ldx + cols / 2 +
// j] value 2j + 1), so both nibbles of 16 bytes meet 16 consecutive x values. 16 bytes lie in one
// scale group (MXFP4's 32 values; int4's multiple of 32).
template <int N, bool kInt4>
FT_INLINE void packed_rows(const Matrix& m, int64_t r0, int64_t r1, const float* x, int64_t ldx, float* out,
                           int64_t ldo) {
  const auto& scales = e8m0_values();
  constexpr int kStep = row_step<N>();  // bytes a step takes
  const int64_t half = m.cols / 2;
  const int64_t group_bytes = kInt4 ? m.int4_group / 2 : kMxfp4Group / 2;
  const int64_t groups = half / group_bytes;
  // A 16-byte step's scale, byte / group_bytes: a shift where group_bytes is a power of two (every
  // int4 group in use: 32, 64, 128 values), the 64-bit division otherwise (it cost int4 rows 15 %
  // of their time against MXFP4's, whose group is one step).
  const bool group_pow2 = (group_bytes & (group_bytes - 1)) == 0;
  const int group_shift = __builtin_ctzll(static_cast<unsigned long long>(group_bytes));
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = m.data + r * m.row_bytes;
    const uint8_t* srow = kInt4 ? nullptr : m.mx_scale + r * groups;
    const float* frow = kInt4 ? m.int4_scale + r * groups : nullptr;
    float acc[N][kStep] = {};
    // Bytes [b, b + len) (whole groups) decoded, then multiplied as rows_dot multiplies: the same
    // loop shape, which GCC vectorizes.
    // A group's products are summed unscaled (the doubled e2m1 values and the int4 values are
    // small integers) and scaled once: one multiply-add for the scale, where scaling both halves
    // first took two.
    const auto step = [&](int64_t b, auto len_constant) FT_LAMBDA_INLINE {
      constexpr int kLen = decltype(len_constant)::value;
      float lo[kLen], hi[kLen], scale[kLen / kLanes];
      for (int u = 0; u < kLen; u += kLanes) {
        if constexpr (kInt4) {
          int4_times16(row + b + u, lo + u, hi + u);
          scale[u / kLanes] = frow[group_pow2 ? (b + u) >> group_shift : (b + u) / group_bytes];
        } else {
          e2m1_times16(row + b + u, 2.0f, lo + u, hi + u);  // times 2 / 2: the doubled values
          scale[u / kLanes] = scales[srow[(b + u) / kLanes]] * 0.5f;
        }
      }
      for (int t = 0; t < N; ++t) {
        const float* xe = x + t * ldx + b;
        const float* xo = xe + half;
        for (int u = 0; u < kLen; u += kLanes) {
          for (int j = 0; j < kLanes; ++j) {
            const float dot = lo[u + j] * xe[u + j] + hi[u + j] * xo[u + j];
            acc[t][u + j] += scale[u / kLanes] * dot;
          }
        }
      }
    };
    int64_t b = 0;
    for (; b + kStep <= half; b += kStep) {
      __builtin_prefetch(row + b + 8 * kStep);  // as rows_dot: 8 steps ahead
      step(b, std::integral_constant<int, kStep>{});
    }
    for (; b < half; b += kLanes) step(b, std::integral_constant<int, kLanes>{});  // 16 bytes at a time
    for (int t = 0; t < N; ++t) {
      float sum = sum_of<kStep>(acc[t]);
      out[t * ldo + r] = sum;
    }
  }
}

enum class RowFormat { kBf16, kFp8, kMxfp4, kInt4 };

template <int N, int kIsa>
FT_INLINE void format_rows(RowFormat f, const Matrix& m, int64_t r0, int64_t r1, const float* x, int64_t ldx,
                           float* out, int64_t ldo) {
  switch (f) {
    case RowFormat::kBf16:
      return dense_rows<N>(m, r0, r1, x, ldx, out, ldo, [](uint16_t v) FT_LAMBDA_INLINE { return bf16_value(v); });
    case RowFormat::kFp8:
      return fp8_rows<N, kIsa>(m, r0, r1, x, ldx, out, ldo);
    case RowFormat::kMxfp4:
      return packed_rows<N, false>(m, r0, r1, x, ldx, out, ldo);
    case RowFormat::kInt4:
      return packed_rows<N, true>(m, r0, r1, x, ldx, out, ldo);
  }
}

template <int N, int kIsa>
FT_INLINE void rows_any(int format, const void* matrix, int64_t r0, int64_t r1, const float* x, int64_t ldx,
                        float* out, int64_t ldo) {
  format_rows<N, kIsa>(static_cast<RowFormat>(format), *static_cast<const Matrix*>(matrix), r0, r1, x, ldx, out, ldo);
}

using RowsFn = void (*)(int, int, const void*, int64_t, int64_t, const float*, int64_t, float*, int64_t);

// One entry per instruction set; every template above is inlined into it, so it is compiled for it.
#define FT_ROWS_ENTRY(name, attributes, kIsa)                                                                 \
  attributes void name(int format, int tokens, const void* matrix, int64_t r0, int64_t r1, const float* x, \
                       int64_t ldx, float* out, int64_t ldo) {                                            \
    switch (tokens) {                                                                                     \
      case 1: return rows_any<1, kIsa>(format, matrix, r0, r1, x, ldx, out, ldo);                         \
      case 2: return rows_any<2, kIsa>(format, matrix, r0, r1, x, ldx, out, ldo);                         \
      case 3: return rows_any<3, kIsa>(format, matrix, r0, r1, x, ldx, out, ldo);                         \
      default: return rows_any<4, kIsa>(format, matrix, r0, r1, x, ldx, out, ldo);                        \
    }                                                                                                     \
  }

FT_ROWS_ENTRY(rows_baseline, , kIsaBaseline)
#if defined(__x86_64__) && defined(__GNUC__)
FT_ROWS_ENTRY(rows_avx2, __attribute__((target("avx2,fma,f16c"))), kIsaAvx2)
FT_ROWS_ENTRY(rows_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), kIsaAvx512)
#endif

RowsFn pick_rows() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
#ifdef __clang__
  const bool f16c = true;  // clang 14 knows no "f16c" here; every AVX2 CPU has it (the FP8 use is GCC-only)
#else
  const bool f16c = __builtin_cpu_supports("f16c");
#endif
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return rows_avx512;  // every feature its target string names
  }
  if (avx2) return rows_avx2;
#endif
  return rows_baseline;
}

void expert_gemv_rows(int format, int tokens, const void* matrix, int64_t r0, int64_t r1, const float* x,
                      int64_t ldx, float* out, int64_t ldo) {
  static const RowsFn rows = pick_rows();
  rows(format, tokens, matrix, r0, r1, x, ldx, out, ldo);
}

// The layout of x an MXFP4 or int4 matrix reads: each row's even values, then its odd values.
at::Tensor split_even_odd(const at::Tensor& x) {
  return at::cat({x.slice(1, 0, x.size(1), 2), x.slice(1, 1, x.size(1), 2)}, 1).contiguous();
}

}  // namespace

bool expert_gemv_supports(const at::Tensor& w13, const at::Tensor& w2, WeightFormat format) {
  if (format == WeightFormat::kDense && w13.scalar_type() != at::kBFloat16) {
    // float32 keeps ATen's GEMMs (a float32 model computes its own modules' values), and so does
    // float16: GCC does not vectorize a float16 conversion here, and ATen's GEMM was faster.
    return false;
  }
  return w13.stride(2) == 1 && w2.stride(2) == 1;
}

void expert_gemv(const at::Tensor& hidden, const at::Tensor& token_of, const at::Tensor& weight_of,
                 const std::vector<ExpertGroup>& groups, WeightFormat format, const at::Tensor& w13,
                 const at::Tensor& w2, const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                 const c10::optional<at::Tensor>& w13_scale, const c10::optional<at::Tensor>& w2_scale,
                 int64_t intermediate, const ActivationParams& act, at::Tensor& y, SpinPool* pool) {
  if (groups.empty()) return;
  const int64_t hidden_size = hidden.size(1);
  const int64_t parts13 = act.gated ? 2 : 1;  // ungated experts: w13 holds the up rows alone
  const RowFormat row_format = is_fp8(format)                   ? RowFormat::kFp8
                               : format == WeightFormat::kMxfp4 ? RowFormat::kMxfp4
                               : format == WeightFormat::kInt4  ? RowFormat::kInt4
                                                                : RowFormat::kBf16;
  const bool packed = is_packed(format);
  // The groups' pairs packed in group order: pair q of the pack is pair order index pack[q].
  std::vector<int64_t> pack, first(groups.size() + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(groups[g].end - groups[g].begin <= kExpertGemvMaxTokens, "expert_gemv: a group of ",
                groups[g].end - groups[g].begin, " pairs (at most ", kExpertGemvMaxTokens, ")");
    for (int64_t p = groups[g].begin; p < groups[g].end; ++p) pack.push_back(p);
    first[g + 1] = static_cast<int64_t>(pack.size());
  }
  const auto pack_index = at::from_blob(pack.data(), {static_cast<int64_t>(pack.size())}, at::kLong).clone();
  auto x = hidden.index_select(0, token_of.index_select(0, pack_index)).to(at::kFloat).contiguous();
  if (packed) x = split_even_odd(x);

  const auto matrix = [&](const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t slot, int64_t parts) {
    Matrix m{};
    m.data = static_cast<const uint8_t*>(w.data_ptr()) + slot * w.stride(0) * w.element_size();
    m.row_bytes = w.stride(1) * w.element_size();
    m.rows = w.size(1);
    m.cols = packed ? 2 * w.size(2) : w.size(2);
    if (row_format == RowFormat::kFp8) {
      m.fp8_scale = scale->data_ptr<float>() + slot * scale->stride(0);
      m.fp8_index = fp8_scale_index(w, *scale, parts);
    } else if (row_format == RowFormat::kMxfp4) {
      m.mx_scale = scale->data_ptr<uint8_t>() + slot * scale->stride(0);
    } else if (row_format == RowFormat::kInt4) {
      m.int4_scale = scale->data_ptr<float>() + slot * scale->stride(0);
      m.int4_group = m.cols / scale->size(2);
    }
    return m;
  };
  // Rows of every group in one loop: item i is row i % rows of group i / rows.
  const auto for_rows = [&](int64_t rows, int64_t row_bytes, auto&& body) {
    const auto chunk = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end;) {
        const int64_t g = i / rows, r0 = i % rows, r1 = std::min(rows, r0 + (end - i));
        body(g, r0, r1);
        i += r1 - r0;
      }
    };
    const int64_t items = static_cast<int64_t>(groups.size()) * rows;
    if (pool != nullptr) {
      // About four chunks a thread (at least 16 rows): enough to even out threads that start late,
      // few enough that claiming them costs little against the rows.
      pool->parallel_for(items, std::max<int64_t>(16, items / (4 * pool->threads())), chunk);
    } else {
      // At least 64 KiB of weights a task: a parallel region costs a wake-up of ATen's threads, and
      // waits out a descheduled one on a busy machine (a tiny model's decode ran 20x slower on two
      // cores with one taken by another process), so small products run on the caller alone.
      at::parallel_for(0, items, std::max<int64_t>(16, (64 << 10) / std::max<int64_t>(1, row_bytes)), chunk);
    }
  };

  // out[q] = w[slot of q's group] @ in[q] for every packed pair q (in, out float32, rows in pack order).
  const auto product = [&](const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t parts,
                           const at::Tensor& in, int64_t rows) {
    auto out = at::empty({in.size(0), rows}, in.options());
    const float* ind = in.data_ptr<float>();
    float* od = out.data_ptr<float>();
    for_rows(rows, w.stride(1) * w.element_size(), [&](int64_t g, int64_t r0, int64_t r1) {
      const Matrix m = matrix(w, scale, groups[g].slot, parts);
      expert_gemv_rows(static_cast<int>(row_format), static_cast<int>(first[g + 1] - first[g]), &m, r0, r1,
                       ind + first[g] * in.size(1), in.size(1), od + first[g] * rows, rows);
    });
    return out;
  };

  auto h = product(w13, w13_scale, parts13, x, parts13 * intermediate);
  std::vector<int64_t> slot_of_pack(pack.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int64_t q = first[g]; q < first[g + 1]; ++q) slot_of_pack[q] = groups[g].slot;
  }
  const auto slots = at::from_blob(slot_of_pack.data(), {static_cast<int64_t>(pack.size())}, at::kLong).clone();
  if (b13.has_value()) h.add_(b13->index_select(0, slots).to(at::kFloat));
  // The activation stays float32 between the products, as in the device's decode kernels: the CPU
  // share's pairs and the device's pairs of one token are computed alike.
  auto a = activate_gate_up(h, intermediate, act).contiguous();
  if (packed) a = split_even_odd(a);
  auto out = product(w2, w2_scale, 1, a, hidden_size);
  if (b2.has_value()) out.add_(b2->index_select(0, slots).to(at::kFloat));
  out.mul_(weight_of.index_select(0, pack_index).unsqueeze(1));
  y.index_copy_(0, pack_index, out);
}

}  // namespace ft::cpu
