// The expert activations on float32 gate/up values, shared by the CUDA expert_gemm kernels.
#pragma once

#include "../common/checks.h"

namespace ft::cuda {

__device__ __forceinline__ float activate(float g, float u, int act) {
  if (act == static_cast<int>(Activation::kSilu)) return g / (1.0f + __expf(-g)) * u;
  if (act == static_cast<int>(Activation::kGeluTanh)) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
  }
  g = fminf(g, kSwigluOaiLimit);
  u = fmaxf(fminf(u, kSwigluOaiLimit), -kSwigluOaiLimit);
  return (u + 1.0f) * g / (1.0f + __expf(-kSwigluOaiAlpha * g));
}

}  // namespace ft::cuda
