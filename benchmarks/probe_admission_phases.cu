// Where the time of one dedup_and_admit call goes: the library's level kernel and decode kernel
// (4,096 slots, 512 threads), compiled here with a timing hook that records when thread 0 reaches each phase
// (FT_ADMIT_MARK in src/cuda/admission_common.cuh), run in the setting of bench_slot_cache.py:
// E = 128, K = 8 routed ids per call, 64 layers' calls captured in one CUDA graph, the pool aged
// by admitting each layer's resident experts first, the state reset before each replay.
// Prints, per miss share and launch kind, the time per call (graph replay minus the reset, / 64)
// and the median time of each phase ("warm": the block first runs the same call on a scratch copy
// of the pool, so the measured pass finds its instructions in cache; its time per call includes
// both passes); the gap column is from the previous call's last mark to this
// call's first (kernel end, store drain and the next launch). The decode kernel runs twice: with
// int32 ids, and with int64 ids as the library gets torch's top-k indices (bench_slot_cache.py
// passes int64 ids and reads ~0.4 us above this probe's int32 rows: is it the ids?).
// Standalone (CUDA runtime only; the admission headers include no torch):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc benchmarks/probe_admission_phases.cu -o phases
#include <cstdint>
#include <random>
#include <string>

#include "probe_common.cuh"

constexpr int kPhases = 11;  // marks 0-10; in time order: 0 1 2 3 4 10 8 9 5 6 7 (10, 8, 9: calls with misses)
constexpr int kOrder[kPhases] = {0, 1, 2, 3, 4, 10, 8, 9, 5, 6, 7};
constexpr int kCalls = 64;
__device__ unsigned long long g_trace[kCalls][kPhases];   // %globaltimer (ns) per call and phase
__device__ long long g_cycles[kCalls][kPhases];           // clock64 (SM cycles): finer than the timer
__device__ unsigned g_next_call;

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The call index is taken at phase 0 (thread 0 only, so no barrier is needed to read it back).
__device__ __forceinline__ unsigned& call_index() {
  __shared__ unsigned index;
  return index;
}

__device__ unsigned long long g_last_warp_end[kCalls];  // %globaltimer when the last warp ended

// Phase 7 (the end) is also recorded by every warp, so the table can tell thread 0's end from
// the block's (call_index() was written before the call's first barrier).
// Whether this pass of the block records its marks (the warm-up pass of twice_kernel does not).
__device__ __forceinline__ bool& recording() {
  __shared__ bool on;
  return on;
}

#define FT_ADMIT_MARK(phase)                                                    \
  do {                                                                          \
    if (!recording()) break;                                                    \
    if (threadIdx.x == 0) {                                                     \
      if ((phase) == 0) call_index() = atomicAdd(&g_next_call, 1u) % kCalls;    \
      g_trace[call_index()][(phase)] = global_ns();                             \
      g_cycles[call_index()][(phase)] = clock64();                              \
      if ((phase) == 0) g_last_warp_end[call_index()] = 0;                      \
      if ((phase) == 0) g_cycles[call_index()][8] = 0;                          \
      if ((phase) == 0) g_cycles[call_index()][10] = 0;                         \
    }                                                                           \
    if ((phase) == 7 && (threadIdx.x & 31) == 0) {                              \
      atomicMax(&g_last_warp_end[call_index()], global_ns());                   \
    }                                                                           \
  } while (0)

#include "cuda/admission_decode.cuh"
#include "cuda/admission_decode_early.cuh"

using ft::cuda::admission::Args;
constexpr int E = 128, S = 4096, K = 8;

// The library's kernel for this call: the level kernel (kind 0), the decode kernel
// (admission_decode.cuh, 1) or the early decode kernel (admission_decode_early.cuh, 2; its
// block has one more warp), kThreads x kPerThread = S (512 x 8; the decode kernels also 256 x 16,
// FT_DECODE_THREADS).
template <int kKind, int kThreads, int kPerThread, typename id_t>
__device__ __forceinline__ void admit_call(const Args<id_t>& a) {
  if constexpr (kKind == 2) {
    ft::cuda::admission::admit_decode_early<kThreads, kPerThread>(a);
  } else if constexpr (kKind == 1) {
    ft::cuda::admission::admit_decode<kThreads, kPerThread>(a);
  } else {
    ft::cuda::admission::admit_by_level<kThreads, kPerThread>(a);
  }
}

template <int kKind, int kThreads>
__host__ __device__ constexpr int block_threads() {
  return kKind == 2 ? ft::cuda::admission::early_block_threads<kThreads>() : kThreads;
}

template <int kKind, int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(block_threads<kKind, kThreads>()) once_kernel(const Args<id_t> a) {
  if (threadIdx.x == 0) recording() = true;
  __syncthreads();
  admit_call<kKind, kThreads, kPerThread>(a);
}

// The same call after one on a scratch copy of the pool, in the same block: the second pass
// finds the instructions (and the parameters' cache lines) warm on this SM.
template <int kKind, int kThreads, int kPerThread, typename id_t>
__global__ void __launch_bounds__(block_threads<kKind, kThreads>()) twice_kernel(const Args<id_t> scratch, const Args<id_t> a) {
  if (threadIdx.x == 0) recording() = false;
  __syncthreads();
  admit_call<kKind, kThreads, kPerThread>(scratch);
  __syncthreads();
  if (threadIdx.x == 0) recording() = true;
  __syncthreads();
  admit_call<kKind, kThreads, kPerThread>(a);
}

int g_kind = 0;       // which kernel admit() launches (admit_call's kinds)
int g_threads = 512;  // and its stamp threads: 512 x 8 stamps, or (decode kernels) 256 x 16

struct Pool {
  int32_t *slot_of, *owner_of;
  int64_t *last_use, *clock;
  int32_t *slot_ids, *plan_e, *plan_s, *num_copies;
};

size_t smem_bytes(int64_t numel) {  // as slot_cache.cu sizes it
  const int64_t plan_len = std::min<int64_t>(numel, E);
  return ft::cuda::admission::call_state_bytes(E, plan_len);
}

template <typename id_t>
Args<id_t> args_for(const Pool& p, int layer, const id_t* ids, int64_t numel) {
  Args<id_t> a{};
  a.slot_of = p.slot_of, a.owner_of = p.owner_of, a.last_use = p.last_use, a.clock = p.clock;
  a.ids = ids, a.numel = numel, a.layer = layer, a.experts = E, a.slots = S;
  a.fetch_fraction = 1.0, a.protect_lo = 0, a.protect_hi = 0;
  a.slot_ids = p.slot_ids, a.plan_e = p.plan_e, a.plan_s = p.plan_s, a.num_copies = p.num_copies;
  a.plan_len = std::min<int64_t>(numel, E), a.stats = nullptr, a.vector_slots = true;
  return a;
}

// One call; with `scratch`, run twice_kernel (a warm-up call on the scratch pool first).
template <typename id_t>
void admit(cudaStream_t stream, const Pool& p, int layer, const id_t* ids, int64_t numel, bool dependent,
           const Pool* scratch = nullptr) {
  const Args<id_t> a = args_for(p, layer, ids, numel);
  cudaLaunchConfig_t config = {};
  config.gridDim = 1;
  config.blockDim = g_kind == 2 ? ft::cuda::admission::early_block_threads<512>() - 512 + g_threads : g_threads;
  config.dynamicSmemBytes = smem_bytes(numel);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent ? 1 : 0;
  const auto once = g_kind == 0   ? once_kernel<0, 512, 8, id_t>
                    : g_kind == 1 ? (g_threads == 256 ? once_kernel<1, 256, 16, id_t> : once_kernel<1, 512, 8, id_t>)
                                  : (g_threads == 256 ? once_kernel<2, 256, 16, id_t> : once_kernel<2, 512, 8, id_t>);
  const auto twice = g_kind == 0   ? twice_kernel<0, 512, 8, id_t>
                     : g_kind == 1 ? (g_threads == 256 ? twice_kernel<1, 256, 16, id_t> : twice_kernel<1, 512, 8, id_t>)
                                   : (g_threads == 256 ? twice_kernel<2, 256, 16, id_t> : twice_kernel<2, 512, 8, id_t>);
  if (scratch == nullptr) {
    CHECK(cudaLaunchKernelEx(&config, once, a));
  } else {
    CHECK(cudaLaunchKernelEx(&config, twice, args_for(*scratch, layer, ids, numel), a));
  }
}

int main() {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Pool p{}, snapshot{}, scratch{};
  CHECK(cudaMalloc(&p.slot_of, kCalls * E * 4));
  CHECK(cudaMalloc(&p.owner_of, S * 4));
  CHECK(cudaMalloc(&p.last_use, S * 8));
  CHECK(cudaMalloc(&p.clock, 8));
  CHECK(cudaMalloc(&snapshot.slot_of, kCalls * E * 4));
  CHECK(cudaMalloc(&snapshot.owner_of, S * 4));
  CHECK(cudaMalloc(&snapshot.last_use, S * 8));
  CHECK(cudaMalloc(&snapshot.clock, 8));
  CHECK(cudaMalloc(&scratch.slot_of, kCalls * E * 4));
  CHECK(cudaMalloc(&scratch.owner_of, S * 4));
  CHECK(cudaMalloc(&scratch.last_use, S * 8));
  CHECK(cudaMalloc(&scratch.clock, 8));
  CHECK(cudaMalloc(&p.slot_ids, E * 4));
  CHECK(cudaMalloc(&p.plan_e, E * 4));
  CHECK(cudaMalloc(&p.plan_s, E * 4));
  CHECK(cudaMalloc(&p.num_copies, 4));
  int32_t* routing;  // [kCalls][K]
  int64_t* routing64;  // the same ids as int64 (torch's top-k indices, as the library gets them)
  int32_t* resident;  // [kCalls][K], the first n_resident of each row used
  CHECK(cudaMalloc(&routing, kCalls * K * 4));
  CHECK(cudaMalloc(&routing64, kCalls * K * 8));
  CHECK(cudaMalloc(&resident, kCalls * K * 4));
  int max_smem = 0;
  CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  std::printf("\n## dedup_and_admit phases: S %d, E %d, K %d, %d calls per graph\n", S, E, K, kCalls);
  std::printf("%-6s %-9s %8s | %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s %7s (ns, medians)\n", "misses", "launch",
              "us/call", "gap", "wait", "map", "count", "hits", "keys", "lvl-bar", "ranks", "take", "final", "finish", "lastwarp", "gap2");
  std::fflush(stdout);
  const char* out_dir = std::getenv("OUT");
  std::string json = "[";
  // Level kernel; decode kernel with int32 ids; with int64 ids; 256 x 16 with int64 ids; the
  // early decode kernel with int32 ids, int64 ids, 256 x 16 with int64 ids.
  const char* names[] = {"level kernel (admission_level.cuh), 512 x 8, int32 ids",
                         "decode kernel (admission_decode.cuh), 512 x 8, int32 ids",
                         "decode kernel, 512 x 8, int64 ids",
                         "decode kernel, 256 x 16, int64 ids",
                         "early decode kernel (admission_decode_early.cuh), 512 x 8 + routing warp, int32 ids",
                         "early decode kernel, 512 x 8 + routing warp, int64 ids",
                         "early decode kernel, 256 x 16 + routing warp, int64 ids"};
  const char* json_names[] = {"level", "decode", "decode_int64_ids", "decode_256x16_int64_ids",
                              "early", "early_int64_ids", "early_256x16_int64_ids"};
  for (const int kernel : {0, 1, 2, 3, 4, 5, 6})
  for (int misses : {0, 2, 8}) {
    const bool long_ids = kernel == 2 || kernel == 3 || kernel >= 5;
    g_kind = kernel == 0 ? 0 : kernel <= 3 ? 1 : 2;
    g_threads = kernel == 3 || kernel == 6 ? 256 : 512;
    if (misses == 0) std::printf("### %s\n", names[kernel]);
    std::mt19937 rng(4096 * 1000 + misses);
    std::vector<int32_t> route(kCalls * K), res(kCalls * K);
    std::vector<int> n_resident(kCalls, K - misses);
    for (int l = 0; l < kCalls; ++l) {
      std::vector<int32_t> all(E);
      for (int e = 0; e < E; ++e) all[e] = e;
      std::shuffle(all.begin(), all.end(), rng);
      for (int k = 0; k < K; ++k) route[l * K + k] = all[k];
      std::shuffle(all.begin(), all.begin() + K, rng);
      for (int k = 0; k < K; ++k) res[l * K + k] = all[k];
    }
    CHECK(cudaMemcpy(routing, route.data(), route.size() * 4, cudaMemcpyHostToDevice));
    const std::vector<int64_t> route64(route.begin(), route.end());
    CHECK(cudaMemcpy(routing64, route64.data(), route64.size() * 8, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(resident, res.data(), res.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(p.slot_of, 0xff, kCalls * E * 4));
    CHECK(cudaMemset(p.owner_of, 0xff, S * 4));
    CHECK(cudaMemset(p.last_use, 0, S * 8));
    CHECK(cudaMemset(p.clock, 0, 8));
    for (int l = 0; l < kCalls; ++l) {  // age the pool: each layer's residents admitted once
      if (n_resident[l] > 0) admit(stream, p, l, resident + l * K, n_resident[l], false);
    }
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaMemcpy(snapshot.slot_of, p.slot_of, kCalls * E * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(snapshot.owner_of, p.owner_of, S * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(snapshot.last_use, p.last_use, S * 8, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(snapshot.clock, p.clock, 8, cudaMemcpyDeviceToDevice));
    auto reset = [&] {
      CHECK(cudaMemcpyAsync(p.slot_of, snapshot.slot_of, kCalls * E * 4, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaMemcpyAsync(p.owner_of, snapshot.owner_of, S * 4, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaMemcpyAsync(p.last_use, snapshot.last_use, S * 8, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaMemcpyAsync(p.clock, snapshot.clock, 8, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaMemcpyAsync(scratch.slot_of, snapshot.slot_of, kCalls * E * 4, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaMemcpyAsync(scratch.owner_of, snapshot.owner_of, S * 4, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaMemcpyAsync(scratch.last_use, snapshot.last_use, S * 8, cudaMemcpyDeviceToDevice, stream));
      CHECK(cudaMemcpyAsync(scratch.clock, snapshot.clock, 8, cudaMemcpyDeviceToDevice, stream));
    };
    scratch.slot_ids = p.slot_ids, scratch.plan_e = p.plan_e, scratch.plan_s = p.plan_s, scratch.num_copies = p.num_copies;
    for (int mode : {0, 1, 2}) {  // ordinary launch, dependent launch, dependent + warm-up pass
      const bool dependent = mode > 0;
      const Pool* warm = mode == 2 ? &scratch : nullptr;
      cudaGraph_t g_both, g_reset;
      cudaGraphExec_t both, only_reset;
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      reset();
      for (int l = 0; l < kCalls; ++l) {
        if (long_ids) {
          admit(stream, p, l, routing64 + l * K, K, dependent, warm);
        } else {
          admit(stream, p, l, routing + l * K, K, dependent, warm);
        }
      }
      CHECK(cudaStreamEndCapture(stream, &g_both));
      CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      reset();
      CHECK(cudaStreamEndCapture(stream, &g_reset));
      CHECK(cudaGraphInstantiate(&both, g_both, 0));
      CHECK(cudaGraphInstantiate(&only_reset, g_reset, 0));
      const float us = (median_replay_us(both, stream) - median_replay_us(only_reset, stream)) / kCalls;
      // One more replay, its trace read back: calls are in launch order (the counter wraps at kCalls).
      unsigned zero = 0;
      CHECK(cudaMemcpyToSymbol(g_next_call, &zero, sizeof(zero)));
      CHECK(cudaGraphLaunch(both, stream));
      CHECK(cudaStreamSynchronize(stream));
      unsigned long long trace[kCalls][kPhases];
      CHECK(cudaMemcpyFromSymbol(trace, g_trace, sizeof(trace)));
      int copies = 0;
      CHECK(cudaMemcpy(&copies, p.num_copies, 4, cudaMemcpyDeviceToHost));
      long long cycles[kCalls][kPhases];
      CHECK(cudaMemcpyFromSymbol(cycles, g_cycles, sizeof(cycles)));
      // Phases within a call are on one SM: clock64 deltas, turned into ns with the ratio of the
      // timer to the cycles summed over all calls (the timer alone may tick coarsely). The gap
      // spans two SMs: timer only.
      double timer_sum = 0, cycle_sum = 0;
      for (int c = 0; c < kCalls; ++c) {
        timer_sum += double(trace[c][7]) - double(trace[c][0]);
        cycle_sum += double(cycles[c][7]) - double(cycles[c][0]);
      }
      const double ns_per_cycle = timer_sum / cycle_sum;
      unsigned long long warp_end[kCalls];
      CHECK(cudaMemcpyFromSymbol(warp_end, g_last_warp_end, sizeof(warp_end)));
      std::vector<std::vector<double>> d(kPhases + 2);  // + the last warp after thread 0, the gap after it
      for (int c = 0; c < kCalls; ++c) {  // the early kernel's thread 0 routes: it keys no stamps (mark 10)
        if (cycles[c][10] == 0 && cycles[c][8] != 0) cycles[c][10] = cycles[c][4];
      }
      for (int c = 1; c < kCalls; ++c) {
        d[0].push_back(double(trace[c][0]) - double(trace[c - 1][7]));
        for (int i = 1; i < kPhases; ++i) {
          const int ph = kOrder[i], prev = kOrder[i - 1];
          // Calls without misses skip marks 10, 8 and 9: their phases count as 0.
          const auto miss_mark = [](int m) { return m == 10 || m == 8 || m == 9; };
          const bool skipped = (miss_mark(ph) || miss_mark(prev)) && cycles[c][8] == 0;
          const long long from = prev == 9 && skipped ? cycles[c][4] : cycles[c][prev];
          d[i].push_back(skipped && miss_mark(ph) ? 0.0 : (cycles[c][ph] - from) * ns_per_cycle);
        }
        d[kPhases].push_back(double(warp_end[c]) - double(trace[c][7]));
        d[kPhases + 1].push_back(double(trace[c][0]) - double(warp_end[c - 1]));
      }
      const char* launch = mode == 0 ? "ordinary" : mode == 1 ? "dependent" : "warm";
      std::printf("%-6d %-9s %8.2f |", misses, launch, us);
      json += std::string(json.size() > 1 ? ", " : "") + "{\"kernel\": \"" + json_names[kernel] +
              "\", \"misses\": " + std::to_string(misses) +
              ", \"launch\": \"" + launch + "\", \"us_per_call\": " + std::to_string(us) +
              ", \"last_call_copies\": " + std::to_string(copies) + ", \"phase_ns\": [";
      std::string means;
      for (int ph = 0; ph < kPhases + 2; ++ph) {
        double mean = 0;
        for (double v : d[ph]) mean += v / d[ph].size();
        std::sort(d[ph].begin(), d[ph].end());
        const double median = d[ph][d[ph].size() / 2];
        std::printf(" %7.0f", median);
        json += (ph ? ", " : "") + std::to_string(median);
        means += (ph ? ", " : "") + std::to_string(mean);
      }
      json += "], \"phase_ns_mean\": [" + means + "]}";
      std::printf("  mean %s\n", means.c_str());
      std::printf("   (last call admitted %d; %.3f ns per cycle)\n", copies, ns_per_cycle);
      CHECK(cudaGraphExecDestroy(both));
      CHECK(cudaGraphExecDestroy(only_reset));
      CHECK(cudaGraphDestroy(g_both));
      CHECK(cudaGraphDestroy(g_reset));
    }
  }
  json += "]";
  std::printf("decode kernel: map = the routing warp's ids, map and stamps (one round trip; the other warps load "
              "theirs beside it); count = its dedup, hits and ranks; hits = the first barrier (the other warps' "
              "arrival); keys = thread 0's keys and its warp's first level; lvl-bar = the second barrier and the "
              "first level read\n");
  std::printf("phases: gap = previous call's end mark to this call's first; wait = griddepcontrol.wait; map = layer map "
              "into shared memory; count = ids counted; hits = hits stamped (+ stamps loaded, first level); keys = "
              "(level kernel: nothing, done before mark 4); lvl-bar = a level's pass and barrier; ranks = its ranks; take = victims taken (marks 8-9 are the last level's); final = the barrier before finish and the slot ids rewritten; finish = thread 0 writes the "
              "count and the clock; lastwarp = the block's last warp ends after thread 0; gap2 = the previous call's last "
              "warp to this call's first mark\n");
  const std::string path = std::string(out_dir ? out_dir : ".") + "/admission_phases.json";
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "%s\n", json.c_str());
    std::fclose(f);
  }
  (void)max_smem;
  return 0;
}
