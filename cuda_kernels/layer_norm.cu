// LayerNorm over the last dimension: x [rows, cols] in T, weight and bias fp32 [cols]; statistics in fp32
// with two passes over the row (mean, then the mean of squared deviations). Forward saves mean and rstd
// for backward.
//
// Rows of up to 8192 columns take the row kernels (rows.cuh, [Note: row teams]): each row read once into
// registers; backward reads dy and x once and reduces dx's row sums and each team's partial dweight
// (dy * xhat) and dbias (dy) in the same pass; the host sums the teams' partials. Wider rows take the
// looping kernels below them, which read a row three times (forward) or twice plus a column pass (backward).
#include "rows.cuh"

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

template <typename T>
__device__ void layer_norm_fwd_rows(const T* __restrict__ x, const float* __restrict__ weight,
                                    const float* __restrict__ bias, T* __restrict__ y, float* __restrict__ mean_out,
                                    float* __restrict__ rstd_out, i64 rows, int cols, int team_size, int vec,
                                    float eps) {
  __shared__ float scratch[32];
  constexpr int E = FWD_ELEMS, V = PACK_OF(T);
  const RowTeam team(team_size, vec);
  for (i64 row = team.first; row < rows; row += team.stride) {
    float v[E];
    load_row<E>(x + row * cols, cols, team, v, 0.f);
    const float2 stats = layer_norm_row<E, V>(v, cols, weight, bias, eps, team, scratch);
    store_row<E>(y + row * cols, cols, team, v);
    if (team.lane == 0) {
      mean_out[row] = stats.x;
      rstd_out[row] = stats.y;
    }
  }
}

// dx for each row, and this team's sums over its rows of dy * xhat and dy into row `team.index` of
// partial_dweight / partial_dbias ([teams, cols]; every team writes its row, zeros if it had no rows).
template <typename T>
__device__ void layer_norm_bwd_rows(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ weight,
                                    const float* __restrict__ mean, const float* __restrict__ rstd,
                                    T* __restrict__ dx, float* __restrict__ partial_dweight,
                                    float* __restrict__ partial_dbias, i64 rows, int cols, int team_size, int vec) {
  __shared__ float scratch[32];
  constexpr int E = BWD_ELEMS, V = PACK_OF(T);
  const RowTeam team(team_size, vec);
  float dweight[E] = {}, dbias[E] = {};
  for (i64 row = team.first; row < rows; row += team.stride) {
    float xv[E], g[E];
    load_row<E>(x + row * cols, cols, team, xv, 0.f);
    load_row<E>(dy + row * cols, cols, team, g, 0.f);
    layer_norm_row_grad<E, V>(xv, g, mean[row], rstd[row], cols, weight, team, scratch, dweight, dbias);
    store_row<E>(dx + row * cols, cols, team, g);
  }
  write_team_sums<E, V>(team, cols, dweight, partial_dweight);
  write_team_sums<E, V>(team, cols, dbias, partial_dbias);
}

#define LZ_LAYER_NORM(T, N)                                                                                            \
  extern "C" __global__ void layer_norm_fwd_##N(const T* x, const float* weight, const float* bias, T* y,              \
                                                float* mean, float* rstd, i64 cols, float eps) {                       \
    layer_norm_fwd<T>(x, weight, bias, y, mean, rstd, cols, eps);                                                      \
  }                                                                                                                    \
  extern "C" __global__ void layer_norm_bwd_input_##N(const T* dy, const T* x, const float* weight, const float* mean, \
                                                      const float* rstd, T* dx, i64 cols) {                            \
    layer_norm_bwd_input<T>(dy, x, weight, mean, rstd, dx, cols);                                                      \
  }                                                                                                                    \
  extern "C" __global__ void layer_norm_bwd_params_##N(const T* dy, const T* x, const float* mean, const float* rstd,  \
                                                       i64 rows, i64 cols, i64 rows_per_chunk, float* partial_dweight, \
                                                       float* partial_dbias) {                                         \
    layer_norm_bwd_params<T>(dy, x, mean, rstd, rows, cols, rows_per_chunk, partial_dweight, partial_dbias);           \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(1024)                                                                   \
      layer_norm_fwd_rows_##N(const T* x, const float* weight, const float* bias, T* y, float* mean, float* rstd,      \
                              i64 rows, int cols, int team, int vec, float eps) {                                      \
    layer_norm_fwd_rows<T>(x, weight, bias, y, mean, rstd, rows, cols, team, vec, eps);                                \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(512)                                                                    \
      layer_norm_bwd_rows_##N(const T* dy, const T* x, const float* weight, const float* mean, const float* rstd,      \
                              T* dx, float* partial_dweight, float* partial_dbias, i64 rows, int cols, int team,       \
                              int vec) {                                                                               \
    layer_norm_bwd_rows<T>(dy, x, weight, mean, rstd, dx, partial_dweight, partial_dbias, rows, cols, team, vec);      \
  }
LZ_EXPORT_FLOATING(LZ_LAYER_NORM)
