/* radixgen's CPU kernels: decode attention through the slot table, KV store, fused residual-add RMSNorm,
 * SiLU-and-multiply and in-place rotary embedding, for float32 and bfloat16 tensors. Built on first use
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

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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
 * 1.2e-38 rather than 0; callers that need an exact zero test for it. */
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

int rg_d_max(void) { return D_MAX; }

#define T float
#define LD(x) (x)
#define ST(f) (f)
#define FN(name) rg_##name##_f32
#include "cpu_kernels_impl.h"
#undef T
#undef LD
#undef ST
#undef FN

#define T uint16_t
#define LD(x) bf16_to_f32(x)
#define ST(f) f32_to_bf16(f)
#define FN(name) rg_##name##_bf16
#include "cpu_kernels_impl.h"
#undef T
#undef LD
#undef ST
#undef FN
