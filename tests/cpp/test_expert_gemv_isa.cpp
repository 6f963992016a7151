// The CPU decode kernel's row loops (src/cpu/expert_gemv.cpp) are compiled once per instruction set
// (baseline, AVX2 + FMA, AVX-512) and a call takes the best one the CPU has, so on any one machine
// the others never run in the Python tests. This test includes the source and runs every entry the
// CPU can execute on the same rows against a float64 reference decoded value by value: each
// format, 1 to 4 tokens, rows with tails after the last whole step.
#include "cpu/expert_gemv.cpp"  // the entries live in its anonymous namespace

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace ft::cpu {
namespace {

struct Entry {
  std::string name;
  RowsFn fn;
};

std::vector<Entry> runnable_entries() {
  std::vector<Entry> out{{"baseline", rows_baseline}};
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2) out.push_back({"avx2", rows_avx2});
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    out.push_back({"avx512", rows_avx512});
  }
#endif
  return out;
}

// One matrix of random values in a format, with the value of each element in float64.
struct Rows {
  RowFormat format;
  int64_t rows, cols;
  std::vector<uint8_t> data;
  std::vector<float> fp8_scale;
  std::vector<uint8_t> mx_scale;
  std::vector<float> int4_scale;
  int64_t group = 0;  // int4
  Matrix m{};

  double value(int64_t r, int64_t c) const {
    switch (format) {
      case RowFormat::kBf16: {
        uint16_t v;
        std::memcpy(&v, data.data() + (r * cols + c) * 2, 2);
        return bf16_value(v);
      }
      case RowFormat::kFp8:
        return double(e4m3_value(data[r * cols + c])) *
               fp8_scale[(r / kFp8Block) * ceil_div(cols, kFp8Block) + c / kFp8Block];
      case RowFormat::kMxfp4: {
        static const double e2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
        const uint8_t byte = data[r * (cols / 2) + c / 2];
        return e2m1[(c & 1) != 0 ? byte >> 4 : byte & 0xF] * std::ldexp(1.0, mx_scale[r * (cols / 32) + c / 32] - 127);
      }
      case RowFormat::kInt4: {
        const uint8_t byte = data[r * (cols / 2) + c / 2];
        const int code = (c & 1) != 0 ? byte >> 4 : byte & 0xF;
        return double(code - 8) * int4_scale[r * (cols / group) + c / group];
      }
    }
    return 0.0;
  }
};

Rows random_rows(RowFormat format, int64_t rows, int64_t cols, std::mt19937& gen, int64_t group = 0) {
  Rows w{format, rows, cols};
  w.group = group;
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.f, 1.f);
  if (format == RowFormat::kBf16) {
    w.data.resize(rows * cols * 2);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float f = normal(gen);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t v = static_cast<uint16_t>(bits >> 16);
      std::memcpy(w.data.data() + 2 * i, &v, 2);
    }
    w.m.row_bytes = cols * 2;
  } else if (format == RowFormat::kFp8) {
    w.data.resize(rows * cols);
    for (auto& b : w.data) {
      do b = static_cast<uint8_t>(byte(gen));
      while ((b & 0x7F) == 0x7F);  // NaN codes: the exact-decode Python test covers them
    }
    w.fp8_scale.resize(ceil_div(rows, kFp8Block) * ceil_div(cols, kFp8Block));
    for (auto& s : w.fp8_scale) s = std::ldexp(1.f + 0.5f * normal(gen) * normal(gen), -8);
    w.m.row_bytes = cols;
    w.m.fp8_scale = w.fp8_scale.data();
    w.m.fp8_index = {rows, ceil_div(cols, kFp8Block)};  // block scales, one projection
  } else if (format == RowFormat::kInt4) {
    w.data.resize(rows * cols / 2);
    for (auto& b : w.data) b = static_cast<uint8_t>(byte(gen));
    w.int4_scale.resize(rows * cols / group);
    for (auto& s : w.int4_scale) s = 0.01f * (1.f + std::fabs(normal(gen)));
    w.m.row_bytes = cols / 2;
    w.m.int4_scale = w.int4_scale.data();
    w.m.int4_group = group;
  } else {
    w.data.resize(rows * cols / 2);
    for (auto& b : w.data) b = static_cast<uint8_t>(byte(gen));
    w.mx_scale.resize(rows * cols / 32);
    for (auto& s : w.mx_scale) s = static_cast<uint8_t>(118 + byte(gen) % 12);
    w.m.row_bytes = cols / 2;
    w.m.mx_scale = w.mx_scale.data();
  }
  w.m.data = w.data.data();
  w.m.rows = rows;
  w.m.cols = cols;
  return w;
}

void check(RowFormat format, int64_t rows, int64_t cols, const char* what, int64_t group = 0) {
  std::mt19937 gen(static_cast<unsigned>(rows * 131 + cols * 7 + static_cast<int>(format)));
  const Rows w = random_rows(format, rows, cols, gen, group);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int tokens = 1; tokens <= 4; ++tokens) {
    // x in the layout the format reads: MXFP4 and int4 take each token's even values, then its odd ones.
    const int64_t ldx = cols + 3;
    std::vector<float> x(tokens * ldx);
    for (auto& v : x) v = normal(gen);
    const auto x_at = [&](int t, int64_t c) {
      const bool packed = format == RowFormat::kMxfp4 || format == RowFormat::kInt4;
      return packed ? x[t * ldx + (c % 2 == 0 ? c / 2 : cols / 2 + c / 2)] : x[t * ldx + c];
    };
    const int64_t r0 = 1, r1 = rows;  // not from row 0: the loops take any row range
    for (const Entry& e : runnable_entries()) {
      const int64_t ldo = rows + 1;
      std::vector<float> out(tokens * ldo, std::nanf(""));
      e.fn(static_cast<int>(format), tokens, &w.m, r0, r1, x.data(), ldx, out.data(), ldo);
      for (int t = 0; t < tokens; ++t) {
        for (int64_t r = r0; r < r1; ++r) {
          double want = 0.0, magnitude = 0.0;
          for (int64_t c = 0; c < cols; ++c) {
            const double p = w.value(r, c) * x_at(t, c);
            want += p;
            magnitude += std::fabs(p);
          }
          ASSERT_NEAR(out[t * ldo + r], want, 1e-5 * magnitude + 1e-30)
              << what << ", entry " << e.name << ", tokens " << tokens << ", token " << t << ", row " << r;
        }
        ASSERT_TRUE(std::isnan(out[t * ldo + 0])) << e.name << " wrote outside its rows";
      }
    }
  }
}

TEST(ExpertGemvEntries, EveryEntryMatchesTheReference) {
  ASSERT_FALSE(runnable_entries().empty());
  check(RowFormat::kBf16, 9, 2048 + 16 + 5, "bf16 with a 16-value piece and a tail");
  check(RowFormat::kBf16, 5, 7, "bf16 shorter than a piece");
  check(RowFormat::kFp8, 9, 768 + 48 + 3, "fp8 over partial 128-column blocks and a tail");
  check(RowFormat::kFp8, 130, 64, "fp8 rows across two 128-row blocks");
  check(RowFormat::kMxfp4, 9, 2880, "mxfp4 at GPT-OSS's width (a partial step of groups)");
  check(RowFormat::kMxfp4, 5, 32, "mxfp4 of one group");
  check(RowFormat::kInt4, 9, 2048 + 32, "int4 in groups of 32 (a partial step)", 32);
  check(RowFormat::kInt4, 5, 768, "int4 in groups of 128", 128);
  check(RowFormat::kInt4, 3, 64, "int4, one group a row", 64);
}

}  // namespace
}  // namespace ft::cpu
