// Running a CPU kernel's tiles on XLA's intra-op thread pool (the forward, the backward and the
// decode update).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "ffi_common.h"

namespace causal_conv {

// Below this many points a call runs on the calling thread: scheduling costs more than it saves.
constexpr int64_t kParallelPoints = int64_t{1} << 16;

// The threads a call of this many points may use: XLA's pool, or only the calling thread.
inline int64_t threads_for(ffi::ThreadPool& pool, int64_t points) {
  return points >= kParallelPoints ? pool.num_threads() : 1;
}

// Runs fn(i) for i in [0, tiles): on the calling thread for small work, else on the calling
// thread and up to num_threads - 1 tasks of XLA's pool, which take tiles from a shared counter.
// The caller waits only for tiles that were taken, never for a task to start, so it cannot
// deadlock on a busy pool; a task that starts late finds no tile left and touches only the
// shared state it co-owns.
template <typename Fn>
inline void run_tiles(ffi::ThreadPool& pool, int64_t tiles, int64_t points, const Fn& fn) {
  const int64_t threads = std::min(threads_for(pool, points), tiles);
  if (threads <= 1) {
    for (int64_t i = 0; i < tiles; ++i) fn(i);
    return;
  }
  struct Shared {
    std::function<void(int64_t)> body;
    int64_t total = 0;
    std::atomic<int64_t> next{0};
    std::mutex mutex;
    std::condition_variable finished;
    int64_t done = 0;
  };
  auto shared = std::make_shared<Shared>();
  shared->body = [&fn](int64_t i) { fn(i); };
  shared->total = tiles;
  const auto work = [](Shared& s) {
    int64_t ran = 0;
    for (int64_t i = s.next.fetch_add(1); i < s.total; i = s.next.fetch_add(1), ++ran) s.body(i);
    if (ran == 0) return;
    std::lock_guard<std::mutex> lock(s.mutex);
    s.done += ran;
    if (s.done == s.total) s.finished.notify_all();
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([shared, work] { work(*shared); });
  work(*shared);
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->finished.wait(lock, [&] { return shared->done == shared->total; });
}

}  // namespace causal_conv
