// The windowed grouped FFN (src/common/windowed_grouped.h) on the CPU, with ATen steps: windows,
// group ends relative to each window, sub-bank views and the scatter back to pairs must give every
// valid pair's FFN output whatever the window size; rows of invalid pairs stay untouched.
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

void check_windows(int64_t window, bool bias, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t T = 7, K = 3, S = 23, H = 16, I = 8, N = T * K;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const auto hidden = at::randn({T, H}, bf16);
  const auto w13 = (at::randn({S, 2 * I, H}) * 0.3).to(at::kBFloat16);
  const auto w2 = (at::randn({S, H, I}) * 0.3).to(at::kBFloat16);
  // Slots in [-1, S + 2): some invalid (-1 or out of range), repeats across tokens.
  const auto slots = at::randint(-1, S + 2, {N}, at::TensorOptions().dtype(at::kInt));
  CpuSteps steps{I, bias ? at::randn({S, 2 * I}).to(at::kBFloat16) : at::Tensor()};
  auto y_all = at::full({N, H}, std::numeric_limits<float>::quiet_NaN(), bf16);
  ft::windowed_grouped_ffn(hidden, slots, w13, w2, K, window, steps, y_all);

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

}  // namespace
