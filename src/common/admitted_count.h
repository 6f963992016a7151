// How many misses an admission call admits, shared by the CPU and CUDA kernels. No torch
// headers here, so the CUDA admission kernels need none.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FT_HOST_DEVICE __host__ __device__
#else
#define FT_HOST_DEVICE
#endif

namespace ft {

// The number of admitted misses: F = floor(m * fetch_fraction + 0.5), computed identically on
// every device so CPU and CUDA admit the same count.
FT_HOST_DEVICE inline int64_t admitted_count(int64_t misses, double fetch_fraction) {
  const double f = static_cast<double>(misses) * fetch_fraction + 0.5;
  int64_t n = static_cast<int64_t>(f);  // f >= 0, so truncation is floor
  return n < 0 ? 0 : (n > misses ? misses : n);
}

}  // namespace ft
