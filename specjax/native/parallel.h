// Work split over XLA's intra-op thread pool, shared by the native kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace specjax_native {

// Calls work(i0, i1) over [0, items) in claims of `claim` items, taken from an atomic counter by
// the calling thread and by up to threads - 1 helpers scheduled on the pool, and returns when
// every item is done. A helper that starts late finds nothing to claim, so the call never waits
// on a busy pool; the shared state outlives the call for such a helper (it only reads the counter).
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, int64_t claim,
                        std::function<void(int64_t, int64_t)> work) {
  struct State {
    std::function<void(int64_t, int64_t)> work;
    int64_t items, claim;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    void Work() {
      for (;;) {
        const int64_t i0 = next.fetch_add(claim, std::memory_order_relaxed);
        if (i0 >= items) return;
        const int64_t i1 = std::min(items, i0 + claim);
        work(i0, i1);
        done.fetch_add(i1 - i0, std::memory_order_release);
      }
    }
  };
  if (items <= 0) return;
  auto state = std::make_shared<State>();
  state->work = std::move(work);
  state->items = items;
  state->claim = std::max<int64_t>(1, claim);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads, (items + state->claim - 1) / state->claim) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->Work(); });
  state->Work();
  // items claimed by helpers may still be in flight
  while (state->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace specjax_native
