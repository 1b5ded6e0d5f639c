/* One dtype's instantiation of the CPU kernels; cpu_kernels.c includes this file once per element type
 * with T (storage type), LD(x) (to float), ST(f) (from float), FN(name) (name with a dtype suffix),
 * LOAD16(p) (16 elements to a float vector) and IS_BF16 defined; the file undefines them at its end.
 * Every kernel computes in float32. Tensors are passed as base pointers plus the strides that vary. */

/* The kernels that write and read the KV pool (store, decode attention), once per pool format: the pool in T
 * itself, and 8-bit codes with a scale per (slot, head) (cpu_kv_quant.h). */
#define KV_FORMAT KV_PLAIN
#include "cpu_pool_impl.h" /* undefines KV_FORMAT */
#define KV_FORMAT KV_INT8
#include "cpu_pool_impl.h"
#define KV_FORMAT KV_FP8
#include "cpu_pool_impl.h"

/* out = rmsnorm(x [+ residual]) * weight, per row of N. With a residual, the sum (rounded to T, as the
 * unfused torch code rounds it) is written back into `residual` first. x rows have stride x_stride. */
#if defined(__AVX512BF16__) && IS_BF16
/* add_rmsnorm's row for bf16 with N a multiple of 16, 16 lanes at a time: the same float32 operations and
 * roundings in the same order, the sum of squares accumulated in 16 lanes. */
static inline void FN(add_rmsnorm_row16)(const T *xr, T *rr, const T *weight, T *o, int64_t N, float eps) {
    __m512 acc = _mm512_setzero_ps();
    if (rr) {
        for (int64_t i = 0; i < N; i += 16) {
            const __m256bh sum = _mm512_cvtneps_pbh(_mm512_add_ps(load16_bf16(xr + i), load16_bf16(rr + i)));
            _mm256_storeu_si256((__m256i *)(rr + i), (__m256i)sum);
            const __m512 v = _mm512_cvtpbh_ps(sum);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        xr = rr;
    } else {
        for (int64_t i = 0; i < N; i += 16) {
            const __m512 v = load16_bf16(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)N + eps));
    for (int64_t i = 0; i < N; i += 16) {
        const __m512 y = _mm512_mul_ps(load16_bf16(weight + i), _mm512_mul_ps(load16_bf16(xr + i), inv));
        _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(y));
    }
}
#endif

void FN(add_rmsnorm)(const T *x, int64_t x_stride, T *residual, const T *weight, T *out, int64_t n_rows,
                     int64_t N, float eps) {
#pragma omp parallel for if (n_rows * N >= 65536)
    for (int64_t r = 0; r < n_rows; ++r) {
        const T *xr = x + r * x_stride;
        T *o = out + r * N;
#if defined(__AVX512BF16__) && IS_BF16
        if (N % 16 == 0) {
            FN(add_rmsnorm_row16)(xr, residual ? residual + r * N : NULL, weight, o, N, eps);
            continue;
        }
#endif
        float ss = 0.f;
        if (residual) {
            T *rr = residual + r * N;
            for (int64_t i = 0; i < N; ++i) {
                rr[i] = ST(LD(xr[i]) + LD(rr[i]));
            }
            xr = rr;
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; ++i) {
            const float v = LD(xr[i]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)N + eps);
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) o[i] = ST(LD(weight[i]) * (LD(xr[i]) * inv));
    }
}

/* In-place rotate-half rotary embedding of q (T, Hq, D) and k (T, Hk, D); heads are D apart, rows
 * q_stride / k_stride apart. cos_sin (P, D) float32: cos in the first D/2 columns, sin in the rest. */
void FN(rotary)(const int64_t *positions, T *q, int64_t q_stride, int64_t Hq, T *k, int64_t k_stride,
                int64_t Hk, const float *cos_sin, int64_t D, int64_t n_tok) {
    const int64_t half = D / 2;
#pragma omp parallel for if (n_tok * (Hq + Hk) * D >= 65536)
    for (int64_t t = 0; t < n_tok; ++t) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        for (int64_t hh = 0; hh < Hq + Hk; ++hh) {
            T *x = hh < Hq ? q + t * q_stride + hh * D : k + t * k_stride + (hh - Hq) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = LD(x[i]), x2 = LD(x[i + half]);
                x[i] = ST(x1 * c[i] - x2 * s[i]);
                x[i + half] = ST(x2 * c[i] + x1 * s[i]);
            }
        }
    }
}

#undef T
#undef LD
#undef ST
#undef FN
#undef LOAD16
#undef IS_BF16
