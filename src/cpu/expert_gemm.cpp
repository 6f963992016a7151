// CPU kernel of expert_gemm. It serves CPU models and is the decode path's CPU miss path, where
// the "bank" is one layer of the pinned host pool and the slot ids are expert ids.
//
// Pairs (token, k) are grouped by slot with a counting sort. Groups of a few tokens (decode) go to
// expert_gemv (src/cpu/expert_gemv.cpp), which reads each weight row once; each larger group is two
// matrix products (gate_up, then down) through ATen's CPU GEMMs on the bank rows in place (a slice
// of the bank, never a copy of the weights), the activation in float32, and a weighted scatter-add.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "../common/checks.h"
#include "../common/quantized_weights.h"
#include "cpu_kernels.h"
#include "spin_pool.h"

namespace ft::cpu {

// act(gate, up) in float32 (src/common/checks.h gives the function); h is [n, 2I], gate columns
// first ([n, I] for ungated experts: the up columns are the gate's too). The plain functions go
// through ATen's own kernels (at::silu, at::gelu, at::relu), the ones torch.nn.functional runs, so
// a float32 model offloaded on the CPU computes its module's values.
at::Tensor activate_gate_up(const at::Tensor& h, int64_t inter, const ActivationParams& p) {
  auto gate = h.narrow(1, 0, inter);
  auto up = h.narrow(1, p.gated ? inter : 0, inter);
  if (p.limit > 0.f) {
    if (!p.limit_after_act) gate = gate.clamp_max(p.limit);
    up = up.clamp(-p.limit, p.limit);
  }
  if (p.up_softcap > 0.f) up = at::tanh(up / p.up_softcap) * p.up_softcap;
  if (p.up_offset != 0.f) up = up + p.up_offset;
  // min(act(g), limit) where the clamp comes after the activation (act_fn's output, as the
  // classes that do so write it).
  const auto clamped = [&](at::Tensor activated) {
    return p.limit_after_act ? activated.clamp_max(p.limit) : activated;
  };
  if (p.gate_softcap == 0.f) {
    switch (p.kind) {
      case ActivationKind::kSilu:
        if (p.alpha == 1.f) return clamped(at::silu(gate)) * up;
        break;  // a sigmoid of another slope: below
      case ActivationKind::kGeluTanh:
        return clamped(at::gelu(gate, "tanh")) * up;
      case ActivationKind::kGelu:
        return clamped(at::gelu(gate)) * up;
      case ActivationKind::kRelu:
        return clamped(at::relu(gate)) * up;
    }
  }
  // lin(g) * phi(g) * up, in the order transformers writes it: (lin * phi) * up.
  const auto lin = p.gate_softcap > 0.f ? at::tanh(gate / p.gate_softcap) * p.gate_softcap : gate;
  at::Tensor phi;
  switch (p.kind) {
    case ActivationKind::kSilu:
      phi = at::sigmoid(gate * p.alpha);
      break;
    case ActivationKind::kGeluTanh:
      phi = (at::tanh((gate + gate.pow(3) * 0.044715) * 0.7978845608028654) + 1.0) * 0.5;
      break;
    case ActivationKind::kGelu:
      phi = (at::erf(gate * M_SQRT1_2) + 1.0) * 0.5;
      break;
    case ActivationKind::kRelu:
      phi = (gate > 0).to(gate.scalar_type());
      break;
  }
  return clamped(lin * phi) * up;
}

namespace {

// Whether ATen's bf16 GEMMs are fast here: the CPU multiplies bf16 natively (AVX512-BF16, which every
// CPU with AMX has too) and ATen may take oneDNN. Elsewhere ATen's generic bf16 GEMM took 1.3x (AVX-512
// without BF16) to 3.6x (AVX2) the float32 path's time for the same FP8 prompt (a review's
// measurement with oneDNN capped by DNNL_MAX_CPU_ISA, 2026-12-04).
bool fast_bf16_gemm() {
  static const bool native = [] {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
#else
    return false;
#endif
  }();
  return native && at::globalContext().userEnabledMkldnn();
}

// Pairs of at most this many rows are summed into their tokens on the calling thread.
constexpr int64_t kSerialSumPairs = 64;

// acc[token_of[p]] += y[p] for every pair p (float32, contiguous rows). A decode-sized call sums
// its few rows on this thread: index_add_ opens a parallel region, and on a host whose cores are
// taken (the CPU share's row threads spin between jobs) the region waits for its descheduled
// threads. That wait was most of the CPU share's fixed cost a call: on the H200's 16-core host the
// split's start-up measurement fell from 0.44-0.51 ms a call to 0.11 ms with this loop.
void add_pairs_to_tokens(at::Tensor& acc, const at::Tensor& token_of, const at::Tensor& y) {
  const int64_t pairs = y.size(0), hidden = y.size(1);
  if (pairs > kSerialSumPairs) {
    acc.index_add_(0, token_of, y);
    return;
  }
  const auto tokens = token_of.contiguous();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const float* src = y.data_ptr<float>();
  float* dst = acc.data_ptr<float>();
  for (int64_t p = 0; p < pairs; ++p) {
    float* row = dst + tok[p] * hidden;
    const float* add = src + p * hidden;
    for (int64_t j = 0; j < hidden; ++j) row[j] += add[j];
  }
}

}  // namespace

at::Tensor expert_gemm_on(SpinPool* pool, const at::Tensor& hidden, const at::Tensor& slot_ids,
                          const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2,
                          const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                          c10::string_view activation, double alpha, double limit, double up_offset,
                          double gate_softcap, double up_softcap, const c10::optional<at::Tensor>& w13_scale,
                          const c10::optional<at::Tensor>& w2_scale, bool limit_after_act, bool gated) {
  const WeightFormat format = check_gemm_weight_format(w13, w2, w13_scale, w2_scale, gated);
  const bool quantized = format != WeightFormat::kDense;
  const GemmShape shape = check_gemm_inputs(hidden, slot_ids, weights, w13, w2, b13, b2, format, gated);
  const ActivationParams act =
      parse_activation(activation, alpha, limit, up_offset, gate_softcap, up_softcap, limit_after_act, gated);
  const auto dtype = hidden.scalar_type();
  const int64_t pairs = shape.tokens * shape.top_k;

  const auto slots = slot_ids.to(at::kLong).contiguous();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(slot_data[p] >= -1 && slot_data[p] < shape.slots, "slot_ids[", p / shape.top_k,
                ", ", p % shape.top_k, "] is ", slot_data[p], ", outside [-1, ", shape.slots,
                "); -1 marks a pair that is not computed here");
  }

  // Counting sort of pairs by slot (stable: pairs keep token order inside a group).
  std::vector<int64_t> count(shape.slots + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (slot_data[p] >= 0) ++count[slot_data[p] + 1];
  }
  for (int64_t s = 0; s < shape.slots; ++s) count[s + 1] += count[s];
  std::vector<int64_t> order(count[shape.slots]);
  std::vector<ExpertGroup> groups;
  {
    std::vector<int64_t> cursor(count.begin(), count.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      if (slot_data[p] >= 0) order[cursor[slot_data[p]]++] = p;
    }
    for (int64_t s = 0; s < shape.slots; ++s) {
      if (count[s + 1] > count[s]) groups.push_back({s, count[s], count[s + 1]});
    }
  }

  auto acc = at::zeros({shape.tokens, shape.hidden}, hidden.options().dtype(at::kFloat));
  if (groups.empty()) return acc.to(dtype);
  const auto pair_index = at::from_blob(order.data(), {static_cast<int64_t>(order.size())},
                                        at::TensorOptions().dtype(at::kLong));
  const auto token_of = at::floor_divide(pair_index, shape.top_k);
  const auto weight_of = weights.to(at::kFloat).reshape({-1}).index_select(0, pair_index);
  // y holds each grouped pair's weighted output, so groups can run in parallel without races.
  auto y = at::empty({pair_index.numel(), shape.hidden}, acc.options());

  // Quantized slots (FP8, MXFP4, int4) are dequantized once per group (each slot's weights are read once
  // per call) to the type the group's products run in: bf16 for bf16 hidden states on a CPU that
  // multiplies bf16 natively, as the CUDA prompt path does (its scratch bank, then the grouped GEMM
  // in bf16), where float32 products took 3.5x (FP8) and 6-9x (MXFP4) bf16 weights' time
  // (benchmarks/bench_cpu_prompt.py). MXFP4 values are exact in bf16 (one mantissa bit times a
  // power of two); FP8 and int4 values times their float32 scale round to bf16. Elsewhere, and for
  // other hidden types, float32. Dense weights are used in place.
  const auto compute_dtype = dtype == at::kBFloat16 && fast_bf16_gemm() ? at::kBFloat16 : at::kFloat;
  const auto dequantized = [&](const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t slot,
                               int64_t parts) {
    return is_fp8(format)                   ? dequantize_fp8_slot(w, *scale, slot, parts, compute_dtype)
           : format == WeightFormat::kInt4 ? dequantize_int4_slot(w, *scale, slot, compute_dtype)
                                            : dequantize_mxfp4_slot(w, *scale, slot, compute_dtype);
  };
  const auto gate_up_of = [&](int64_t slot) {
    return quantized ? dequantized(w13, w13_scale, slot, gated ? 2 : 1) : w13.select(0, slot);
  };
  const auto down_of = [&](int64_t slot) {
    return quantized ? dequantized(w2, w2_scale, slot, 1) : w2.select(0, slot);
  };
  const auto run_group = [&](const ExpertGroup& g) {
    const int64_t n = g.end - g.begin;
    const auto tok = token_of.narrow(0, g.begin, n);
    auto x = hidden.index_select(0, tok);
    if (quantized) x = x.to(compute_dtype);
    auto h = at::mm(x, gate_up_of(g.slot).t()).to(at::kFloat);
    if (b13.has_value()) h.add_(b13->select(0, g.slot).to(at::kFloat));
    auto a = activate_gate_up(h, shape.intermediate, act).to(dtype);
    if (quantized) a = a.to(compute_dtype);
    auto out = at::mm(a, down_of(g.slot).t()).to(at::kFloat);
    if (b2.has_value()) out.add_(b2->select(0, g.slot).to(at::kFloat));
    y.narrow(0, g.begin, n).copy_(out.mul_(weight_of.narrow(0, g.begin, n).unsqueeze(1)));
  };
  if (expert_gemv_supports(w13, w2, format)) {
    std::vector<ExpertGroup> few;
    std::vector<ExpertGroup> many;
    for (const auto& g : groups) (g.end - g.begin <= kExpertGemvMaxTokens ? few : many).push_back(g);
    expert_gemv(hidden, token_of, weight_of, few, format, w13, w2, b13, b2, w13_scale, w2_scale,
                shape.intermediate, act, y, pool);
    groups.swap(many);
    if (pool != nullptr && !groups.empty()) pool->rest();  // ATen's threads take the larger groups
  }
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  const int threads = at::get_num_threads();
  if (num_groups >= threads) {
    // Many groups: each thread takes the next group left, largest first (the products inside run
    // single-threaded). Contiguous ranges of groups, one a thread, left every thread waiting for
    // the one whose experts the prompt routed to most. The tasks run tensor operations on ATen's
    // threads, which do not inherit the caller's thread-local state: without it, a call under
    // torch.inference_mode() writes its inference tensors from a thread outside inference mode,
    // which torch refuses.
    std::stable_sort(groups.begin(), groups.end(), [](const ExpertGroup& a, const ExpertGroup& b) {
      return a.end - a.begin > b.end - b.begin;
    });
    std::atomic<int64_t> next{0};
    const at::ThreadLocalState caller_state;
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      const at::ThreadLocalStateGuard state_guard(caller_state);
      for (int64_t i = next.fetch_add(1); i < num_groups; i = next.fetch_add(1)) run_group(groups[i]);
    });
  } else {
    // Few groups: let each product use every thread.
    for (const auto& g : groups) run_group(g);
  }
  add_pairs_to_tokens(acc, token_of, y);
  return acc.to(dtype);
}

at::Tensor expert_gemm(const at::Tensor& hidden, const at::Tensor& slot_ids,
                       const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       c10::string_view activation, double alpha, double limit, double up_offset,
                       double gate_softcap, double up_softcap, const c10::optional<at::Tensor>& w13_scale,
                       const c10::optional<at::Tensor>& w2_scale, bool limit_after_act, bool gated,
                       const c10::optional<at::Tensor>& slot_map) {
  // The CPU kernels read quantized rows in place at any token count: a slot_map only maps the ids.
  at::Tensor slots = slot_ids;
  if (slot_map) {
    check_slot_map(*slot_map, hidden);
    check_index_dtype(slot_ids, "slot_ids");
    // Like a slot id out of range, a map entry outside the bank is refused on the CPU (the check is
    // free here; CUDA leaves such an expert's pairs uncomputed).
    const int64_t S = w13.dim() > 0 ? w13.size(0) : 0;
    const auto bad = at::logical_or(*slot_map < -1, *slot_map >= S).nonzero();
    TORCH_CHECK(bad.numel() == 0, "slot_map[", bad.numel() ? bad[0][0].item<int64_t>() : 0, "] is ",
                bad.numel() ? (*slot_map)[bad[0][0]].item<int64_t>() : 0, ", outside [-1, ", S,
                "): each entry must be a slot of the bank or -1");
    slots = slots_through_map(slot_ids, *slot_map);
  }
  return expert_gemm_on(nullptr, hidden, slots, weights, w13, w2, b13, b2, activation, alpha, limit, up_offset,
                        gate_softcap, up_softcap, w13_scale, w2_scale, limit_after_act, gated);
}

TORCH_LIBRARY_IMPL(freetoken, CPU, m) { m.impl("expert_gemm", &expert_gemm); }

}  // namespace ft::cpu
