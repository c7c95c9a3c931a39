// A CPU emulation of Metal's compute execution model, to run the golden source of `mx.fast.metal_kernel`
// kernels (metal_shim.h) on a machine without a GPU:
//   - each threadgroup runs on a fresh OS thread, its threads as fibers (ucontext) of that thread, so
//     `threadgroup` arrays (static thread_local, see metal_shim.h) are shared by exactly one threadgroup's
//     threads and start zeroed;
//   - a fiber runs until it reaches threadgroup_barrier or a SIMD-group collective, then the next runs
//     (in thread order). A barrier releases when every thread of the threadgroup has reached it; a SIMD-group
//     collective when every live lane of its SIMD group (32 consecutive threads) has, and it computes over
//     those lanes. So a missing barrier deterministically lets a thread read what others have not written
//     yet (or overwrite what they still need), and a wrong reduction gives wrong sums;
//   - a barrier some threads never reach (returned early, or waiting at another barrier / collective) and
//     collectives whose lanes disagree (op or value type) are reported as errors, not hung on.
// Threadgroups may run on several OS threads at once (`workers`); results do not depend on it.

#ifndef MLX_INFER_METAL_EMU_H
#define MLX_INFER_METAL_EMU_H

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "metal_shim.h"

namespace emu {

constexpr int kSimdWidth = 32;
constexpr size_t kFiberStack = 256 * 1024;

// Every thread attribute a Metal kernel may take, named as Metal names them.
struct ThreadAttrs {
  uint3 thread_position_in_grid;
  uint3 thread_position_in_threadgroup;
  uint3 threadgroup_position_in_grid;
  uint3 threads_per_threadgroup;
  uint3 dispatch_threads_per_threadgroup;
  uint3 threadgroups_per_grid;
  uint3 threads_per_grid;
  uint3 grid_size;
  uint3 grid_origin;
  uint thread_index_in_threadgroup;
  uint thread_index_in_simdgroup;
  uint simdgroup_index_in_threadgroup;
  uint simdgroups_per_threadgroup;
  uint dispatch_simdgroups_per_threadgroup;
  uint threads_per_simdgroup;
  uint thread_execution_width;
  uint thread_index_in_quadgroup;
  uint quadgroup_index_in_threadgroup;
  uint quadgroups_per_threadgroup;
  uint dispatch_quadgroups_per_threadgroup;
};

using Kernel = std::function<void(const ThreadAttrs&)>;

enum class Wait { running, barrier, simd, done };
enum class SimdOp { sum, max, shuffle_xor, shuffle_down, shuffle, broadcast_first };

struct Fiber;
using Combine = void (*)(Fiber** lanes);  // lanes[kSimdWidth], nullptr where a lane is not live

struct Fiber {
  ucontext_t ctx;
  Wait wait = Wait::running;
  SimdOp op = SimdOp::sum;
  uint arg = 0;
  Combine combine = nullptr;
  alignas(16) unsigned char in[16];
  alignas(16) unsigned char out[16];
  ThreadAttrs attrs;
  void* stack = nullptr;
};

struct Group {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  int current = 0;
  const Kernel* kernel = nullptr;
  std::string error;
};

inline thread_local Group* t_group = nullptr;

inline Fiber& current_fiber() { return t_group->fibers[t_group->current]; }

inline void block(Wait why) {
  Fiber& f = current_fiber();
  f.wait = why;
  swapcontext(&f.ctx, &t_group->scheduler);
}

inline void fiber_entry() {
  Group* g = t_group;
  Fiber& f = g->fibers[g->current];
  (*g->kernel)(f.attrs);
  f.wait = Wait::done;
  swapcontext(&f.ctx, &g->scheduler);
}

template <typename U>
void combine_lanes(Fiber** lanes) {
  static_assert(std::is_trivially_copyable<U>::value && sizeof(U) <= 16, "SIMD-group value type");
  U v[kSimdWidth];
  bool live[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l) {
    live[l] = lanes[l] != nullptr;
    if (live[l]) std::memcpy(&v[l], lanes[l]->in, sizeof(U));
  }
  U poison;
  std::memset(&poison, 0xff, sizeof(U));  // NaN for float types: reading a dead lane shows up
  int first = 0;
  while (!live[first]) ++first;
  for (int l = 0; l < kSimdWidth; ++l) {
    if (!live[l]) continue;
    Fiber& f = *lanes[l];
    U r = poison;
    switch (f.op) {
      case SimdOp::sum: {
        float acc = 0.0f;  // accumulated in lane order, in float for float-like types
        U s = U();
        bool any = false;
        for (int j = 0; j < kSimdWidth; ++j) {
          if (!live[j]) continue;
          if constexpr (std::is_integral<U>::value) {
            s = any ? U(s + v[j]) : v[j];
          } else {
            acc += float(v[j]);
          }
          any = true;
        }
        if constexpr (std::is_integral<U>::value) {
          r = s;
        } else {
          r = U(acc);
        }
        break;
      }
      case SimdOp::max: {
        r = v[first];
        for (int j = first + 1; j < kSimdWidth; ++j) {
          if (live[j] && float(v[j]) > float(r)) r = v[j];
        }
        break;
      }
      case SimdOp::shuffle_xor: {
        const uint src = uint(l) ^ f.arg;
        r = src < uint(kSimdWidth) && live[src] ? v[src] : poison;
        break;
      }
      case SimdOp::shuffle_down: {
        const uint src = uint(l) + f.arg;
        r = src < uint(kSimdWidth) && live[src] ? v[src] : v[l];  // Metal: lanes past the end keep theirs
        break;
      }
      case SimdOp::shuffle: {
        const uint src = f.arg;
        r = src < uint(kSimdWidth) && live[src] ? v[src] : poison;
        break;
      }
      case SimdOp::broadcast_first:
        r = v[first];
        break;
    }
    std::memcpy(f.out, &r, sizeof(U));
  }
}

template <typename U>
U collective(SimdOp op, U v, uint arg) {
  Fiber& f = current_fiber();
  f.op = op;
  f.arg = arg;
  f.combine = &combine_lanes<U>;
  std::memcpy(f.in, &v, sizeof(U));
  block(Wait::simd);
  U r;
  std::memcpy(&r, current_fiber().out, sizeof(U));
  return r;
}

inline const char* op_name(SimdOp op) {
  switch (op) {
    case SimdOp::sum: return "simd_sum";
    case SimdOp::max: return "simd_max";
    case SimdOp::shuffle_xor: return "simd_shuffle_xor";
    case SimdOp::shuffle_down: return "simd_shuffle_down";
    case SimdOp::shuffle: return "simd_shuffle";
    case SimdOp::broadcast_first: return "simd_broadcast_first";
  }
  return "?";
}

// Runs one threadgroup to completion on the calling OS thread; returns "" or what went wrong.
inline std::string run_threadgroup(const Kernel& kernel, const std::vector<ThreadAttrs>& attrs) {
  Group g;
  g.kernel = &kernel;
  const int n = int(attrs.size());
  g.fibers.resize(n);
  const long page = sysconf(_SC_PAGESIZE);
  for (int i = 0; i < n; ++i) {
    Fiber& f = g.fibers[i];
    f.attrs = attrs[i];
    // A guard page below each stack: an overflow faults instead of corrupting a neighbour.
    char* base = static_cast<char*>(mmap(nullptr, kFiberStack + page, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) return "mmap of a fiber stack failed";
    mprotect(base, page, PROT_NONE);
    f.stack = base;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = base + page;
    f.ctx.uc_stack.ss_size = kFiberStack;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  t_group = &g;
  const int simdgroups = (n + kSimdWidth - 1) / kSimdWidth;
  while (g.error.empty()) {
    for (int i = 0; i < n; ++i) {
      if (g.fibers[i].wait == Wait::running) {
        g.current = i;
        swapcontext(&g.scheduler, &g.fibers[i].ctx);
      }
    }
    int done = 0, at_barrier = 0;
    for (const Fiber& f : g.fibers) {
      done += f.wait == Wait::done;
      at_barrier += f.wait == Wait::barrier;
    }
    if (done == n) break;
    bool released = false;
    for (int s = 0; s < simdgroups && g.error.empty(); ++s) {
      Fiber* lanes[kSimdWidth] = {};
      int waiting = 0, blocked_elsewhere = 0;
      Fiber* first = nullptr;
      for (int l = 0; l < kSimdWidth; ++l) {
        const int i = s * kSimdWidth + l;
        if (i >= n || g.fibers[i].wait == Wait::done) continue;
        Fiber& f = g.fibers[i];
        if (f.wait == Wait::simd) {
          lanes[l] = &f;
          ++waiting;
          if (!first) first = &f;
        } else {
          ++blocked_elsewhere;
        }
      }
      if (waiting == 0 || blocked_elsewhere > 0) continue;
      for (int l = 0; l < kSimdWidth; ++l) {
        if (lanes[l] && (lanes[l]->op != first->op || lanes[l]->combine != first->combine)) {
          g.error = std::string("SIMD group ") + std::to_string(s) + ": lanes meet at different collectives (" +
                    op_name(first->op) + " and " + op_name(lanes[l]->op) + ", or different value types)";
        }
      }
      if (!g.error.empty()) break;
      first->combine(lanes);
      for (Fiber* f : lanes) {
        if (f) f->wait = Wait::running;
      }
      released = true;
    }
    if (!g.error.empty() || released) continue;
    if (at_barrier == n - done) {
      if (done > 0) {
        g.error = std::to_string(done) + " thread(s) of the threadgroup returned while " + std::to_string(at_barrier) +
                  " wait at threadgroup_barrier";
        break;
      }
      for (Fiber& f : g.fibers) f.wait = Wait::running;
      continue;
    }
    g.error = "deadlock: threads wait at different synchronization points (a barrier or SIMD-group collective "
              "in divergent control flow)";
  }
  t_group = nullptr;
  for (Fiber& f : g.fibers) munmap(f.stack, kFiberStack + page);
  return g.error;
}

inline std::vector<ThreadAttrs> threadgroup_attrs(uint3 tg_pos, uint3 groups, uint3 tg) {
  const uint n = tg.x * tg.y * tg.z;
  std::vector<ThreadAttrs> out(n);
  for (uint z = 0; z < tg.z; ++z) {
    for (uint y = 0; y < tg.y; ++y) {
      for (uint x = 0; x < tg.x; ++x) {
        const uint i = x + tg.x * (y + tg.y * z);
        ThreadAttrs& a = out[i];
        a.thread_position_in_threadgroup = {x, y, z};
        a.threadgroup_position_in_grid = tg_pos;
        a.thread_position_in_grid = {tg_pos.x * tg.x + x, tg_pos.y * tg.y + y, tg_pos.z * tg.z + z};
        a.threads_per_threadgroup = tg;
        a.dispatch_threads_per_threadgroup = tg;
        a.threadgroups_per_grid = groups;
        a.threads_per_grid = {groups.x * tg.x, groups.y * tg.y, groups.z * tg.z};
        a.grid_size = a.threads_per_grid;
        a.grid_origin = {0, 0, 0};
        a.thread_index_in_threadgroup = i;
        a.thread_index_in_simdgroup = i % kSimdWidth;
        a.simdgroup_index_in_threadgroup = i / kSimdWidth;
        a.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
        a.dispatch_simdgroups_per_threadgroup = a.simdgroups_per_threadgroup;
        a.threads_per_simdgroup = kSimdWidth;
        a.thread_execution_width = kSimdWidth;
        a.thread_index_in_quadgroup = i % 4;
        a.quadgroup_index_in_threadgroup = i / 4;
        a.quadgroups_per_threadgroup = (n + 3) / 4;
        a.dispatch_quadgroups_per_threadgroup = a.quadgroups_per_threadgroup;
      }
    }
  }
  return out;
}

// Dispatches `kernel` as Metal's dispatchThreads(grid, threadgroup) would (grid counts threads). Only
// uniform threadgroups are emulated: grid must be a multiple of the threadgroup size in each dimension.
// Returns "" or the first error of any threadgroup.
inline std::string launch(uint3 grid, uint3 tg, const Kernel& kernel, int workers) {
  if (tg.x * tg.y * tg.z == 0 || tg.x * tg.y * tg.z > 1024) return "threadgroup size must be 1..1024 threads";
  if (grid.x % tg.x || grid.y % tg.y || grid.z % tg.z) {
    return "grid (in threads) is not a multiple of the threadgroup size: non-uniform threadgroups are not emulated";
  }
  const uint3 groups = {grid.x / tg.x, grid.y / tg.y, grid.z / tg.z};
  const long total = long(groups.x) * groups.y * groups.z;
  std::atomic<long> next{0};
  std::mutex mu;
  std::string first_error;
  auto worker = [&]() {
    for (long id = next++; id < total; id = next++) {
      const uint3 pos = {uint(id % groups.x), uint((id / groups.x) % groups.y), uint(id / (long(groups.x) * groups.y))};
      const std::vector<ThreadAttrs> attrs = threadgroup_attrs(pos, groups, tg);
      std::string err;
      // A fresh OS thread per threadgroup: fresh (zeroed) threadgroup memory.
      std::thread([&]() { err = run_threadgroup(kernel, attrs); }).join();
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty()) {
          first_error = "threadgroup (" + std::to_string(pos.x) + ", " + std::to_string(pos.y) + ", " +
                        std::to_string(pos.z) + "): " + err;
        }
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < std::max(1, workers); ++i) pool.emplace_back(worker);
  for (std::thread& t : pool) t.join();
  return first_error;
}

}  // namespace emu

namespace metal {

inline void threadgroup_barrier(mem_flags) { emu::block(emu::Wait::barrier); }
// A SIMD group executes in lockstep in the emulation's sense only at collectives: a simdgroup_barrier is
// modelled as a collective that moves no data.
inline void simdgroup_barrier(mem_flags) { emu::collective<uint>(emu::SimdOp::broadcast_first, 0u, 0u); }
template <typename U>
U simd_sum(U v) { return emu::collective<U>(emu::SimdOp::sum, v, 0u); }
template <typename U>
U simd_max(U v) { return emu::collective<U>(emu::SimdOp::max, v, 0u); }
template <typename U>
U simd_shuffle_xor(U v, ushort mask) { return emu::collective<U>(emu::SimdOp::shuffle_xor, v, mask); }
template <typename U>
U simd_shuffle_down(U v, ushort delta) { return emu::collective<U>(emu::SimdOp::shuffle_down, v, delta); }
template <typename U>
U simd_shuffle(U v, ushort lane) { return emu::collective<U>(emu::SimdOp::shuffle, v, lane); }
template <typename U>
U simd_broadcast_first(U v) { return emu::collective<U>(emu::SimdOp::broadcast_first, v, 0u); }

}  // namespace metal

#endif  // MLX_INFER_METAL_EMU_H
