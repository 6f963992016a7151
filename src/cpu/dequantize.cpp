// CPU kernel of dequantize_experts, and the row dequantization (FP8 with block or row scales, MXFP4,
// int4) the CPU expert_gemm uses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "../common/checks.h"
#include "../common/quantized_weights.h"
#include "cpu_kernels.h"

namespace ft::cpu {
namespace {

// Every e4m3 bit pattern as a float: a table read is cheaper than the conversion.
const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

// FP8 rows [row_begin, row_end) of one slot, each value times the scale `index` gives it.
template <typename out_t>
void dequantize_rows(const uint8_t* w, const float* scale, Fp8ScaleIndex index, int64_t cols, int64_t row_begin,
                     int64_t row_end, out_t* out) {
  const auto& values = e4m3_values();
  const int64_t blocks = ceil_div(cols, kFp8Block), step = index.col_step();
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* srow = scale + index.row(r);
    const uint8_t* in = w + r * cols;
    out_t* o = out + r * cols;
    for (int64_t b = 0; b < blocks; ++b) {
      const float s = srow[b * step];
      const int64_t end = std::min(cols, (b + 1) * kFp8Block);
      for (int64_t c = b * kFp8Block; c < end; ++c) o[c] = static_cast<out_t>(values[in[c]] * s);
    }
  }
}

// MXFP4 rows [row_begin, row_end) of one slot: a byte holds two e2m1 values (low nibble first), each
// group of 32 values shares an e8m0 scale.
template <typename out_t>
void dequantize_mxfp4_rows(const uint8_t* w, const uint8_t* scale, int64_t cols, int64_t row_begin,
                           int64_t row_end, out_t* out) {
  const int64_t half = cols / 2, groups = cols / kMxfp4Group;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      // The group's 16 possible values, each the product and conversion the value itself would
      // take; the group's 32 values are then two table reads a byte.
      const float f = std::ldexp(1.0f, static_cast<int>(scale[r * groups + g]) - 127);
      out_t value_of[16];
      for (uint32_t code = 0; code < 16; ++code) value_of[code] = static_cast<out_t>(e2m1_value(code) * f);
      const uint8_t* bytes = w + r * half + g * (kMxfp4Group / 2);
      out_t* o = out + r * cols + g * kMxfp4Group;
      for (int64_t j = 0; j < kMxfp4Group / 2; ++j) {
        o[2 * j] = value_of[bytes[j] & 0x0F];
        o[2 * j + 1] = value_of[bytes[j] >> 4];
      }
    }
  }
}

// int4 rows [row_begin, row_end) of one slot: a byte holds two codes (low nibble first), value code -
// 8, each group of `group` values sharing a float32 scale.
template <typename out_t>
void dequantize_int4_rows(const uint8_t* w, const float* scale, int64_t cols, int64_t group, int64_t row_begin,
                          int64_t row_end, out_t* out) {
  const int64_t half = cols / 2, groups = cols / group;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      // The group's 16 possible values, each the product (exact in float32) and conversion the
      // value itself would take.
      const float f = scale[r * groups + g];
      out_t value_of[16];
      for (uint32_t code = 0; code < 16; ++code) value_of[code] = static_cast<out_t>(int4_value(code) * f);
      const uint8_t* bytes = w + r * half + g * (group / 2);
      out_t* o = out + r * cols + g * group;
      for (int64_t j = 0; j < group / 2; ++j) {
        o[2 * j] = value_of[bytes[j] & 0x0F];
        o[2 * j + 1] = value_of[bytes[j] >> 4];
      }
    }
  }
}

}  // namespace

at::Tensor dequantize_int4_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, at::ScalarType dtype) {
  const int64_t rows = weight.size(1), cols = 2 * weight.size(2), group = cols / scale.size(2);
  auto out = at::empty({rows, cols}, weight.options().dtype(dtype));
  const auto* w = weight.data_ptr<uint8_t>() + slot * weight.stride(0);
  const float* s = scale.data_ptr<float>() + slot * scale.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_int4_slot", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      dequantize_int4_rows(w, s, cols, group, begin, end, o);
    });
  });
  return out;
}

at::Tensor dequantize_mxfp4_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, at::ScalarType dtype) {
  const int64_t rows = weight.size(1), cols = 2 * weight.size(2);
  auto out = at::empty({rows, cols}, weight.options().dtype(dtype));
  const auto* w = weight.data_ptr<uint8_t>() + slot * weight.stride(0);
  const auto* s = scale.data_ptr<uint8_t>() + slot * scale.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_mxfp4_slot", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) { dequantize_mxfp4_rows(w, s, cols, begin, end, o); });
  });
  return out;
}

at::Tensor dequantize_fp8_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, int64_t parts,
                               at::ScalarType dtype) {
  const int64_t rows = weight.size(1), cols = weight.size(2);
  auto out = at::empty({rows, cols}, weight.options().dtype(dtype));
  const auto* w = reinterpret_cast<const uint8_t*>(weight.data_ptr()) + slot * weight.stride(0);
  const float* s = scale.data_ptr<float>() + slot * scale.stride(0);
  const Fp8ScaleIndex index = fp8_scale_index(weight, scale, parts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_fp8_slot", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      dequantize_rows(w, s, index, cols, begin, end, o);
    });
  });
  return out;
}

at::Tensor dequantize_experts(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& slots,
                              int64_t parts, at::ScalarType dtype) {
  const WeightFormat format = check_dequantize_inputs(weight, scale, slots, parts, dtype);
  const bool mxfp4 = format == WeightFormat::kMxfp4, int4 = format == WeightFormat::kInt4;
  const auto ids = slots.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), rows = weight.size(1), num_slots = weight.size(0);
  const int64_t cols = is_packed(format) ? 2 * weight.size(2) : weight.size(2);
  const int64_t* slot = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= -1 && slot[i] < num_slots, "slots[", i, "] is ", slot[i], ", outside [-1, ", num_slots,
                "); -1 marks a row left unwritten");
  }
  auto out = at::empty({n, rows, cols}, weight.options().dtype(dtype));
  const Fp8ScaleIndex index = is_packed(format) ? Fp8ScaleIndex{} : fp8_scale_index(weight, scale, parts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_experts", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, n * rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end;) {
        const int64_t i = item / rows, r0 = item % rows, r1 = std::min(rows, r0 + (end - item));
        if (slot[i] >= 0) {
          const auto* w = reinterpret_cast<const uint8_t*>(weight.data_ptr()) + slot[i] * weight.stride(0);
          if (mxfp4) {
            dequantize_mxfp4_rows(w, scale.data_ptr<uint8_t>() + slot[i] * scale.stride(0), cols, r0, r1,
                                  o + i * rows * cols);
          } else if (int4) {
            dequantize_int4_rows(w, scale.data_ptr<float>() + slot[i] * scale.stride(0), cols,
                                 cols / scale.size(2), r0, r1, o + i * rows * cols);
          } else {
            dequantize_rows(w, scale.data_ptr<float>() + slot[i] * scale.stride(0), index, cols, r0, r1,
                            o + i * rows * cols);
          }
        }
        item += r1 - r0;
      }
    });
  });
  return out;
}

TORCH_LIBRARY_IMPL(freetoken, CPU, m) { m.impl("dequantize_experts", &dequantize_experts); }

}  // namespace ft::cpu
