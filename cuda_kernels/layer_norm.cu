// LayerNorm over the last dimension: x [rows, cols] in T, weight and bias fp32 [cols]. One block per
// row; statistics in fp32 with two passes (mean, then the mean of squared deviations). Forward saves
// mean and rstd for backward. Backward writes dx per row and, in a second kernel over column tiles,
// each chunk of rows' partial sums of dweight (dy * xhat) and dbias (dy); the host sums the chunks.
#include "common.cuh"

template <typename T>
__device__ void layer_norm_fwd(const T* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias,
                               T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, i64 cols,
                               float eps) {
  __shared__ float scratch[32];
  const i64 row = blockIdx.x;
  const T* xr = x + row * cols;
  float sum = 0.f;
  for (i64 c = threadIdx.x; c < cols; c += blockDim.x) sum += to_f32(xr[c]);
  const float mean = block_sum(sum, scratch) / cols;
  float squares = 0.f;
  for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_f32(xr[c]) - mean;
    squares += d * d;
  }
  const float rstd = rsqrtf(block_sum(squares, scratch) / cols + eps);
  for (i64 c = threadIdx.x; c < cols; c += blockDim.x)
    y[row * cols + c] = from_f32<T>((to_f32(xr[c]) - mean) * rstd * weight[c] + bias[c]);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

template <typename T>
__device__ void layer_norm_bwd_input(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ weight,
                                     const float* __restrict__ mean, const float* __restrict__ rstd, T* __restrict__ dx,
                                     i64 cols) {
  __shared__ float scratch[32];
  const i64 row = blockIdx.x;
  const float mu = mean[row], rs = rstd[row];
  float sum_g = 0.f, sum_gx = 0.f;
  for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = to_f32(dy[row * cols + c]) * weight[c];
    sum_g += g;
    sum_gx += g * (to_f32(x[row * cols + c]) - mu) * rs;
  }
  const float mean_g = block_sum(sum_g, scratch) / cols, mean_gx = block_sum(sum_gx, scratch) / cols;
  for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_f32(x[row * cols + c]) - mu) * rs;
    const float g = to_f32(dy[row * cols + c]) * weight[c];
    dx[row * cols + c] = from_f32<T>(rs * (g - mean_g - xhat * mean_gx));
  }
}

template <typename T>
__device__ void layer_norm_bwd_params(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                                      const float* __restrict__ rstd, i64 rows, i64 cols, i64 rows_per_chunk,
                                      float* __restrict__ partial_dweight, float* __restrict__ partial_dbias) {
  const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const i64 first = (i64)blockIdx.y * rows_per_chunk, last = min(rows, first + rows_per_chunk);
  float dweight = 0.f, dbias = 0.f;
  for (i64 r = first; r < last; ++r) {
    const float g = to_f32(dy[r * cols + col]);
    dweight += g * (to_f32(x[r * cols + col]) - mean[r]) * rstd[r];
    dbias += g;
  }
  partial_dweight[(i64)blockIdx.y * cols + col] = dweight;
  partial_dbias[(i64)blockIdx.y * cols + col] = dbias;
}

#define LZ_LAYER_NORM(T, N)                                                                                          \
  extern "C" __global__ void layer_norm_fwd_##N(const T* x, const float* weight, const float* bias, T* y,           \
                                                float* mean, float* rstd, i64 cols, float eps) {                    \
    layer_norm_fwd<T>(x, weight, bias, y, mean, rstd, cols, eps);                                                    \
  }                                                                                                                  \
  extern "C" __global__ void layer_norm_bwd_input_##N(const T* dy, const T* x, const float* weight, const float* mean, \
                                                      const float* rstd, T* dx, i64 cols) {                          \
    layer_norm_bwd_input<T>(dy, x, weight, mean, rstd, dx, cols);                                                    \
  }                                                                                                                  \
  extern "C" __global__ void layer_norm_bwd_params_##N(const T* dy, const T* x, const float* mean, const float* rstd, \
                                                       i64 rows, i64 cols, i64 rows_per_chunk, float* partial_dweight, \
                                                       float* partial_dbias) {                                       \
    layer_norm_bwd_params<T>(dy, x, mean, rstd, rows, cols, rows_per_chunk, partial_dweight, partial_dbias);         \
  }
LZ_EXPORT_FLOATING(LZ_LAYER_NORM)
