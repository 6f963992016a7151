// SpinPool (spin_pool.h): helpers poll the ticket and claim chunks from it with one fetch_add each;
// the caller claims chunks too, then waits until every chunk is done. A claim is a single atomic
// add, never a compare-and-swap: with a dozen threads claiming at once, compare-and-swap loops fail
// and retry, and every attempt moves the ticket's cache line, so a chunk cost several line transfers
// instead of one. A claim that lands on a newer job than the one its thread saw is a valid chunk of
// that job (its fields were written before its ticket); one past the last chunk ends the thread's
// share. Each thread counts the chunks it ran and adds them to `done` once, when its share ends.
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
// Claims past the last chunk still add 1 to the next-chunk field (one per thread and visit of a
// job): the chunk count stays this far below the field's limit so that they never carry into it.
constexpr int64_t kMaxThreads = 1024;
constexpr uint64_t kMaxChunks = kField - 4 * kMaxThreads;
inline uint64_t tag_of(uint64_t ticket) { return ticket >> kTagShift; }

}  // namespace

SpinPool::SpinPool(int threads) {
  threads = std::min<int>(threads, kMaxThreads);
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

int64_t SpinPool::run_chunks() {
  int64_t ran = 0;
  for (;;) {
    const uint64_t t = ticket_.fetch_add(1, std::memory_order_acq_rel);
    const uint64_t next = t & kField;
    if (next >= ((t >> kCountShift) & kField)) break;  // this job has no chunk left (or none runs)
    // The job's fields are those of the ticket just read: its caller waits for this chunk before
    // it writes another job's.
    const int64_t begin = static_cast<int64_t>(next) * grain_;
    try {
      (*body_)(begin, begin + std::min(grain_, n_ - begin));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    ++ran;
  }
  if (ran > 0) done_.fetch_add(ran, std::memory_order_release);
  return ran;
}

SpinPool::Counters SpinPool::counters() const {
  Counters c;
  c.split_calls = split_calls_.load(std::memory_order_relaxed);
  c.chunks = chunks_run_.load(std::memory_order_relaxed);
  c.caller_chunks = caller_chunks_.load(std::memory_order_relaxed);
  c.wakes = wakes_.load(std::memory_order_relaxed);
  return c;
}

void SpinPool::helper_loop() {
  uint64_t seen = 0;
  auto last_job = std::chrono::steady_clock::now();
  int64_t polls = 0;
  while (!stop_.load(std::memory_order_relaxed)) {
    const uint64_t tag = tag_of(ticket_.load(std::memory_order_acquire));
    if (tag != seen) {
      seen = tag;
      run_chunks();
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
  const auto most = static_cast<int64_t>(kMaxChunks);
  grain = std::max<int64_t>(grain, n / most + (n % most != 0));  // without overflow near INT64_MAX
  const int64_t chunks = n / grain + (n % grain != 0);           // at most kMaxChunks
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
    wakes_.fetch_add(1, std::memory_order_relaxed);
  }
  const int64_t ran_here = run_chunks();
  split_calls_.fetch_add(1, std::memory_order_relaxed);
  chunks_run_.fetch_add(chunks, std::memory_order_relaxed);
  caller_chunks_.fetch_add(ran_here, std::memory_order_relaxed);
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
