// C++ unit tests of SpinPool (src/cpu/spin_pool.h), the CPU share's row threads: every chunk runs
// exactly once per call, back to back (with its own job's bounds) and after the helpers went to sleep; an exception in a chunk
// reaches the caller and the pool stays usable; a pool of one thread runs on the caller; the
// counters add up.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/spin_pool.h"

namespace {

using ft::cpu::SpinPool;

// Counts how often each index ran in one parallel_for.
std::vector<int> coverage(SpinPool& pool, int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> hits(n);
  pool.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
    ASSERT_LE(end - begin, grain);
    for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
  });
  std::vector<int> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = hits[i].load();
  return out;
}

TEST(SpinPool, EveryChunkRunsOnceInManyCallsBackToBack) {
  SpinPool pool(3);
  EXPECT_EQ(pool.threads(), 3);
  for (int call = 0; call < 500; ++call) {
    const int64_t n = 1 + (call * 37) % 3000, grain = 1 + call % 40;
    const auto hits = coverage(pool, n, grain);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "call " << call << " index " << i;
  }
}

TEST(SpinPool, MoreThreadsThanCoresStillRunEveryChunkOnce) {
  // The caller waits for chunks, not helpers: descheduled helpers must neither lose nor repeat one.
  SpinPool pool(2 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) + 2);
  for (int call = 0; call < 200; ++call) {
    const auto hits = coverage(pool, 1 + (call * 53) % 700, 1 + call % 5);
    for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "call " << call << " index " << i;
  }
}

TEST(SpinPool, EveryChunkSeesItsOwnJobBackToBackAcrossSizes) {
  // Jobs of very different sizes and grains back to back, more threads than cores: a helper late
  // for one job claims chunks of the next, which must carry that job's bounds (each chunk starts on
  // its own grain and ends at its own n), and every index of every job runs once.
  SpinPool pool(3 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) + 2);
  std::vector<std::atomic<int>> hits(20000);
  uint64_t state = 12345;
  const auto next = [&state] { return (state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
  for (int job = 0; job < 3000; ++job) {
    const int64_t n = 1 + static_cast<int64_t>(next() % (job % 10 == 0 ? 20000 : 200));
    const int64_t grain = 1 + static_cast<int64_t>(next() % (job % 3 == 0 ? 40 : 3));
    for (int64_t i = 0; i < n; ++i) hits[i].store(0, std::memory_order_relaxed);
    std::atomic<int> misplaced{0};
    pool.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
      if (begin % grain != 0 || end != std::min(n, begin + grain)) misplaced.fetch_add(1);
      for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
    });
    ASSERT_EQ(misplaced.load(), 0) << "job " << job << " (n " << n << ", grain " << grain << ")";
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "job " << job << " index " << i;
  }
}

TEST(SpinPool, MoreChunksThanTheTicketCountsTakeLargerChunks) {
  SpinPool pool(3);
  const int64_t n = 3'000'000;  // a grain of 1 would be 3M chunks; the ticket counts 2^20 - 1
  std::vector<std::atomic<int>> hits(n);
  std::atomic<int64_t> chunks{0};
  pool.parallel_for(n, 1, [&](int64_t begin, int64_t end) {
    chunks.fetch_add(1);
    for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
  });
  EXPECT_LT(chunks.load(), int64_t{1} << 20);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
}

TEST(SpinPool, HelpersThatWentToSleepWakeForTheNextCall) {
  SpinPool pool(3);
  coverage(pool, 100, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past the 100 ms of spinning
  std::atomic<int> distinct_threads{0};
  std::vector<std::thread::id> seen;
  std::mutex m;
  pool.parallel_for(3000, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(m);
    const auto id = std::this_thread::get_id();
    bool found = false;
    for (const auto& s : seen) found |= s == id;
    if (!found) {
      seen.push_back(id);
      distinct_threads.fetch_add(1);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  });
  EXPECT_GE(distinct_threads.load(), 2);  // a helper took part, not the caller alone
  EXPECT_GE(pool.counters().wakes, 1);    // and the counters saw the call that woke it
  const auto hits = coverage(pool, 500, 3);
  for (int h : hits) EXPECT_EQ(h, 1);
}

TEST(SpinPool, CountersAddUpTheSplitCallsAndWhoRanTheirChunks) {
  SpinPool pool(3);
  coverage(pool, 10, 20);  // one chunk: runs on the caller, not split
  EXPECT_EQ(pool.counters().split_calls, 0);
  int64_t chunks = 0;
  for (int call = 0; call < 50; ++call) {
    const int64_t n = 100 + call * 7, grain = 1 + call % 9;
    coverage(pool, n, grain);
    chunks += n / grain + (n % grain != 0);
  }
  const auto c = pool.counters();
  EXPECT_EQ(c.split_calls, 50);
  EXPECT_EQ(c.chunks, chunks);
  EXPECT_GE(c.caller_chunks, 0);
  EXPECT_LE(c.caller_chunks, c.chunks);
  EXPECT_LE(c.wakes, c.split_calls);
}

TEST(SpinPool, HelpersPutToRestWakeForTheNextCall) {
  SpinPool pool(3);
  for (int round = 0; round < 20; ++round) {
    coverage(pool, 200, 1);
    pool.rest();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the helpers reach their wait
    const auto hits = coverage(pool, 300, 2);
    for (int h : hits) ASSERT_EQ(h, 1) << "round " << round;
  }
}

TEST(SpinPool, AnExceptionReachesTheCallerAndThePoolStaysUsable) {
  SpinPool pool(3);
  EXPECT_THROW(pool.parallel_for(1000, 1,
                                 [](int64_t begin, int64_t) {
                                   if (begin == 517) throw std::runtime_error("chunk 517");
                                 }),
               std::runtime_error);
  const auto hits = coverage(pool, 1000, 7);
  for (int h : hits) EXPECT_EQ(h, 1);
}

TEST(SpinPool, ACallFromInsideAChunkRunsOnItsOwnThread) {
  SpinPool pool(3);
  std::vector<std::atomic<int>> outer(64), inner(64 * 10);
  pool.parallel_for(64, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      outer[i].fetch_add(1);
      pool.parallel_for(10, 1, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) inner[i * 10 + j].fetch_add(1);
      });
    }
  });
  for (auto& h : outer) EXPECT_EQ(h.load(), 1);
  for (auto& h : inner) EXPECT_EQ(h.load(), 1);
}

TEST(SpinPool, OneThreadRunsOnTheCaller) {
  SpinPool pool(1);
  EXPECT_EQ(pool.threads(), 1);
  const auto caller = std::this_thread::get_id();
  int chunks = 0;
  pool.parallel_for(100, 10, [&](int64_t begin, int64_t end) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    EXPECT_EQ(begin, 0);
    EXPECT_EQ(end, 100);  // one call over everything
    ++chunks;
  });
  EXPECT_EQ(chunks, 1);
  pool.parallel_for(0, 10, [&](int64_t, int64_t) { ++chunks; });  // nothing to do
  EXPECT_EQ(chunks, 1);
}

}  // namespace
