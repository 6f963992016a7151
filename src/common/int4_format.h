// The int4 expert format (ft_ops/formats.py): rows of R x C values stored as uint8 [R, C/2], two
// 4-bit codes a byte (the low nibble holds the even element), value = code - 8, times a float32
// scale per group of G values of a row ([R, C/G]); G a multiple of 32 that divides C. The layout
// of symmetric GPTQ and compressed-tensors W4A16 checkpoints once unpacked.
#pragma once

#include <ATen/ATen.h>

#include "admitted_count.h"  // FT_HOST_DEVICE
#include "checks.h"

namespace ft {

constexpr int64_t kInt4Offset = 8;       // code c holds the integer c - 8
constexpr int64_t kInt4GroupQuantum = 32;  // a group is a multiple of this many values

// The code's integer value.
FT_HOST_DEVICE inline float int4_value(uint32_t code) {
  return static_cast<float>(static_cast<int>(code & 15u) - static_cast<int>(kInt4Offset));
}

// A bank of int4 experts [S, rows, cols / 2] and its scales [S, rows, cols / G]; returns G.
inline int64_t check_int4_bank(const at::Tensor& weight, const at::Tensor& scale, const char* name,
                               const char* scale_name) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 3, name,
              " must be uint8 [slots, rows, cols / 2] (int4: two 4-bit codes a byte), got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t cols = 2 * weight.size(2);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 3 && scale.size(0) == weight.size(0) &&
                  scale.size(1) == weight.size(1) && scale.size(2) > 0 && cols % scale.size(2) == 0,
              scale_name, " must be float32 [", weight.size(0), ", ", weight.size(1),
              ", cols / G] (int4: one scale per group of G values of ", name, "'s rows of ", cols, "), got ",
              scale.scalar_type(), " ", scale.sizes());
  const int64_t group = cols / scale.size(2);
  TORCH_CHECK(group % kInt4GroupQuantum == 0, name, ": int4 groups of ", group,
              " values; the kernels take groups of a multiple of 32 values");
  TORCH_CHECK(weight.stride(2) == 1 && weight.stride(1) == weight.size(2) && scale.stride(2) == 1 &&
                  scale.stride(1) == scale.size(2),
              name, " and ", scale_name, " rows must be contiguous within a slot");
  check_same_device(scale, weight, scale_name, name);
  return group;
}

}  // namespace ft
