// Fused AdamW over flat buffers, one tensor per launch or many (adamw_multi): one pass reads the gradient
// (any dtype), unscales it, updates the fp32 weights and both moments, and optionally writes the
// fp16/bf16 copy of the updated weights that ZeRO all-gathers. Same arithmetic as torch.optim.AdamW
// (decoupled weight decay; bias corrections computed on the host from a host step count, or, for a
// multi-tensor task with a device step count, here in fp64 from it). `found_inf` (nullable) is a device
// flag: the step does nothing while it is set, so an overflow found on the device skips the step without
// a host sync (a device step count is the caller's to hold back: FusedAdamW adds 1 - found_inf to it).
// `multiplier` (nullable) is a device scalar the gradient is also multiplied by (ZeRO's clip coefficient: no
// host sync).
#include "common.cuh"

__device__ __forceinline__ void adamw_update(float& p, float& m, float& v, float g, float lr, float beta1, float beta2,
                                             float eps, float decay, float step_size, float bias2_sqrt) {
  p *= decay;  // 1 - lr * weight_decay
  m = beta1 * m + (1.f - beta1) * g;
  v = beta2 * v + (1.f - beta2) * g * g;
  p -= step_size * m / (sqrtf(v) / bias2_sqrt + eps);
}

// One AdamW step over a flat buffer: the addresses, size and hyper-parameters of a tensor's update. The
// multi-tensor kernel reads an array of them (laid out by kernels/adamw.py's TASK); 64-bit fields first.
struct AdamWTask {
  long long param, grad, exp_avg, exp_avg_sq, lowp;  // device addresses; lowp 0: no 16-bit copy
  long long step;     // 0, or the address of an fp32 step count (this step's, from 1) on the device
  long long n, head;  // head: elements before the buffers' common 16-byte boundary, or -1 (unequally misaligned)
  double beta1_exact, beta2_exact;  // the betas as the host holds them, for bias corrections from `step`
  float lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt, grad_mul;  // grad_mul: this tensor's own factor
};

// The bias corrections (1 - beta1^t, sqrt(1 - beta2^t)): the host's, or from the device step count in fp64,
// as the host computes them.
__device__ __forceinline__ float2 bias_corrections(const AdamWTask& task) {
  if (task.step == 0) return make_float2(task.bias1, task.bias2_sqrt);
  const double t = *reinterpret_cast<const float*>(task.step);
  return make_float2((float)(1.0 - pow(task.beta1_exact, t)), (float)sqrt(1.0 - pow(task.beta2_exact, t)));
}

// Elements [lo, hi) of `task`, thread `first` of `stride`. With head >= 0 the three fp32 buffers are equally
// misaligned: elements before `head` one at a time, then 16-byte loads of four elements (a span that
// starts at or after head starts on a group: the host cuts spans there), then the tail.
template <typename G, typename L>
__device__ void adamw_span(const AdamWTask& task, i64 lo, i64 hi, i64 first, i64 stride, float inv_scale) {
  float* const param = reinterpret_cast<float*>(task.param);
  const G* const grad = reinterpret_cast<const G*>(task.grad);
  float* const exp_avg = reinterpret_cast<float*>(task.exp_avg);
  float* const exp_avg_sq = reinterpret_cast<float*>(task.exp_avg_sq);
  L* const lowp = reinterpret_cast<L*>(task.lowp);
  const float2 bias = bias_corrections(task);
  const float lr = task.lr, beta1 = task.beta1, beta2 = task.beta2, eps = task.eps, bias2_sqrt = bias.y;
  const float decay = 1.f - lr * task.weight_decay, step_size = lr / bias.x;
  inv_scale *= task.grad_mul;
  auto one = [&](i64 i) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p, m, v, to_f32(grad[i]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (lowp != nullptr) lowp[i] = from_f32<L>(p);
  };
  if (task.head < 0) {  // param, exp_avg and exp_avg_sq misaligned differently: one element at a time
    for (i64 i = lo + first; i < hi; i += stride) one(i);
    return;
  }
  const i64 vec_lo = max(lo, min(hi, task.head)), groups = (hi - vec_lo) / 4;
  for (i64 i = lo + first; i < vec_lo; i += stride) one(i);
  float4* const P = reinterpret_cast<float4*>(param + vec_lo);
  float4* const M = reinterpret_cast<float4*>(exp_avg + vec_lo);
  float4* const V = reinterpret_cast<float4*>(exp_avg_sq + vec_lo);
  for (i64 k = first; k < groups; k += stride) {
    float4 p = P[k], m = M[k], v = V[k];
    const i64 i = vec_lo + 4 * k;
    adamw_update(p.x, m.x, v.x, to_f32(grad[i + 0]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
    adamw_update(p.y, m.y, v.y, to_f32(grad[i + 1]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
    adamw_update(p.z, m.z, v.z, to_f32(grad[i + 2]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
    adamw_update(p.w, m.w, v.w, to_f32(grad[i + 3]) * inv_scale, lr, beta1, beta2, eps, decay, step_size, bias2_sqrt);
    P[k] = p;
    M[k] = m;
    V[k] = v;
    if (lowp != nullptr) {
      lowp[i + 0] = from_f32<L>(p.x);
      lowp[i + 1] = from_f32<L>(p.y);
      lowp[i + 2] = from_f32<L>(p.z);
      lowp[i + 3] = from_f32<L>(p.w);
    }
  }
  for (i64 i = vec_lo + 4 * groups + first; i < hi; i += stride) one(i);
}

// The pending gradient factor (unscale and clip, read on the device), or false when a device overflow
// flag says to skip the step.
__device__ __forceinline__ bool step_factor(float& inv_scale, const float* multiplier, const int* found_inf) {
  if (found_inf != nullptr && *found_inf != 0) return false;
  if (multiplier != nullptr) inv_scale *= *multiplier;
  return true;
}

template <typename G, typename L>
__device__ void adamw(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, L* lowp, i64 n, float lr,
                      float beta1, float beta2, float eps, float weight_decay, float bias1, float bias2_sqrt,
                      float inv_scale, const float* __restrict__ multiplier, const int* __restrict__ found_inf,
                      i64 head) {
  if (!step_factor(inv_scale, multiplier, found_inf)) return;
  const AdamWTask task{(long long)param, (long long)grad, (long long)exp_avg, (long long)exp_avg_sq, (long long)lowp,
                       0, n, head, 0.0, 0.0, lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt, 1.f};
  adamw_span<G, L>(task, 0, n, (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x, inv_scale);
}

// Many tensors in one launch: block b steps span (task, lo, hi) = spans[3b .. 3b + 2] (host-cut, at most a
// few hundred thousand elements each), its threads striding through it.
template <typename G, typename L>
__device__ void adamw_multi(const AdamWTask* __restrict__ tasks, const long long* __restrict__ spans, float inv_scale,
                            const float* __restrict__ multiplier, const int* __restrict__ found_inf) {
  if (!step_factor(inv_scale, multiplier, found_inf)) return;
  const long long* span = spans + 3 * (i64)blockIdx.x;
  adamw_span<G, L>(tasks[span[0]], span[1], span[2], threadIdx.x, blockDim.x, inv_scale);
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
                                                i64 head) {                                                    \
    adamw<G, L>(param, grad, exp_avg, exp_avg_sq, lowp, n, lr, beta1, beta2, eps, weight_decay, bias1,         \
                bias2_sqrt, inv_scale, multiplier, found_inf, head);                                            \
  }                                                                                                            \
  extern "C" __global__ void adamw_multi_##GN##_##LN(const AdamWTask* tasks, const long long* spans,            \
                                                      float inv_scale, const float* multiplier,                 \
                                                      const int* found_inf) {                                   \
    adamw_multi<G, L>(tasks, spans, inv_scale, multiplier, found_inf);                                           \
  }
#define LZ_ADAMW_FOR_GRAD(G, GN) LZ_ADAMW(G, GN, float, none) LZ_ADAMW(G, GN, __half, f16) LZ_ADAMW(G, GN, __nv_bfloat16, bf16)
LZ_EXPORT_FLOATING(LZ_ADAMW_FOR_GRAD)

#define LZ_CHECK_FINITE(T, N) \
  extern "C" __global__ void check_finite_##N(const T* grad, i64 n, int* found_inf) { check_finite<T>(grad, n, found_inf); }
LZ_EXPORT_FLOATING(LZ_CHECK_FINITE)
