// What a one-block admission kernel cannot go below on this GPU: the pieces its time is made of,
// each measured alone in the setting of bench_slot_cache.py (64 dependent launches of one block
// of 512 threads captured in a CUDA graph, time per launch = graph replay / 64).
//   - an empty kernel: the launch gap between dependent kernels;
//   - n block barriers;
//   - n dependent global round trips (each load's address comes from the previous load; L2 hits);
//   - loading B bytes into one SM with 16-byte loads, then one block-wide minimum (the stamps and
//     owners a call with misses loads: 48 KB at 4,096 slots);
//   - the same B bytes loaded by B / 12 KB blocks of 512 threads (does spreading the load over
//     SMs help?);
//   - programmatic dependent launch (the next kernel scheduled while the previous one runs), and
//     an L1 prefetch of the stamps at kernel start, on a kernel shaped like admission with misses;
//   - how loads are laid out (per-thread contiguous, coalesced, bulk copy to shared memory);
//   - a cluster of 4 or 8 blocks sharing the stamps, with cluster barriers (the price of a
//     multi-block admission);
//   - in SM cycles: one warp's dedup of a decode call's ids (admission_decode.cuh's routing warp)
//     with __match_any_sync or with shuffles.
// Standalone (CUDA runtime only): benchmarks/gpu_check.sh probe-floor builds and runs it; it prints a
// table and writes admission_floor.json to $OUT (or the working directory).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc benchmarks/probe_admission_floor.cu -o probe_floor
#include <cooperative_groups.h>

#include <string>

#include "cuda/admission_decode.cuh"
#include "cuda/wait_for_previous_kernel.cuh"
#include "probe_common.cuh"

constexpr int kThreads = 512;
constexpr int kLaunches = 64;

__device__ __forceinline__ unsigned min_of(const uint4& w) { return min(min(w.x, w.y), min(w.z, w.w)); }

// The block's minimum of `least` (every thread gets it), with one barrier, as admission's first
// level takes it.
__device__ __forceinline__ unsigned block_min(unsigned least) {
  __shared__ unsigned warp_min[kThreads / 32];
  least = __reduce_min_sync(0xffffffffu, least);
  if ((threadIdx.x & 31) == 0) warp_min[threadIdx.x >> 5] = least;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  return __reduce_min_sync(0xffffffffu, lane < kThreads / 32 ? warp_min[lane] : 0xffffffffu);
}

__global__ void empty_kernel(int* sink) {
  if (threadIdx.x == 0 && sink[0] == -12345) sink[1] = 0;  // a read, so the launch is not elided
}

__global__ void barrier_kernel(int* sink, int barriers) {
  int v = threadIdx.x;
  for (int i = 0; i < barriers; ++i) {
    v += i;
    __syncthreads();
  }
  if (v == -1) sink[0] = v;
}

// Thread 0 follows a chain of `hops` dependent loads through `next` (a permutation), then the
// block waits for it, as admission waits for its map before the count.
__global__ void round_trip_kernel(const int* __restrict__ next, int* sink, int hops) {
  __shared__ int result;
  if (threadIdx.x == 0) {
    int at = 0;
    for (int i = 0; i < hops; ++i) at = next[at];
    result = at;
  }
  __syncthreads();
  if (threadIdx.x == 0 && result == -1) sink[0] = result;
}

// Every thread loads its contiguous share of `words` 16-byte words, takes the minimum of their
// first 32-bit lanes, and the block reduces it (one barrier), like the first level of admission.
__global__ void load_min_kernel(const uint4* __restrict__ data, int words_per_block, int* sink) {
  const uint4* mine = data + static_cast<size_t>(blockIdx.x) * words_per_block;
  const int per_thread = words_per_block / kThreads;
  unsigned least = 0xffffffffu;
  for (int i = 0; i < per_thread; ++i) least = min(least, min_of(mine[threadIdx.x * per_thread + i]));
  least = block_min(least);
  if (threadIdx.x == 0 && least == 0xfffffffeu) sink[blockIdx.x] = static_cast<int>(least);
}

// Launched as a programmatic dependent launch (the library's device side of it).
__global__ void empty_dependent_kernel(int* sink) {
  ft::cuda::wait_for_previous_kernel();
  if (threadIdx.x == 0 && sink[0] == -12345) sink[1] = 0;
}

// Admission's shape in miniature: one dependent round trip (the map and ids) and a barrier, then
// every thread loads its share of the stamps and owners (`words` 16-byte words) and the block
// takes the minimum. With `prefetch`, each thread first asks L1 for its share's lines (as
// an FT_ADMIT_PREFETCH option of the kernel did in session 5, measured slower and removed), so the
// loads after the barrier may hit L1.
template <bool kPrefetch, bool kDependent>
__global__ void round_trip_then_load_kernel(const int* __restrict__ next, const uint4* __restrict__ data,
                                            int words, int* sink) {
  __shared__ int result;
  if (kDependent) ft::cuda::wait_for_previous_kernel();
  const int per_thread = words / kThreads;
  const uint4* mine = data + threadIdx.x * per_thread;
  if (kPrefetch) {
    for (int i = 0; i < per_thread; i += 8) asm volatile("prefetch.global.L1 [%0];" ::"l"(mine + i));
  }
  if (threadIdx.x == 0) result = next[0];
  __syncthreads();
  unsigned least = 0xffffffffu;
  if (result != -1) {
    for (int i = 0; i < per_thread; ++i) least = min(least, min_of(mine[i]));
  }
  least = block_min(least);
  if (threadIdx.x == 0 && least == 0xfffffffeu) sink[0] = static_cast<int>(least);
}

// How the stamps reach the block (kBytes in all), each followed by a block-wide minimum:
//   kThreadContiguous: thread t loads 16-byte words [t * n, (t + 1) * n) (the level kernel's layout);
//   kCoalesced: thread t loads words t + i * kThreads (each warp instruction reads 512 bytes in a row);
//   kBulk: one thread starts a bulk copy (TMA) of all bytes into shared memory, the block waits on
//     its mbarrier, then reads the words coalesced from shared memory.
// With kRoundTripFirst the block first does one dependent global load and a barrier (admission's
// prologue) and, for kBulk, the copy is started before that prologue (at kernel start).
enum LoadMode { kThreadContiguous, kCoalesced, kBulk };

__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  const unsigned dst_s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const unsigned bar_s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_s), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst_s), "l"(src), "r"(bytes), "r"(bar_s) : "memory");
}

__device__ __forceinline__ void wait_phase0(unsigned long long* bar) {
  const unsigned bar_s = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar_s) : "memory");
  }
}

template <LoadMode kMode, int kBytes, bool kRoundTripFirst>
__global__ void __launch_bounds__(kThreads) load_pattern_kernel(const int* __restrict__ next, const uint4* __restrict__ data, int* sink) {
  constexpr int kWords = kBytes / 16, kPer = kWords / kThreads;
  static_assert(kWords % kThreads == 0, "whole words per thread");
  extern __shared__ __align__(128) uint4 staged[];
  __shared__ __align__(8) unsigned long long bar;
  __shared__ int result;
  if (kMode == kBulk && threadIdx.x == 0) {
    const unsigned bar_s = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    bulk_copy_to_shared(staged, data, kBytes, &bar);
  }
  if (kRoundTripFirst && threadIdx.x == 0) result = next[0];
  __syncthreads();
  if (kRoundTripFirst && result == -1) return;
  uint4 w[kPer];
  if (kMode == kThreadContiguous) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) w[i] = data[threadIdx.x * kPer + i];
  } else if (kMode == kCoalesced) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) w[i] = data[i * kThreads + threadIdx.x];
  } else {
    wait_phase0(&bar);
#pragma unroll
    for (int i = 0; i < kPer; ++i) w[i] = staged[i * kThreads + threadIdx.x];
  }
  unsigned least = 0xffffffffu;
#pragma unroll
  for (int i = 0; i < kPer; ++i) least = min(least, min_of(w[i]));
  least = block_min(least);
  if (threadIdx.x == 0 && least == 0xfffffffeu) sink[0] = static_cast<int>(least);
}

// A cluster of blocks (thread block clusters, sm_90) splitting the stamps: each block loads its
// share coalesced and takes its minimum, then block 0 gathers the minima through distributed
// shared memory, with `barriers` cluster barriers in all (what a 4-block admission would pay to
// combine a level across blocks). With words == 0 only the barriers.
__global__ void cluster_kernel(const uint4* __restrict__ data, int words_per_block, int barriers, int* sink) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ unsigned block_minima[16];
  unsigned least = 0xffffffffu;
  for (int i = threadIdx.x; i < words_per_block; i += kThreads) {
    least = min(least, min_of(data[static_cast<size_t>(blockIdx.x) * words_per_block + i]));
  }
  least = block_min(least);
  if (threadIdx.x == 0) *cluster.map_shared_rank(&block_minima[cluster.block_rank()], 0) = least;
  for (int b = 0; b < barriers; ++b) cluster.sync();
  if (cluster.block_rank() == 0 && threadIdx.x == 0) {
    unsigned all = 0xffffffffu;
    for (unsigned r = 0; r < cluster.num_blocks(); ++r) all = min(all, block_minima[r]);
    if (all == 0xfffffffeu) sink[0] = static_cast<int>(all);
  }
}

// kernel<<<grid, kThreads, 0, stream>>>(args...) with one launch attribute.
template <typename... KernelArgs, typename... Args>
void launch_with(cudaStream_t stream, int grid, cudaLaunchAttribute attribute, void (*kernel)(KernelArgs...),
                 Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = kThreads;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

// One cluster of `blocks` blocks.
void launch_cluster(cudaStream_t stream, int blocks, const uint4* data, int words_per_block, int barriers, int* sink) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = blocks;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  launch_with(stream, blocks, attribute, cluster_kernel, data, words_per_block, barriers, sink);
}

// A programmatic dependent launch.
template <typename... KernelArgs, typename... Args>
void launch_dependent(cudaStream_t stream, int grid, void (*kernel)(KernelArgs...), Args... args) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  launch_with(stream, grid, attribute, kernel, args...);
}

// Time per launch of `launch` when kLaunches of them run back to back in one CUDA graph.
template <typename Launch>
float us_per_launch(cudaStream_t stream, Launch launch) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kLaunches; ++i) launch(stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const float us = median_replay_us(exec, stream) / kLaunches;
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return us;
}

// SM cycles of one warp's dedup of `numel` ids (the decode kernel's routing warp), 64 rounds each
// depending on the last, by method: 0 __match_any_sync with every unrouted lane its own key (as
// the decode kernel had it), 1 __match_any_sync with the unrouted lanes sharing one key, 2 one
// shuffle per routed lane behind a test of the lane against numel, 3 the decode kernel's
// over_routed_lanes (shuffles in groups of 8 with no branch between them).
template <int kMethod>
__global__ void warp_dedup_kernel(const int* ids, int numel, long long* cycles, int* sink) {
  const int lane = threadIdx.x;
  int key = lane < numel ? ids[lane] : -1 - lane;
  unsigned acc = 0;
  __syncwarp();
  const long long t0 = clock64();
  for (int round = 0; round < 64; ++round) {
    unsigned peers = 0;
    if constexpr (kMethod == 0) {
      peers = __match_any_sync(0xffffffffu, key);
    } else if constexpr (kMethod == 1) {
      peers = __match_any_sync(0xffffffffu, lane < numel ? key : -1);
    } else if constexpr (kMethod == 3) {
      ft::cuda::admission::over_routed_lanes(key, numel, [&](int j, int other) {
        peers |= static_cast<unsigned>(j < numel && other == key) << j;
      });
    } else {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (j >= numel) break;
        peers |= static_cast<unsigned>(__shfl_sync(0xffffffffu, key, j) == key) << j;
      }
    }
    acc += peers;
    key ^= static_cast<int>(peers & 0x80000000u);  // the next round waits for this one's result
  }
  const long long t1 = clock64();
  if (lane == 0) cycles[0] = (t1 - t0) / 64;
  if (acc == 12345u) sink[0] = 1;
}

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int* sink;
  CHECK(cudaMalloc(&sink, 4096 * sizeof(int)));
  CHECK(cudaMemset(sink, 0, 4096 * sizeof(int)));
  // A random cycle through 1 Mi ints for the dependent loads (each hop lands on another line).
  const int chain = 1 << 20;
  std::vector<int> perm(chain), next(chain);
  for (int i = 0; i < chain; ++i) perm[i] = i;
  srand(1);
  for (int i = chain - 1; i > 0; --i) std::swap(perm[i], perm[rand() % (i + 1)]);
  for (int i = 0; i < chain; ++i) next[perm[i]] = perm[(i + 1) % chain];
  int* next_d;
  CHECK(cudaMalloc(&next_d, chain * sizeof(int)));
  CHECK(cudaMemcpy(next_d, next.data(), chain * sizeof(int), cudaMemcpyHostToDevice));
  const size_t max_bytes = 192 << 10;
  uint4* data;
  CHECK(cudaMalloc(&data, max_bytes));
  CHECK(cudaMemset(data, 0x7f, max_bytes));

  struct Row {
    std::string what;
    float us;
  };
  std::vector<Row> rows;
  const float empty = us_per_launch(stream, [&](cudaStream_t s) { empty_kernel<<<1, kThreads, 0, s>>>(sink); });
  rows.push_back({"empty kernel (launch gap)", empty});
  rows.push_back({"empty kernel, dependent launch", us_per_launch(stream, [&](cudaStream_t s) {
                    launch_dependent(s, 1, empty_dependent_kernel, sink);
                  })});
  {
    const int words = (48 << 10) / 16;
    rows.push_back({"round trip, barrier, load 48 KB", us_per_launch(stream, [&](cudaStream_t s) {
                      round_trip_then_load_kernel<false, false><<<1, kThreads, 0, s>>>(next_d, data, words, sink);
                    })});
    rows.push_back({"  the same, L1 prefetch at start", us_per_launch(stream, [&](cudaStream_t s) {
                      round_trip_then_load_kernel<true, false><<<1, kThreads, 0, s>>>(next_d, data, words, sink);
                    })});
    rows.push_back({"  the same, dependent launch", us_per_launch(stream, [&](cudaStream_t s) {
                      launch_dependent(s, 1, round_trip_then_load_kernel<false, true>, next_d, data, words, sink);
                    })});
    rows.push_back({"  the same, prefetch + dependent launch", us_per_launch(stream, [&](cudaStream_t s) {
                      launch_dependent(s, 1, round_trip_then_load_kernel<true, true>, next_d, data, words, sink);
                    })});
  }
  {
    const auto add = [&](const char* what, auto kernel, int bytes) {
      const int smem = bytes + 16;
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      rows.push_back({what, us_per_launch(stream, [&](cudaStream_t s) { kernel<<<1, kThreads, smem, s>>>(next_d, data, sink); })});
    };
    add("32 KB thread-contiguous", load_pattern_kernel<kThreadContiguous, 32768, false>, 32768);
    add("32 KB coalesced", load_pattern_kernel<kCoalesced, 32768, false>, 32768);
    add("32 KB bulk copy to shared", load_pattern_kernel<kBulk, 32768, false>, 32768);
    add("48 KB thread-contiguous", load_pattern_kernel<kThreadContiguous, 49152, false>, 49152);
    add("48 KB coalesced", load_pattern_kernel<kCoalesced, 49152, false>, 49152);
    add("48 KB bulk copy to shared", load_pattern_kernel<kBulk, 49152, false>, 49152);
    add("round trip, 32 KB thread-contiguous", load_pattern_kernel<kThreadContiguous, 32768, true>, 32768);
    add("round trip, 32 KB coalesced", load_pattern_kernel<kCoalesced, 32768, true>, 32768);
    add("bulk 32 KB started, round trip, wait", load_pattern_kernel<kBulk, 32768, true>, 32768);
    add("bulk 48 KB started, round trip, wait", load_pattern_kernel<kBulk, 49152, true>, 49152);
  }
  for (int barriers : {1, 2, 8}) {
    rows.push_back({"cluster of 4 blocks, " + std::to_string(barriers) + " cluster barriers",
                    us_per_launch(stream, [&](cudaStream_t s) { launch_cluster(s, 4, data, 0, barriers, sink); })});
  }
  rows.push_back({"cluster of 4, 8 KB coalesced each, 2 barriers", us_per_launch(stream, [&](cudaStream_t s) {
                    launch_cluster(s, 4, data, (8 << 10) / 16, 2, sink);
                  })});
  rows.push_back({"cluster of 8, 4 KB coalesced each, 2 barriers", us_per_launch(stream, [&](cudaStream_t s) {
                    launch_cluster(s, 8, data, (4 << 10) / 16, 2, sink);
                  })});
  for (int n : {2, 4, 8, 16}) {
    rows.push_back({std::to_string(n) + " barriers", us_per_launch(stream, [&](cudaStream_t s) {
                      barrier_kernel<<<1, kThreads, 0, s>>>(sink, n);
                    })});
  }
  for (int hops : {1, 2, 4, 8}) {
    rows.push_back({std::to_string(hops) + " dependent loads", us_per_launch(stream, [&](cudaStream_t s) {
                      round_trip_kernel<<<1, kThreads, 0, s>>>(next_d, sink, hops);
                    })});
  }
  for (int kb : {12, 24, 48, 96, 192}) {
    const int words = (kb << 10) / 16;
    rows.push_back({"load " + std::to_string(kb) + " KB in 1 block + min", us_per_launch(stream, [&](cudaStream_t s) {
                      load_min_kernel<<<1, kThreads, 0, s>>>(data, words, sink);
                    })});
  }
  for (int kb : {48, 192}) {
    const int blocks = kb / 12;
    rows.push_back({"load " + std::to_string(kb) + " KB in " + std::to_string(blocks) + " blocks + min",
                    us_per_launch(stream, [&](cudaStream_t s) {
                      load_min_kernel<<<blocks, kThreads, 0, s>>>(data, (12 << 10) / 16, sink);
                    })});
  }

  // One warp's dedup in SM cycles (not launches): ids 0, 1, 2, ... as a decode call routes them.
  struct DedupRow {
    const char* method;
    int numel;
    long long cycles;
  };
  std::vector<DedupRow> dedup_rows;
  {
    int* ids;
    long long* cycles;
    CHECK(cudaMalloc(&ids, 32 * sizeof(int)));
    CHECK(cudaMalloc(&cycles, sizeof(long long)));
    std::vector<int> host_ids(32);
    for (int i = 0; i < 32; ++i) host_ids[i] = (i * 37) % 128;
    CHECK(cudaMemcpy(ids, host_ids.data(), 32 * sizeof(int), cudaMemcpyHostToDevice));
    const auto run = [&](const char* method, auto kernel, int numel) {
      long long best = 1LL << 60;
      for (int rep = 0; rep < 5; ++rep) {
        kernel<<<1, 32, 0, stream>>>(ids, numel, cycles, sink);
        long long c = 0;
        CHECK(cudaMemcpyAsync(&c, cycles, sizeof(c), cudaMemcpyDeviceToHost, stream));
        CHECK(cudaStreamSynchronize(stream));
        best = std::min(best, c);
      }
      dedup_rows.push_back({method, numel, best});
    };
    for (int numel : {8, 32}) {
      run("match_any, unrouted lanes distinct", warp_dedup_kernel<0>, numel);
      run("match_any, unrouted lanes one key", warp_dedup_kernel<1>, numel);
      run("shuffle per routed lane, tested", warp_dedup_kernel<2>, numel);
      run("shuffles in groups of 8 (decode kernel)", warp_dedup_kernel<3>, numel);
    }
    CHECK(cudaFree(ids));
    CHECK(cudaFree(cycles));
  }
  std::printf("\n## admission floor on %s: one block of %d threads unless said, %d dependent launches per graph\n",
              prop.name, kThreads, kLaunches);
  std::printf("%-40s %10s %18s\n", "kernel", "us/launch", "minus empty (us)");
  for (const Row& r : rows) std::printf("%-40s %10.2f %18.2f\n", r.what.c_str(), r.us, r.us - empty);
  std::printf("\n## one warp's dedup of a decode call's ids (SM cycles per dedup, best of 5 runs of 64 dependent rounds)\n");
  std::printf("%-40s %6s %8s\n", "method", "ids", "cycles");
  for (const DedupRow& r : dedup_rows) std::printf("%-40s %6d %8lld\n", r.method, r.numel, r.cycles);
  const char* out = std::getenv("OUT");
  const std::string path = std::string(out ? out : ".") + "/admission_floor.json";
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fprintf(f, "{\"device\": \"%s\", \"threads\": %d, \"launches_per_graph\": %d, \"rows\": [", prop.name,
                 kThreads, kLaunches);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(f, "%s{\"kernel\": \"%s\", \"us_per_launch\": %.3f}", i ? ", " : "", rows[i].what.c_str(), rows[i].us);
    }
    std::fprintf(f, "], \"warp_dedup_cycles\": [");
    for (size_t i = 0; i < dedup_rows.size(); ++i) {
      std::fprintf(f, "%s{\"method\": \"%s\", \"ids\": %d, \"cycles\": %lld}", i ? ", " : "", dedup_rows[i].method,
                   dedup_rows[i].numel, dedup_rows[i].cycles);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
