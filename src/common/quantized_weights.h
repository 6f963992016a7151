// Which format expert_gemm's weights are in, told by their scales (both or neither): none, dense
// weights of hidden's dtype; float32 scale_inv with float8_e4m3fn weights, block-FP8 or, with
// [S, rows] scales, FP8 with row scales (fp8_format.h); uint8 e8m0 scales with uint8 weights,
// MXFP4 (mxfp4_format.h); float32 group scales with uint8 weights, int4 (int4_format.h).
#pragma once

#include "checks.h"
#include "fp8_format.h"
#include "int4_format.h"
#include "mxfp4_format.h"

namespace ft {

inline WeightFormat check_gemm_weight_format(const at::Tensor& w13, const at::Tensor& w2,
                                             const c10::optional<at::Tensor>& w13_scale,
                                             const c10::optional<at::Tensor>& w2_scale, bool gated = true) {
  TORCH_CHECK(w13_scale.has_value() == w2_scale.has_value(),
              "pass both w13_scale and w2_scale (quantized weights), or neither");
  if (!w13_scale.has_value()) return WeightFormat::kDense;
  check_gating(w13, w2, w13.scalar_type() == at::kByte ? 2 : 1, gated);  // before the scales' shapes
  if (w13.scalar_type() == at::kByte) {
    TORCH_CHECK(w13_scale->scalar_type() == at::kByte || w13_scale->scalar_type() == at::kFloat,
                "uint8 weights take uint8 e8m0 scales (MXFP4) or float32 group scales (int4), got w13_scale ",
                w13_scale->scalar_type());
  }
  if (w13.scalar_type() == at::kByte && w13_scale->scalar_type() == at::kFloat) {
    TORCH_CHECK(gated, "int4 experts must be gated (gate and up rows); ungated experts are served in bf16, "
                "float16, float32 or FP8");
    check_int4_bank(w13, *w13_scale, "w13", "w13_scale");
    check_int4_bank(w2, *w2_scale, "w2", "w2_scale");
    return WeightFormat::kInt4;
  }
  if (w13.scalar_type() == at::kByte) {
    TORCH_CHECK(gated, "MXFP4 experts must be gated (gate and up rows, as GPT-OSS stores them); ungated "
                "experts are served in bf16, float16, float32 or block-FP8");
    check_mxfp4_bank(w13, *w13_scale, "w13", "w13_scale");
    check_mxfp4_bank(w2, *w2_scale, "w2", "w2_scale");
    return WeightFormat::kMxfp4;
  }
  const bool rows13 = check_fp8_bank(w13, *w13_scale, gated ? 2 : 1, "w13", "w13_scale");
  const bool rows2 = check_fp8_bank(w2, *w2_scale, 1, "w2", "w2_scale");
  TORCH_CHECK(rows13 == rows2, "w13_scale is ", rows13 ? "one scale a row" : "128 x 128 blocks", " but w2_scale ",
              rows2 ? "one scale a row" : "128 x 128 blocks", ": both banks hold one FP8 format");
  return rows13 ? WeightFormat::kFp8Rows : WeightFormat::kFp8;
}

// Everything dequantize_experts checks, for both devices; returns the weights' format: kMxfp4
// (uint8 with uint8 scales), kInt4 (uint8 with float32 scales) or kFp8 (block or row scales, which
// Fp8ScaleIndex tells apart).
inline WeightFormat check_dequantize_inputs(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& slots,
                                            int64_t parts, at::ScalarType dtype) {
  const bool packed = weight.scalar_type() == at::kByte;
  TORCH_CHECK(packed || weight.scalar_type() == at::kFloat8_e4m3fn,
              "weight must be float8_e4m3fn (FP8) or uint8 (MXFP4 or int4 codes), got ", weight.scalar_type());
  TORCH_CHECK(!packed || scale.scalar_type() == at::kByte || scale.scalar_type() == at::kFloat,
              "uint8 weights take uint8 e8m0 scales (MXFP4) or float32 group scales (int4), got scale ",
              scale.scalar_type());
  WeightFormat format = WeightFormat::kFp8;
  if (packed && scale.scalar_type() == at::kFloat) {
    check_int4_bank(weight, scale, "weight", "scale");
    format = WeightFormat::kInt4;
  } else if (packed) {
    check_mxfp4_bank(weight, scale, "weight", "scale");
    format = WeightFormat::kMxfp4;
  } else {
    check_fp8_bank(weight, scale, parts, "weight", "scale");
  }
  check_index_dtype(slots, "slots");
  TORCH_CHECK(slots.dim() == 1, "slots must be 1-D, got shape ", slots.sizes());
  check_same_device(slots, weight, "slots", "weight");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "dtype must be float32, bfloat16 or float16, got ", dtype);
  return format;
}

}  // namespace ft
