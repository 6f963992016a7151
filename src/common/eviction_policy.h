// The slot pool's eviction policies (ft_ops/policies.py), shared by the CPU and CUDA kernels. No
// torch headers here, so the CUDA admission kernels can include it.
#pragma once

#include <cstdint>

#include "admitted_count.h"  // FT_HOST_DEVICE

namespace ft {

enum class EvictionPolicy : int64_t { kLru = 0, kOpportunity = 1 };

// A streamed row's stamp under kOpportunity (the pool's clock starts at 1, so no call stamps it).
constexpr int64_t kStreamedStamp = 1;

// A slot's victim key (victims in ascending (key, slot)): LRU, the stamp; opportunity, with
// a = now - 1 - last_use (one call per layer per decode token), now - L floor(a / L) + (a mod L):
// the most missed turns of its layer first, and among those the most recently used (its next turn
// is the farthest); free slots (0) and streamed rows (1) first. Keys stay below now + layers.
// Only for eligible slots (last_use < now): C++ division truncates, so a < 0 would not give the
// reference's (floored) key. Under kOpportunity the pool's clock must have started at 1.
FT_HOST_DEVICE inline int64_t victim_key(int64_t last_use, int64_t now, int64_t layers, bool opportunity) {
  if (!opportunity || last_use <= kStreamedStamp) return last_use;
  const int64_t a = now - 1 - last_use;
  return now - layers * (a / layers) + a % layers;
}

}  // namespace ft
