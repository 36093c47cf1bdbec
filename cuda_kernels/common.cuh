// Shared device code for lightning_zero's kernels: dtype conversions, block reductions, the
// counter-based RNG used by every fused dropout, and the per-dtype entry-point macro.
//
// Every kernel computes in fp32 whatever its storage type (float, __half, __nv_bfloat16), indexes
// with 64-bit integers (ZeRO's flat buffers can pass 2^31 elements), and is exported once per dtype
// as extern "C" <name>_<f32|f16|bf16> so that CuPy's cache never depends on template name mangling.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;

// NVRTC has no <cmath>: infinity spelled out.
#define LZ_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024). Every thread gets the
// result. `scratch` holds 32 floats of shared memory; the call synchronizes the block.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  value = lane < warps ? scratch[lane] : 0.f;
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float block_max(float value, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  value = lane < warps ? scratch[lane] : -LZ_INF;
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Philox4x32-10 (Salmon et al., SC'11): four 32-bit random words from a 64-bit key (the seed) and a
// 128-bit counter (the element's index and the stream offset). The same (seed, offset, index) gives
// the same bits on any device and in the pure-torch reference (kernels/reference.py).
__device__ __forceinline__ uint4 philox4x32(uint4 counter, uint2 key) {
  const unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const unsigned hi0 = __umulhi(M0, counter.x), lo0 = M0 * counter.x;
    const unsigned hi1 = __umulhi(M1, counter.z), lo1 = M1 * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    key.x += W0;
    key.y += W1;
  }
  return counter;
}

// The dropout stream (seed, offset): one Philox call gives the four elements 4g .. 4g + 3 (its four
// words, in order), from counter (offset / 4 + g, subsequence 0), torch's own layout (counter words 0-1:
// offset / 4 plus the calls made so far, words 2-3: the subsequence). A call that reserved its range of
// torch's CUDA generator offset (loader.dropout_stream) so shares no counter with torch's dropout. Each
// word's top 24 bits make a uniform float in [0, 1). Every kernel walks the stream in these groups of four.
__device__ __forceinline__ float4 philox_uniform4(unsigned long long seed, unsigned long long offset, i64 group) {
  const unsigned long long c = (offset >> 2) + (unsigned long long)group;
  const uint4 bits = philox4x32(make_uint4((unsigned)c, (unsigned)(c >> 32), 0u, 0u),
                                make_uint2((unsigned)seed, (unsigned)(seed >> 32)));
  const float unit = 1.0f / 16777216.0f;
  return make_float4((bits.x >> 8) * unit, (bits.y >> 8) * unit, (bits.z >> 8) * unit, (bits.w >> 8) * unit);
}

// A dropout stream lives in device memory as two int64s, (seed, offset), drawn by torch's generator on the
// tensors' device (ops._stream): read here, never passed as a host value, so a CUDA graph replays a fresh
// draw each time instead of baking one mask in. Null when there is no dropout.
struct DropoutStream {
  unsigned long long seed, offset;
};
__device__ __forceinline__ DropoutStream read_stream(const long long* stream) {
  if (stream == nullptr) return {0ull, 0ull};
  return {(unsigned long long)stream[0], (unsigned long long)stream[1]};
}

__device__ __forceinline__ float word_of(float4 u, int j) { return j == 0 ? u.x : j == 1 ? u.y : j == 2 ? u.z : u.w; }

// 16 bytes of T (8 half-precision values, 4 floats): moved with one vector load or store. Callers check
// that the pointers are 16-byte aligned.
template <typename T> struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};
template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T* p) {
  Pack<T> out;
  *reinterpret_cast<uint4*>(out.v) = __ldg(reinterpret_cast<const uint4*>(p));
  return out;
}
template <typename T> __device__ __forceinline__ void store_pack(T* p, const Pack<T>& in) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(in.v);
}

#define LZ_EXPORT_FLOATING(MACRO) MACRO(float, f32) MACRO(__half, f16) MACRO(__nv_bfloat16, bf16)
