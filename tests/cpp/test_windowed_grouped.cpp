// The windowed grouped FFN (src/common/windowed_grouped.h) on the CPU, with ATen steps: windows,
// group ends relative to each window, the windows' banks (sub-bank views, or experts gathered
// through a map into a scratch bank reused by every window, as a quantized layer's are) and the
// scatter back to pairs must give every valid pair's FFN output whatever the window size; rows of
// invalid pairs stay untouched.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <utility>

#include "common/windowed_grouped.h"

namespace {

struct CpuSteps {
  int64_t intermediate;
  at::Tensor b13;  // [S, 2I] or undefined

  static std::pair<int64_t, int64_t> bounds(const ft::WindowRange& r) {
    const int64_t begin = r.a == 0 ? 0 : r.ends[r.a - 1].item<int64_t>();
    return {begin, r.ends[r.b - 1].item<int64_t>()};
  }
  void gather(const at::Tensor& hidden, const ft::WindowRange& r, int64_t top_k, at::Tensor& x) {
    const auto [begin, end] = bounds(r);
    if (end == begin) return;
    const auto tokens = at::floor_divide(r.order.narrow(0, begin, end - begin), top_k);
    x.narrow(0, 0, end - begin).copy_(hidden.index_select(0, tokens));
  }
  void bias_act(const at::Tensor& h, const ft::WindowRange& r, at::Tensor& out) {
    const auto [begin, end] = bounds(r);
    const int64_t n = end - begin, I = intermediate;
    if (n == 0) return;
    auto hf = h.narrow(0, 0, n).to(at::kFloat);
    if (b13.defined()) hf = hf + b13.index_select(0, r.sorted_keys.narrow(0, begin, n).to(at::kLong)).to(at::kFloat);
    out.narrow(0, 0, n).copy_(at::silu(hf.narrow(1, 0, I)) * hf.narrow(1, I, I));
  }
  void scatter(const at::Tensor& y, const ft::WindowRange& r, at::Tensor& y_all) {
    const auto [begin, end] = bounds(r);
    if (end == begin) return;
    y_all.index_copy_(0, r.order.narrow(0, begin, end - begin), y.narrow(0, 0, end - begin));
  }
};

// mapped: the bank's expert e is row map[e] of a larger store (-1: no expert, never routed), each
// window's experts copied into one scratch bank of `window` rows, as dequantize_experts fills it.
void check_windows(int64_t window, bool bias, uint64_t seed, bool mapped = false) {
  at::manual_seed(seed);
  const int64_t T = 7, K = 3, S = 23, H = 16, I = 8, N = T * K, stored = 31;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const auto hidden = at::randn({T, H}, bf16);
  const auto store13 = (at::randn({stored, 2 * I, H}) * 0.3).to(at::kBFloat16);
  const auto store2 = (at::randn({stored, H, I}) * 0.3).to(at::kBFloat16);
  auto map = at::randperm(stored, at::TensorOptions().dtype(at::kLong)).narrow(0, 0, S).clone();
  map[5] = -1;  // an expert with no row (not resident): no pair routes to it
  const auto w13 = mapped ? store13.index_select(0, map.clamp_min(0)) : store13.narrow(0, 0, S);
  const auto w2 = mapped ? store2.index_select(0, map.clamp_min(0)) : store2.narrow(0, 0, S);
  // Slots in [-1, S + 2): some invalid (-1 or out of range), repeats across tokens.
  auto slots = at::randint(-1, S + 2, {N}, at::TensorOptions().dtype(at::kInt));
  if (mapped) slots.masked_fill_(slots == 5, -1);
  CpuSteps steps{I, bias ? at::randn({S, 2 * I}).to(at::kBFloat16) : at::Tensor()};
  auto y_all = at::full({N, H}, std::numeric_limits<float>::quiet_NaN(), bf16);
  auto scratch13 = at::full({window, 2 * I, H}, std::numeric_limits<float>::quiet_NaN(), bf16);
  auto scratch2 = at::full({window, H, I}, std::numeric_limits<float>::quiet_NaN(), bf16);
  const auto bank = [&](int64_t a, int64_t b) -> std::pair<at::Tensor, at::Tensor> {
    if (!mapped) return {w13.narrow(0, a, b - a), w2.narrow(0, a, b - a)};
    for (int64_t e = a; e < b; ++e) {
      const int64_t row = map[e].item<int64_t>();
      if (row < 0) continue;  // left as it was, as dequantize_experts leaves a -1 slot
      scratch13[e - a].copy_(store13[row]);
      scratch2[e - a].copy_(store2[row]);
    }
    return {scratch13.narrow(0, 0, b - a), scratch2.narrow(0, 0, b - a)};
  };
  ft::windowed_grouped_ffn(hidden, slots, S, K, window, bank, steps, y_all);

  for (int64_t p = 0; p < N; ++p) {
    const int64_t s = slots[p].item<int64_t>();
    if (s < 0 || s >= S) {
      EXPECT_TRUE(y_all[p].isnan().all().item<bool>()) << "invalid pair " << p << " was written";
      continue;
    }
    const auto x = hidden[p / K].to(at::kDouble);
    auto hrow = at::matmul(w13[s].to(at::kDouble), x);
    if (bias) hrow = hrow + steps.b13[s].to(at::kDouble);
    const auto act = at::silu(hrow.narrow(0, 0, I)) * hrow.narrow(0, I, I);
    const auto want = at::matmul(w2[s].to(at::kDouble), act);
    const auto got = y_all[p].to(at::kDouble);
    const double err = (got - want).norm().item<double>() / want.norm().item<double>();
    EXPECT_LT(err, 3e-2) << "pair " << p << " slot " << s << " window " << window;
  }
}

TEST(WindowedGroupedFfn, ManyWindows) { check_windows(5, false, 1); }
TEST(WindowedGroupedFfn, OneSlotWindows) { check_windows(1, false, 2); }
TEST(WindowedGroupedFfn, OneWindowCoversTheBank) { check_windows(1023, false, 3); }
TEST(WindowedGroupedFfn, UnevenLastWindowWithBias) { check_windows(6, true, 4); }
TEST(WindowedGroupedFfn, MappedExpertsThroughOneScratchBank) { check_windows(4, true, 5, /*mapped=*/true); }
TEST(WindowedGroupedFfn, MappedExpertsInOneWindow) { check_windows(23, false, 6, /*mapped=*/true); }

}  // namespace
