// The CPU share of a decode call: pairs whose expert the admission left to the CPU (slot -1) are
// computed by a worker thread from the host pool while the device copies and computes the rest.
// The device and the worker meet in one mailbox in pinned, mapped host memory; no host sync and no
// host function: cpu_share_submit (a kernel on CUDA) writes the call's routed ids, weights and
// hidden states there and then the job's sequence number; the worker, polling that number,
// computes the call and writes the result and then the same number into `done`; cpu_share_join
// (a kernel) waits until `done` reaches the job and adds the result. Both ops are capturable, so
// compiled decode (CUDA graphs) runs the CPU share too. Calls of a session are ordered by the
// stream that issues them (a layer's join before the next layer's submit), so one mailbox serves
// every layer. docs/design.md ("The CPU share") explains the protocol.
#pragma once

#include <ATen/ATen.h>

#include "admitted_count.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace ft::cpu_share {

// The mailbox: a header, then ids [capacity, top_k] int32 (-1: not on the CPU), weights
// [capacity, top_k] float32, hidden [capacity, hidden] in the model's dtype, result
// [capacity, hidden] float32. The two sequence numbers sit on their own 128-byte lines.
struct alignas(128) MailboxHeader {
  alignas(128) volatile int64_t submitted;  // written by the producer after the job's payload
  alignas(128) volatile int64_t done;       // written by the worker after the job's result
  alignas(128) volatile int64_t layer;
  volatile int64_t tokens;
  volatile int64_t pairs;  // pairs on the CPU in the job
  alignas(128) volatile int64_t failed;  // the job whose computation raised (its result is not valid)
};

struct Layout {
  int64_t ids, weights, hidden, result, total;  // byte offsets from the mailbox's start; its size
};

inline int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

inline Layout mailbox_layout(int64_t capacity, int64_t top_k, int64_t hidden, int64_t hidden_element_size) {
  Layout l{};
  l.ids = align_up(static_cast<int64_t>(sizeof(MailboxHeader)), 256);
  l.weights = align_up(l.ids + capacity * top_k * 4, 256);
  l.hidden = align_up(l.weights + capacity * top_k * 4, 256);
  l.result = align_up(l.hidden + capacity * hidden * hidden_element_size, 256);
  l.total = align_up(l.result + capacity * hidden * 4, 256);
  return l;
}

// What the kernels of a session need (registered by open(), looked up by handle).
struct SessionInfo {
  uint8_t* mailbox = nullptr;  // host address
  int64_t capacity = 0, top_k = 0, hidden = 0, layers = 0, experts = 0;
  at::ScalarType dtype = at::kFloat;
  Layout layout{};
};

// One MoE layer's expert function as expert_gemm takes it: (activation, alpha, limit, up_offset,
// gate_softcap, up_softcap, limit_after_act, gated) (src/common/checks.h).
using ActivationArgs = std::tuple<std::string, double, double, double, double, double, bool, bool>;

// The session of `handle` (TORCH_CHECK that it is open).
SessionInfo info(int64_t handle);

// Opens a session over the host pool's banks ([L, E, ...]; scales and biases optional), the expert
// function of each layer (L entries: families such as Step3p7 clamp some layers only), and a
// mailbox (a uint8 CPU tensor of at least mailbox_layout(...).total bytes, pinned for a CUDA
// producer), and starts its worker thread. Returns the handle.
int64_t open(const at::Tensor& mailbox, const at::Tensor& w13, const at::Tensor& w2,
             const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
             const c10::optional<at::Tensor>& w13_scale, const c10::optional<at::Tensor>& w2_scale,
             const std::vector<ActivationArgs>& activations, int64_t capacity, int64_t top_k, at::ScalarType dtype);

// Stops the worker and forgets the session (work a device still has queued for it must have run).
void close(int64_t handle);

// Jobs computed and time spent by the worker (seconds), for the statistics.
std::pair<int64_t, double> worker_counters(int64_t handle);

// The worker's row threads (SpinPool::Counters), as of its last job: calls split across the
// threads, their chunks, the chunks the worker ran itself, the calls that woke sleeping helpers.
std::tuple<int64_t, int64_t, int64_t, int64_t> row_thread_counters(int64_t handle);

// The message of the last job that raised in the worker ("" if none).
std::string last_error(int64_t handle);

// The checks both devices' submit and join make before any work (one-line errors).
void check_submit(const SessionInfo& s, int64_t layer, const at::Tensor& hidden, const at::Tensor& slot_ids,
                  const at::Tensor& expert_ids, const at::Tensor& weights, const at::Tensor& seq,
                  const c10::optional<at::Tensor>& stats);

// Columns of the admit counters (ft_ops/stats.py) that submit adds to (kStatsCpuExperts:
// admitted_count.h, whose split reads it).
constexpr int kStatsCpuPairs = 4;
using ft::kStatsCpuExperts;
void check_join(const at::Tensor& out, const at::Tensor& ticket, const SessionInfo& s);

}  // namespace ft::cpu_share
