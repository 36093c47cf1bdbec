// y = residual + dropout(x + bias), bias broadcast over rows of [rows, cols]. Backward: dx = dy * mask
// / (1 - p) with the mask regenerated from the stream and the index; d(residual) = dy; the bias gradient
// is the column sum of dx (reduce.cu). Elements go in fours (one Philox call each); with `vec` (the host
// checked: n a multiple of the pack, pointers 16-byte aligned) each thread moves a 16-byte pack per load.
#include "common.cuh"

template <typename T>
__device__ void bias_dropout_residual_fwd(const T* __restrict__ x, const float* __restrict__ bias,
                                          const T* __restrict__ residual, T* __restrict__ y, i64 n, i64 cols,
                                          float p_drop, const long long* stream, int vec) {
  const float keep_scale = 1.f / (1.f - p_drop);
  const auto [seed, offset] = read_stream(stream);
  const i64 stride = (i64)gridDim.x * blockDim.x, groups = (n + 3) / 4;
  if (vec) {
    constexpr int N = Pack<T>::N;  // a multiple of 4
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < n / N; g += stride) {
      const Pack<T> in = load_pack(x + g * N), res = load_pack(residual + g * N);
      Pack<T> out;
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        const float4 u = p_drop > 0.f ? philox_uniform4(seed, offset, g * (N / 4) + q) : make_float4(1.f, 1.f, 1.f, 1.f);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int e = 4 * q + j;
          float v = to_f32(in.v[e]) + bias[(g * N + e) % cols];
          if (p_drop > 0.f) v = word_of(u, j) >= p_drop ? v * keep_scale : 0.f;
          out.v[e] = from_f32<T>(to_f32(res.v[e]) + v);
        }
      }
      store_pack(y + g * N, out);
    }
    return;
  }
  for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {  // four elements each
    const float4 u = p_drop > 0.f ? philox_uniform4(seed, offset, g) : make_float4(1.f, 1.f, 1.f, 1.f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const i64 i = 4 * g + j;
      if (i >= n) break;
      float v = to_f32(x[i]) + bias[i % cols];
      if (p_drop > 0.f) v = word_of(u, j) >= p_drop ? v * keep_scale : 0.f;
      y[i] = from_f32<T>(to_f32(residual[i]) + v);
    }
  }
}

template <typename T>
__device__ void dropout_bwd(const T* __restrict__ dy, T* __restrict__ dx, i64 n, float p_drop, const long long* stream, int vec) {
  const float keep_scale = 1.f / (1.f - p_drop);
  const auto [seed, offset] = read_stream(stream);
  const i64 stride = (i64)gridDim.x * blockDim.x, groups = (n + 3) / 4;
  if (vec) {
    constexpr int N = Pack<T>::N;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < n / N; g += stride) {
      const Pack<T> d = load_pack(dy + g * N);
      Pack<T> out;
#pragma unroll
      for (int q = 0; q < N / 4; ++q) {
        const float4 u = philox_uniform4(seed, offset, g * (N / 4) + q);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          out.v[4 * q + j] = from_f32<T>(word_of(u, j) >= p_drop ? to_f32(d.v[4 * q + j]) * keep_scale : 0.f);
      }
      store_pack(dx + g * N, out);
    }
    return;
  }
  for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {  // four elements each
    const float4 u = philox_uniform4(seed, offset, g);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const i64 i = 4 * g + j;
      if (i >= n) break;
      dx[i] = from_f32<T>(word_of(u, j) >= p_drop ? to_f32(dy[i]) * keep_scale : 0.f);
    }
  }
}

#define LZ_BIAS_DROPOUT_RESIDUAL(T, N)                                                                              \
  extern "C" __global__ void bias_dropout_residual_fwd_##N(const T* x, const float* bias, const T* residual, T* y, \
                                                           i64 n, i64 cols, float p_drop, const long long* stream, \
                                                           int vec) {                                              \
    bias_dropout_residual_fwd<T>(x, bias, residual, y, n, cols, p_drop, stream, vec);                               \
  }                                                                                                                 \
  extern "C" __global__ void dropout_bwd_##N(const T* dy, T* dx, i64 n, float p_drop, const long long* stream,    \
                                             int vec) {                                                            \
    dropout_bwd<T>(dy, dx, n, p_drop, stream, vec);                                                                 \
  }
LZ_EXPORT_FLOATING(LZ_BIAS_DROPOUT_RESIDUAL)
