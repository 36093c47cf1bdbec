// Fused AdamW over flat buffers: one pass reads the gradient (any dtype), unscales it, updates the
// fp32 weights and both moments, and optionally writes the fp16/bf16 copy of the updated weights that
// ZeRO all-gathers. Same arithmetic as torch.optim.AdamW (decoupled weight decay, bias corrections
// computed on the host). `found_inf` (nullable) is a device flag: the step does nothing while it is
// set, so an overflow found on the device skips the step without a host sync. `multiplier` (nullable)
// is a device scalar the gradient is also multiplied by (ZeRO's clip coefficient: no host sync).
#include "common.cuh"

__device__ __forceinline__ void adamw_update(float& p, float& m, float& v, float g, float lr, float beta1, float beta2,
                                             float eps, float decay, float step_size, float bias2_sqrt) {
  p *= decay;  // 1 - lr * weight_decay
  m = beta1 * m + (1.f - beta1) * g;
  v = beta2 * v + (1.f - beta2) * g * g;
  p -= step_size * m / (sqrtf(v) / bias2_sqrt + eps);
}

template <typename G, typename L>
__device__ void adamw(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
                      float* __restrict__ exp_avg_sq, L* __restrict__ lowp, i64 n, float lr, float beta1, float beta2,
                      float eps, float weight_decay, float bias1, float bias2_sqrt, float inv_scale,
                      const float* __restrict__ multiplier, const int* __restrict__ found_inf, int vec4) {
  if (found_inf != nullptr && *found_inf != 0) return;
  if (multiplier != nullptr) inv_scale *= *multiplier;
  const float decay = 1.f - lr * weight_decay, step_size = lr / bias1;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec4) {  // the host checked: n % 4 == 0 and param, exp_avg, exp_avg_sq 16-byte aligned
    for (; i < n / 4; i += stride) {
      float4 p = reinterpret_cast<float4*>(param)[i];
      float4 m = reinterpret_cast<float4*>(exp_avg)[i];
      float4 v = reinterpret_cast<float4*>(exp_avg_sq)[i];
      adamw_update(p.x, m.x, v.x, to_f32(grad[4 * i + 0]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
      adamw_update(p.y, m.y, v.y, to_f32(grad[4 * i + 1]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
      adamw_update(p.z, m.z, v.z, to_f32(grad[4 * i + 2]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
      adamw_update(p.w, m.w, v.w, to_f32(grad[4 * i + 3]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(exp_avg)[i] = m;
      reinterpret_cast<float4*>(exp_avg_sq)[i] = v;
      if (lowp != nullptr) {
        lowp[4 * i + 0] = from_f32<L>(p.x);
        lowp[4 * i + 1] = from_f32<L>(p.y);
        lowp[4 * i + 2] = from_f32<L>(p.z);
        lowp[4 * i + 3] = from_f32<L>(p.w);
      }
    }
    return;
  }
  for (; i < n; i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p, m, v, to_f32(grad[i]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (lowp != nullptr) lowp[i] = from_f32<L>(p);
  }
}

// Sets *found_inf to 1 if any gradient element is inf or nan.
template <typename G>
__device__ void check_finite(const G* __restrict__ grad, i64 n, int* __restrict__ found_inf) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  bool bad = false;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) bad |= !isfinite(to_f32(grad[i]));
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicExch(found_inf, 1);
}

#define LZ_ADAMW(G, GN, L, LN)                                                                                   \
  extern "C" __global__ void adamw_##GN##_##LN(float* param, const G* grad, float* exp_avg, float* exp_avg_sq,  \
                                                L* lowp, i64 n, float lr, float beta1, float beta2, float eps,  \
                                                float weight_decay, float bias1, float bias2_sqrt,             \
                                                float inv_scale, const float* multiplier, const int* found_inf, \
                                                int vec4) {                                                    \
    adamw<G, L>(param, grad, exp_avg, exp_avg_sq, lowp, n, lr, beta1, beta2, eps, weight_decay, bias1,         \
                bias2_sqrt, inv_scale, multiplier, found_inf, vec4);                                            \
  }
#define LZ_ADAMW_FOR_GRAD(G, GN) LZ_ADAMW(G, GN, float, none) LZ_ADAMW(G, GN, __half, f16) LZ_ADAMW(G, GN, __nv_bfloat16, bf16)
LZ_EXPORT_FLOATING(LZ_ADAMW_FOR_GRAD)

#define LZ_CHECK_FINITE(T, N) \
  extern "C" __global__ void check_finite_##N(const T* grad, i64 n, int* found_inf) { check_finite<T>(grad, n, found_inf); }
LZ_EXPORT_FLOATING(LZ_CHECK_FINITE)
