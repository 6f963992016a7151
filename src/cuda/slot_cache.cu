// CUDA kernels for the slot cache: slot_lookup, and the launch of dedup_and_admit.
//
// dedup_and_admit is one launch of one block for the whole call (dedup, hit refresh, victim
// choice, map rewrite, copy plan; under Duel with its shadow caches, two more blocks replay the
// call in them), by one of three kernels that choose_admission_kernel() picks
// from the call's size and the pool's (docs/design.md, "Kernel selection"):
//   admission_decode.cuh  decode calls (at most 32 ids) on pools of up to 8,192 slots;
//   admission_level.cuh   other calls on pools of up to 8,192 slots (stamps in registers);
//   admission_scan.cuh    larger pools (stamps scanned in global memory).
// Their shared steps are in admission_common.cuh. Nothing is read back to the host, and every
// shape comes from the inputs, so the op can be captured in a CUDA graph and replayed with new
// routing.
//
// Out-of-range expert ids cannot raise here (that would need a host sync): they are treated as
// not routed (slot -1, nothing admitted). The CPU kernel raises for them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <type_traits>

#include "../common/checks.h"
#include "../common/limits.h"
#include "admission_decode.cuh"
#include "admission_level.cuh"
#include "admission_scan.cuh"
#include "cuda_utils.cuh"
#include "dependent_launch.cuh"

namespace ft::cuda {
namespace {

// One admission kernel and its block: threads x stamps per thread covers the pool.
enum class AdmissionKernel {
  kDecode256x4,   // admission_decode.cuh: 256 stamp threads (+ the routing warp), 4 stamps each
  kDecode512x8,
  kDecode512x16,
  kLevel256x4,    // admission_level.cuh
  kLevel512x8,
  kLevel1024x8,
  kScan,          // admission_scan.cuh
};

// The kernel for a call of `ids` routed ids on a pool of `slots` slots and `experts` experts per
// layer: the smallest block that holds the pool (fewer stamps per thread is less work per level).
// Measured on an H200 (docs/performance.md); the table is docs/design.md's "Kernel selection".
AdmissionKernel choose_admission_kernel(int64_t ids, int64_t experts, int64_t slots) {
  if (slots > limits::kMaxRegisterPoolSlots) return AdmissionKernel::kScan;
  if (admission::is_decode_call(ids, experts)) {
    if (slots <= 1024) return AdmissionKernel::kDecode256x4;
    if (slots <= 4096) return AdmissionKernel::kDecode512x8;
    return AdmissionKernel::kDecode512x16;
  }
  if (slots <= 1024) return AdmissionKernel::kLevel256x4;
  if (slots <= 4096) return AdmissionKernel::kLevel512x8;
  return AdmissionKernel::kLevel1024x8;
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
    int64_t protect_lo, int64_t protect_hi, const c10::optional<at::Tensor>& stats, int64_t policy,
    double cpu_expert_cost, double cpu_call_cost, const c10::optional<at::Tensor>& policy_state,
    c10::optional<at::TensorList> shadows) {
  const PoolShape pool = check_admission_inputs(slot_of, owner_of, last_use, clock, layer, expert_ids,
                                                fetch_fraction, protect_lo, protect_hi, stats);
  check_fetch_split(fetch_fraction, cpu_expert_cost, cpu_call_cost);
  const EvictionPolicy kind = check_policy(policy);
  check_policy_state(kind, policy_state, slot_of, pool.slots);
  check_shadows(kind, shadows, slot_of, owner_of, last_use, clock, policy_state, pool);
  TORCH_CHECK(pool.slots <= limits::kMaxSlots, "the slot pool has ", pool.slots,
              " slots; dedup_and_admit supports at most ", limits::kMaxSlots);
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
  // A call of no ids is not replayed in the shadows (the offline model counts none).
  const bool replays = shadows.has_value() && numel > 0;
  // The shadows' own slot ids and copy plans, which nothing reads: one allocation for both.
  const int64_t shadow_outputs = numel + 2 * plan_len + 1;
  auto shadow_scratch = replays ? at::empty({2 * shadow_outputs}, opts) : at::Tensor();

  const AdmissionKernel kernel = choose_admission_kernel(numel, pool.experts, pool.slots);
  const bool decode_kernel = kernel == AdmissionKernel::kDecode256x4 || kernel == AdmissionKernel::kDecode512x8 ||
                             kernel == AdmissionKernel::kDecode512x16;
  const size_t smem = admission::call_state_bytes(
      pool.experts, plan_len, admission::with_estimates_if_used(keeps_hit_density(kind), decode_kernel));
  int max_smem = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        slot_of.get_device()));

  // One cache's arguments: the pool's, or a shadow's (its own maps and outputs; it counts its call
  // in the pool's Duel words, duel::count_replay).
  struct Cache {
    const at::Tensor *slot_of, *owner_of, *last_use, *clock;
    const at::Tensor* policy_state;  // or nullptr
    int32_t *slot_ids, *plan_e, *plan_s, *num_copies;
    int64_t* stats;
    FetchSplit split;
    const int64_t* split_counters;
    int shadow;  // 0 the LRU shadow, 1 the hit-density shadow, -1 the pool
  };
  const auto fill = [&](auto& args, const auto* id_ptr, const Cache& cache) {
    args.slot_of = cache.slot_of->data_ptr<int32_t>();
    args.owner_of = cache.owner_of->data_ptr<int32_t>();
    args.last_use = cache.last_use->data_ptr<int64_t>();
    args.clock = cache.clock->data_ptr<int64_t>();
    args.ids = id_ptr;
    args.numel = numel;
    args.layer = layer;
    args.experts = pool.experts;
    args.slots = pool.slots;
    args.split = cache.split;
    args.protect_lo = cache.shadow >= 0 ? 0 : protect_lo;
    args.protect_hi = cache.shadow >= 0 ? 0 : protect_hi;
    args.slot_ids = cache.slot_ids;
    args.plan_e = cache.plan_e;
    args.plan_s = cache.plan_s;
    args.num_copies = cache.num_copies;
    args.plan_len = plan_len;
    args.stats = cache.stats;
    args.split_counters = cache.split_counters;
    int64_t* state = cache.policy_state != nullptr ? cache.policy_state->data_ptr<int64_t>() : nullptr;
    const int64_t pairs = pool.layers * pool.experts;
    args.pair_clock = state;
    args.pair_estimates = state != nullptr ? state + pairs : nullptr;
    args.slot_estimates = state != nullptr ? state + 2 * pairs : nullptr;
    using A = std::remove_reference_t<decltype(args)>;
    args.duel = A::kDuel ? state + 2 * pairs + pool.slots : nullptr;
    args.launch_words = replays ? policy_state->data_ptr<int64_t>() + policy_state->numel() - duel::kWords : nullptr;
    args.shadow = cache.shadow;
    args.vector_slots = aligned16(cache.last_use->data_ptr()) && aligned16(cache.owner_of->data_ptr()) &&
                        (state == nullptr || aligned16(args.slot_estimates));
    args.layers = pool.layers;
    args.inv_layers = 1.0 / static_cast<double>(pool.layers);
    args.layers_reciprocal = static_cast<uint32_t>(std::min<int64_t>((int64_t{1} << 32) / pool.layers, 0xffffffff));
  };
  const auto compulsory = compulsory_misses(pool.slots, pool.layers);
  const Cache pool_cache{&slot_of, &owner_of, &last_use, &clock,
                         policy_state.has_value() ? &*policy_state : nullptr,
                         slot_ids.data_ptr<int32_t>(), plan_e.data_ptr<int32_t>(), plan_s.data_ptr<int32_t>(),
                         num_copies.data_ptr<int32_t>(), stats.has_value() ? stats->data_ptr<int64_t>() : nullptr,
                         FetchSplit{fetch_fraction, cpu_expert_cost, cpu_call_cost, 0.0, compulsory},
                         split_counters(cpu_expert_cost, stats), -1};
  // Shadow k (0: LRU, 1: hit density) admits every miss a slot can take.
  const auto shadow_cache = [&](int k) {
    const at::TensorList s = *shadows;
    int32_t* out = shadow_scratch.data_ptr<int32_t>() + k * shadow_outputs;
    return Cache{&s[4 * k], &s[4 * k + 1], &s[4 * k + 2], &s[4 * k + 3], k == 1 ? &s[8] : nullptr,
                 out, out + numel, out + numel + plan_len, out + numel + 2 * plan_len, nullptr,
                 FetchSplit{1.0, 0.0, 0.0, 0.0, compulsory}, nullptr, k};
  };

  const auto launch = [&](auto kernel, int blocks, int threads, const auto&... typed_args) {
    // The kernel's own arrays come on top of the call's (a launch with Duel's shadows holds three
    // policies' arrays).
    const int64_t fixed = static_cast<int64_t>(
        kernel_attributes(reinterpret_cast<const void*>(kernel), slot_of.get_device()).sharedSizeBytes);
    TORCH_CHECK(static_cast<int64_t>(smem) + fixed <= max_smem, "dedup_and_admit needs ", smem + fixed,
                " bytes of shared memory for ", pool.experts, " experts and ", numel,
                " routed ids; this GPU allows ", max_smem, ". Split the call into fewer ids.");
    if (static_cast<int64_t>(smem) + fixed > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    }
    // Dependent launch: the call may be scheduled while the kernel before it (the router, the
    // previous layer's GEMM) finishes; it waits for that kernel before touching memory.
    launch_dependent(kernel, blocks, threads, smem, typed_args...);
  };
  const auto dispatch = [&](const auto& typed_args) {
    using A = std::remove_cv_t<std::remove_reference_t<decltype(typed_args)>>;
    using id_t = typename A::Id;
    constexpr int kPol = A::kPolicyId;
    using namespace admission;
    switch (kernel) {
      case AdmissionKernel::kDecode256x4:
        return launch(admit_decode_kernel<256, 4, id_t, kPol>, 1, decode_block_threads<256>(), typed_args);
      case AdmissionKernel::kDecode512x8:
        return launch(admit_decode_kernel<512, 8, id_t, kPol>, 1, decode_block_threads<512>(), typed_args);
      case AdmissionKernel::kDecode512x16:
        return launch(admit_decode_kernel<512, 16, id_t, kPol>, 1, decode_block_threads<512>(), typed_args);
      case AdmissionKernel::kLevel256x4:
        return launch(admit_by_level_kernel<256, 4, id_t, kPol>, 1, 256, typed_args);
      case AdmissionKernel::kLevel512x8:
        return launch(admit_by_level_kernel<512, 8, id_t, kPol>, 1, 512, typed_args);
      case AdmissionKernel::kLevel1024x8:
        return launch(admit_by_level_kernel<1024, 8, id_t, kPol>, 1, 1024, typed_args);
      case AdmissionKernel::kScan:
        return launch(admit_by_scan_kernel<id_t, kPol>, 1, kScanThreads, typed_args);
    }
  };
  // Duel with its shadows: three blocks, the two shadows' before the pool's (admission_common.cuh).
  const auto dispatch_with_shadows = [&](const auto& lru, const auto& density, const auto& duel_args) {
    using id_t = typename std::remove_cv_t<std::remove_reference_t<decltype(duel_args)>>::Id;
    using namespace admission;
    switch (kernel) {
      case AdmissionKernel::kDecode256x4:
        return launch(admit_decode_with_shadows_kernel<256, 4, id_t>, 3, decode_block_threads<256>(), lru, density,
                      duel_args);
      case AdmissionKernel::kDecode512x8:
        return launch(admit_decode_with_shadows_kernel<512, 8, id_t>, 3, decode_block_threads<512>(), lru, density,
                      duel_args);
      case AdmissionKernel::kDecode512x16:
        return launch(admit_decode_with_shadows_kernel<512, 16, id_t>, 3, decode_block_threads<512>(), lru, density,
                      duel_args);
      case AdmissionKernel::kLevel256x4:
        return launch(admit_by_level_with_shadows_kernel<256, 4, id_t>, 3, 256, lru, density, duel_args);
      case AdmissionKernel::kLevel512x8:
        return launch(admit_by_level_with_shadows_kernel<512, 8, id_t>, 3, 512, lru, density, duel_args);
      case AdmissionKernel::kLevel1024x8:
        return launch(admit_by_level_with_shadows_kernel<1024, 8, id_t>, 3, 1024, lru, density, duel_args);
      case AdmissionKernel::kScan:
        return launch(admit_by_scan_with_shadows_kernel<id_t>, 3, kScanThreads, lru, density, duel_args);
    }
  };
  // One instantiation per (id type, policy): the policy is a compile-time choice in the kernels.
  const auto run = [&](auto args, const auto* id_ptr) {
    fill(args, id_ptr, pool_cache);
    dispatch(args);
  };
  constexpr int kLru = admission::kLruPolicy;
  constexpr int kOpportunity = static_cast<int>(EvictionPolicy::kOpportunity);
  constexpr int kHitDensity = admission::kHitDensityPolicy;
  constexpr int kDuel = admission::kDuelPolicy;
  const auto run_ids = [&](const auto* id_ptr) {
    using id_t = std::remove_cv_t<std::remove_pointer_t<decltype(id_ptr)>>;
    if (replays) {
      admission::Args<id_t, kLru> lru{};
      admission::Args<id_t, kHitDensity> density{};
      admission::Args<id_t, kDuel> duel_args{};
      fill(lru, id_ptr, shadow_cache(0));
      fill(density, id_ptr, shadow_cache(1));
      fill(duel_args, id_ptr, pool_cache);
      return dispatch_with_shadows(lru, density, duel_args);
    }
    switch (kind) {
      case EvictionPolicy::kLru: return run(admission::Args<id_t, kLru>{}, id_ptr);
      case EvictionPolicy::kOpportunity: return run(admission::Args<id_t, kOpportunity>{}, id_ptr);
      case EvictionPolicy::kHitDensity: return run(admission::Args<id_t, kHitDensity>{}, id_ptr);
      case EvictionPolicy::kDuel: return run(admission::Args<id_t, kDuel>{}, id_ptr);
    }
  };
  if (ids.scalar_type() == at::kLong) {
    run_ids(ids.data_ptr<int64_t>());
  } else {
    run_ids(ids.data_ptr<int32_t>());
  }
  return {slot_ids, plan_e, plan_s, num_copies};
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CUDA, m) {
  m.impl("slot_lookup", &slot_lookup);
  m.impl("dedup_and_admit", &dedup_and_admit);
}

}  // namespace ft::cuda
