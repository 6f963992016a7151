// CPU kernels of the freetoken ops, declared for the C++ unit tests (tests/cpp/), which call
// them directly. Python reaches them through torch.ops.freetoken via the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "../common/checks.h"

namespace ft::cpu {

// The pool maps' entries that a call reads as indices, checked before it writes anything: the slots
// of `layer`'s experts (slot_of[layer]) in [-1, slots), and every owner in [-1, layers x experts).
// The kernels index the pool with them; an entry outside (a state written by other code) would
// write outside it. O(E + S) a call: an all-hit decode call on 16,384 slots took 11.8 us against
// 6.0 on 512 (one thread), ~0.35 ms a token over 60 layers on the CPU build (CUDA pools do not run it).
void check_pool_maps(const at::Tensor& slot_of, const at::Tensor& owner_of, int64_t layer, const PoolShape& pool);

at::Tensor slot_lookup(const at::Tensor& slot_of, int64_t layer, const at::Tensor& expert_ids);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_and_admit(
    const at::Tensor& slot_of, const at::Tensor& owner_of, const at::Tensor& last_use,
    const at::Tensor& clock, int64_t layer, const at::Tensor& expert_ids, double fetch_fraction,
    int64_t protect_lo, int64_t protect_hi, const c10::optional<at::Tensor>& stats = c10::nullopt,
    int64_t policy = 0, double cpu_expert_cost = 0.0, double cpu_call_cost = 0.0,
    const c10::optional<at::Tensor>& policy_state = c10::nullopt,
    c10::optional<at::TensorList> shadows = c10::nullopt);

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
                       const c10::optional<at::Tensor>& w2_scale = c10::nullopt, bool limit_after_act = false,
                       bool gated = true, const c10::optional<at::Tensor>& slot_map = c10::nullopt);

at::Tensor dequantize_experts(const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& slots,
                              int64_t parts, at::ScalarType dtype);

// One slot of a block-FP8 bank [S, rows, cols] (src/common/fp8_format.h) as a [rows, cols] tensor of
// `dtype` (expert_gemm's CPU path).
at::Tensor dequantize_fp8_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, int64_t parts,
                               at::ScalarType dtype);

// One slot of an MXFP4 bank [S, rows, cols / 2] with its e8m0 scales (src/common/mxfp4_format.h) as
// a [rows, cols] tensor of `dtype`.
at::Tensor dequantize_mxfp4_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, at::ScalarType dtype);

// One slot of an int4 bank [S, rows, cols / 2] with its float32 group scales (src/common/int4_format.h)
// as a [rows, cols] tensor of `dtype`.
at::Tensor dequantize_int4_slot(const at::Tensor& weight, const at::Tensor& scale, int64_t slot, at::ScalarType dtype);

// act(gate, up) of a float32 [n, 2 I] gate_up product (gate columns first) as a float32 [n, I].
at::Tensor activate_gate_up(const at::Tensor& h, int64_t intermediate, const ActivationParams& p);

// The pairs expert_gemm groups by slot: pair order indices [begin, end) use `slot`.
struct ExpertGroup {
  int64_t slot;
  int64_t begin;
  int64_t end;
};

class SpinPool;

// expert_gemm with its row loops on `pool` (the CPU share's worker) rather than ATen's threads.
at::Tensor expert_gemm_on(SpinPool* pool, const at::Tensor& hidden, const at::Tensor& slot_ids,
                          const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2,
                          const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                          c10::string_view activation, double alpha, double limit, double up_offset,
                          double gate_softcap, double up_softcap, const c10::optional<at::Tensor>& w13_scale,
                          const c10::optional<at::Tensor>& w2_scale, bool limit_after_act, bool gated);

// expert_gemm's path for groups of at most kExpertGemvMaxTokens pairs (src/cpu/expert_gemv.cpp):
// y[p] = weight_of[p] * down(act(gate_up(hidden[token_of[p]]))) for the groups' pairs p.
constexpr int64_t kExpertGemvMaxTokens = 4;
bool expert_gemv_supports(const at::Tensor& w13, const at::Tensor& w2, WeightFormat format);
void expert_gemv(const at::Tensor& hidden, const at::Tensor& token_of, const at::Tensor& weight_of,
                 const std::vector<ExpertGroup>& groups, WeightFormat format, const at::Tensor& w13,
                 const at::Tensor& w2, const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                 const c10::optional<at::Tensor>& w13_scale, const c10::optional<at::Tensor>& w2_scale,
                 int64_t intermediate, const ActivationParams& act, at::Tensor& y, SpinPool* pool = nullptr);

}  // namespace ft::cpu
