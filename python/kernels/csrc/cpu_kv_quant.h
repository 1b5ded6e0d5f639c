/* 8-bit KV pool codes (kv_cache_dtype int8 and fp8_e4m3): the conversions the pool kernels use, scalar and
 * 16 lanes at a time. A pool of this kind stores each (slot, KV head) row of D values as D codes and one bf16
 * scale s, value = code * s: int8 codes in [-127, 127] with s = amax / 127, or fp8 e4m3 codes (OCP E4M3FN:
 * 4 exponent bits, bias 7, 3 mantissa bits, no infinities, largest 448) with s = amax / 448, amax being the
 * row's largest magnitude. A row is quantized once when it is stored and never re-scaled, so a slot's codes do
 * not depend on what else is in the pool (the radix tree shares them as they are). The arithmetic matches
 * radixgen.kernels.kv_quant's torch reference bit for bit: amax / QMAX in float32 rounded to bf16 (nearest
 * even), codes from x / s in float32, rounded to nearest even. */

#define KV_PLAIN 0 /* the pool in the model dtype: no codes, no scales */
#define KV_INT8 1
#define KV_FP8 2 /* e4m3 */

#define KV_INT8_MAX 127.f
#define KV_FP8_MAX 448.f

/* The e4m3 code of f, |f| <= 448 (callers clamp), rounded to nearest even. Below 2^-6, the smallest normal,
 * codes are multiples of 2^-9: f * 2^9 rounded to an integer in [0, 8] is the code (8 is 2^-6's own code, so
 * the two ranges meet). Above, the float32 mantissa is rounded to 3 bits in place (a carry moves into the
 * exponent) and the exponent rebased from 127 to 7. */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, sizeof a);
    const uint32_t sub = (uint32_t)rintf(a * 512.f);
    const uint32_t rounded = u + 0x7ffffu + ((u >> 20) & 1u);
    const uint32_t normal = (rounded >> 20) - (120u << 3);
    return (uint8_t)(sign | (a < 0.015625f ? sub : normal));
}

/* The value of an e4m3 code (0x7f and 0xff, NaN, are never written). */
static inline float e4m3_to_f32(uint8_t c) {
    const uint32_t e = (c >> 3) & 15u, m = c & 7u;
    const uint32_t bits = ((e + 120u) << 23) | (m << 20);
    float v;
    memcpy(&v, &bits, sizeof v);
    v = e ? v : (float)m * 0.001953125f; /* subnormal: m * 2^-9 */
    return c & 0x80u ? -v : v;
}

/* A row of D floats -> D codes (int8_t, or uint8_t e4m3 bits with fp8) and its bf16 scale, returned: amax /
 * QMAX, codes x / scale rounded (nearest even), within [-QMAX, QMAX]. An all-zero row gets scale 0 and codes 0.
 * Inlined with fp8 a constant. */
static inline __attribute__((always_inline)) uint16_t kv_quant_row(const float *x, int64_t D, void *codes,
                                                                   const int fp8) {
    const float qmax = fp8 ? KV_FP8_MAX : KV_INT8_MAX;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) {
        const float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    const uint16_t s16 = f32_to_bf16(amax / qmax);
    const float s = bf16_to_f32(s16);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
        float y = s > 0.f ? x[d] / s : 0.f;
        y = y > qmax ? qmax : (y < -qmax ? -qmax : y);
        if (fp8)
            ((uint8_t *)codes)[d] = f32_to_e4m3(y);
        else
            ((int8_t *)codes)[d] = (int8_t)rintf(y);
    }
    return s16;
}

#if defined(__AVX512F__)
/* 16 int8 codes to floats. */
static inline __m512 load16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 e4m3 codes to floats through half precision, whose hardware conversion covers the subnormal codes too:
 * an e4m3 code's sign, exponent and mantissa moved into a half's fields read as the value times 2^(7 - 15). */
static inline __m512 load16_e4m3(const uint8_t *p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
#endif
