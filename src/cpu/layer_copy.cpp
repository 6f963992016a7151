// CPU kernels for moving expert rows into the slot banks: copy_experts (a decode copy plan) and
// async_layer_copy (a whole layer into a prefill buffer region).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../common/checks.h"
#include "cpu_kernels.h"

namespace ft::cpu {
namespace {

// Copies host row `expert` of every host tensor into row `slot` of the matching bank.
void copy_row(at::TensorList banks, at::TensorList host_rows, int64_t expert, int64_t slot) {
  for (size_t j = 0; j < banks.size(); ++j) {
    const int64_t bytes = row_bytes(banks[j]);
    if (bytes == 0) continue;  // empty rows: nothing to copy (and no storage to point into)
    auto* dst = static_cast<char*>(banks[j].data_ptr()) + slot * bytes;
    const auto* src = static_cast<const char*>(host_rows[j].data_ptr()) + expert * bytes;
    std::memcpy(dst, src, bytes);
  }
}

// Experts a copy task takes: at least 1 MiB of rows, so copies of small experts stay on the
// caller (a parallel region wakes ATen's threads, and on a busy machine waits out a descheduled one).
int64_t experts_per_task(at::TensorList banks) {
  int64_t expert_bytes = 0;
  for (const auto& b : banks) expert_bytes += row_bytes(b);
  return std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, expert_bytes));
}

}  // namespace

void copy_experts(at::TensorList banks, at::TensorList host_rows, const at::Tensor& copy_experts,
                  const at::Tensor& copy_slots, const at::Tensor& num_copies) {
  const int64_t experts = host_experts(host_rows);
  const int64_t slots = check_banks(banks, host_rows, experts, banks[0]);
  check_copy_plan(copy_experts, copy_slots, num_copies, banks[0]);
  const int64_t n = num_copies.data_ptr<int32_t>()[0];
  TORCH_CHECK(n >= 0 && n <= copy_experts.numel(), "num_copies is ", n,
              " but the plan holds ", copy_experts.numel(), " entries");
  const int32_t* plan_e = copy_experts.data_ptr<int32_t>();
  const int32_t* plan_s = copy_slots.data_ptr<int32_t>();
  // Entries with a negative expert or slot are skipped (as on CUDA); others must be in range.
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(plan_e[i] < experts, "copy_experts[", i, "] is ", plan_e[i], ", outside [0, ", experts,
                ") (negative entries are skipped)");
    TORCH_CHECK(plan_s[i] < slots, "copy_slots[", i, "] is ", plan_s[i], ", outside [0, ", slots,
                ") (negative entries are skipped)");
  }
  // Rows of real experts are MBs each: spread them over threads. Distinct plan entries never share a slot.
  at::parallel_for(0, n, experts_per_task(banks), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (plan_e[i] >= 0 && plan_s[i] >= 0) copy_row(banks, host_rows, plan_e[i], plan_s[i]);
    }
  });
}

at::Tensor async_layer_copy(const at::Tensor& slot_of, const at::Tensor& owner_of,
                            const at::Tensor& last_use, const at::Tensor& clock,
                            at::TensorList banks, at::TensorList host_rows, int64_t layer,
                            int64_t first_slot, bool skip_resident, int64_t reclaim_lo,
                            int64_t reclaim_hi, int64_t policy,
                            const c10::optional<at::Tensor>& row_sources) {
  const PoolShape pool = check_layer_copy_inputs(slot_of, owner_of, last_use, clock, banks, host_rows,
                                                 layer, first_slot, reclaim_lo, reclaim_hi, skip_resident,
                                                 row_sources);
  // Opportunity and hit density stamp streamed rows 1 and leave kept rows' stamps alone.
  const bool opportunity = check_policy(policy) != EvictionPolicy::kLru;
  const int32_t* hints = row_sources.has_value() ? row_sources->data_ptr<int32_t>() : nullptr;
  check_pool_maps(slot_of, owner_of, layer, pool);

  int32_t* slot_map = slot_of.data_ptr<int32_t>();
  int32_t* owner = owner_of.data_ptr<int32_t>();
  int64_t* stamp = last_use.data_ptr<int64_t>();
  const int64_t now = ++clock.data_ptr<int64_t>()[0];
  const int64_t base = layer * pool.experts;

  // Phase 1: the region's previous owners lose their slots, except (with skip_resident) an
  // expert of this layer that already sits in its own target slot.
  for (int64_t e = 0; e < pool.experts; ++e) {
    const int64_t s = first_slot + e;
    const int32_t o = owner[s];
    if (o < 0 || (skip_resident && o == base + e)) continue;
    slot_map[o] = -1;
    owner[s] = -1;
    stamp[s] = 0;
  }
  // Phase 2: where each row comes from (the host, a slot of the pool, or nowhere: in place), then
  // the maps. A copy inside the reclaim range (the other prefill region, about to be overwritten)
  // is read, but the expert moves into the region.
  constexpr int64_t kFromHost = -1, kInPlace = -2;
  std::vector<int64_t> source(pool.experts, kFromHost);
  int64_t from_host = 0;
  for (int64_t e = 0; e < pool.experts; ++e) {
    const int32_t cur = slot_map[base + e];
    const int64_t target = first_slot + e;
    if (skip_resident && cur >= 0) source[e] = cur == target ? kInPlace : cur;
    if (hints != nullptr && (hints[e] == -1 || hints[e] != cur)) source[e] = kFromHost;
    from_host += source[e] == kFromHost;
    const bool reclaimed = cur >= reclaim_lo && cur < reclaim_hi && cur != target;
    if (skip_resident && cur >= 0 && !reclaimed) {
      // Resident: LRU counts the prefill as a use; opportunity leaves the decode stamp alone (a
      // prompt is not a decode turn).
      if (!opportunity) stamp[cur] = now;
      continue;
    }
    if (cur >= 0) {  // a resident copy elsewhere is dropped (no skip_resident, or reclaimed)
      owner[cur] = -1;
      stamp[cur] = 0;
    }
    slot_map[base + e] = static_cast<int32_t>(target);
    owner[target] = static_cast<int32_t>(base + e);
    stamp[target] = opportunity ? kStreamedStamp : now;
  }
  // Sources lie outside the region (or are the row itself), so the copies are independent.
  at::parallel_for(0, pool.experts, experts_per_task(banks), [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      if (source[e] == kFromHost) {
        copy_row(banks, host_rows, e, first_slot + e);
      } else if (source[e] >= 0) {
        copy_row(banks, banks, source[e], first_slot + e);
      }
    }
  });
  return at::full({}, from_host, slot_of.options().dtype(at::kLong));
}

TORCH_LIBRARY_IMPL(freetoken, CPU, m) {
  m.impl("copy_experts", &copy_experts);
  m.impl("async_layer_copy", &async_layer_copy);
}

}  // namespace ft::cpu
