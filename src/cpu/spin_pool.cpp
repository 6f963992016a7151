// SpinPool (spin_pool.h): helpers poll a generation counter, take chunks from a shared cursor, and
// count themselves out; the caller works too and spins until they are out.
#include "spin_pool.h"

#include <algorithm>
#include <chrono>

namespace ft::cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

constexpr auto kSpinFor = std::chrono::milliseconds(100);  // then sleep until the next job
// Polls between yields once a wait has lasted a while: a helper or caller that waits on a thread
// the OS has descheduled gives it the core instead of spinning through its time slice.
constexpr int kPollsPerYield = 64;

}  // namespace

SpinPool::SpinPool(int threads) {
  for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { helper_loop(); });
}

SpinPool::~SpinPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : helpers_) t.join();
}

void SpinPool::work() {
  for (;;) {
    const int64_t begin = next_.fetch_add(grain_, std::memory_order_relaxed);
    if (begin >= n_) return;
    try {
      (*body_)(begin, std::min(n_, begin + grain_));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void SpinPool::helper_loop() {
  uint64_t seen = 0;
  auto last_job = std::chrono::steady_clock::now();
  int64_t polls = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    const uint64_t g = generation_.load(std::memory_order_acquire);  // the job's fields after it
    if (g != seen) {
      seen = g;
      work();
      running_.fetch_sub(1, std::memory_order_release);
      last_job = std::chrono::steady_clock::now();
      continue;
    }
    if (++polls % kPollsPerYield != 0) {
      cpu_relax();
      continue;
    }
    const auto idle = std::chrono::steady_clock::now() - last_job;
    const bool resting = resting_.load(std::memory_order_relaxed);
    if (!resting && idle < std::chrono::milliseconds(1)) continue;  // decode's next layer comes within this
    if (!resting && idle < kSpinFor) {
      std::this_thread::yield();
      continue;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    sleeping_.fetch_add(1);  // before the check: parallel_for reads it after publishing a job
    wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
    sleeping_.fetch_sub(1);
    last_job = std::chrono::steady_clock::now();
  }
}

void SpinPool::rest() { resting_.store(true, std::memory_order_relaxed); }

void SpinPool::parallel_for(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (helpers_.empty() || n <= grain) {
    body(0, n);
    return;
  }
  n_ = n;
  grain_ = grain;
  body_ = &body;
  next_.store(0, std::memory_order_relaxed);
  resting_.store(false, std::memory_order_relaxed);
  running_.store(static_cast<int>(helpers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1);  // seq_cst: published before sleeping_ is read below
  if (sleeping_.load() > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_all();
  }
  work();
  for (int polls = 1; running_.load(std::memory_order_acquire) > 0; ++polls) {
    if (polls % kPollsPerYield == 0) {
      std::this_thread::yield();  // a helper still running may need this core
    } else {
      cpu_relax();
    }
  }
  body_ = nullptr;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace ft::cpu
