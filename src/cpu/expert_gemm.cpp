// CPU kernel of expert_gemm. It serves CPU models and is the decode path's CPU miss path, where
// the "bank" is one layer of the pinned host pool and the slot ids are expert ids.
//
// Pairs (token, k) are grouped by slot with a counting sort; each group is two matrix products
// (gate_up, then down) through ATen's CPU GEMMs on the bank rows in place (a slice of the bank,
// never a copy of the weights), the activation in float32, and a weighted scatter-add. One
// token (decode) takes row dot products spread over all threads instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../common/checks.h"
#include "cpu_kernels.h"

namespace ft::cpu {
namespace {

// act(gate, up) in float32; h is [n, 2I] with gate columns first.
at::Tensor activate(const at::Tensor& h, int64_t inter, Activation act) {
  const auto gate = h.narrow(1, 0, inter);
  const auto up = h.narrow(1, inter, inter);
  switch (act) {
    case Activation::kSilu:
      return at::silu(gate) * up;
    case Activation::kGeluTanh:
      return at::gelu(gate, "tanh") * up;
    case Activation::kSwigluOai: {
      const auto g = gate.clamp_max(kSwigluOaiLimit);
      const auto u = up.clamp(-kSwigluOaiLimit, kSwigluOaiLimit);
      return (u + 1.0) * (g * at::sigmoid(g * kSwigluOaiAlpha));
    }
  }
  TORCH_CHECK(false, "unreachable activation");
}

struct Group {
  int64_t slot;
  int64_t begin;  // into the pair order
  int64_t end;
};

// --- One token (decode, the CPU miss path): memory-bound row dot products ---------------------
// Every weight row of every selected expert is read once and dotted with the token, the rows
// spread over all threads; GEMM libraries handle these one-row products poorly (CPU machine,
// 2 threads, bf16, H 2048, I 768: one expert 0.40 ms against 0.68 ms through at::mm). With
// several tokens per expert ATen's GEMMs win (4 tokens x 4 experts: 1.95 ms against 4.2 ms).
// The dot products are compiled for AVX-512, AVX2 and plain x86-64 and picked at run time.
constexpr int64_t kFewTokens = 1;

__attribute__((target_clones("avx512f", "avx2", "default"))) float dot_f32(const float* w,
                                                                           const float* x,
                                                                           int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += w[i] * x[i];
  return acc;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) float dot_bf16(const uint16_t* w,
                                                                            const float* x,
                                                                            int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(w[i]) << 16;  // bf16 is the top half of a float
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    acc += f * x[i];
  }
  return acc;
}

float dot_f16(const at::Half* w, const float* x, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<float>(w[i]) * x[i];
  return acc;
}

float dot_row(const void* w, at::ScalarType dtype, const float* x, int64_t n) {
  switch (dtype) {
    case at::kFloat: return dot_f32(static_cast<const float*>(w), x, n);
    case at::kBFloat16: return dot_bf16(static_cast<const uint16_t*>(w), x, n);
    default: return dot_f16(static_cast<const at::Half*>(w), x, n);
  }
}

float activate_one(float g, float u, Activation act) {
  switch (act) {
    case Activation::kSilu:
      return g / (1.f + std::exp(-g)) * u;
    case Activation::kGeluTanh:
      return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    case Activation::kSwigluOai: {
      g = std::min(g, kSwigluOaiLimit);
      u = std::max(std::min(u, kSwigluOaiLimit), -kSwigluOaiLimit);
      return (u + 1.f) * g / (1.f + std::exp(-kSwigluOaiAlpha * g));
    }
  }
  return 0.f;
}

// Weighted output of every grouped pair, y [pairs in group order, H] float.
at::Tensor few_token_products(const at::Tensor& hidden, const std::vector<Group>& groups,
                              const std::vector<int64_t>& order, const at::Tensor& weight_of,
                              const at::Tensor& w13, const at::Tensor& w2,
                              const c10::optional<at::Tensor>& b13,
                              const c10::optional<at::Tensor>& b2, Activation act,
                              const GemmShape& shape) {
  const int64_t H = shape.hidden, I = shape.intermediate, K = shape.top_k;
  const auto dtype = w13.scalar_type();
  const auto x = hidden.to(at::kFloat).contiguous();
  const float* xs = x.data_ptr<float>();
  const float* wts = weight_of.data_ptr<float>();
  const int64_t n = static_cast<int64_t>(order.size());
  const int64_t esize = w13.element_size();
  const char* w13_base = static_cast<const char*>(w13.data_ptr());
  const char* w2_base = static_cast<const char*>(w2.data_ptr());
  const auto b13f = b13 ? b13->to(at::kFloat).contiguous() : at::Tensor();
  const auto b2f = b2 ? b2->to(at::kFloat).contiguous() : at::Tensor();
  auto a = at::empty({n, I}, x.options());
  auto y = at::empty({n, H}, x.options());
  float* as = a.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t G = static_cast<int64_t>(groups.size());
  // Phase 1: gate and up rows i of every selected slot -> act[pair, i].
  at::parallel_for(0, G * I, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Group& g = groups[item / I];
      const int64_t i = item % I;
      const char* gate = w13_base + (g.slot * w13.stride(0) + i * H) * esize;
      const char* up = gate + I * H * esize;
      const float bg = b13 ? b13f.data_ptr<float>()[g.slot * 2 * I + i] : 0.f;
      const float bu = b13 ? b13f.data_ptr<float>()[g.slot * 2 * I + I + i] : 0.f;
      for (int64_t pos = g.begin; pos < g.end; ++pos) {
        const float* xt = xs + (order[pos] / K) * H;
        as[pos * I + i] = activate_one(dot_row(gate, dtype, xt, H) + bg, dot_row(up, dtype, xt, H) + bu, act);
      }
    }
  });
  // Phase 2: down rows h -> weighted y[pair, h].
  at::parallel_for(0, G * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Group& g = groups[item / H];
      const int64_t h = item % H;
      const char* row = w2_base + (g.slot * w2.stride(0) + h * I) * esize;
      const float bias = b2 ? b2f.data_ptr<float>()[g.slot * H + h] : 0.f;
      for (int64_t pos = g.begin; pos < g.end; ++pos) {
        ys[pos * H + h] = wts[pos] * (dot_row(row, dtype, as + pos * I, I) + bias);
      }
    }
  });
  return y;
}

}  // namespace

at::Tensor expert_gemm(const at::Tensor& hidden, const at::Tensor& slot_ids,
                       const at::Tensor& weights, const at::Tensor& w13, const at::Tensor& w2,
                       const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                       c10::string_view activation) {
  const GemmShape shape = check_gemm_inputs(hidden, slot_ids, weights, w13, w2, b13, b2);
  const Activation act = parse_activation(activation);
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
  std::vector<Group> groups;
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
  if (shape.tokens <= kFewTokens) {
    acc.index_add_(0, token_of, few_token_products(hidden, groups, order, weight_of, w13, w2, b13,
                                                   b2, act, shape));
    return acc.to(dtype);
  }
  // y holds each grouped pair's weighted output, so groups can run in parallel without races.
  auto y = at::empty({pair_index.numel(), shape.hidden}, acc.options());

  const auto run_group = [&](const Group& g) {
    const int64_t n = g.end - g.begin;
    const auto tok = token_of.narrow(0, g.begin, n);
    const auto x = hidden.index_select(0, tok);
    auto h = at::mm(x, w13.select(0, g.slot).t()).to(at::kFloat);
    if (b13.has_value()) h.add_(b13->select(0, g.slot).to(at::kFloat));
    const auto a = activate(h, shape.intermediate, act).to(dtype);
    auto out = at::mm(a, w2.select(0, g.slot).t()).to(at::kFloat);
    if (b2.has_value()) out.add_(b2->select(0, g.slot).to(at::kFloat));
    y.narrow(0, g.begin, n).copy_(out.mul_(weight_of.narrow(0, g.begin, n).unsqueeze(1)));
  };
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  if (num_groups >= at::get_num_threads()) {
    // Many small groups: one group per task (the products inside run single-threaded).
    at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) run_group(groups[i]);
    });
  } else {
    // Few groups: let each product use every thread.
    for (const auto& g : groups) run_group(g);
  }
  acc.index_add_(0, token_of, y);
  return acc.to(dtype);
}

TORCH_LIBRARY_IMPL(freetoken, CPU, m) { m.impl("expert_gemm", &expert_gemm); }

}  // namespace ft::cpu
