// SpinPool (spin_pool.h): helpers poll the ticket and claim chunks from it with a compare-and-swap
// that also checks the job's tag (a helper late for a job never takes a chunk of the next one); the
// caller claims chunks too, then waits until every chunk is done.
#include "spin_pool.h"

#include <algorithm>
#include <chrono>

namespace ft::cpu {
namespace {

constexpr auto kSpinFor = std::chrono::milliseconds(100);  // then sleep until the next job
// Polls between yields once a wait has lasted a while: a helper or caller that waits on a thread
// the OS has descheduled gives it the core instead of spinning through its time slice.
constexpr int kPollsPerYield = 64;

constexpr int kTagShift = 40, kCountShift = 20;
constexpr uint64_t kField = (uint64_t{1} << 20) - 1;  // chunk count and next chunk: 20 bits each
constexpr uint64_t kTags = uint64_t{1} << 24;
inline uint64_t tag_of(uint64_t ticket) { return ticket >> kTagShift; }

}  // namespace

SpinPool::SpinPool(int threads) {
  try {
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { helper_loop(); });
  } catch (...) {  // a thread that could not start: stop the ones that did, then report
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& t : helpers_) t.join();
    throw;
  }
}

SpinPool::~SpinPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : helpers_) t.join();
}

void SpinPool::run_chunks(uint64_t tag) {
  for (;;) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    if (tag_of(t) != tag || (t & kField) >= ((t >> kCountShift) & kField)) return;  // a newer job, or none left
    if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) continue;
    // The job's fields are those of `tag`: its caller waits for this chunk before writing others.
    const int64_t begin = static_cast<int64_t>(t & kField) * grain_;
    try {
      (*body_)(begin, begin + std::min(grain_, n_ - begin));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_release);
  }
}

void SpinPool::helper_loop() {
  uint64_t seen = 0;
  auto last_job = std::chrono::steady_clock::now();
  int64_t polls = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    const uint64_t tag = tag_of(ticket_.load(std::memory_order_acquire));
    if (tag != seen) {
      seen = tag;
      run_chunks(tag);
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
    wake_.wait(lock, [&] { return stop_.load() || tag_of(ticket_.load()) != seen; });
    sleeping_.fetch_sub(1);
    last_job = std::chrono::steady_clock::now();
  }
}

void SpinPool::rest() { resting_.store(true, std::memory_order_relaxed); }

void SpinPool::parallel_for(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  bool idle = false;
  if (helpers_.empty() || n <= grain || !in_job_.compare_exchange_strong(idle, true)) {
    body(0, n);  // one chunk, no helpers, or a job already running (see the header)
    return;
  }
  struct EndJob {
    std::atomic<bool>& in_job;
    ~EndJob() { in_job.store(false); }
  } end_job{in_job_};
  const auto field = static_cast<int64_t>(kField);
  grain = std::max<int64_t>(grain, n / field + (n % field != 0));  // without overflow near INT64_MAX
  const int64_t chunks = n / grain + (n % grain != 0);             // at most kField
  n_ = n;
  grain_ = grain;
  body_ = &body;
  done_.store(0, std::memory_order_relaxed);
  resting_.store(false, std::memory_order_relaxed);
  tag_ = tag_ % (kTags - 1) + 1;  // 1 .. 2^24 - 1: a helper starts having seen tag 0
  // seq_cst: the fields above before the ticket, and the ticket before sleeping_ is read below.
  ticket_.store(tag_ << kTagShift | static_cast<uint64_t>(chunks) << kCountShift);
  if (sleeping_.load() > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_all();
  }
  run_chunks(tag_);
  for (int64_t polls = 1; done_.load(std::memory_order_acquire) < chunks; ++polls) {
    if (polls % kPollsPerYield == 0) {
      std::this_thread::yield();  // a helper running a chunk may need this core
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
