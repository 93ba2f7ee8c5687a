// Threads of the kernels' FFI handlers (rowmatmul.cc, row_attention.cc,
// row_sample.cc).
//
// A call's work is cut into chunks claimed from an atomic counter by the
// calling thread and by helpers scheduled on XLA's intra-op thread pool. The
// caller claims whatever the helpers have not started, so the call never
// waits on a helper that has not been scheduled yet (no deadlock when the
// pool is busy), and a late helper finds nothing left and returns.

#ifndef T5X_SPEED_CSRC_FFI_THREADS_H_
#define T5X_SPEED_CSRC_FFI_THREADS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace t5x_speed_kernels {

// ---------------------------------------------------------------------------
// Threads.

// Threads for the `threads` attribute: a positive count as given (capped, so
// that it fits an int), 0 one per hardware thread.
inline int NumThreads(int64_t requested) {
  constexpr int64_t kMaxThreads = 1 << 16;
  if (requested > 0) {
    return static_cast<int>(std::min(requested, kMaxThreads));
  }
  static const int hardware =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  return hardware;
}

// One wait of a spin loop on another thread's progress.
inline void Pause() {
#if defined(__SSE2__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Chunks claimed by the caller and by pool helpers; kept alive by the
// helpers' shared_ptr in case one starts after the call has returned.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t chunks = 0;
  const void* body = nullptr;  // valid while done < chunks
  void (*run)(const void* body, int64_t chunk) = nullptr;
#if defined(__SSE__)
  unsigned int csr = 0;        // caller's MXCSR (denormal modes) for helpers
#endif

  // Runs chunks until none is left.
  void Drain() {
    for (int64_t c;
         (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      run(body, c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t chunks, int threads,
                 const F& fn) {
  if (threads <= 1 || chunks <= 1) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
    return;
  }
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  work->body = &fn;
  work->run = [](const void* body, int64_t c) {
    (*static_cast<const F*>(body))(c);
  };
#if defined(__SSE__)
  work->csr = _mm_getcsr();
#endif
  const int helpers = static_cast<int>(std::min<int64_t>(threads, chunks) - 1);
  for (int i = 0; i < helpers; ++i) {
    pool.Schedule([work] {
#if defined(__SSE__)
      // Same flush-to-zero / denormals-are-zero modes as the caller, so a
      // column's result does not depend on the thread that computes it.
      const unsigned int saved = _mm_getcsr();
      _mm_setcsr(work->csr);
      work->Drain();
      _mm_setcsr(saved);
#else
      work->Drain();
#endif
    });
  }
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < chunks) Pause();
}

// Weights below this size run on the calling thread: a helper's wake-up
// costs more than it saves.
constexpr int64_t kMinParallelBytes = 256 * 1024;

// Threads for a call that reads `bytes`: up to `max_threads`, one below
// kMinParallelBytes or where XLA gives no pool.
inline int ThreadsFor(const xla::ffi::ThreadPool& pool, int64_t bytes,
                      int max_threads) {
  if (bytes < kMinParallelBytes || pool.num_threads() <= 0) return 1;
  return max_threads;
}

inline bool IsFloat(xla::ffi::DataType t) {
  return t == xla::ffi::DataType::F32 || t == xla::ffi::DataType::BF16;
}

}  // namespace t5x_speed_kernels

#endif  // T5X_SPEED_CSRC_FFI_THREADS_H_
