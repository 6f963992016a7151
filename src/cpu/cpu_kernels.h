// CPU kernels of the freetoken ops, declared for the C++ unit tests (tests/cpp/), which call
// them directly. Python reaches them through torch.ops.freetoken via the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace ft::cpu {

at::Tensor slot_lookup(const at::Tensor& slot_of, int64_t layer, const at::Tensor& expert_ids);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_and_admit(
    const at::Tensor& slot_of, const at::Tensor& owner_of, const at::Tensor& last_use,
    const at::Tensor& clock, int64_t layer, const at::Tensor& expert_ids, double fetch_fraction,
    int64_t protect_lo, int64_t protect_hi, const c10::optional<at::Tensor>& stats = c10::nullopt,
    int64_t policy = 0, double cpu_expert_cost = 0.0, double cpu_call_cost = 0.0);

void copy_experts(at::TensorList banks, at::TensorList host_rows, const at::Tensor& copy_experts,
                  const at::Tensor& copy_slots, const at::Tensor& num_copies);

at::Tensor async_layer_copy(const at::Tensor& slot_of, const at::Tensor& owner_of,
                            const at::Tensor& last_use, const at::Tensor& clock,
                            at::TensorList banks, at::TensorList host_rows, int64_t layer,
                            int64_t first_slot, bool skip_resident, int64_t reclaim_lo = 0,
                            int64_t reclaim_hi = 0, int64_t policy = 0,
                            const c10::optional<at::Tensor>& row_sources = c10::nullopt);

at::Tensor expert_gemm(const at::Tensor& hidden, const at::Tensor& slot_ids,
                       const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       c10::string_view activation, double alpha = 1.0, double limit = 0.0,
                       double up_offset = 0.0, double gate_softcap = 0.0, double up_softcap = 0.0,
                       const c10::optional<at::Tensor>& w13_scale = c10::nullopt,
                       const c10::optional<at::Tensor>& w2_scale = c10::nullopt);

at::Tensor dequantize_experts(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& slots,
                              int64_t parts, at::ScalarType dtype);

// One slot of a block-FP8 bank [S, rows, cols] (src/common/fp8_format.h) as a [rows, cols] tensor of
// `dtype` (expert_gemm's CPU path).
at::Tensor dequantize_fp8_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, int64_t parts,
                               at::ScalarType dtype);

// One slot of an MXFP4 bank [S, rows, cols / 2] with its e8m0 scales (src/common/mxfp4_format.h) as
// a [rows, cols] tensor of `dtype`.
at::Tensor dequantize_mxfp4_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, at::ScalarType dtype);

}  // namespace ft::cpu
