// Host AdamW for ZeRO-Offload: one pass over each offloaded master partition that unscales the
// gradient, updates the fp32 master and both moments, and writes the parameters' 16-bit copy.
//
// [Note: host AdamW arithmetic]
// Per element, in the order of kernels/reference.py's adamw_ (torch.optim.AdamW's update):
//   g = grad * grad_mul;  p *= decay;  m = lerp(m, g, 1 - beta1);  v = v * beta2 + (1 - beta2) * g * g;
//   p += neg_step_size * (m / (sqrt(v) / bias2_sqrt + eps))
// compiled with -ffp-contract=off, so no multiply-add is fused: every ISA clone (AVX-512, AVX2,
// baseline) gives the same bits. The elementwise loop is left to the compiler's vectorizer.
//
// [Note: host AdamW threads]
// The tasks (runs of a partition) are treated as one index space split into equal ranges (multiples
// of 16 elements of that space), one per thread; the caller passes torch.get_num_threads(), so the step uses the threads
// torch would. Thread 0 is the calling thread (ctypes has released the GIL).

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float *param;
    const float *grad;
    float *exp_avg;
    float *exp_avg_sq;
    void *lowp;     // NULL, or n fp16 / bf16 values to write
    int64_t n;
    int32_t lowp_kind;  // 0 none, 1 fp16, 2 bf16
    int32_t lerp_small; // 1 - beta1 < 0.5: torch's lerp takes m + w * (g - m), else g - (g - m) * (1 - w)
    float grad_mul, decay, beta2, lerp_weight, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
} lz_adamw_task;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LZ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LZ_CLONES
#endif

static inline uint32_t bits_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return bits;
}

// [Note: 16-bit casts]
// Both casts round to nearest even, as torch's do, in integer operations and selects only: GCC does
// not vectorize a conversion to _Float16 without AVX512-FP16, nor a branch, nor (under the default
// -ftrapping-math) a float comparison, and any of them would leave the whole loop scalar.
static inline uint16_t to_bf16(float x) {  // a nan stays a quiet nan
    uint32_t bits = bits_of(x);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    uint32_t nan = 0u - (uint32_t)((bits & 0x7FFFFFFFu) > 0x7F800000u);  // all ones for a nan
    return (uint16_t)((rounded & ~nan) | (0x7FC0u & nan));
}

static inline uint16_t to_f16(float x) {
    uint32_t bits = bits_of(x), sign = (bits >> 16) & 0x8000u, a = bits & 0x7FFFFFFFu;
    uint32_t normal = a - 0x38000000u;  // the exponent rebiased from 127 to 15, then 13 bits rounded off
    normal = (normal + 0xFFFu + ((normal >> 13) & 1u)) >> 13;
    // below 2^-14 the half is subnormal: |x| * 2^24 rounded to an integer (exact scaling, then adding
    // 2^23 rounds to nearest even), which is its encoding; 1024 (rounded up) is the smallest normal
    uint32_t subnormal = bits_of(fabsf(x) * 16777216.0f + 8388608.0f) - 0x4B000000u;
    uint32_t r = a < 0x38800000u ? subnormal : normal;
    r = a >= 0x477FF000u ? 0x7C00u : r;  // 65520 and above round to inf
    r = a > 0x7F800000u ? 0x7E00u : r;   // nan
    return (uint16_t)(sign | r);
}

// The loop for one output kind and one lerp form, both compile-time constants after inlining: each
// (kind, form) pair is its own branch-free loop that the vectorizer takes whole.
static inline __attribute__((always_inline)) void adamw_loop(const lz_adamw_task *t, int64_t lo, int64_t hi,
                                                             const int lowp_kind, const int small) {
    float *restrict param = t->param;
    const float *restrict grad = t->grad;
    float *restrict exp_avg = t->exp_avg;
    float *restrict exp_avg_sq = t->exp_avg_sq;
    const float grad_mul = t->grad_mul, decay = t->decay, beta2 = t->beta2, weight = t->lerp_weight;
    const float one_minus_beta2 = t->one_minus_beta2, bias2_sqrt = t->bias2_sqrt, eps = t->eps;
    const float neg_step_size = t->neg_step_size;
    uint16_t *restrict out = (uint16_t *)t->lowp;
    for (int64_t i = lo; i < hi; ++i) {
        float g = grad[i] * grad_mul;
        float w = param[i] * decay;
        float m = exp_avg[i];
        m = small ? m + weight * (g - m) : g - (g - m) * (1.0f - weight);
        float v = exp_avg_sq[i] * beta2 + one_minus_beta2 * g * g;
        w = w + neg_step_size * (m / (sqrtf(v) / bias2_sqrt + eps));
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = w;
        if (lowp_kind == 1) out[i] = to_f16(w);
        if (lowp_kind == 2) out[i] = to_bf16(w);
    }
}

LZ_CLONES static void adamw_range(const lz_adamw_task *t, int64_t lo, int64_t hi) {
    switch (t->lowp_kind * 2 + t->lerp_small) {
        case 0: adamw_loop(t, lo, hi, 0, 0); break;
        case 1: adamw_loop(t, lo, hi, 0, 1); break;
        case 2: adamw_loop(t, lo, hi, 1, 0); break;
        case 3: adamw_loop(t, lo, hi, 1, 1); break;
        case 4: adamw_loop(t, lo, hi, 2, 0); break;
        default: adamw_loop(t, lo, hi, 2, 1); break;
    }
}

typedef struct {
    const lz_adamw_task *tasks;
    int64_t count, begin, end;  // [begin, end) of the tasks' concatenated elements
} lz_share;

static void *run_share(void *arg) {
    const lz_share *s = (const lz_share *)arg;
    int64_t base = 0;
    for (int64_t k = 0; k < s->count && base < s->end; ++k) {
        const lz_adamw_task *t = &s->tasks[k];
        int64_t lo = s->begin > base ? s->begin - base : 0;
        int64_t hi = s->end - base < t->n ? s->end - base : t->n;
        if (lo < hi) adamw_range(t, lo, hi);
        base += t->n;
    }
    return NULL;
}

// Steps every task; returns 0, or the number of threads that could not be started (their shares then
// run on the calling thread).
int lz_adamw_step(const lz_adamw_task *tasks, int64_t count, int32_t threads) {
    int64_t total = 0;
    for (int64_t k = 0; k < count; ++k) total += tasks[k].n;
    if (threads < 1) threads = 1;
    if ((int64_t)threads * 4096 > total) threads = (int32_t)(total / 4096 > 0 ? total / 4096 : 1);
    if (threads > 256) threads = 256;
    lz_share shares[256];
    pthread_t ids[256];
    int started[256] = {0};
    int64_t per = ((total + threads - 1) / threads + 15) / 16 * 16;
    for (int32_t k = 0; k < threads; ++k) {
        int64_t begin = per * k < total ? per * k : total;
        int64_t end = begin + per < total ? begin + per : total;
        shares[k] = (lz_share){tasks, count, begin, end};
    }
    int failed = 0;
    for (int32_t k = 1; k < threads; ++k) started[k] = pthread_create(&ids[k], NULL, run_share, &shares[k]) == 0;
    run_share(&shares[0]);
    for (int32_t k = 1; k < threads; ++k) {
        if (started[k]) {
            pthread_join(ids[k], NULL);
        } else {
            run_share(&shares[k]);
            failed += 1;
        }
    }
    return failed;
}
