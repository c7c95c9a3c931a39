#include "thread_pool.h"

#include <atomic>
#include <chrono>
#include <cstdlib>

// What a spin loop does between two loads of the flag it waits on: nothing but a compiler barrier. x86's
// PAUSE was measured here (KVM guest, Zen 4) to take the spinning worker off its CPU for long stretches
// (pause-loop exiting): with it the helper took part in 1% of back-to-back products, without it in half.
#define MLX_INFER_PAUSE() std::atomic_signal_fence(std::memory_order_seq_cst)

namespace mlx_infer_kernels {
namespace {

// How long an idle worker spins before it sleeps ($MLX_INFER_KERNEL_SPIN_US, microseconds).
constexpr int64_t kDefaultSpinNs = 100'000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::atoi(v);
}

}  // namespace

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: workers asleep at interpreter exit are not joined from a static destructor.
  static ThreadPool* pool = [] {
    int hw = int(std::thread::hardware_concurrency());
    int n = env_int("MLX_INFER_KERNEL_THREADS", hw > 0 ? hw : 1);
    return new ThreadPool(n < 1 ? 1 : n);
  }();
  return *pool;
}

ThreadPool::ThreadPool(int threads) {
  int spin_us = env_int("MLX_INFER_KERNEL_SPIN_US", -1);
  spin_ns_ = spin_us < 0 ? kDefaultSpinNs : int64_t(spin_us) * 1000;
  for (int t = 1; t < threads; ++t) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

// The job state word: (epoch << 32) | (chunks << 16) | next unclaimed chunk. The chunk count lives in the
// word a worker claims against, so a worker whose view is of a finished job (next == chunks) never takes
// the count of the job being published: it claims only against a state with unclaimed chunks of its own.
constexpr uint64_t kNextBits = 16;
constexpr uint64_t kFieldMask = (uint64_t(1) << kNextBits) - 1;

void ThreadPool::work() {
  uint64_t s = state_.load(std::memory_order_acquire);
  for (;;) {
    const int chunk = int(s & kFieldMask);
    const int chunks = int((s >> kNextBits) & kFieldMask);
    if (chunk >= chunks) return;
    // While a chunk of this state's job is unclaimed the job cannot end (its caller waits for every
    // chunk) and its fields cannot change; a successful claim proves the state did not move since s was
    // read, so the fields read here are the claimed job's.
    const Call call = call_.load(std::memory_order_relaxed);
    void* body = body_.load(std::memory_order_relaxed);
    if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      call(body, chunk);
      done_.fetch_add(1, std::memory_order_release);
      s = state_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::run(int chunks, Call call, void* body) {
  std::unique_lock<std::mutex> lock(busy_, std::try_to_lock);
  if (!lock.owns_lock() || workers_.empty() || chunks <= 1 || uint64_t(chunks) > kFieldMask) {
    for (int c = 0; c < chunks; ++c) call(body, c);
    return;
  }
  // The previous job is complete (we waited for it): no worker holds a claim on it, and a worker that
  // still reads its exhausted state claims nothing (work()).
  call_.store(call, std::memory_order_relaxed);
  body_.store(body, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  const uint64_t epoch = (state_.load(std::memory_order_relaxed) >> 32) + 1;
  state_.store((epoch << 32) | (uint64_t(chunks) << kNextBits), std::memory_order_release);
  wake_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {  // seq_cst pairs with worker_loop's check
    std::lock_guard<std::mutex> guard(sleep_mutex_);
    sleep_cv_.notify_all();
  }
  work();
  for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
    if (spins < 64) {
      MLX_INFER_PAUSE();
    } else {
      std::this_thread::yield();  // a worker still on its chunk may be waiting for this CPU
    }
  }
}

void ThreadPool::worker_loop() {
  uint32_t seen = 0;
  for (;;) {
    uint32_t e = wake_.load(std::memory_order_acquire);
    if (e == seen) {
      const int64_t until = now_ns() + spin_ns_;
      int spins = 0;
      while ((e = wake_.load(std::memory_order_acquire)) == seen) {
        // Yield rather than spin: on a busy machine this worker may share its CPU with the thread
        // that will publish the next job (measured: pure spinning there halves that thread's speed).
        std::this_thread::yield();
        if ((++spins & 15) == 0 && now_ns() > until) {
          // Sleep. Registered as a sleeper before the last look at wake_ (both seq_cst), so a job
          // published after that look finds the sleeper and notifies it.
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          while (wake_.load(std::memory_order_seq_cst) == seen) {
            sleep_cv_.wait(lock);
          }
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
    }
    seen = e;
    work();
  }
}

}  // namespace mlx_infer_kernels
