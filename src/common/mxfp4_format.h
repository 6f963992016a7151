// The MXFP4 expert format (ft_ops/formats.py): rows of R x C values stored as uint8 [R, C/2], two
// e2m1 values a byte (the low nibble holds the even element), with uint8 e8m0 scales [R, C/32],
// 2^(scale - 127) for each group of 32 values of a row; the layout of GPT-OSS checkpoints.
#pragma once

#include <ATen/ATen.h>

#include "admitted_count.h"  // FT_HOST_DEVICE
#include "checks.h"

namespace ft {

constexpr int64_t kMxfp4Group = 32;

// The e2m1 code's value (bit 3: sign).
FT_HOST_DEVICE inline float e2m1_value(uint32_t code) {
  constexpr float kMagnitude[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  const float m = kMagnitude[code & 7u];
  return (code & 8u) ? -m : m;
}

// A bank of MXFP4 experts [S, rows, cols / 2] and its scales [S, rows, cols / 32]; returns cols.
inline int64_t check_mxfp4_bank(const at::Tensor& weight, const at::Tensor& scale, const char* name,
                                const char* scale_name) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3, name,
              " must be uint8 [slots, rows, cols / 2] (MXFP4: two e2m1 values a byte), got ", weight.scalar_type(),
              " ", weight.sizes());
  const int64_t cols = 2 * weight.size(2);
  TORCH_CHECK(cols % kMxfp4Group == 0, name, ": MXFP4 rows of ", cols, " values are not whole groups of 32");
  TORCH_CHECK(scale.scalar_type() == at::kByte && scale.dim() == 3 && scale.size(0) == weight.size(0) &&
                  scale.size(1) == weight.size(1) && scale.size(2) == cols / kMxfp4Group,
              scale_name, " must be uint8 e8m0 [", weight.size(0), ", ", weight.size(1), ", ", cols / kMxfp4Group,
              "] (one scale per 32 values of ", name, "), got ", scale.scalar_type(), " ", scale.sizes());
  TORCH_CHECK(weight.stride(2) == 1 && weight.stride(1) == weight.size(2) && scale.stride(2) == 1 &&
                  scale.stride(1) == scale.size(2),
              name, " and ", scale_name, " rows must be contiguous within a slot");
  check_same_device(scale, weight, scale_name, name);
  return cols;
}

}  // namespace ft
