// y = gelu(x + bias), bias broadcast over rows of [rows, cols]; the tanh approximation (as in GPT-2 and
// DeepSpeed's transformer kernel) or the exact erf form, in fp32. Backward writes dx; the bias
// gradient is the column sum of dx (reduce.cu).
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
                              int tanh_approx) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] = from_f32<T>(gelu(to_f32(x[i]) + bias[i % cols], tanh_approx));
}

template <typename T>
__device__ void bias_gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ bias,
                              T* __restrict__ dx, i64 n, i64 cols, int tanh_approx) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    dx[i] = from_f32<T>(to_f32(dy[i]) * gelu_grad(to_f32(x[i]) + bias[i % cols], tanh_approx));
}

#define LZ_BIAS_GELU(T, N)                                                                                       \
  extern "C" __global__ void bias_gelu_fwd_##N(const T* x, const float* bias, T* y, i64 n, i64 cols,           \
                                               int tanh_approx) {                                              \
    bias_gelu_fwd<T>(x, bias, y, n, cols, tanh_approx);                                                          \
  }                                                                                                              \
  extern "C" __global__ void bias_gelu_bwd_##N(const T* dy, const T* x, const float* bias, T* dx, i64 n, i64 cols, \
                                               int tanh_approx) {                                              \
    bias_gelu_bwd<T>(dy, x, bias, dx, n, cols, tanh_approx);                                                     \
  }
LZ_EXPORT_FLOATING(LZ_BIAS_GELU)
