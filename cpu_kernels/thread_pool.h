// A small persistent thread pool for the kernels: parallel_for over chunks, the calling thread taking
// part. Idle workers poll for the next job for a short while, yielding their CPU between looks
// (consecutive matmuls of a layer follow each other within microseconds), and then sleep on a condition
// variable, so an idle process costs no CPU.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace mlx_infer_kernels {

class ThreadPool {
 public:
  // The process-wide pool: $MLX_INFER_KERNEL_THREADS threads, else one per hardware thread.
  static ThreadPool& instance();

  // Threads that take part in parallel_for, the caller included.
  int size() const { return int(workers_.size()) + 1; }

  // Calls body(chunk) for every chunk in [0, chunks) on the pool's threads and the caller; returns
  // when all chunks are done. Chunks are claimed one at a time from a shared counter and the caller
  // never waits for a worker that has not started: on a busy machine it does the work itself.
  // A nested or concurrent call runs all its chunks on the caller.
  template <class F>
  void parallel_for(int chunks, F&& body) {
    run(chunks, &invoke<F>, &body);
  }

 private:
  using Call = void (*)(void* body, int chunk);

  template <class F>
  static void invoke(void* body, int chunk) {
    (*static_cast<F*>(body))(chunk);
  }

  explicit ThreadPool(int threads);
  void run(int chunks, Call call, void* body);
  // Claims and runs chunks of the job published as state_ (epoch, chunks, next chunk) until none is
  // left or a newer job replaced it.
  void work();
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex busy_;                       // one parallel_for at a time
  std::atomic<uint64_t> state_{0};        // (job epoch << 32) | (chunks << 16) | next unclaimed chunk
  std::atomic<Call> call_{nullptr};
  std::atomic<void*> body_{nullptr};
  std::atomic<int> done_{0};              // chunks of the current job completed
  std::atomic<uint32_t> wake_{0};         // bumped per job; idle workers spin on it, then sleep
  std::atomic<int> sleepers_{0};          // workers asleep (or about to be) on sleep_cv_
  std::mutex sleep_mutex_;
  std::condition_variable sleep_cv_;
  int64_t spin_ns_;
};

}  // namespace mlx_infer_kernels
