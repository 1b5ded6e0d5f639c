/* radixgen's CPU kernels: decode attention through the slot table, KV store, fused residual-add RMSNorm
 * and in-place rotary embedding, for float32 and bfloat16 tensors. Built on first use
 * by radixgen.kernels.cpu (cc -O3 -march=native -fopenmp) and called through ctypes; OpenMP resolves to
 * the libgomp that torch has already loaded, so these kernels share torch's thread pool. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define D_MAX 512

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN; branch-free */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* Slots are scattered over the pool, so the hardware prefetcher cannot follow a request's rows: attention
 * asks for the row PREFETCH positions ahead while it works on the current one. */
#define PREFETCH 16

static inline void prefetch_row(const void *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

/* exp for float32 that the compiler can vectorize (glibc's expf is a scalar call): 2^(x log2 e) as
 * 2^i * 2^f with i the nearest integer and |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error
 * about 1e-7). Arguments are clamped to the range whose result is a normal float, so exp(-inf) gives
 * 1.2e-38 rather than 0; callers that need an exact zero test for it. Needs -fno-trapping-math to vectorize
 * (floorf). */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.4426950408889634f;
    const float i = floorf(t + 0.5f);
    const float f = t - i;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* v[0..15] hold 16 partial sums each, one vector per key; returns the vector of the 16 keys' totals.
 * Each round adds even lanes to odd lanes across a pair of vectors, halving the partials per key and
 * packing two keys' halves into one vector; after four rounds lane i is key i's total. */
static inline __m512 hsum16(__m512 v[16]) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int w = 16; w > 1; w /= 2)
        for (int i = 0; i < w / 2; ++i)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], even, v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], odd, v[2 * i + 1]));
    return v[0];
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

int rg_d_max(void) { return D_MAX; }

#define T float
#define LD(x) (x)
#define ST(f) (f)
#define FN(name) rg_##name##_f32
#define LOAD16(p) load16_f32(p)
#include "cpu_kernels_impl.h"
#undef T
#undef LD
#undef ST
#undef FN
#undef LOAD16

#define T uint16_t
#define LD(x) bf16_to_f32(x)
#define ST(f) f32_to_bf16(f)
#define FN(name) rg_##name##_bf16
#define LOAD16(p) load16_bf16(p)
#include "cpu_kernels_impl.h"
#undef T
#undef LD
#undef ST
#undef FN
#undef LOAD16
