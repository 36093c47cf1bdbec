// A CPU emulator for lightning_zero's CUDA kernels, for machines without a GPU: cuda_kernels/*.cu compile
// as host C++ with this header forced in front (g++ -include), and every CUDA thread of a block runs as a
// fiber (its own stack, ucontext) on the launching OS thread, switched only where a GPU thread could wait
// for another: __syncthreads, __syncwarp and the warp shuffles are real barriers. Blocks run one after
// another, which lets __shared__ be a function-local static. It checks what a GPU would fault on or
// silently get wrong: a 16-byte vector load from an unaligned address, and threads left waiting at
// barriers nobody else reaches (a __syncthreads reached by only part of a block while the rest wait
// elsewhere), end the launch with an error naming it (the launch returns 1, emulated_error() says why). Maths is the host's (expf, rsqrtf exact-ish): results are
// compared with tolerances, never bit for bit with a GPU. Driven by tests/support/cuda_emulator.py.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/mman.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)

using std::isfinite;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline dim3 threadIdx, blockIdx;  // the running fiber's (set at every switch)
inline dim3 blockDim, gridDim;

// The running block: one fiber per CUDA thread, and which barrier each is waiting at.
enum class Waiting { none, block, warp, done, failed };
struct EmulatedThread {
  ucontext_t context;
  char* stack = nullptr;
  Waiting waiting = Waiting::none;
};
struct EmulatedBlock {
  std::vector<EmulatedThread> threads;
  ucontext_t scheduler;
  unsigned running = 0;              // the fiber on the CPU
  std::vector<std::uint64_t> lanes;  // the shuffle exchange: one slot per thread
  int any = 0;                       // __syncthreads_or's accumulator
};
inline EmulatedBlock emulated_block;

inline unsigned emulated_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

// Waits at `barrier` until the scheduler releases it (every live thread of the block, or of the warp, is there).
inline void emulated_wait(Waiting barrier) {
  auto& me = emulated_block.threads[emulated_block.running];
  me.waiting = barrier;
  swapcontext(&me.context, &emulated_block.scheduler);
}

inline char emulated_message[512];  // why the last launch failed

// Ends the launch with `message`: this thread stops here (its fiber is abandoned), the launch returns 1.
inline void emulated_fail(const char* message) {
  std::snprintf(emulated_message, sizeof emulated_message, "%s", message);
  emulated_wait(Waiting::failed);
}
extern "C" const char* emulated_error() { return emulated_message; }

inline void __syncthreads() { emulated_wait(Waiting::block); }
inline int __syncthreads_or(int predicate) {
  __syncthreads();
  if (predicate) emulated_block.any = 1;
  __syncthreads();
  const int result = emulated_block.any;
  __syncthreads();
  if (emulated_thread() == 0) emulated_block.any = 0;  // before anyone's next call passes its first barrier
  return result;
}
inline void __syncwarp(unsigned = 0xffffffffu) { emulated_wait(Waiting::warp); }

template <typename T> T emulated_shuffle(T value, int source_lane) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  const unsigned me = emulated_thread(), warp = me / 32;
  __syncwarp();  // the warp's previous shuffle has been read
  std::memcpy(&emulated_block.lanes[me], &value, sizeof(T));
  __syncwarp();
  T out;
  std::memcpy(&out, &emulated_block.lanes[warp * 32 + source_lane], sizeof(T));
  return out;
}
template <typename T> T __shfl_xor_sync(unsigned, T value, int lane_mask, int = 32) {
  return emulated_shuffle(value, (int)(emulated_thread() % 32) ^ lane_mask);
}
template <typename T> T __shfl_sync(unsigned, T value, int lane, int width = 32) {
  return emulated_shuffle(value, (int)(emulated_thread() % 32) / width * width + lane % width);
}
template <typename T> T __shfl_down_sync(unsigned, T value, unsigned delta, int width = 32) {
  const int lane = emulated_thread() % 32, source = lane % width + (int)delta < width ? lane + (int)delta : lane;
  return emulated_shuffle(value, source);
}

// 16-byte __ldg loads since the last read (the kernels' vector path), so a test can tell which path ran.
static std::atomic<long long> emulated_wide_loads{0};  // (static: one per library; an inline one is unified across them)
extern "C" long long emulated_take_wide_loads() { return emulated_wide_loads.exchange(0); }

template <typename T> T __ldg(const T* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0) {
    char message[128];
    std::snprintf(message, sizeof message, "misaligned %zu-byte load at %p", sizeof(T), (const void*)p);
    emulated_fail(message);
  }
  if constexpr (sizeof(T) == 16) emulated_wide_loads.fetch_add(1, std::memory_order_relaxed);
  return *p;
}

inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline int atomicExch(int* address, int value) { return __atomic_exchange_n(address, value, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* address, float value) {
  float expected = *address, desired;
  do {
    desired = expected + value;
  } while (!__atomic_compare_exchange(address, &expected, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return expected;
}
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// Runs `kernel` over the grid, a block at a time. Each CUDA thread is a fiber that runs until it waits at a
// barrier or returns; after each pass over the fibers a barrier whose every live thread (block) or lane (warp)
// is waiting there releases them. Nothing left to run while threads still wait is a deadlock.
inline constexpr std::size_t EMULATED_STACK = 1 << 20;  // per thread (mapped lazily: only what is touched costs)

inline std::function<void()> emulated_kernel;

inline void emulated_fiber_entry() {
  emulated_kernel();
  emulated_block.threads[emulated_block.running].waiting = Waiting::done;  // returns to uc_link: the scheduler
}

inline int emulated_launch_grid(std::function<void()> kernel, unsigned gx, unsigned gy, unsigned bx, unsigned by) {
  gridDim = {gx, gy, 1};
  blockDim = {bx, by, 1};
  const unsigned threads = bx * by, blocks = gx * gy, warps = (threads + 31) / 32;
  emulated_kernel = std::move(kernel);
  auto& block = emulated_block;
  block.threads.resize(threads);
  for (auto& t : block.threads)
    if (t.stack == nullptr) {
      void* stack = mmap(nullptr, EMULATED_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (stack == MAP_FAILED) std::abort();
      t.stack = static_cast<char*>(stack);
    }
  block.lanes.assign(threads + 32, 0);
  std::vector<unsigned> live(warps), at_warp(warps);
  for (unsigned b = 0; b < blocks; ++b) {
    blockIdx = {b % gx, b / gx, 0};
    for (unsigned t = 0; t < threads; ++t) {
      auto& thread = block.threads[t];
      getcontext(&thread.context);
      thread.context.uc_stack = {thread.stack, 0, EMULATED_STACK};
      thread.context.uc_link = &block.scheduler;
      makecontext(&thread.context, emulated_fiber_entry, 0);
      thread.waiting = Waiting::none;
    }
    unsigned done = 0;
    while (done < threads) {
      bool ran = false;
      for (unsigned t = 0; t < threads; ++t) {
        auto& thread = block.threads[t];
        if (thread.waiting != Waiting::none) continue;
        block.running = t;
        threadIdx = {t % bx, t / bx, 0};
        swapcontext(&block.scheduler, &thread.context);
        if (thread.waiting == Waiting::failed) return 1;
        done += thread.waiting == Waiting::done;
        ran = true;
      }
      // Release what every live thread waits at: the block barrier, else each warp's.
      unsigned alive = 0, at_block = 0;
      std::fill(live.begin(), live.end(), 0u);
      std::fill(at_warp.begin(), at_warp.end(), 0u);
      for (unsigned t = 0; t < threads; ++t) {
        const Waiting w = block.threads[t].waiting;
        if (w == Waiting::done) continue;
        ++alive, ++live[t / 32];
        at_block += w == Waiting::block;
        at_warp[t / 32] += w == Waiting::warp;
      }
      bool released = false;
      for (unsigned t = 0; t < threads; ++t) {
        auto& w = block.threads[t].waiting;
        if ((w == Waiting::block && at_block == alive) || (w == Waiting::warp && at_warp[t / 32] == live[t / 32])) {
          w = Waiting::none;
          released = true;
        }
      }
      if (!ran && !released && done < threads) {
        std::snprintf(emulated_message, sizeof emulated_message,
                      "deadlock in block %u: %u of %u live threads wait at __syncthreads, the others at a warp"
                      " barrier their warp does not complete", b, at_block, alive);
        return 1;
      }
    }
  }
  return 0;
}

// Each kernel parameter comes in a 64-bit slot (its bits as the GPU would receive them); the kernel's own
// signature says how to read each.
template <typename T> T emulated_unpack(std::uint64_t slot) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(slot);
  } else if constexpr (std::is_same_v<T, float>) {
    const auto bits = static_cast<std::uint32_t>(slot);
    float value;
    std::memcpy(&value, &bits, 4);
    return value;
  } else {
    static_assert(std::is_integral_v<T>, "kernel parameters are pointers, integers or floats");
    return static_cast<T>(slot);
  }
}
template <typename... Args, std::size_t... I>
void emulated_call(void (*kernel)(Args...), const std::uint64_t* slots, std::index_sequence<I...>) {
  kernel(emulated_unpack<Args>(slots[I])...);
}
template <typename... Args>
int emulated_run(void (*kernel)(Args...), const std::uint64_t* slots, unsigned gx, unsigned gy, unsigned bx,
                 unsigned by) {
  return emulated_launch_grid([=] { emulated_call(kernel, slots, std::index_sequence_for<Args...>{}); }, gx, gy, bx, by);
}
