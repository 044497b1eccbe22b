/*
 * A host emulation of the small part of the CUDA runtime that kernels/qsgd_cuda.cu uses, so that
 * its kernels can be compiled as C++ and run on a machine without a GPU (tests/test_cuda_emulated.py).
 *
 * A launch runs the 32 lanes of a warp as fibers (ucontext) on the launching thread; each lane walks
 * every (block, warp) of the grid in the same order and executes its own thread of that warp, until it
 * reaches a shuffle, where it waits for the other 31 (they run in turn). __shfl_xor_sync is a real
 * exchange between the 32 lanes, atomics are std::atomic_ref, "device memory" is host memory and
 * streams are ignored (everything is synchronous). This checks the kernels' arithmetic, indexing,
 * packing, reduction order and validation; it says nothing about the GPU's memory model, alignment
 * faults or stream ordering, which only a GPU run checks. (The lanes were OS threads meeting at a
 * std::barrier, 32 thread switches a shuffle: tests/test_cuda.py's emulated half took 245 s on 2
 * cores, 114 s with fibers; its 3-rank job under horovodrun 93 s, 56 s.)
 *
 * Limits: every warp of a launch that shuffles must be full and take uniform control flow around
 * the shuffles (true of qsgd_cuda.cu); there is no shared memory.
 */
#ifndef HVD_QSGD_CUDA_EMU_H_
#define HVD_QSGD_CUDA_EMU_H_

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <ucontext.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define QSGD_EMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(QSGD_EMU_ASAN)
#define QSGD_EMU_ASAN 1
#endif
#ifdef QSGD_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#include <atomic>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

typedef int cudaError_t;
typedef void* cudaStream_t;
enum { cudaSuccess = 0 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };

namespace qsgd_emu {
/* The launching thread's state: a launch runs on one thread, and the lanes' fibers on it share it. */
inline thread_local dim3 tid, bid, bdim, gdim;
inline thread_local uint64_t slots[32];

constexpr unsigned kLanes = 32;
constexpr size_t kLaneStack = 256 * 1024;

/* Under AddressSanitizer every switch between fibers is announced, so that it follows the stack in
 * use (its fake stacks, which catch a use of a stack frame after its return, included): leaving
 * names the stack switched to and keeps the leaving fiber's fake stack in *save (nullptr: the fiber
 * ends); arriving restores the fake stack kept (nullptr: a new fiber) and can tell the stack left. */
inline void fiber_leave(void** save, const void* to_bottom, size_t to_size) {
#ifdef QSGD_EMU_ASAN
  __sanitizer_start_switch_fiber(save, to_bottom, to_size);
#else
  (void)save, (void)to_bottom, (void)to_size;
#endif
}
inline void fiber_arrive(void* saved, const void** from_bottom, size_t* from_size) {
#ifdef QSGD_EMU_ASAN
  __sanitizer_finish_switch_fiber(saved, from_bottom, from_size);
#else
  (void)saved, (void)from_bottom, (void)from_size;
#endif
}

/* The lanes of the launch running on this thread: the scheduler's context, each lane's, and the
 * shuffle barrier (arrived lanes, and its generation, which moves on when the 32nd arrives). */
struct Lanes {
  ucontext_t scheduler;
  ucontext_t ctx[kLanes];
  dim3 tid[kLanes], bid[kLanes];
  bool done[kLanes];
  unsigned current = 0, arrived = 0;
  uint64_t generation = 0;
  std::function<void(unsigned)> body;
  /* the fibers' announcements (fiber_leave): the scheduler's stack and its fake stack kept */
  const void* scheduler_bottom = nullptr;
  size_t scheduler_size = 0;
  void* scheduler_fake = nullptr;
};
inline thread_local Lanes* lanes = nullptr;
inline thread_local std::vector<std::unique_ptr<char[]>> stacks; /* kept from launch to launch */
inline thread_local void* lane_fake[kLanes];                      /* so are the lanes' fake stacks */

/* Back to the scheduler; on return this lane's thread and block indices are its own again. */
inline void yield_lane() {
  Lanes& l = *lanes;
  const unsigned me = l.current;
  l.tid[me] = tid, l.bid[me] = bid;
  fiber_leave(&lane_fake[me], l.scheduler_bottom, l.scheduler_size);
  swapcontext(&l.ctx[me], &l.scheduler);
  fiber_arrive(lane_fake[me], nullptr, nullptr);
  tid = l.tid[me], bid = l.bid[me];
}

/* Every lane waits here until all 32 have arrived. */
inline void lanes_barrier() {
  Lanes& l = *lanes;
  const uint64_t g = l.generation;
  if (++l.arrived == kLanes) {
    l.arrived = 0;
    ++l.generation;
    return;
  }
  while (l.generation == g) yield_lane();
}

inline void lane_entry(int lane) {
  Lanes& l = *lanes;
  fiber_arrive(lane_fake[lane], &l.scheduler_bottom, &l.scheduler_size);
  l.body((unsigned)lane);
  l.done[lane] = true;
  fiber_leave(&lane_fake[lane], l.scheduler_bottom, l.scheduler_size); /* back through uc_link */
}

template <class... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  template <class... A>
  void operator()(A&&... a) {
    std::tuple<P...> args(static_cast<P>(a)...);
    gdim = grid, bdim = block;
    Lanes l;
    l.body = [&](unsigned lane) {
      for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx)
          for (unsigned w = 0; w * 32 < block.x; ++w) {
            const unsigned t = w * 32 + lane;
            if (t >= block.x) continue;
            bid = dim3(bx, by), tid = dim3(t);
            std::apply(kernel, args);
          }
    };
    while (stacks.size() < kLanes) stacks.emplace_back(new char[kLaneStack]);
    Lanes* const outer = lanes;
    lanes = &l;
    for (unsigned lane = 0; lane < kLanes; ++lane) {
      l.done[lane] = false;
      getcontext(&l.ctx[lane]);
      l.ctx[lane].uc_stack.ss_sp = stacks[lane].get();
      l.ctx[lane].uc_stack.ss_size = kLaneStack;
      l.ctx[lane].uc_link = &l.scheduler;
      makecontext(&l.ctx[lane], reinterpret_cast<void (*)()>(lane_entry), 1, (int)lane);
    }
    for (unsigned left = kLanes; left;) {
      left = 0;
      for (unsigned lane = 0; lane < kLanes; ++lane) {
        if (l.done[lane]) continue;
        l.current = lane;
        fiber_leave(&l.scheduler_fake, stacks[lane].get(), kLaneStack);
        swapcontext(&l.scheduler, &l.ctx[lane]);
        fiber_arrive(l.scheduler_fake, nullptr, nullptr);
        left += !l.done[lane];
      }
    }
    lanes = outer;
  }
};

template <class... P>
Launch<P...> make_launch(void (*kernel)(P...), dim3 grid, dim3 block) {
  return Launch<P...>{kernel, grid, block};
}
}  // namespace qsgd_emu

#define threadIdx (qsgd_emu::tid)
#define blockIdx (qsgd_emu::bid)
#define blockDim (qsgd_emu::bdim)
#define gridDim (qsgd_emu::gdim)
#define QSGD_LAUNCH(kernel, grid, block, stream) qsgd_emu::make_launch(kernel, dim3(grid), dim3(block))

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  const unsigned lane = qsgd_emu::tid.x & 31u;
  uint64_t u = 0;
  memcpy(&u, &v, sizeof(T));
  qsgd_emu::slots[lane] = u;
  qsgd_emu::lanes_barrier();
  const uint64_t r = qsgd_emu::slots[lane ^ (unsigned)off];
  qsgd_emu::lanes_barrier();
  T out;
  memcpy(&out, &r, sizeof(T));
  return out;
}

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

inline unsigned __float_as_uint(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}
inline int atomicCAS(int* p, int compare, int val) {
  std::atomic_ref<int>(*p).compare_exchange_strong(compare, val);
  return compare;
}

inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaFreeAsync(void* p, cudaStream_t) { free(p); return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaMalloc(void** p, size_t n) {
  *p = malloc(n ? n : 1);
  return *p ? cudaSuccess : 2;
}
inline cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) { return cudaMalloc(p, n); }
inline cudaError_t cudaFree(void* p) { free(p); return cudaSuccess; }
inline void __syncwarp() { qsgd_emu::lanes_barrier(); }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) {
  memcpy(d, s, n);
  return cudaSuccess;
}

#endif
