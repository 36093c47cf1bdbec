// Scaled, masked / causal softmax with fused dropout, over the last dimension of attention scores
// [rows = batch * heads * q_len, cols = k_len]. x = scores * scale + mask (mask: optional fp32, any
// shape that broadcasts to [batch, heads, q_len, k_len], read through its strides for batch, head and
// query, its keys contiguous: a [batch, 1, 1, k_len] padding mask is never expanded); causal hides key
// k > q + (k_len - q_len). A fully hidden row gives zeros. Forward writes the probabilities (kept for
// backward) and, with dropout, the dropped-out output; backward regenerates the mask from the stream and
// row * cols + col.
//
// Rows of up to 8192 keys take the row kernels (rows.cuh, [Note: row teams]): each row read once into
// registers, the mask made once per element in backward. Wider rows take the looping kernels, which read a
// row three times forward and twice backward; their dropout passes walk the row in the stream's groups of
// four elements (one Philox call each, as the row kernels), and backward makes the mask twice.
#include "rows.cuh"

// The stream's groups of four that row [base, base + cols) touches, one a thread in turn: group g holds
// elements 4g .. 4g + 3, columns 4g - base + j of the row (those in [0, cols) are the row's).
#define LZ_FOR_EACH_GROUP(g, base, cols) \
  for (i64 g = ((base) >> 2) + threadIdx.x; g <= ((base) + (cols) - 1) >> 2; g += blockDim.x)

// Group g's four uniforms, or words that keep every element when there is no dropout.
__device__ __forceinline__ float4 group_words(DropoutStream stream, i64 g, float p_drop) {
  return p_drop > 0.f ? philox_uniform4(stream.seed, stream.offset, g) : make_float4(1.f, 1.f, 1.f, 1.f);
}

template <typename T>
__device__ void softmax_dropout_fwd(const T* __restrict__ scores, const float* __restrict__ mask, i64 mask_sb,
                                    i64 mask_sh, i64 mask_sq, T* __restrict__ probs, T* __restrict__ out, i64 cols,
                                    i64 heads, i64 q_len, float scale, int causal, float p_drop,
                                    const long long* stream) {
  __shared__ float scratch[32];
  const DropoutStream drop = read_stream(stream);
  const i64 row = blockIdx.x, q = row % q_len, head = (row / q_len) % heads, batch = row / (heads * q_len);
  const i64 visible = causal ? min(cols, q + (cols - q_len) + 1) : cols;
  const float* mask_row = mask != nullptr ? mask + batch * mask_sb + head * mask_sh + q * mask_sq : nullptr;
  float row_max = -LZ_INF;
  for (i64 c = threadIdx.x; c < visible; c += blockDim.x)
    row_max = fmaxf(row_max, to_f32(scores[row * cols + c]) * scale + (mask_row ? mask_row[c] : 0.f));
  row_max = block_max(row_max, scratch);
  float sum = 0.f;
  for (i64 c = threadIdx.x; c < visible; c += blockDim.x)
    if (row_max != -LZ_INF)
      sum += expf(to_f32(scores[row * cols + c]) * scale + (mask_row ? mask_row[c] : 0.f) - row_max);
  sum = block_sum(sum, scratch);
  const float inv_sum = sum > 0.f ? 1.f / sum : 0.f, keep_scale = 1.f / (1.f - p_drop);
  const i64 base = row * cols;
  LZ_FOR_EACH_GROUP(g, base, cols) {
    const float4 u = group_words(drop, g, p_drop);
    for (int j = 0; j < 4; ++j) {
      const i64 c = 4 * g + j - base;
      if (c < 0 || c >= cols) continue;
      float p = 0.f;
      if (c < visible && row_max != -LZ_INF)
        p = expf(to_f32(scores[base + c]) * scale + (mask_row ? mask_row[c] : 0.f) - row_max) * inv_sum;
      probs[base + c] = from_f32<T>(p);
      if (p_drop > 0.f) out[base + c] = from_f32<T>(word_of(u, j) >= p_drop ? p * keep_scale : 0.f);
    }
  }
}

template <typename T>
__device__ void softmax_dropout_bwd(const T* __restrict__ dout, const T* __restrict__ probs, T* __restrict__ dscores,
                                    i64 cols, float scale, float p_drop, const long long* stream) {
  __shared__ float scratch[32];
  const DropoutStream drop = read_stream(stream);
  const i64 row = blockIdx.x;
  const float keep_scale = 1.f / (1.f - p_drop);
  const i64 base = row * cols;
  float dot = 0.f;
  LZ_FOR_EACH_GROUP(g, base, cols) {
    const float4 u = group_words(drop, g, p_drop);
    for (int j = 0; j < 4; ++j) {
      const i64 c = 4 * g + j - base;
      if (c >= 0 && c < cols) dot += (word_of(u, j) >= p_drop ? to_f32(dout[base + c]) * keep_scale : 0.f) *
                                     to_f32(probs[base + c]);
    }
  }
  dot = block_sum(dot, scratch);
  LZ_FOR_EACH_GROUP(g, base, cols) {  // the mask again (the row does not fit in registers)
    const float4 u = group_words(drop, g, p_drop);
    for (int j = 0; j < 4; ++j) {
      const i64 c = 4 * g + j - base;
      if (c < 0 || c >= cols) continue;
      const float d = word_of(u, j) >= p_drop ? to_f32(dout[base + c]) * keep_scale : 0.f;
      dscores[base + c] = from_f32<T>(scale * to_f32(probs[base + c]) * (d - dot));
    }
  }
}

template <typename T>
__device__ void softmax_dropout_fwd_rows(const T* scores, const float* __restrict__ mask, i64 mask_sb, i64 mask_sh,
                                         i64 mask_sq, T* probs, T* out, i64 rows, int cols, i64 heads, i64 q_len,
                                         float scale, int causal, float p_drop, const long long* stream,
                                         int team_size, int vec) {
  __shared__ float scratch[32];
  constexpr int E = FWD_ELEMS, V = PACK_OF(T);
  const DropoutStream drop = read_stream(stream);
  const RowTeam team(team_size, vec);
  for (i64 row = team.first; row < rows; row += team.stride) {
    const i64 q = row % q_len, head = (row / q_len) % heads, batch = row / (heads * q_len);
    const i64 visible = causal ? min((i64)cols, q + (cols - q_len) + 1) : cols;
    const float* mask_row = mask != nullptr ? mask + batch * mask_sb + head * mask_sh + q * mask_sq : nullptr;
    float v[E];
    load_row<E>(scores + row * cols, cols, team, v, 0.f);
    float row_max = -LZ_INF;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const int c = team.column<V>(j);
      v[j] = c < visible ? v[j] * scale + (mask_row ? mask_row[c] : 0.f) : -LZ_INF;
      row_max = fmaxf(row_max, v[j]);
    }
    row_max = team_max(row_max, team, scratch);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) {
      v[j] = row_max != -LZ_INF ? expf(v[j] - row_max) : 0.f;  // hidden keys: exp(-inf) = 0
      sum += v[j];
    }
    sum = team_sum(sum, team, scratch);
    const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] *= inv_sum;
    store_row<E>(probs + row * cols, cols, team, v);  // (without dropout, `out` is `probs`)
    if (p_drop > 0.f) {
      dropout_row<E, V>(v, drop, row, cols, team, p_drop);
      store_row<E>(out + row * cols, cols, team, v);
    }
  }
}

template <typename T>
__device__ void softmax_dropout_bwd_rows(const T* __restrict__ dout, const T* __restrict__ probs,
                                         T* __restrict__ dscores, i64 rows, int cols, float scale, float p_drop,
                                         const long long* stream, int team_size, int vec) {
  __shared__ float scratch[32];
  constexpr int E = FWD_ELEMS, V = PACK_OF(T);
  const DropoutStream drop = read_stream(stream);
  const RowTeam team(team_size, vec);
  for (i64 row = team.first; row < rows; row += team.stride) {
    float d[E], pr[E];
    load_row<E>(dout + row * cols, cols, team, d, 0.f);
    load_row<E>(probs + row * cols, cols, team, pr, 0.f);
    dropout_row<E, V>(d, drop, row, cols, team, p_drop);  // the mask, made once
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) dot += d[j] * pr[j];  // (past the row's end: 0)
    dot = team_sum(dot, team, scratch);
#pragma unroll
    for (int j = 0; j < E; ++j) d[j] = scale * pr[j] * (d[j] - dot);
    store_row<E>(dscores + row * cols, cols, team, d);
  }
}

#define LZ_SOFTMAX_DROPOUT(T, N)                                                                                       \
  extern "C" __global__ void softmax_dropout_fwd_##N(const T* scores, const float* mask, i64 mask_sb, i64 mask_sh,     \
                                                     i64 mask_sq, T* probs, T* out, i64 cols, i64 heads, i64 q_len,    \
                                                     float scale, int causal, float p_drop,                            \
                                                     const long long* stream) {                                        \
    softmax_dropout_fwd<T>(scores, mask, mask_sb, mask_sh, mask_sq, probs, out, cols, heads, q_len, scale, causal,     \
                           p_drop, stream);                                                                            \
  }                                                                                                                    \
  extern "C" __global__ void softmax_dropout_bwd_##N(const T* dout, const T* probs, T* dscores, i64 cols,              \
                                                     float scale, float p_drop, const long long* stream) {             \
    softmax_dropout_bwd<T>(dout, probs, dscores, cols, scale, p_drop, stream);                                         \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(1024) softmax_dropout_fwd_rows_##N(                                     \
      const T* scores, const float* mask, i64 mask_sb, i64 mask_sh, i64 mask_sq, T* probs, T* out, i64 rows,           \
      int cols, i64 heads, i64 q_len, float scale, int causal, float p_drop, const long long* stream, int team,        \
      int vec) {                                                                                                       \
    softmax_dropout_fwd_rows<T>(scores, mask, mask_sb, mask_sh, mask_sq, probs, out, rows, cols, heads, q_len,         \
                                scale, causal, p_drop, stream, team, vec);                                             \
  }                                                                                                                    \
  extern "C" __global__ void __launch_bounds__(1024) softmax_dropout_bwd_rows_##N(                                     \
      const T* dout, const T* probs, T* dscores, i64 rows, int cols, float scale, float p_drop,                        \
      const long long* stream, int team, int vec) {                                                                    \
    softmax_dropout_bwd_rows<T>(dout, probs, dscores, rows, cols, scale, p_drop, stream, team, vec);                   \
  }
LZ_EXPORT_FLOATING(LZ_SOFTMAX_DROPOUT)
