// The FP8 expert formats (ft_ops/formats.py): float8_e4m3fn weights [rows, cols] with float32
// scale_inv per 128 x 128 block, partial blocks at the edges, a weight whose rows are `parts` equal
// projections (w13: gate, then up) blocked per projection (fp8); or with one float32 scale a row
// (fp8_rows). A bank's scales tell which: [S, scale rows, scale cols] blocks or [S, rows].
// Shared by both devices' kernels.
#pragma once

#include <ATen/ATen.h>

#include "admitted_count.h"  // FT_HOST_DEVICE
#include "checks.h"

namespace ft {

constexpr int64_t kFp8Block = 128;

FT_HOST_DEVICE inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Scale blocks [parts * ceil(rows / parts / 128), ceil(cols / 128)] of a [rows, cols] weight.
inline std::pair<int64_t, int64_t> fp8_scale_blocks(int64_t rows, int64_t cols, int64_t parts) {
  return {parts * ceil_div(rows / parts, kFp8Block), ceil_div(cols, kFp8Block)};
}

// A bank of FP8 experts [S, rows, cols] and its scales: [S, scale rows, scale cols] blocks, or
// [S, rows] row scales. Returns whether they are row scales.
inline bool check_fp8_bank(const at::Tensor& weight, const at::Tensor& scale, int64_t parts, const char* name,
                           const char* scale_name) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, name, " must be float8_e4m3fn, got ",
              weight.scalar_type(), " (scales go with FP8 weights, float32 [S, rows/128, cols/128] blocks or "
              "[S, rows] row scales, or MXFP4 ones, uint8)");
  TORCH_CHECK(parts >= 1, "parts must be 1 or more (2 for a gated w13: gate and up blocked apart), got ", parts);
  TORCH_CHECK(weight.dim() == 3, name, " must be [slots, rows, cols], got shape ", weight.sizes());
  TORCH_CHECK(weight.size(1) % parts == 0, name, "'s ", weight.size(1),
              " rows do not split into ", parts, " equal projections");
  check_dtype(scale, at::kFloat, scale_name);
  if (scale.dim() == 2) {
    TORCH_CHECK(scale.size(0) == weight.size(0) && scale.size(1) == weight.size(1), scale_name, " must be [",
                weight.size(0), ", ", weight.size(1), "] (one scale a row of ", name, " ", weight.sizes(),
                ") or [", weight.size(0), ", rows/128, cols/128] blocks, got ", scale.sizes());
    TORCH_CHECK(weight.stride(2) == 1 && weight.stride(1) == weight.size(2) && scale.stride(1) == 1,
                name, " and ", scale_name, " rows must be contiguous within a slot");
    check_same_device(scale, weight, scale_name, name);
    return true;
  }
  const auto [srows, scols] = fp8_scale_blocks(weight.size(1), weight.size(2), parts);
  TORCH_CHECK(scale.dim() == 3 && scale.size(0) == weight.size(0) && scale.size(1) == srows &&
                  scale.size(2) == scols,
              scale_name, " must be [", weight.size(0), ", ", srows, ", ", scols, "] (128 x 128 blocks of ",
              name, " ", weight.sizes(), ") or [", weight.size(0), ", ", weight.size(1), "] (one scale a row), got ",
              scale.sizes());
  TORCH_CHECK(weight.stride(2) == 1 && weight.stride(1) == weight.size(2) && scale.stride(2) == 1 &&
                  scale.stride(1) == scale.size(2),
              name, " and ", scale_name, " rows must be contiguous within a slot");
  check_same_device(scale, weight, scale_name, name);
  return false;
}

// Scale row of weight row r (of rows / parts per projection).
FT_HOST_DEVICE inline int64_t fp8_scale_row(int64_t r, int64_t rows_per_part) {
  return (r / rows_per_part) * ceil_div(rows_per_part, kFp8Block) + (r % rows_per_part) / kFp8Block;
}

// Where weight (r, c) of a slot finds its scale among the slot's scales: row(r) + (c / 128) * col_step
// (block scales: the scale row's blocks; row scales: the row's one scale, whatever the column).
struct Fp8ScaleIndex {
  int64_t rows_per_part;  // block scales: rows of one projection
  int64_t scale_cols;     // block scales: blocks a scale row; 0 for row scales
  FT_HOST_DEVICE int64_t row(int64_t r) const {
    return scale_cols == 0 ? r : fp8_scale_row(r, rows_per_part) * scale_cols;
  }
  FT_HOST_DEVICE int64_t col_step() const { return scale_cols == 0 ? 0 : 1; }
  FT_HOST_DEVICE int64_t operator()(int64_t r, int64_t c) const { return row(r) + (c / kFp8Block) * col_step(); }
};

// The index of a checked bank's scales (check_fp8_bank) for weights [S, rows, cols] of `parts` projections.
inline Fp8ScaleIndex fp8_scale_index(const at::Tensor& weight, const at::Tensor& scale, int64_t parts) {
  if (scale.dim() == 2) return {weight.size(1), 0};
  return {weight.size(1) / parts, ceil_div(weight.size(2), kFp8Block)};
}

}  // namespace ft
