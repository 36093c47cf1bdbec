// The pre-LayerNorm block's seam, fused: hidden = residual + dropout(x + bias), normed = LayerNorm(hidden),
// x, residual, hidden and normed [rows, cols] in T, bias, weight and ln_bias fp32 [cols]. LayerNorm's
// statistics are those of the stored (T-rounded) hidden values, as the unfused ops would compute them.
// Backward: dhidden = LayerNorm's input gradient + the gradient arriving at hidden from the residual
// stream, in fp32; dresidual = dhidden; dx = dropout's gradient of it; each team's partial sums of
// dweight (dnormed * xhat), dln_bias (dnormed) and dbias (dx, unrounded). Row kernels only (rows.cuh,
// [Note: row teams]); the host composes the unfused ops for rows the row kernels do not take.
#include "rows.cuh"

template <typename T>
__device__ void residual_layer_norm_fwd(const T* __restrict__ x, const float* __restrict__ bias,
                                        const T* __restrict__ residual, const float* __restrict__ weight,
                                        const float* __restrict__ ln_bias, T* __restrict__ hidden,
                                        T* __restrict__ normed, float* __restrict__ mean_out,
                                        float* __restrict__ rstd_out, i64 rows, int cols, float p_drop,
                                        const long long* stream, float eps, int team_size, int vec) {
  __shared__ float scratch[32];
  constexpr int E = FWD_ELEMS, V = PACK_OF(T);
  const DropoutStream drop = read_stream(stream);
  const RowTeam team(team_size, vec);
  for (i64 row = team.first; row < rows; row += team.stride) {
    float v[E], r[E];
    load_row<E>(x + row * cols, cols, team, v, 0.f);
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int c = team.column<V>(j);
      v[j] = c < cols ? v[j] + bias[c] : 0.f;
    }
    dropout_row<E, V>(v, drop, row, cols, team, p_drop);
    load_row<E>(residual + row * cols, cols, team, r, 0.f);  // after dropout, whose Philox rounds need registers
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = to_f32(from_f32<T>(r[j] + v[j]));  // what `hidden` stores (0 past the end)
    store_row<E>(hidden + row * cols, cols, team, v);
    const float2 stats = layer_norm_row<E, V>(v, cols, weight, ln_bias, eps, team, scratch);
    store_row<E>(normed + row * cols, cols, team, v);
    if (team.lane == 0) {
      mean_out[row] = stats.x;
      rstd_out[row] = stats.y;
    }
  }
}

template <typename T>
__device__ void residual_layer_norm_bwd(const T* __restrict__ dnormed, const T* __restrict__ dhidden_in,
                                        const T* __restrict__ hidden, const float* __restrict__ weight,
                                        const float* __restrict__ mean, const float* __restrict__ rstd,
                                        T* __restrict__ dx, T* __restrict__ dresidual,
                                        float* __restrict__ partial_dweight, float* __restrict__ partial_dln_bias,
                                        float* __restrict__ partial_dbias, i64 rows, int cols, float p_drop,
                                        const long long* stream, int team_size, int vec) {
  __shared__ float scratch[32];
  constexpr int E = BWD_ELEMS, V = PACK_OF(T);
  const DropoutStream drop = read_stream(stream);
  const RowTeam team(team_size, vec);
  float dweight[E] = {}, dln_bias[E] = {}, dbias[E] = {};
  for (i64 row = team.first; row < rows; row += team.stride) {
    float h[E], g[E], d[E];
    load_row<E>(hidden + row * cols, cols, team, h, 0.f);
    load_row<E>(dnormed + row * cols, cols, team, g, 0.f);
    layer_norm_row_grad<E, V>(h, g, mean[row], rstd[row], cols, weight, team, scratch, dweight, dln_bias);
    load_row<E>(dhidden_in + row * cols, cols, team, d, 0.f);
#pragma unroll
    for (int j = 0; j < E; ++j) d[j] += g[j];  // all of hidden's gradient
    store_row<E>(dresidual + row * cols, cols, team, d);
    dropout_row<E, V>(d, drop, row, cols, team, p_drop);
#pragma unroll
    for (int j = 0; j < E; ++j) dbias[j] += d[j];  // (past the row's end: 0)
    store_row<E>(dx + row * cols, cols, team, d);
  }
  write_team_sums<E, V>(team, cols, dweight, partial_dweight);
  write_team_sums<E, V>(team, cols, dln_bias, partial_dln_bias);
  write_team_sums<E, V>(team, cols, dbias, partial_dbias);
}

#define LZ_RESIDUAL_LAYER_NORM(T, N)                                                                                   \
  extern "C" __global__ void __launch_bounds__(1024) residual_layer_norm_fwd_##N(                                      \
      const T* x, const float* bias, const T* residual, const float* weight, const float* ln_bias, T* hidden,          \
      T* normed, float* mean, float* rstd, i64 rows, int cols, float p_drop, const long long* stream, float eps,       \
      int team, int vec) {                                                                                             \
    residual_layer_norm_fwd<T>(x, bias, residual, weight, ln_bias, hidden, normed, mean, rstd, rows, cols, p_drop,     \
                               stream, eps, team, vec);                                                                \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(256) residual_layer_norm_bwd_##N(                                       \
      const T* dnormed, const T* dhidden, const T* hidden, const float* weight, const float* mean,                     \
      const float* rstd, T* dx, T* dresidual, float* partial_dweight, float* partial_dln_bias,                         \
      float* partial_dbias, i64 rows, int cols, float p_drop, const long long* stream, int team, int vec) {            \
    residual_layer_norm_bwd<T>(dnormed, dhidden, hidden, weight, mean, rstd, dx, dresidual, partial_dweight,           \
                               partial_dln_bias, partial_dbias, rows, cols, p_drop, stream, team, vec);                \
  }
LZ_EXPORT_FLOATING(LZ_RESIDUAL_LAYER_NORM)
