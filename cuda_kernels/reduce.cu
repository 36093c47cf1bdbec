// Column sums of a [rows, cols] matrix, the gradient of a bias broadcast over rows. Deterministic in
// two stages: block (x, y) sums column x*blockDim.x + threadIdx.x over its chunk of rows into
// partial[y][col] (fp32); the host sums the chunks (partial.sum(0)).
#include "common.cuh"

template <typename T>
__device__ void column_sum_partial(const T* __restrict__ data, i64 rows, i64 cols, i64 rows_per_chunk,
                                   float* __restrict__ partial) {
  const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const i64 first = (i64)blockIdx.y * rows_per_chunk, last = min(rows, first + rows_per_chunk);
  float sum = 0.f;
  for (i64 r = first; r < last; ++r) sum += to_f32(data[r * cols + col]);
  partial[(i64)blockIdx.y * cols + col] = sum;
}

#define LZ_COLUMN_SUM(T, N)                                                                                \
  extern "C" __global__ void column_sum_partial_##N(const T* data, i64 rows, i64 cols, i64 rows_per_chunk, \
                                                    float* partial) {                                      \
    column_sum_partial<T>(data, rows, cols, rows_per_chunk, partial);                                      \
  }
LZ_EXPORT_FLOATING(LZ_COLUMN_SUM)
