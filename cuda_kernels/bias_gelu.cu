// y = gelu(x + bias), bias broadcast over rows of [rows, cols]; the tanh approximation (as in GPT-2 and
// DeepSpeed's transformer kernel) or the exact erf form, in fp32. Backward writes dx; the bias
// gradient is the column sum of dx (reduce.cu). With `vec` (the host checked: n a multiple of the pack,
// every pointer 16-byte aligned) each thread moves 16 bytes per load and store (8 fp16/bf16 or 4 fp32
// values); else one element at a time.
#include "common.cuh"

__device__ __forceinline__ float gelu(float u, int tanh_approx) {
  if (tanh_approx) return 0.5f * u * (1.f + tanhf(0.7978845608028654f * (u + 0.044715f * u * u * u)));
  return 0.5f * u * (1.f + erff(u * 0.7071067811865476f));
}

__device__ __forceinline__ float gelu_grad(float u, int tanh_approx) {
  if (tanh_approx) {
    const float t = tanhf(0.7978845608028654f * (u + 0.044715f * u * u * u));
    return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * 0.7978845608028654f * (1.f + 3.f * 0.044715f * u * u);
  }
  return 0.5f * (1.f + erff(u * 0.7071067811865476f)) + u * 0.3989422804014327f * expf(-0.5f * u * u);
}

template <typename T>
__device__ void bias_gelu_fwd(const T* __restrict__ x, const float* __restrict__ bias, T* __restrict__ y, i64 n, i64 cols,
                              int tanh_approx, int vec) {
  const i64 stride = (i64)gridDim.x * blockDim.x, first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec) {
    constexpr int N = Pack<T>::N;
    for (i64 g = first; g < n / N; g += stride) {
      const Pack<T> in = load_pack(x + g * N);
      Pack<T> out;
#pragma unroll
      for (int j = 0; j < N; ++j) out.v[j] = from_f32<T>(gelu(to_f32(in.v[j]) + bias[(g * N + j) % cols], tanh_approx));
      store_pack(y + g * N, out);
    }
    return;
  }
  for (i64 i = first; i < n; i += stride) y[i] = from_f32<T>(gelu(to_f32(x[i]) + bias[i % cols], tanh_approx));
}

template <typename T>
__device__ void bias_gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ bias,
                              T* __restrict__ dx, i64 n, i64 cols, int tanh_approx, int vec) {
  const i64 stride = (i64)gridDim.x * blockDim.x, first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec) {
    constexpr int N = Pack<T>::N;
    for (i64 g = first; g < n / N; g += stride) {
      const Pack<T> d = load_pack(dy + g * N), in = load_pack(x + g * N);
      Pack<T> out;
#pragma unroll
      for (int j = 0; j < N; ++j)
        out.v[j] = from_f32<T>(to_f32(d.v[j]) * gelu_grad(to_f32(in.v[j]) + bias[(g * N + j) % cols], tanh_approx));
      store_pack(dx + g * N, out);
    }
    return;
  }
  for (i64 i = first; i < n; i += stride)
    dx[i] = from_f32<T>(to_f32(dy[i]) * gelu_grad(to_f32(x[i]) + bias[i % cols], tanh_approx));
}

#define LZ_BIAS_GELU(T, N)                                                                                       \
  extern "C" __global__ void bias_gelu_fwd_##N(const T* x, const float* bias, T* y, i64 n, i64 cols,           \
                                               int tanh_approx, int vec) {                                     \
    bias_gelu_fwd<T>(x, bias, y, n, cols, tanh_approx, vec);                                                     \
  }                                                                                                              \
  extern "C" __global__ void bias_gelu_bwd_##N(const T* dy, const T* x, const float* bias, T* dx, i64 n, i64 cols, \
                                               int tanh_approx, int vec) {                                     \
    bias_gelu_bwd<T>(dy, x, bias, dx, n, cols, tanh_approx, vec);                                                \
  }
LZ_EXPORT_FLOATING(LZ_BIAS_GELU)
