// The grouped expert FFN over a bank of experts of any size, one window of the bank at a time.
//
// torch._grouped_mm takes fewer than 1,024 groups, and the grouped path uses one group per slot,
// so a larger bank is cut into windows of at most `window` consecutive slots; a quantized layer is
// cut into windows whose dequantized experts fit a bounded scratch bank. The caller's `bank(a, b)`
// returns the window's w13 [b - a, rows, H] and w2 [b - a, H, I] in the compute dtype (sub-bank
// views of a dense bank, or the window's experts dequantized into scratch; a window's bank is used
// before the next one is asked for, in stream order). The pairs routed to a window are a
// contiguous run of the slot-sorted order, [begin, end) with begin = ends[a - 1] and
// end = ends[b - 1] read on the device, so no host synchronization is needed. Per window: gather
// its rows to the top of a scratch buffer, two grouped products with group ends relative to the
// window, bias + activation between them, and a scatter of the result rows to their pairs. Rows
// past the window's count are neither computed by the products nor touched by the steps. The
// device steps come from the caller (CUDA kernels, or ATen ops in the CPU unit test), so this
// orchestration is tested without a GPU.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

namespace ft {

// What a window's steps get: the slot-sorted order and keys, the searchsorted group ends of the
// whole bank (ends[s] = number of sorted pairs with key <= s), and the window [a, b).
struct WindowRange {
  const at::Tensor& sorted_keys;  // int32 [N], invalid pairs keyed S (sorted last)
  const at::Tensor& order;        // int64 [N], pair index of each sorted position
  const at::Tensor& ends;         // int32 [S]
  int64_t a;                      // first slot of the window
  int64_t b;                      // one past its last slot
};

// Steps must provide, each acting on rows j < n = end - begin only:
//   gather(hidden, range, top_k, x):   x[j] = hidden[order[begin + j] / top_k]
//   bias_act(h, range, a_out):          a_out[j] = act(h[j] + b13[key]) over gate/up halves,
//                                       key = sorted_keys[begin + j]
//   scatter(y, range, y_all):           y_all[order[begin + j]] = y[j]
// `slots` holds each pair's slot of the bank's `num_slots` (others: not computed).
template <typename Bank, typename Steps>
void windowed_grouped_ffn(const at::Tensor& hidden, const at::Tensor& slots, int64_t num_slots, int64_t top_k,
                          int64_t window, Bank&& bank, Steps& steps, at::Tensor& y_all) {
  TORCH_CHECK(window >= 1, "windowed_grouped_ffn: window must be positive, got ", window);
  const int64_t S = num_slots, N = slots.numel(), H = y_all.size(1);
  const auto keys = at::where(at::logical_or(slots < 0, slots >= S),
                              at::scalar_tensor(S, slots.options()), slots);
  auto [sorted_keys, order] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto ends = at::searchsorted(sorted_keys, at::arange(S, slots.options()),
                                     /*out_int32=*/true, /*right=*/true);
  auto x = at::empty({N, H}, hidden.options());
  at::Tensor act;  // [N, I], once the first window's bank gives I
  const auto zero = at::zeros({1}, ends.options());
  for (int64_t a = 0; a < S; a += window) {
    const int64_t b = std::min(a + window, S), groups = b - a;
    const WindowRange range{sorted_keys, order, ends, a, b};
    const auto begin = a == 0 ? zero : ends.narrow(0, a - 1, 1);
    const auto group_ends = ends.narrow(0, a, groups) - begin;  // int32, relative to the window
    const std::pair<at::Tensor, at::Tensor> w = bank(a, b);
    if (!act.defined()) act = at::empty({N, w.second.size(2)}, hidden.options());
    steps.gather(hidden, range, top_k, x);
    const auto h = at::_grouped_mm(x, w.first.transpose(1, 2), group_ends);
    steps.bias_act(h, range, act);
    const auto y = at::_grouped_mm(act, w.second.transpose(1, 2), group_ends);
    steps.scatter(y, range, y_all);
  }
}

}  // namespace ft
