// The CPU share's sessions (src/common/cpu_share.h): a registry of handles, each with a worker
// thread that polls the mailbox and computes a job with the CPU expert_gemm over the host pool's
// layer; and the CPU kernels of cpu_share_submit / cpu_share_join (the CPU build and CPU runtimes:
// the same protocol, the producer being a CPU thread).
#include "../common/cpu_share.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "cpu_kernels.h"
#include "spin_pool.h"

namespace ft::cpu_share {
namespace {

// The mailbox's sequence numbers, read and written with acquire / release semantics (the GPU's
// side of the same protocol uses system-scope fences: src/cuda/cpu_share.cu).
inline int64_t load_acquire(volatile int64_t* p) { return __atomic_load_n(const_cast<int64_t*>(p), __ATOMIC_ACQUIRE); }
inline void store_release(volatile int64_t* p, int64_t v) { __atomic_store_n(const_cast<int64_t*>(p), v, __ATOMIC_RELEASE); }

struct Session {
  SessionInfo info;
  at::Tensor mailbox, w13, w2;
  c10::optional<at::Tensor> b13, b2, w13_scale, w2_scale;
  std::vector<ActivationArgs> activations;  // one per layer
  std::atomic<bool> stop{false};
  std::atomic<int64_t> jobs{0};
  std::atomic<int64_t> busy_ns{0};
  // The row threads' counters (SpinPool::Counters), copied by the worker after each job: the pool
  // itself is made by the worker thread, so other threads never touch it.
  std::atomic<int64_t> split_calls{0}, chunks{0}, worker_chunks{0}, wakes{0};
  std::mutex error_mutex;
  std::string error;
  std::unique_ptr<ft::cpu::SpinPool> pool;  // the worker's row threads, made by the worker
  std::thread worker;

  MailboxHeader* header() const { return reinterpret_cast<MailboxHeader*>(info.mailbox); }

  // A session still open at exit (its Python owner never collected) stops its worker here.
  ~Session() {
    stop.store(true);
    if (worker.joinable()) worker.join();
  }

  void compute(int64_t layer, int64_t tokens) {
    const auto& l = info.layout;
    const auto cpu = at::TensorOptions().device(at::kCPU);
    auto ids = at::from_blob(info.mailbox + l.ids, {tokens, info.top_k}, cpu.dtype(at::kInt));
    auto weights = at::from_blob(info.mailbox + l.weights, {tokens, info.top_k}, cpu.dtype(at::kFloat));
    auto hidden = at::from_blob(info.mailbox + l.hidden, {tokens, info.hidden}, cpu.dtype(info.dtype));
    auto result = at::from_blob(info.mailbox + l.result, {tokens, info.hidden}, cpu.dtype(at::kFloat));
    const auto opt = [&](const c10::optional<at::Tensor>& t) -> c10::optional<at::Tensor> {
      return t.has_value() ? c10::optional<at::Tensor>(t->select(0, layer)) : c10::nullopt;
    };
    // The layer's banks with the expert ids as slots (expert_gemm's contract).
    const auto& [kind, alpha, limit, up_offset, gate_softcap, up_softcap, limit_after_act, gated] = activations[layer];
    auto out = ft::cpu::expert_gemm_on(pool.get(), hidden, ids, weights, w13.select(0, layer), w2.select(0, layer),
                                       opt(b13), opt(b2), kind, alpha, limit, up_offset, gate_softcap,
                                       up_softcap, opt(w13_scale), opt(w2_scale), limit_after_act, gated);
    result.copy_(out);
  }

  // Polls `submitted`; spins while jobs come (a decode step posts up to one job per layer, and a
  // step of a cache that mostly hits may post one every few tokens), then sleeps in short steps
  // (timer slack 1 us, so a sleep of 20 us wakes after about that), then in long ones.
  void run() {
#ifdef __linux__
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
    at::init_num_threads();  // this thread's OpenMP team (larger groups' GEMMs) follows torch's setting
    // Row threads: torch's thread count less two cores (the thread that drives the GPU, and one for
    // the rest of the process), so the spinning helpers leave those cores alone.
    try {
      pool = std::make_unique<ft::cpu::SpinPool>(std::max(1, at::get_num_threads() - 2));
    } catch (const std::exception&) {
      pool.reset();  // threads could not start: the row loops run on ATen's threads instead
    }
    int64_t seen = load_acquire(&header()->done);
    auto last_job = std::chrono::steady_clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
      const int64_t s = load_acquire(&header()->submitted);  // the payload after the number
      if (s > seen) {
        const auto t0 = std::chrono::steady_clock::now();
        const int64_t tokens = header()->tokens;
        try {
          compute(header()->layer, tokens);
        } catch (const std::exception& e) {
          // The producer must not wait forever, nor take this job's result: the join fails loudly.
          {
            std::lock_guard<std::mutex> lock(error_mutex);
            error = e.what();
          }
          header()->failed = s;
        }
        store_release(&header()->done, s);  // the result (and `failed`) before the number
        seen = s;
        last_job = std::chrono::steady_clock::now();
        jobs.fetch_add(1, std::memory_order_relaxed);
        if (pool) {
          const auto c = pool->counters();
          split_calls.store(c.split_calls, std::memory_order_relaxed);
          chunks.store(c.chunks, std::memory_order_relaxed);
          worker_chunks.store(c.caller_chunks, std::memory_order_relaxed);
          wakes.store(c.wakes, std::memory_order_relaxed);
        }
        busy_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(last_job - t0).count(),
                          std::memory_order_relaxed);
        continue;
      }
      const auto idle = std::chrono::steady_clock::now() - last_job;
      if (idle < std::chrono::milliseconds(100)) {
        ft::cpu::cpu_relax();
      } else if (idle < std::chrono::seconds(2)) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
    }
  }
};

std::mutex registry_mutex;
// Never destroyed: a session still open at exit (opened without a Python owner) keeps its worker
// until the process ends, rather than being joined during static destruction (after CUDA and
// OpenMP may have shut down). CpuShare closes its session when collected or at exit.
std::map<int64_t, std::unique_ptr<Session>>& registry() {
  static auto* sessions = new std::map<int64_t, std::unique_ptr<Session>>();
  return *sessions;
}
int64_t next_handle = 1;

Session& session(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(handle);
  TORCH_CHECK(it != registry().end(), "cpu_share: no open session ", handle,
              " (it was closed, or never opened by ft_ops.cpu_share.CpuShare)");
  return *it->second;
}

}  // namespace

SessionInfo info(int64_t handle) { return session(handle).info; }

std::string last_error(int64_t handle) {
  Session& s = session(handle);
  std::lock_guard<std::mutex> lock(s.error_mutex);
  return s.error;
}

std::pair<int64_t, double> worker_counters(int64_t handle) {
  Session& s = session(handle);
  return {s.jobs.load(), s.busy_ns.load() * 1e-9};
}

std::tuple<int64_t, int64_t, int64_t, int64_t> row_thread_counters(int64_t handle) {
  Session& s = session(handle);
  return {s.split_calls.load(), s.chunks.load(), s.worker_chunks.load(), s.wakes.load()};
}

int64_t open(const at::Tensor& mailbox, const at::Tensor& w13, const at::Tensor& w2,
             const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
             const c10::optional<at::Tensor>& w13_scale, const c10::optional<at::Tensor>& w2_scale,
             const std::vector<ActivationArgs>& activations, int64_t capacity, int64_t top_k, at::ScalarType dtype) {
  TORCH_CHECK(w13.is_cpu() && w2.is_cpu() && w13.dim() == 4 && w2.dim() == 4,
              "cpu_share: w13 and w2 must be the host pool's CPU banks [layers, experts, ...]");
  TORCH_CHECK(static_cast<int64_t>(activations.size()) == w13.size(0), "cpu_share: one expert function per layer: ",
              w13.size(0), " layers, got ", activations.size());
  TORCH_CHECK(capacity > 0 && top_k > 0, "cpu_share: capacity and top_k must be positive, got ", capacity,
              " and ", top_k);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "cpu_share: hidden states must be float32, bfloat16 or float16, got ", dtype);
  // The hidden size: the output rows of w2 (its dim 2 in [L, E, H, I'] for every format).
  const int64_t hidden = w2.size(2);
  const Layout layout = mailbox_layout(capacity, top_k, hidden, c10::elementSize(dtype));
  TORCH_CHECK(mailbox.is_cpu() && mailbox.scalar_type() == at::kByte && mailbox.is_contiguous() &&
                  mailbox.numel() >= layout.total,
              "cpu_share: the mailbox must be a contiguous uint8 CPU tensor of at least ", layout.total,
              " bytes, got ", mailbox.numel());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(mailbox.data_ptr()) % 128 == 0, "cpu_share: the mailbox must be 128-byte aligned");
  auto s = std::make_unique<Session>();
  s->mailbox = mailbox;
  s->w13 = w13;
  s->w2 = w2;
  s->b13 = b13;
  s->b2 = b2;
  s->w13_scale = w13_scale;
  s->w2_scale = w2_scale;
  s->activations = activations;
  s->info.mailbox = static_cast<uint8_t*>(mailbox.data_ptr());
  s->info.capacity = capacity;
  s->info.top_k = top_k;
  s->info.hidden = hidden;
  s->info.layers = w13.size(0);
  s->info.experts = w13.size(1);
  s->info.dtype = dtype;
  s->info.layout = layout;
  auto* header = s->header();
  header->submitted = 0;
  header->done = 0;
  header->layer = 0;
  header->tokens = 0;
  header->pairs = 0;
  header->failed = 0;
  Session* raw = s.get();
  raw->worker = std::thread([raw] { raw->run(); });
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t handle = next_handle++;
  registry()[handle] = std::move(s);
  return handle;
}

void close(int64_t handle) {
  std::unique_ptr<Session> s;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry().find(handle);
    if (it == registry().end()) return;
    s = std::move(it->second);
    registry().erase(it);
  }
  s->stop.store(true);
  if (s->worker.joinable()) s->worker.join();
}

void check_submit(const SessionInfo& s, int64_t layer, const at::Tensor& hidden, const at::Tensor& slot_ids,
                  const at::Tensor& expert_ids, const at::Tensor& weights, const at::Tensor& seq,
                  const c10::optional<at::Tensor>& stats) {
  TORCH_CHECK(layer >= 0 && layer < s.layers, "cpu_share_submit: layer ", layer, " is out of range for ",
              s.layers, " layers");
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == s.hidden && hidden.scalar_type() == s.dtype,
              "cpu_share_submit: hidden must be [tokens, ", s.hidden, "] ", s.dtype, ", got ", hidden.sizes(), " ",
              hidden.scalar_type());
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK(tokens <= s.capacity, "cpu_share_submit: a call of ", tokens, " tokens leaves experts to the CPU, but "
              "the CPU share holds ", s.capacity, " tokens a call (OffloadRuntime(..., cpu_share_tokens=...))");
  TORCH_CHECK(slot_ids.dim() == 2 && slot_ids.size(0) == tokens && slot_ids.size(1) == s.top_k &&
                  slot_ids.scalar_type() == at::kInt,
              "cpu_share_submit: slot_ids must be int32 [", tokens, ", ", s.top_k, "] (tokens, the session's top_k), "
              "got ", slot_ids.sizes(), " ", slot_ids.scalar_type());
  TORCH_CHECK(expert_ids.sizes() == slot_ids.sizes() &&
                  (expert_ids.scalar_type() == at::kInt || expert_ids.scalar_type() == at::kLong),
              "cpu_share_submit: expert_ids must be int32 or int64 [", tokens, ", ", s.top_k, "], got ",
              expert_ids.sizes(), " ", expert_ids.scalar_type());
  TORCH_CHECK(weights.sizes() == slot_ids.sizes() && at::isFloatingType(weights.scalar_type()),
              "cpu_share_submit: weights must be floating point [", tokens, ", ", s.top_k, "], got ", weights.sizes(),
              " ", weights.scalar_type());
  TORCH_CHECK(seq.numel() == 1 && seq.scalar_type() == at::kLong, "cpu_share_submit: seq must be one int64");
  if (stats.has_value()) {
    TORCH_CHECK(stats->dim() == 1 && stats->size(0) > kStatsCpuExperts && stats->scalar_type() == at::kLong &&
                    stats->is_contiguous(),
                "cpu_share_submit: stats must be a contiguous int64 row of at least ", kStatsCpuExperts + 1,
                " counters (Stats.admission_counters)");
  }
  for (const at::Tensor* t : {&slot_ids, &expert_ids, &weights, &seq}) {
    TORCH_CHECK(t->device() == hidden.device(), "cpu_share_submit: every tensor must be on ", hidden.device(),
                ", got one on ", t->device());
  }
  TORCH_CHECK(!stats.has_value() || stats->device() == hidden.device(), "cpu_share_submit: stats must be on ",
              hidden.device());
}

void check_join(const at::Tensor& out, const at::Tensor& ticket, const SessionInfo& s) {
  TORCH_CHECK(out.dim() == 2 && out.size(1) == s.hidden && out.size(0) <= s.capacity,
              "cpu_share_join: out must be [tokens <= ", s.capacity, ", ", s.hidden, "], got ", out.sizes());
  TORCH_CHECK(ticket.numel() == 1 && ticket.scalar_type() == at::kLong && ticket.device() == out.device(),
              "cpu_share_join: ticket must be the int64 that cpu_share_submit returned, on ", out.device());
}

namespace {

// The producer on the CPU: the payload, then the number (release).
at::Tensor submit_cpu(int64_t handle, int64_t layer, const at::Tensor& hidden, const at::Tensor& slot_ids,
                      const at::Tensor& expert_ids, const at::Tensor& weights, const at::Tensor& seq,
                      const c10::optional<at::Tensor>& stats) {
  const SessionInfo s = info(handle);
  check_submit(s, layer, hidden, slot_ids, expert_ids, weights, seq, stats);
  const int64_t tokens = hidden.size(0);
  const auto cpu = at::TensorOptions().device(at::kCPU);
  const auto experts = expert_ids.to(at::kLong).contiguous();
  const auto slots = slot_ids.contiguous();
  auto ids = at::from_blob(s.mailbox + s.layout.ids, {tokens, s.top_k}, cpu.dtype(at::kInt));
  const int64_t* e = experts.data_ptr<int64_t>();
  const int32_t* sl = slots.data_ptr<int32_t>();
  int32_t* dst = ids.data_ptr<int32_t>();
  std::vector<char> seen(s.experts, 0);
  int64_t pairs = 0, distinct = 0;
  for (int64_t i = 0; i < tokens * s.top_k; ++i) {
    const bool on_cpu = sl[i] < 0 && e[i] >= 0 && e[i] < s.experts;
    dst[i] = on_cpu ? static_cast<int32_t>(e[i]) : -1;
    if (on_cpu) {
      ++pairs;
      if (!seen[e[i]]) seen[e[i]] = 1, ++distinct;
    }
  }
  at::from_blob(s.mailbox + s.layout.weights, {tokens, s.top_k}, cpu.dtype(at::kFloat)).copy_(weights);
  at::from_blob(s.mailbox + s.layout.hidden, {tokens, s.hidden}, cpu.dtype(s.dtype)).copy_(hidden);
  auto ticket = at::zeros({1}, seq.options());
  if (pairs == 0) return ticket;  // nothing for the CPU: the join adds nothing
  if (stats.has_value()) {
    int64_t* row = stats->data_ptr<int64_t>();
    row[kStatsCpuPairs] += pairs;
    row[kStatsCpuExperts] += distinct;
  }
  auto* header = reinterpret_cast<MailboxHeader*>(s.mailbox);
  header->layer = layer;
  header->tokens = tokens;
  header->pairs = pairs;
  const int64_t next = seq.item<int64_t>() + 1;
  seq.fill_(next);
  ticket.fill_(next);
  store_release(&header->submitted, next);  // the payload before the number
  return ticket;
}

at::Tensor join_cpu(int64_t handle, const at::Tensor& out, const at::Tensor& ticket) {
  const SessionInfo s = info(handle);
  check_join(out, ticket, s);
  const int64_t job = ticket.item<int64_t>();
  TORCH_CHECK(job >= 0, "cpu_share_join: ticket ", job, " is negative; pass the ticket cpu_share_submit returned");
  if (job == 0) return out.clone();
  auto* header = reinterpret_cast<MailboxHeader*>(s.mailbox);
  // The mailbox holds one job: only the last one submitted can be joined, with its call's rows.
  const int64_t last = load_acquire(&header->submitted);
  TORCH_CHECK(job == last, "cpu_share_join: ticket ", job, " is not the session's last job (", last,
              "): join each job before the next submit");
  TORCH_CHECK(out.size(0) == header->tokens, "cpu_share_join: out has ", out.size(0), " rows but job ", job, " has ",
              header->tokens, " tokens; join with the output of the call that was submitted");
  // The producer waits without holding a core: it spins for a moment (a small job ends within
  // it), then sleeps in short steps. A waiter that keeps its core (spinning, or yielding, which the
  // Linux scheduler mostly ignores while the core has no other task) takes it from the row threads
  // when every core is busy, and a row thread it displaces stalls the job's join for a whole time
  // slice: on the 2-core machine, a call on two row threads took 2.34 ms with a yielding waiter and
  // 0.99 ms with this one (one row thread: 1.26 ms).
  const auto start = std::chrono::steady_clock::now();
  while (load_acquire(&header->done) < job) {  // the result after the number
    const auto waited = std::chrono::steady_clock::now() - start;
    if (waited < std::chrono::microseconds(50)) {
      ft::cpu::cpu_relax();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    TORCH_CHECK(waited < std::chrono::seconds(60), "cpu_share_join: the CPU worker did not finish its job in 60 s");
  }
  TORCH_CHECK(header->failed != job, "cpu_share_join: the CPU worker failed on its job: ", last_error(handle));
  auto result = at::from_blob(s.mailbox + s.layout.result, {out.size(0), s.hidden},
                              at::TensorOptions().dtype(at::kFloat));
  return (out.to(at::kFloat) + result).to(out.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(freetoken, CPU, m) {
  m.impl("cpu_share_submit", &submit_cpu);
  m.impl("cpu_share_join", &join_cpu);
}

}  // namespace ft::cpu_share
