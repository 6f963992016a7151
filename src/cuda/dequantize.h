// dequantize_experts' kernels for other CUDA sources: expert_gemm's prompt path on a quantized
// layer fills its scratch bank with them, a window of experts at a time.
#pragma once

#include <ATen/ATen.h>

namespace ft::cuda {

// out[i] = weight[ids[i]] dequantized (FP8: block scales with `parts` projections per row, or row
// scales; MXFP4; int4) in
// out's dtype (float32, bf16 or fp16); rows whose id is -1 (or out of range) are left unwritten.
// ids: int64 on weight's device; out: [ids.numel(), rows, columns], contiguous. Inputs checked
// by the caller (check_dequantize_inputs, or expert_gemm's checks); launches on the current stream.
void dequantize_experts_into(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& ids, int64_t parts,
                             at::Tensor& out);

}  // namespace ft::cuda
