// C++ unit tests of the CPU slot-cache kernels, called directly (no Python, no dispatcher).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <vector>

#include "cpu/cpu_kernels.h"

namespace {

struct Pool {
  at::Tensor slot_of, owner_of, last_use, clock;
  std::vector<at::Tensor> banks, host;  // host: [L, E, ...]

  Pool(int64_t layers, int64_t experts, int64_t slots) {
    slot_of = at::full({layers, experts}, -1, at::kInt);
    owner_of = at::full({slots}, -1, at::kInt);
    last_use = at::zeros({slots}, at::kLong);
    clock = at::zeros({1}, at::kLong);
    at::manual_seed(7);
    host = {at::randn({layers, experts, 4, 3}), at::randn({layers, experts, 5})};
    banks = {at::full({slots, 4, 3}, NAN), at::full({slots, 5}, NAN)};
  }
  std::vector<at::Tensor> rows(int64_t layer) const { return {host[0][layer], host[1][layer]}; }

  auto admit(int64_t layer, std::vector<int64_t> ids, double fraction = 1.0, int64_t lo = 0,
             int64_t hi = 0) {
    auto t = at::tensor(ids, at::kLong);
    auto out = ft::cpu::dedup_and_admit(slot_of, owner_of, last_use, clock, layer, t, fraction, lo, hi);
    ft::cpu::copy_experts(banks, rows(layer), std::get<1>(out), std::get<2>(out), std::get<3>(out));
    return out;
  }

  // Every registered slot agrees both ways and holds its owner's host bytes.
  void expect_consistent() const {
    const int64_t experts = slot_of.size(1);
    auto flat = slot_of.view(-1);
    for (int64_t s = 0; s < owner_of.size(0); ++s) {
      const int owner = owner_of[s].item<int>();
      if (owner < 0) continue;
      EXPECT_EQ(flat[owner].item<int>(), s) << "owner_of[" << s << "] = " << owner;
      for (size_t j = 0; j < banks.size(); ++j) {
        EXPECT_TRUE(at::equal(banks[j][s], host[j][owner / experts][owner % experts]))
            << "slot " << s << " bank " << j << " holds bytes that are not its owner's";
      }
    }
    for (int64_t f = 0; f < flat.numel(); ++f) {
      const int s = flat[f].item<int>();
      if (s >= 0) EXPECT_EQ(owner_of[s].item<int>(), f);
    }
  }
};

std::vector<int> as_vector(const at::Tensor& t) {
  auto c = t.contiguous().to(at::kInt);
  return std::vector<int>(c.data_ptr<int>(), c.data_ptr<int>() + c.numel());
}

TEST(DedupAndAdmit, DuplicatesShareOneSlotAndMostRoutedGoFirst) {
  Pool pool(1, 8, 8);
  auto [slot_ids, plan_e, plan_s, n] = pool.admit(0, {3, 5, 5, 3, 3, 1});
  EXPECT_EQ(n.item<int>(), 3);
  EXPECT_EQ(as_vector(plan_e), (std::vector<int>{3, 5, 1, -1, -1, -1}));
  EXPECT_EQ(as_vector(plan_s), (std::vector<int>{0, 1, 2, -1, -1, -1}));
  EXPECT_EQ(as_vector(slot_ids), (std::vector<int>{0, 1, 1, 0, 0, 2}));
  EXPECT_EQ(pool.clock.item<int64_t>(), 1);
  pool.expect_consistent();
}

TEST(DedupAndAdmit, LeastRecentlyUsedVictimOutsideProtectedRange) {
  Pool pool(1, 8, 4);
  pool.admit(0, {0});
  pool.admit(0, {1});
  pool.admit(0, {2});
  pool.admit(0, {3});
  // Slot 0 (expert 0) is the oldest but protected; slot 1 (expert 1) is next.
  auto [slot_ids, plan_e, plan_s, n] = pool.admit(0, {7}, 1.0, 0, 1);
  EXPECT_EQ(as_vector(slot_ids), (std::vector<int>{1}));
  EXPECT_EQ(pool.slot_of[0][1].item<int>(), -1);
  EXPECT_EQ(pool.slot_of[0][0].item<int>(), 0);
  pool.expect_consistent();
}

TEST(DedupAndAdmit, FetchFractionAndShortPoolLeaveMissesAtMinusOne) {
  Pool pool(1, 16, 16);
  auto out = pool.admit(0, {1, 2, 3, 4}, 0.5);
  EXPECT_EQ(std::get<3>(out).item<int>(), 2);
  EXPECT_EQ(as_vector(std::get<0>(out)), (std::vector<int>{0, 1, -1, -1}));
  Pool small(1, 16, 2);
  out = small.admit(0, {5, 6, 7});
  EXPECT_EQ(std::get<3>(out).item<int>(), 2);
  EXPECT_EQ(as_vector(std::get<0>(out)), (std::vector<int>{0, 1, -1}));
  small.expect_consistent();
}

TEST(DedupAndAdmit, RejectsIdsOutOfRangeWithoutTouchingState) {
  Pool pool(1, 8, 8);
  EXPECT_THROW(pool.admit(0, {1, 8}), c10::Error);
  EXPECT_THROW(pool.admit(1, {1}), c10::Error);
  EXPECT_EQ(pool.clock.item<int64_t>(), 0);
}

TEST(AsyncLayerCopy, StaleHitAfterStreamIsAMissAndReload) {
  Pool pool(2, 4, 4);
  pool.admit(0, {1, 2});
  ft::cpu::async_layer_copy(pool.slot_of, pool.owner_of, pool.last_use, pool.clock, pool.banks,
                            pool.rows(1), 1, 0, false);
  EXPECT_EQ(as_vector(pool.slot_of[0]), (std::vector<int>{-1, -1, -1, -1}));
  auto lookup = ft::cpu::slot_lookup(pool.slot_of, 0, at::tensor({1, 2}, at::kLong));
  EXPECT_EQ(as_vector(lookup), (std::vector<int>{-1, -1}));
  auto [slot_ids, plan_e, plan_s, n] = pool.admit(0, {1, 2});
  EXPECT_EQ(n.item<int>(), 2);
  pool.expect_consistent();
}

TEST(AsyncLayerCopy, SkipResidentKeepsResidentExpertsWhereTheyAre) {
  Pool pool(2, 4, 8);
  pool.admit(1, {2});  // slot 0
  auto from_host = ft::cpu::async_layer_copy(pool.slot_of, pool.owner_of, pool.last_use, pool.clock,
                                             pool.banks, pool.rows(1), 1, 4, true);
  EXPECT_EQ(from_host.item<int64_t>(), 3);  // expert 2's row came from slot 0
  EXPECT_EQ(as_vector(pool.slot_of[1]), (std::vector<int>{4, 5, 0, 7}));
  EXPECT_EQ(pool.owner_of[6].item<int>(), -1);  // holds a copy of expert 2's row, unregistered
  EXPECT_TRUE(pool.banks[0][6].equal(pool.banks[0][0]));
  EXPECT_EQ(pool.last_use[0].item<int64_t>(), 2);
  pool.expect_consistent();
  EXPECT_THROW(ft::cpu::async_layer_copy(pool.slot_of, pool.owner_of, pool.last_use, pool.clock,
                                         pool.banks, pool.rows(1), 1, 5, true),
               c10::Error);
}

TEST(ExpertGemm, SkipsMinusOneSlots) {
  at::manual_seed(3);
  auto hidden = at::randn({2, 8});
  auto w13 = at::randn({3, 8, 8});
  auto w2 = at::randn({3, 8, 4});
  auto slots = at::tensor({-1, -1, -1, -1}, at::kInt).view({2, 2});
  auto weights = at::ones({2, 2});
  auto out = ft::cpu::expert_gemm(hidden, slots, weights, w13, w2, {}, {}, "silu");
  EXPECT_TRUE(at::equal(out, at::zeros({2, 8})));
}

}  // namespace
