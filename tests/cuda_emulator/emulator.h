// A CPU emulator for lightning_zero's CUDA kernels, for machines without a GPU: cuda_kernels/*.cu compile
// as host C++ with this header forced in front (g++ -include), and every CUDA thread of a block runs as
// an OS thread, so __syncthreads and warp shuffles are real barriers. Blocks run one after another, which
// lets __shared__ be a function-local static. It checks what a GPU would fault on or silently get wrong:
// 16-byte vector loads from unaligned addresses abort, and a __syncthreads reached by only part of a block
// deadlocks (the test's timeout reports it). Maths is the host's (expf, rsqrtf exact-ish): results are
// compared with tolerances, never bit for bit with a GPU. Driven by tests/cuda_emulator.py.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

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

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

// The running block's barriers: one for the block, one per warp (a partial last warp has fewer lanes).
struct EmulatedBlock {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<std::uint64_t> lanes;  // the shuffle exchange: one slot per thread
  int any = 0;                       // __syncthreads_or's accumulator
};
inline EmulatedBlock emulated_block;

inline unsigned emulated_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

inline void __syncthreads() { emulated_block.block->arrive_and_wait(); }
inline int __syncthreads_or(int predicate) {
  __syncthreads();
  if (predicate) __atomic_store_n(&emulated_block.any, 1, __ATOMIC_SEQ_CST);
  __syncthreads();
  const int result = __atomic_load_n(&emulated_block.any, __ATOMIC_SEQ_CST);
  __syncthreads();
  if (emulated_thread() == 0) emulated_block.any = 0;  // before anyone's next call passes its first barrier
  return result;
}
inline void __syncwarp(unsigned = 0xffffffffu) { emulated_block.warps[emulated_thread() / 32]->arrive_and_wait(); }

template <typename T> T emulated_shuffle(T value, int source_lane) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  const unsigned me = emulated_thread(), warp = me / 32;
  auto& barrier = *emulated_block.warps[warp];
  barrier.arrive_and_wait();  // the warp's previous shuffle has been read
  std::memcpy(&emulated_block.lanes[me], &value, sizeof(T));
  barrier.arrive_and_wait();
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
    std::fprintf(stderr, "emulated CUDA: misaligned %zu-byte load at %p\n", sizeof(T), (const void*)p);
    std::abort();
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

// Runs `kernel` (a callback that calls the kernel with its arguments) over the grid, a block at a time, on one
// OS thread per CUDA thread of a block, made once per launch: between blocks the launching thread sets up the
// next block's barriers while the team waits at `gate`.
extern "C" void emulated_launch(void (*kernel)(), unsigned gx, unsigned gy, unsigned bx, unsigned by) {
  gridDim = {gx, gy, 1};
  blockDim = {bx, by, 1};
  const unsigned threads = bx * by, blocks = gx * gy;
  std::barrier<> gate(threads + 1);
  auto set_up_block = [&] {
    emulated_block.block = std::make_unique<std::barrier<>>(threads);
    emulated_block.warps.clear();
    for (unsigned w = 0; w < threads; w += 32)
      emulated_block.warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - w)));
    emulated_block.lanes.assign(threads + 32, 0);
  };
  std::vector<std::thread> team;
  for (unsigned t = 0; t < threads; ++t) {
    team.emplace_back([&, t] {
      threadIdx = {t % bx, t / bx, 0};
      for (unsigned b = 0; b < blocks; ++b) {
        gate.arrive_and_wait();  // the block's barriers are set up
        blockIdx = {b % gx, b / gx, 0};
        kernel();
        emulated_block.warps[t / 32]->arrive_and_drop();  // an exited thread no longer holds others up
        emulated_block.block->arrive_and_drop();
        gate.arrive_and_wait();  // the whole block is done
      }
    });
  }
  for (unsigned b = 0; b < blocks; ++b) {
    set_up_block();
    gate.arrive_and_wait();
    gate.arrive_and_wait();
  }
  for (auto& thread : team) thread.join();
}
