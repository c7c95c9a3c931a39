// The execution-model core shared by the CPU emulations of Metal (metal_emu.h) and CUDA
// (cuda_kernels/host/cuda_emu.h), which run GPU kernel sources on a machine without a GPU:
//   - each threadgroup (CUDA: block) runs on a fresh OS thread, its threads as fibers (ucontext) of that
//     thread, so `threadgroup` / `__shared__` arrays (declared static thread_local by the shims) are shared by
//     exactly one threadgroup's threads and start zeroed;
//   - a fiber runs until it reaches a barrier or a SIMD-group (warp) collective, then the next runs (in thread
//     order). A barrier releases when every thread of the threadgroup has reached it; a collective when every
//     live lane of its SIMD group (32 consecutive threads) has, and the collective's combine function then
//     computes every lane's result from all lanes' inputs. So a missing barrier deterministically lets a thread
//     read what others have not written yet (or overwrite what they still need), and a wrong reduction gives
//     wrong sums;
//   - a barrier some threads never reach (returned early, or waiting at another barrier / collective),
//     collectives whose lanes disagree (op or value type), and whatever a combine function or fail() reports
//     are errors, not hangs.
// Threadgroups may run on several OS threads at once (`workers`); results do not depend on it.
//
// The includer declares `uint` and `uint3` (a struct of uint x, y, z) first: the thread attributes are of the
// types the kernel source itself uses.

#ifndef MLX_INFER_EMU_CORE_H
#define MLX_INFER_EMU_CORE_H

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace emu {

constexpr int kSimdWidth = 32;
constexpr size_t kFiberStack = 256 * 1024;

// Every thread attribute a Metal kernel may take, named as Metal names them (CUDA's threadIdx, blockIdx,
// blockDim and gridDim are thread_position_in_threadgroup, threadgroup_position_in_grid,
// threads_per_threadgroup and threadgroups_per_grid).
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

enum class Wait { running, barrier, simd, done, failed };

struct Fiber;
// Computes every waiting lane's `out` from the lanes' `in` (lanes[kSimdWidth], nullptr where a lane is not
// live); returns "" or what is wrong (then the threadgroup stops with that error).
using Combine = std::string (*)(Fiber** lanes);

struct Fiber {
  ucontext_t ctx;
  Wait wait = Wait::running;
  int op = 0;                  // which collective, as the combine function reads it
  const char* name = "";       // the collective's name, for error messages
  uint arg = 0;                // its lane argument (shuffle mask, delta, source lane)
  uint mask = 0xffffffffu;     // its member mask (CUDA's *_sync), all lanes for Metal
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

inline const ThreadAttrs& current_attrs() { return current_fiber().attrs; }

inline void block(Wait why) {
  Fiber& f = current_fiber();
  f.wait = why;
  swapcontext(&f.ctx, &t_group->scheduler);
}

// Stops the threadgroup with `message` (the first one reported wins); the calling fiber never resumes.
inline void fail(const std::string& message) {
  if (t_group->error.empty()) t_group->error = message;
  block(Wait::failed);
}

inline void fiber_entry() {
  Group* g = t_group;
  Fiber& f = g->fibers[g->current];
  (*g->kernel)(f.attrs);
  f.wait = Wait::done;
  swapcontext(&f.ctx, &g->scheduler);
}

// One lane's part of a collective: waits until every live lane of the SIMD group has called one, then
// returns what `combine` computed for this lane.
template <typename U>
U collective(Combine combine, int op, const char* name, U v, uint arg, uint mask) {
  static_assert(std::is_trivially_copyable<U>::value && sizeof(U) <= 16, "SIMD-group value type");
  Fiber& f = current_fiber();
  f.op = op;
  f.name = name;
  f.arg = arg;
  f.mask = mask;
  f.combine = combine;
  std::memcpy(f.in, &v, sizeof(U));
  block(Wait::simd);
  U r;
  std::memcpy(&r, current_fiber().out, sizeof(U));
  return r;
}

// Releases the SIMD groups whose live lanes all wait at a collective; returns whether any was released.
inline bool release_collectives(Group& g) {
  const int n = int(g.fibers.size());
  const int simdgroups = (n + kSimdWidth - 1) / kSimdWidth;
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
    for (int l = 0; l < kSimdWidth && g.error.empty(); ++l) {
      if (lanes[l] && (lanes[l]->op != first->op || lanes[l]->combine != first->combine)) {
        g.error = std::string("SIMD group ") + std::to_string(s) + ": lanes meet at different collectives (" +
                  first->name + " and " + lanes[l]->name + ", or different value types)";
      }
    }
    if (!g.error.empty()) break;
    const std::string err = first->combine(lanes);
    if (!err.empty()) {
      g.error = std::string("SIMD group ") + std::to_string(s) + ": " + err;
      break;
    }
    for (Fiber* f : lanes) {
      if (f) f->wait = Wait::running;
    }
    released = true;
  }
  return released;
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
  while (g.error.empty()) {
    for (int i = 0; i < n && g.error.empty(); ++i) {
      if (g.fibers[i].wait == Wait::running) {
        g.current = i;
        swapcontext(&g.scheduler, &g.fibers[i].ctx);
      }
    }
    if (!g.error.empty()) break;
    int done = 0, at_barrier = 0;
    for (const Fiber& f : g.fibers) {
      done += f.wait == Wait::done;
      at_barrier += f.wait == Wait::barrier;
    }
    if (done == n) break;
    if (release_collectives(g) || !g.error.empty()) continue;
    if (at_barrier == n - done) {
      if (done > 0) {
        g.error = std::to_string(done) + " thread(s) of the threadgroup returned while " + std::to_string(at_barrier) +
                  " wait at threadgroup_barrier (__syncthreads)";
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

// Dispatches `kernel` as Metal's dispatchThreads(grid, threadgroup) would (grid counts threads; MLX's
// cuda_kernel takes its grid the same way). Only uniform threadgroups are emulated: grid must be a multiple
// of the threadgroup size in each dimension. Returns "" or the first error of any threadgroup.
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

#endif  // MLX_INFER_EMU_CORE_H
