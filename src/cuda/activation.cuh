// The expert function act(gate, up) on float32 gate/up values, shared by the CUDA expert_gemm
// kernels (decode FMA, decode tensor cores, grouped bias+activation). src/common/checks.h defines
// the function; docs/ops.md states it.
//
// The parameters are runtime values, uniform over a launch (a kernel argument in constant memory),
// so one kernel serves every family: the clamp is branch-free (an "off" limit is +inf, and
// fminf/fmaxf with +inf are exact no-ops), the softcaps and the kind are warp-uniform branches. The
// activation runs once per output row of gate_up, next to 2H weight loads, so its cost is noise.
#pragma once

#include <cmath>

#include "../common/checks.h"

namespace ft::cuda {

struct DeviceActivation {
  int kind;            // ActivationKind
  float alpha;
  float limit;         // clamp of up; +inf when off
  float gate_limit;    // clamp of the raw gate; +inf when off or applied after the activation
  float up_offset;
  float gate_softcap;  // 0: off
  float up_softcap;    // 0: off
  int limit_after_act;  // 1: the activated gate lin(g) * phi(g) is clamped at limit
};

inline DeviceActivation to_device(const ActivationParams& p) {
  const float limit = p.limit > 0.f ? p.limit : INFINITY;
  return DeviceActivation{static_cast<int>(p.kind), p.alpha, limit, p.limit_after_act ? INFINITY : limit,
                          p.up_offset, p.gate_softcap, p.up_softcap, p.limit_after_act ? 1 : 0};
}

// w13's first up row (and b13's first up column) in the gate_up kernels, which take whether the
// experts are gated as a template parameter: I, or 0 for ungated experts, whose up rows are the
// gate's too. A compile-time choice, so the gated kernels compile as they did before ungated
// experts existed (a runtime select made the tensor-core kernels spill).
template <bool kGated>
__host__ __device__ __forceinline__ int64_t up_row_of(int64_t I) {
  return kGated ? I : 0;
}

__device__ __forceinline__ float activate(float g, float u, const DeviceActivation& p) {
  g = fminf(g, p.gate_limit);
  u = fmaxf(fminf(u, p.limit), -p.limit);
  if (p.up_softcap > 0.f) u = p.up_softcap * tanhf(u / p.up_softcap);
  u += p.up_offset;
  float phi;
  if (p.kind == static_cast<int>(ActivationKind::kSilu)) {
    phi = 1.0f / (1.0f + __expf(-p.alpha * g));
  } else if (p.kind == static_cast<int>(ActivationKind::kGeluTanh)) {
    phi = 0.5f * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  } else if (p.kind == static_cast<int>(ActivationKind::kGelu)) {
    phi = 0.5f * (1.0f + erff(g * 0.7071067811865476f));
  } else {
    phi = g > 0.f ? 1.f : 0.f;  // relu
  }
  // The gate's softcap bounds its linear factor only; phi saw the raw (clamped) gate.
  const float lin = p.gate_softcap > 0.f ? p.gate_softcap * tanhf(g / p.gate_softcap) : g;
  float gate = lin * phi;
  if (p.limit_after_act) gate = fminf(gate, p.limit);  // launch-uniform branch (Step3p7's order)
  return gate * u;
}

}  // namespace ft::cuda
