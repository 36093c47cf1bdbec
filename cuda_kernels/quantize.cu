// Block-wise int8 quantization of flat shards and gradient parts (ZeRO++'s quantized gathers and reductions;
// sharding/quantize.py holds the Note and kernels/reference.py the same in torch). ``rows`` rows of ``n``
// elements each, every row cut into blocks of ``block`` elements (the last may be shorter) with one fp32
// scale each: absmax / 127, a non-finite value making it infinite (so the whole block dequantizes to
// non-finite values and an fp16 overflow stays visible). Values are round-half-even(x / scale) in
// [-127, 127]; an all-zero block has scale 0 and values 0.
#include "common.cuh"

// One CUDA block per quantization block: the block's absmax, then its values.
template <typename T>
__device__ void quantize_blocks(const T* __restrict__ x, i64 rows, i64 n, i64 block, signed char* __restrict__ values,
                                float* __restrict__ scales) {
  __shared__ float scratch[32];
  const i64 per_row = (n + block - 1) / block;
  const i64 row = (i64)blockIdx.x / per_row, first = row * n + ((i64)blockIdx.x - row * per_row) * block;
  const i64 last = min(row * n + n, first + block);
  float amax = 0.f;
  for (i64 i = first + threadIdx.x; i < last; i += blockDim.x) {
    const float a = fabsf(to_f32(x[i]));
    amax = fmaxf(amax, a == a ? a : LZ_INF);  // (fmaxf drops a NaN: count it as infinite)
  }
  amax = block_max(amax, scratch);
  const float scale = amax / 127.f;
  if (threadIdx.x == 0) scales[blockIdx.x] = scale;
  const float safe = scale > 0.f ? scale : 1.f;
  for (i64 i = first + threadIdx.x; i < last; i += blockDim.x) {
    const float q = rintf(to_f32(x[i]) / safe);
    values[i] = (signed char)(q == q ? fminf(fmaxf(q, -127.f), 127.f) : 0.f);
  }
}

// One element per thread of a grid-stride loop: out = value * its block's scale, in out's dtype.
template <typename T>
__device__ void dequantize_blocks(const signed char* __restrict__ values, const float* __restrict__ scales, i64 rows,
                                  i64 n, i64 block, T* __restrict__ out) {
  const i64 per_row = (n + block - 1) / block, total = rows * n;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    const i64 row = i / n;
    out[i] = from_f32<T>((float)values[i] * scales[row * per_row + (i - row * n) / block]);
  }
}

#define LZ_QUANTIZE(T, N)                                                                                        \
  extern "C" __global__ void quantize_blocks_##N(const T* x, i64 rows, i64 n, i64 block, signed char* values,    \
                                                 float* scales) {                                                \
    quantize_blocks<T>(x, rows, n, block, values, scales);                                                       \
  }                                                                                                              \
  extern "C" __global__ void dequantize_blocks_##N(const signed char* values, const float* scales, i64 rows,    \
                                                   i64 n, i64 block, T* out) {                                   \
    dequantize_blocks<T>(values, scales, rows, n, block, out);                                                   \
  }
LZ_EXPORT_FLOATING(LZ_QUANTIZE)
