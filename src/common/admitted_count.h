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

// How a call's misses divide between the link (admitted: copied, computed on the device) and the
// CPU share (left at -1). Either a fixed fraction, or, when cpu_expert > 0, from the costs of this
// machine in units of one expert's copy over the link: the CPU share of n experts takes
// cpu_call + n * cpu_expert (its fixed cost per call, then per expert) while the device copies
// the rest, so the call takes max(fetched, cpu_call + left * cpu_expert) (0 for the CPU when it has
// nothing). An expert the CPU computes is not admitted, so the next token that routes it misses
// again: each one left to the CPU also costs `recopy` later copies (recopy_share), added to the
// call's time. The count with the least total is taken (ties: more fetched).
struct FetchSplit {
  double fraction = 1.0;
  double cpu_expert = 0.0;
  double cpu_call = 0.0;
  double recopy = 0.0;      // recopy_share of the layer's counters, filled in by the kernel
  double compulsory = 0.0;  // compulsory_misses of the pool, filled in on the host
};

// A layer's share of the pool, slots / layers: misses that fill the cache (recopy_share).
inline double compulsory_misses(int64_t slots, int64_t layers) {
  return static_cast<double>(slots) / static_cast<double>(layers);
}

// Columns of an admission counters row (ft_ops/stats.py) that the split reads: distinct experts
// per call (summed), admitted misses, and experts left to the CPU (cpu_share_submit adds those).
constexpr int kStatsDistinct = 2, kStatsAdmitted = 3, kStatsCpuExperts = 5;
constexpr int kStatsSplitColumns = kStatsCpuExperts + 1;

// a * b and a + b rounded alone on both devices (nvcc would fuse them into one FMA, which rounds
// once, so a tie could fall differently on the CPU and the GPU).
FT_HOST_DEVICE inline double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
FT_HOST_DEVICE inline double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
// The same in float32, and a / b (IEEE-rounded even under --use_fast_math); the hit-density
// eviction policy (eviction_policy.h) keys and updates with them.
FT_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FT_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FT_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FT_HOST_DEVICE inline double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// The later copies that one expert left to the CPU costs, from the layer's counters so far: its
// hits per miss (an admitted expert is hit that many times on average before it is evicted; not
// admitted, its next use misses and is copied then), at most 1. The layer's first `compulsory`
// misses (its share of the pool, slots / layers) fill the cache rather than say anything about
// reuse, so they are not counted: until the layer has missed more, the share is 1 and a cold cache
// is filled over the link, not left to the CPU. 0 without counters (`counters` nullptr: else a row
// of at least kStatsSplitColumns int64).
FT_HOST_DEVICE inline double recopy_share(int64_t distinct, int64_t admitted, int64_t cpu_experts, double compulsory) {
  const int64_t misses = admitted + cpu_experts;
  const double counted = add_rn(static_cast<double>(misses), -compulsory);
  if (counted <= 0.0) return 1.0;
  const int64_t hits = distinct - misses;
  if (hits <= 0) return 0.0;
  const double r = div_rn(static_cast<double>(hits), counted);
  return r < 1.0 ? r : 1.0;
}
FT_HOST_DEVICE inline double recopy_share(const int64_t* counters, double compulsory) {
  return counters == nullptr ? 0.0
                             : recopy_share(counters[kStatsDistinct], counters[kStatsAdmitted],
                                            counters[kStatsCpuExperts], compulsory);
}

FT_HOST_DEVICE inline double split_cost(int64_t fetched, int64_t misses, const FetchSplit& s) {
  const double link = static_cast<double>(fetched);
  const int64_t left = misses - fetched;
  const double cpu = left > 0 ? add_rn(s.cpu_call, mul_rn(static_cast<double>(left), s.cpu_expert)) : 0.0;
  const double now = link > cpu ? link : cpu;
  return left > 0 ? add_rn(now, mul_rn(static_cast<double>(left), s.recopy)) : now;
}

// The number of admitted misses, computed identically on every device so CPU and CUDA admit the
// same count: floor(m * fraction + 0.5), or with CPU costs the count of least split_cost among
// the neighbours of the balance point and m itself (below the balance point the cost falls as
// more are fetched, above it it rises, re-copies included, so the least is among those three).
FT_HOST_DEVICE inline int64_t admitted_count(int64_t misses, const FetchSplit& s) {
  if (s.cpu_expert <= 0.0) {
    const double f = add_rn(mul_rn(static_cast<double>(misses), s.fraction), 0.5);
    int64_t n = static_cast<int64_t>(f);  // f >= 0, so truncation is floor
    return n < 0 ? 0 : (n > misses ? misses : n);
  }
  // fetched = cpu_call + (m - fetched) * cpu_expert at the balance point.
  const double balance = add_rn(s.cpu_call, mul_rn(static_cast<double>(misses), s.cpu_expert)) / add_rn(1.0, s.cpu_expert);
  int64_t lo = static_cast<int64_t>(balance);  // balance >= 0: floor
  if (lo > misses) lo = misses;
  const int64_t hi = lo + 1 > misses ? misses : lo + 1;
  int64_t best = misses;
  double best_cost = split_cost(misses, misses, s);
  for (const int64_t n : {hi, lo}) {
    const double c = split_cost(n, misses, s);
    if (c < best_cost) best = n, best_cost = c;
  }
  return best;
}

}  // namespace ft
