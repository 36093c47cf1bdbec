// Row kernels (LayerNorm, softmax, and the fused residual + LayerNorm): each row is read from memory once
// and kept in registers while its statistics are reduced.
//
// [Note: row teams]
// A team of threads owns a row: a warp (team = 32; a block holds blockDim.x / 32 teams, one row each) for
// short rows, else the whole block (team = blockDim.x). Each thread holds E elements in registers: chunk k
// of V contiguous elements (a 16-byte pack) starts at column (k * team + lane) * V, so a row of up to
// E * team columns stays in registers. A chunk moves with one 16-byte load or store when every row is a
// whole number of packs and the tensors are 16-byte aligned (`vec`, the host's check); otherwise (odd key
// counts, views that start mid-pack) element by element in the same layout: still one read of the row. Forward
// kernels hold E = 8 with teams of up to 1024 threads (64 registers a thread), backward kernels, which
// keep two rows and two partial sums, E = 16 with teams of up to 512 (128 registers): 8192 columns
// either way (columns are ints there); wider rows take the looping kernels. Teams walk the
// rows with a grid stride (the grid is one wave of the device), so per-team partial sums of parameter
// gradients stay few. A team is either one warp (shuffles only) or the whole block (every thread walks the
// same rows, so the block's barriers are reached by all); never anything in between (the host's
// launchers._row_team never gives a team of 64: a row that needs 33-127 threads takes a 128-thread block).
#pragma once
#include "common.cuh"

constexpr int FWD_ELEMS = 8, BWD_ELEMS = 16;  // E of the forward and backward row kernels
#define PACK_OF(T) (int)(16 / sizeof(T))  // elements per 16-byte pack (a macro: entry-point macros name their dtype N)

struct RowTeam {
  int lane, size;  // this thread's place in its team, the team's size
  bool vec;        // whether rows move in 16-byte packs (else element by element)
  i64 first, stride, index;
  __device__ RowTeam(int team, int packed) {
    size = team;
    vec = packed != 0;
    lane = threadIdx.x % team;
    const i64 per_block = blockDim.x / team;
    index = (i64)blockIdx.x * per_block + threadIdx.x / team;
    first = index;
    stride = (i64)gridDim.x * per_block;
  }
  // The column of this thread's element j, for chunks of V.
  template <int V> __device__ __forceinline__ int column(int j) const { return ((j / V) * size + lane) * V + j % V; }
};

__device__ __forceinline__ float team_sum(float value, const RowTeam& team, float* scratch) {
  if (team.size > 32) return block_sum(value, scratch);
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float team_max(float value, const RowTeam& team, float* scratch) {
  if (team.size > 32) return block_max(value, scratch);
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// This thread's elements of `row` as fp32 (`fill` past the row's end): one 16-byte load per chunk with
// `team.vec` (the host checked that the row length is a multiple of the pack and that every row starts
// 16-byte aligned), else one load per element.
template <int E, typename T>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int cols, const RowTeam& team, float (&out)[E],
                                         float fill) {
  constexpr int V = PACK_OF(T);
#pragma unroll
  for (int k = 0; k < E / V; ++k) {
    const int c = team.column<V>(k * V);
    if (team.vec && c < cols) {
      const Pack<T> pack = load_pack(row + c);
#pragma unroll
      for (int j = 0; j < V; ++j) out[k * V + j] = to_f32(pack.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) out[k * V + j] = c + j < cols ? to_f32(row[c + j]) : fill;
    }
  }
}

template <int E, typename T>
__device__ __forceinline__ void store_row(T* __restrict__ row, int cols, const RowTeam& team, const float (&in)[E]) {
  constexpr int V = PACK_OF(T);
#pragma unroll
  for (int k = 0; k < E / V; ++k) {
    const int c = team.column<V>(k * V);
    if (c >= cols) continue;
    if (team.vec) {
      Pack<T> pack;
#pragma unroll
      for (int j = 0; j < V; ++j) pack.v[j] = from_f32<T>(in[k * V + j]);
      store_pack(row + c, pack);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (c + j < cols) row[c + j] = from_f32<T>(in[k * V + j]);
    }
  }
}

// Dropout in place on this thread's elements of row `row` (element index row * cols + column; kept ones scaled
// by 1 / (1 - p)): one Philox call per four elements of the stream. A chunk whose first element starts a
// group of four (always, when the row length is a multiple of 4) takes V / 4 calls; one that does not
// straddles groups and takes V / 4 + 1, each call's words reused while the group lasts. Elements past the
// row's end get words too (they are 0 and never stored). Nothing without dropout.
template <int E, int V>
__device__ __forceinline__ void dropout_row(float (&v)[E], DropoutStream stream, i64 row, int cols,
                                            const RowTeam& team, float p_drop) {
  if (p_drop <= 0.f) return;
  const float keep_scale = 1.f / (1.f - p_drop);
#pragma unroll
  for (int k = 0; k < E / V; ++k) {
    const i64 first = row * cols + team.column<V>(k * V);
    if ((first & 3) == 0) {
#pragma unroll
      for (int q = 0; q < V / 4; ++q) {
        const float4 u = philox_uniform4(stream.seed, stream.offset, first / 4 + q);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float& x = v[k * V + 4 * q + j];
          x = word_of(u, j) >= p_drop ? x * keep_scale : 0.f;
        }
      }
    } else {
      i64 group = first >> 2;
      float4 u = philox_uniform4(stream.seed, stream.offset, group);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const i64 index = first + j;
        if ((index >> 2) != group) u = philox_uniform4(stream.seed, stream.offset, group = index >> 2);
        float& x = v[k * V + j];
        x = word_of(u, (int)(index & 3)) >= p_drop ? x * keep_scale : 0.f;
      }
    }
  }
}

// LayerNorm in place on this thread's elements of a row (0 past the row's end): the row's mean, then the mean
// of its squared deviations, each reduced over the team; v becomes (v - mean) * rstd * weight + bias.
// Returns (mean, rstd), which backward needs.
template <int E, int V>
__device__ __forceinline__ float2 layer_norm_row(float (&v)[E], int cols, const float* __restrict__ weight,
                                                 const float* __restrict__ bias, float eps, const RowTeam& team,
                                                 float* scratch) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) sum += v[j];
  const float mean = team_sum(sum, team, scratch) / cols;
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float d = team.column<V>(j) < cols ? v[j] - mean : 0.f;
    squares += d * d;
  }
  const float rstd = rsqrtf(team_sum(squares, team, scratch) / cols + eps);
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int c = team.column<V>(j);
    if (c < cols) v[j] = (v[j] - mean) * rstd * weight[c] + bias[c];
  }
  return make_float2(mean, rstd);
}

// LayerNorm's backward on a row: x (the input, overwritten) and g (dy in, the input's gradient out, 0 past the
// row's end), with dy * xhat and dy added to this thread's per-column sums dweight and dbias.
template <int E, int V>
__device__ __forceinline__ void layer_norm_row_grad(float (&x)[E], float (&g)[E], float mean, float rstd, int cols,
                                                    const float* __restrict__ weight, const RowTeam& team,
                                                    float* scratch, float (&dweight)[E], float (&dbias)[E]) {
  float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int c = team.column<V>(j);
    if (c >= cols) continue;
    const float xhat = (x[j] - mean) * rstd;
    dweight[j] += g[j] * xhat;
    dbias[j] += g[j];
    g[j] *= weight[c];
    x[j] = xhat;
    sum_g += g[j];
    sum_gx += g[j] * xhat;
  }
  const float mean_g = team_sum(sum_g, team, scratch) / cols, mean_gx = team_sum(sum_gx, team, scratch) / cols;
#pragma unroll
  for (int j = 0; j < E; ++j)
    g[j] = team.column<V>(j) < cols ? rstd * (g[j] - mean_g - x[j] * mean_gx) : 0.f;
}

// This team's per-column sums into row `team.index` of a [teams, cols] partial buffer (the host sums the rows).
template <int E, int V>
__device__ __forceinline__ void write_team_sums(const RowTeam& team, int cols, const float (&sums)[E],
                                                float* __restrict__ partial) {
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int c = team.column<V>(j);
    if (c < cols) partial[team.index * cols + c] = sums[j];
  }
}
