// A team of threads that spin between jobs, for the CPU share's worker (src/cpu/cpu_share.cpp).
//
// Decode posts a CPU job per layer every few hundred microseconds. OpenMP (ATen's parallel_for)
// puts its threads to sleep right after each parallel region once more threads exist than cores
// (the worker's team beside torch's own), and waking a team costs tens of microseconds a region,
// several regions a job. These helpers spin while jobs keep coming and sleep only after 100 ms
// without one, as llama.cpp's and kTransformers' CPU expert threads do.
//
// A job is a count of chunks published in one atomic ticket (job tag, chunk count, next chunk):
// whoever runs claims the next chunk with one atomic add, and the caller waits for the chunks, not
// for the helpers, so a helper the OS has descheduled delays nothing it has not claimed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ft::cpu {

// One step of a spin-wait: the pause instruction where there is one (it frees the core's other
// hardware thread and the memory pipeline), else a yield.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class SpinPool {
 public:
  using Body = std::function<void(int64_t begin, int64_t end)>;

  // `threads` counts the caller of parallel_for: threads - 1 helpers are started (at most 1,023).
  explicit SpinPool(int threads);
  ~SpinPool();
  SpinPool(const SpinPool&) = delete;
  SpinPool& operator=(const SpinPool&) = delete;

  // body over [0, n) in chunks of `grain` (larger when n / grain passes about 10^6), on the caller and
  // the helpers; returns when every chunk has run. An exception in a chunk is rethrown here after
  // the others finish. One job at a time: a call made while one runs (from a chunk, or from another
  // thread) runs its body on its own thread instead.
  void parallel_for(int64_t n, int64_t grain, const Body& body);

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

  // Since the pool started: calls split into chunks across the threads, their chunks, the chunks
  // the callers ran themselves, and the calls that found helpers asleep and woke them. Written by
  // the caller once per call; readable from any thread.
  struct Counters {
    int64_t split_calls = 0, chunks = 0, caller_chunks = 0, wakes = 0;
  };
  Counters counters() const;

  // Puts the helpers to sleep now rather than after 100 ms without a job: the caller is about to
  // run work on other threads (ATen's GEMMs of a prompt-sized job), which spinning helpers would
  // slow down. The next parallel_for wakes them.
  void rest();

 private:
  void helper_loop();
  int64_t run_chunks();  // claims and runs chunks of the current job while it has any left; returns how many

  std::vector<std::thread> helpers_;
  // Their own cache lines: every chunk writes both, and idle helpers poll the ticket.
  alignas(64) std::atomic<uint64_t> ticket_{0};  // tag << 40 | chunks << 20 | next chunk
  alignas(64) std::atomic<int64_t> done_{0};     // chunks of the current job run to the end
  alignas(64) std::atomic<bool> in_job_{false};
  std::atomic<int> sleeping_{0};
  std::atomic<int64_t> split_calls_{0}, chunks_run_{0}, caller_chunks_{0}, wakes_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> resting_{false};
  uint64_t tag_ = 0;
  int64_t n_ = 0, grain_ = 1;
  const Body* body_ = nullptr;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace ft::cpu
