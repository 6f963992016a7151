// CUDA kernels for the slot cache: slot_lookup, and the launch of dedup_and_admit.
//
// dedup_and_admit is one launch of one block for the whole call (dedup, hit refresh, victim
// choice, map rewrite, copy plan): admission_decode_early.cuh for decode calls (up to 32 ids) on
// pools of up to 4,096 slots, admission_decode.cuh for those on pools of up to 8,192, and
// admission_level.cuh for larger calls on pools of up to 8,192 slots (stamps in registers, victims
// level by level), admission_scan.cuh for larger pools (stamps scanned in
// global memory); their shared steps are in admission_common.cuh. Nothing is read back to the
// host, and every shape comes from the inputs, so the op can be captured in a CUDA graph and
// replayed with new routing.
//
// Out-of-range expert ids cannot raise here (that would need a host sync): they are treated as
// not routed (slot -1, nothing admitted). The CPU kernel raises for them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <type_traits>

#include "../common/checks.h"
#include "admission_cluster.cuh"
#include "admission_decode.cuh"
#include "admission_decode_early.cuh"
#include "admission_level.cuh"
#include "admission_scan.cuh"
#include "cuda_utils.cuh"
#include "dependent_launch.cuh"

namespace ft::cuda {
namespace {

constexpr int kLevelThreads = 256;  // admission_level.cuh, pools of up to 1,024 slots: 4 per thread
// Pools of 4,097-8,192 slots: the level kernel at 1,024 threads x 8 slots; larger pools scan.
constexpr int64_t kLargestLevelPool = 8192;

// FT_ADMIT_CLUSTER=1: pools of 1,025-8,192 slots take the cluster kernel (admission_cluster.cuh,
// one block per 1,024 slots) instead of the one-block level kernel.
bool cluster_admission() {
  static const bool on = [] {
    const char* env = std::getenv("FT_ADMIT_CLUSTER");
    return env != nullptr && std::atoi(env) == 1;
  }();
  return on;
}

// Decode calls (at most 32 routed ids) on pools of up to 8,192 slots take admission_decode.cuh
// unless FT_ADMIT_DECODE=0 (bench_slot_cache.py compares the kernels).
bool decode_admission() {
  static const bool on = [] {
    const char* env = std::getenv("FT_ADMIT_DECODE");
    return env == nullptr || std::atoi(env) != 0;
  }();
  return on;
}

// Decode calls on pools of up to 4,096 slots take admission_decode_early.cuh (the stamps keyed
// during the routing, one barrier) unless FT_DECODE_EARLY=0 (then admission_decode.cuh).
bool early_decode_admission() {
  static const bool on = [] {
    const char* env = std::getenv("FT_DECODE_EARLY");
    return env == nullptr || std::atoi(env) != 0;
  }();
  return on;
}

// Block size of the level kernel for pools of 1,025-4,096 slots (4,096 / threads slots per
// thread): 512 measured best with misses (docs/benchmarks.md). FT_ADMIT_THREADS=1024 overrides it
// (bench_slot_cache.py compares them).
int large_level_threads() {
  static const int threads = [] {
    const char* env = std::getenv("FT_ADMIT_THREADS");
    return env != nullptr && std::atoi(env) == 1024 ? 1024 : 512;
  }();
  return threads;
}

// Stamp threads of the decode kernels for pools of 1,025-4,096 slots: 512 threads x 8 stamps, or
// with FT_DECODE_THREADS=256, 256 x 16 (half the warps, twice the work each; measured no better,
// bench_slot_cache.py compares them).
int decode_threads() {
  static const int threads = [] {
    const char* env = std::getenv("FT_DECODE_THREADS");
    return env != nullptr && std::atoi(env) == 256 ? 256 : 512;
  }();
  return threads;
}

template <typename id_t>
__global__ void slot_lookup_kernel(const int32_t* __restrict__ layer_map, const id_t* __restrict__ ids,
                                   int32_t* __restrict__ out, int64_t n, int64_t experts) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = static_cast<int64_t>(ids[i]);
    out[i] = (e >= 0 && e < experts) ? layer_map[e] : -1;
  }
}

at::Tensor slot_lookup(const at::Tensor& slot_of, int64_t layer, const at::Tensor& expert_ids) {
  TORCH_CHECK(slot_of.dim() == 2 && slot_of.is_contiguous(),
              "slot_of must be a contiguous [layers, experts] tensor, got shape ", slot_of.sizes());
  check_dtype(slot_of, at::kInt, "slot_of");
  check_routed_ids(expert_ids, slot_of);
  check_layer(layer, PoolShape{slot_of.size(0), slot_of.size(1), 0});
  const c10::cuda::CUDAGuard guard(slot_of.device());
  const auto ids = expert_ids.contiguous();
  auto out = at::empty(expert_ids.sizes(), expert_ids.options().dtype(at::kInt));
  const int64_t n = ids.numel();
  if (n == 0) return out;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 1024));
  const int32_t* layer_map = slot_of.data_ptr<int32_t>() + layer * slot_of.size(1);
  if (ids.scalar_type() == at::kLong) {
    slot_lookup_kernel<<<blocks, threads, 0, current_stream()>>>(layer_map, ids.data_ptr<int64_t>(),
                                                                 out.data_ptr<int32_t>(), n, slot_of.size(1));
  } else {
    slot_lookup_kernel<<<blocks, threads, 0, current_stream()>>>(layer_map, ids.data_ptr<int32_t>(),
                                                                 out.data_ptr<int32_t>(), n, slot_of.size(1));
  }
  FT_CHECK_LAUNCH();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_and_admit(
    const at::Tensor& slot_of, const at::Tensor& owner_of, const at::Tensor& last_use,
    const at::Tensor& clock, int64_t layer, const at::Tensor& expert_ids, double fetch_fraction,
    int64_t protect_lo, int64_t protect_hi, const c10::optional<at::Tensor>& stats) {
  const PoolShape pool = check_admission_inputs(slot_of, owner_of, last_use, clock, layer, expert_ids,
                                                fetch_fraction, protect_lo, protect_hi, stats);
  TORCH_CHECK(pool.slots < (int64_t{1} << admission::kSlotBits), "the slot pool has ", pool.slots,
              " slots; dedup_and_admit supports fewer than 2^24");
  const c10::cuda::CUDAGuard guard(slot_of.device());

  const auto ids = expert_ids.contiguous();
  const int64_t numel = ids.numel();
  TORCH_CHECK(numel < (int64_t{1} << 31), "too many routed ids in one call: ", numel);
  const int64_t plan_len = std::min(numel, pool.experts);
  auto opts = slot_of.options();
  auto slot_ids = at::empty(expert_ids.sizes(), opts);
  auto plan_e = at::empty({plan_len}, opts);
  auto plan_s = at::empty({plan_len}, opts);
  auto num_copies = at::empty({1}, opts);

  const bool decode_kernel =
      decode_admission() && admission::is_decode_call(numel, pool.experts) && pool.slots <= kLargestLevelPool;
  const size_t smem = admission::call_state_bytes(pool.experts, plan_len);
  int max_smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        slot_of.get_device()));
  TORCH_CHECK(static_cast<int64_t>(smem) + 8192 <= max_smem, "dedup_and_admit needs ", smem,
              " bytes of shared memory for ", pool.experts, " experts and ", numel,
              " routed ids; this GPU allows ", max_smem, ". Split the call into fewer ids.");

  const auto fill = [&](auto& args, const auto* id_ptr) {
    args.slot_of = slot_of.data_ptr<int32_t>();
    args.owner_of = owner_of.data_ptr<int32_t>();
    args.last_use = last_use.data_ptr<int64_t>();
    args.clock = clock.data_ptr<int64_t>();
    args.ids = id_ptr;
    args.numel = numel;
    args.layer = layer;
    args.experts = pool.experts;
    args.slots = pool.slots;
    args.fetch_fraction = fetch_fraction;
    args.protect_lo = protect_lo;
    args.protect_hi = protect_hi;
    args.slot_ids = slot_ids.data_ptr<int32_t>();
    args.plan_e = plan_e.data_ptr<int32_t>();
    args.plan_s = plan_s.data_ptr<int32_t>();
    args.num_copies = num_copies.data_ptr<int32_t>();
    args.plan_len = plan_len;
    args.stats = stats.has_value() ? stats->data_ptr<int64_t>() : nullptr;
    args.vector_slots = aligned16(last_use.data_ptr()) && aligned16(owner_of.data_ptr());
  };

  // The smallest kernel that holds the pool: fewer stamps per thread is less work per level.
  const auto launch = [&](auto kernel, int threads, const auto& typed_args) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    // Dependent launch: the call may be scheduled while the kernel before it (the router, the
    // previous layer's GEMM) finishes; it waits for that kernel before touching memory.
    launch_dependent(kernel, 1, threads, smem, typed_args);
  };
  // One cluster of `blocks` blocks (a dependent launch as well).
  const auto launch_cluster = [&](auto kernel, int blocks, const auto& typed_args) {
    launch_dependent_with(kernel, blocks, admission::kClusterThreads, smem, static_cast<unsigned>(blocks), typed_args);
  };
  const auto dispatch = [&](const auto& typed_args) {
    using id_t = std::remove_cv_t<std::remove_pointer_t<decltype(typed_args.ids)>>;
    if (decode_kernel && early_decode_admission() && pool.slots <= 4096) {
      // Stamp threads x slots per thread; the block has one more (routing) warp. (Pools of
      // 4,097-8,192 slots keep the decode kernel's 1,024 x 8: 512 x 16 here measured 3.05 / 4.31 /
      // 4.13 us at 0 / 2 / 8 misses against its 2.42 / 4.68 / 4.74; docs/perf_notes.md.)
      if (pool.slots <= kLevelThreads * 4) {
        launch(admission::admit_decode_early_kernel<kLevelThreads, 4, id_t>,
               admission::early_block_threads<kLevelThreads>(), typed_args);
      } else if (decode_threads() == 256) {
        launch(admission::admit_decode_early_kernel<256, 16, id_t>, admission::early_block_threads<256>(), typed_args);
      } else {
        launch(admission::admit_decode_early_kernel<512, 8, id_t>, admission::early_block_threads<512>(), typed_args);
      }
    } else if (decode_kernel) {
      if (pool.slots <= kLevelThreads * 4) {
        launch(admission::admit_decode_kernel<kLevelThreads, 4, id_t>, kLevelThreads, typed_args);
      } else if (pool.slots <= 4096) {
        if (decode_threads() == 256) {
          launch(admission::admit_decode_kernel<256, 16, id_t>, 256, typed_args);
        } else {
          launch(admission::admit_decode_kernel<512, 8, id_t>, 512, typed_args);
        }
      } else {
        launch(admission::admit_decode_kernel<1024, 8, id_t>, 1024, typed_args);
      }
    } else if (cluster_admission() && pool.slots > kLevelThreads * 4 && pool.slots <= admission::kMaxClusterSlots) {
      const int blocks = static_cast<int>((pool.slots + admission::kClusterBlockSlots - 1) / admission::kClusterBlockSlots);
      launch_cluster(admission::admit_by_cluster_kernel<id_t>, blocks, typed_args);
    } else if (pool.slots <= kLevelThreads * 4) {
      launch(admission::admit_by_level_kernel<kLevelThreads, 4, id_t>, kLevelThreads, typed_args);
    } else if (pool.slots <= 4096) {
      switch (large_level_threads()) {
        case 1024: launch(admission::admit_by_level_kernel<1024, 4, id_t>, 1024, typed_args); break;
        default: launch(admission::admit_by_level_kernel<512, 8, id_t>, 512, typed_args);
      }
    } else if (pool.slots <= kLargestLevelPool) {
      launch(admission::admit_by_level_kernel<1024, 8, id_t>, 1024, typed_args);
    } else {
      launch(admission::admit_by_scan_kernel<id_t>, admission::kScanThreads, typed_args);
    }
  };
  if (ids.scalar_type() == at::kLong) {
    admission::Args<int64_t> args{};
    fill(args, ids.data_ptr<int64_t>());
    dispatch(args);
  } else {
    admission::Args<int32_t> args{};
    fill(args, ids.data_ptr<int32_t>());
    dispatch(args);
  }
  return {slot_ids, plan_e, plan_s, num_copies};
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) {
  m.impl("slot_lookup", &slot_lookup);
  m.impl("dedup_and_admit", &dedup_and_admit);
}

}  // namespace ft::cuda
