/* The AVX2 (FMA, F16C) streaming matmul for int8 / int4 weights over the layouts of cpu_linear.h, float32 math.
 * Included by cpu_linear.h; defines RG_AVX2_GEMV where built. */
#ifndef RG_CPU_LINEAR_AVX2_H
#define RG_CPU_LINEAR_AVX2_H
#include "cpu_linear_layout.h"

/* ------------------------------------------------------------------------ AVX2 decode (float32 inputs) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <omp.h>
#define RG_AVX2_GEMV 1
#define GEMV2_MAX_M 16      /* rows up to which int8 / int4 weights stream here (more: the portable path) */
#define GEMV2_PREFETCH 2048 /* bytes ahead in a thread's stream, into L2: on a Zen 3 20-30% faster than 512 into L1 */

/* The 8 float32 lanes of 8 bytes of a K-pair slice: byte j of a slice is row j/2 and column 2p + j%2, so bytes
 * 8v .. 8v+7 are rows 4v .. 4v+3 of the block, each row's two columns side by side (lane 2r + t). The input
 * side is the pair (x[2p], x[2p+1]) four times; per-row values (scales, offsets) are each doubled. A lane pair
 * sums to the row's result at the end. */
static inline __m256 bcast_pair_f32(const float *x) {
    return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)x));
}

static inline __m256 dup4_f16(const uint8_t *p) { /* 4 fp16, each twice */
    const __m128i h = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtph_ps(_mm_unpacklo_epi16(h, h));
}

static inline __m256 dup4_f32(const uint8_t *p) { /* 4 float32, each twice */
    const __m128 s = _mm_loadu_ps((const float *)p);
    return _mm256_set_m128(_mm_unpackhi_ps(s, s), _mm_unpacklo_ps(s, s));
}

/* Input rows [m0, m0+MB) against rows 4 V0 .. 4 (V0+NV) of block blk (int8 or int4): into res (row m at
 * res[(m - m0) * 16 + block row]). sx (M x K/group): each input row's group sums (int4 only). */
static inline __attribute__((always_inline)) void gemv2_tile(const rg_weight *w, const float *x, const float *sx,
                                                            int64_t blk, int64_t m0, float *res, const int MB,
                                                            const int V0, const int NV, const int INT4) {
    const int64_t K = w->K, G = w->group, ng = K / G, gb = rg_w_group_bytes(w);
    const uint8_t *bp = (const uint8_t *)w->data + blk * ng * gb;
    const __m256i m15 = _mm256_set1_epi32(15);
    const __m256 even = _mm256_castsi256_ps(_mm256_setr_epi32(-1, 0, -1, 0, -1, 0, -1, 0));
    __m256 acc[4][4];
    for (int i = 0; i < MB; ++i)
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        const uint8_t *gp = bp + g * gb, *q = gp + 64;
        const float *xg = x + m0 * K + g * G;
        __m256 ag[4][4];
        for (int i = 0; i < MB; ++i)
            for (int v = 0; v < NV; ++v) ag[i][v] = _mm256_setzero_ps();
        if (INT4) {
            for (int64_t c = 0; c < G / 4; ++c) { /* a quad: low nibbles pair 2c, high nibbles pair 2c+1 */
                const uint8_t *qc = q + c * 32;
                if (c % 2 == 0) _mm_prefetch((const char *)qc + GEMV2_PREFETCH, _MM_HINT_T1);
                for (int v = 0; v < NV; ++v) {
                    const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qc + 8 * (V0 + v))));
                    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, m15));
                    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4));
                    for (int i = 0; i < MB; ++i) {
                        ag[i][v] = _mm256_fmadd_ps(lo, bcast_pair_f32(xg + i * K + 4 * c), ag[i][v]);
                        ag[i][v] = _mm256_fmadd_ps(hi, bcast_pair_f32(xg + i * K + 4 * c + 2), ag[i][v]);
                    }
                }
            }
            for (int v = 0; v < NV; ++v) {
                const __m256 s = dup4_f16(gp + 8 * (V0 + v)), o = dup4_f16(gp + 32 + 8 * (V0 + v));
                /* sum_k x_k w_k = s sum_k x_k q_k + corr sum_k x_k: corr = offset, or -s z with zero points;
                 * the group sum enters a row's even lane only */
                const __m256 corr = w->zero_points ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(s, o)) : o;
                for (int i = 0; i < MB; ++i) {
                    const __m256 sxe = _mm256_and_ps(_mm256_set1_ps(sx[(m0 + i) * ng + g]), even);
                    acc[i][v] = _mm256_fmadd_ps(corr, sxe, _mm256_fmadd_ps(s, ag[i][v], acc[i][v]));
                }
            }
        } else {
            for (int64_t pl = 0; pl < G / 2; ++pl) {
                const uint8_t *qp = q + pl * 32;
                if (pl % 2 == 0) _mm_prefetch((const char *)qp + GEMV2_PREFETCH, _MM_HINT_T1);
                for (int v = 0; v < NV; ++v) {
                    const __m256 d = _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qp + 8 * (V0 + v)))));
                    for (int i = 0; i < MB; ++i)
                        ag[i][v] = _mm256_fmadd_ps(d, bcast_pair_f32(xg + i * K + 2 * pl), ag[i][v]);
                }
            }
            for (int v = 0; v < NV; ++v) {
                const __m256 s = dup4_f32(gp + 16 * (V0 + v));
                for (int i = 0; i < MB; ++i) acc[i][v] = _mm256_fmadd_ps(s, ag[i][v], acc[i][v]);
            }
        }
    }
    for (int i = 0; i < MB; ++i)
        for (int v = 0; v < NV; ++v) {
            float t[8];
            _mm256_storeu_ps(t, acc[i][v]);
            for (int r = 0; r < 4; ++r) res[i * 16 + 4 * (V0 + v) + r] = t[2 * r] + t[2 * r + 1];
        }
}

/* All M input rows against block blk: four rows at a time (a quarter of the block per pass), then two (halves),
 * then one (the whole block): the later passes read the block from L1. */
static inline __attribute__((always_inline)) void gemv2_block(const rg_weight *w, const float *x, int64_t M,
                                                             const float *sx, int64_t blk, float *res,
                                                             const int INT4) {
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4)
        for (int v = 0; v < 4; ++v) gemv2_tile(w, x, sx, blk, m0, res + m0 * 16, 4, v, 1, INT4);
    for (; m0 + 2 <= M; m0 += 2)
        for (int v = 0; v < 4; v += 2) gemv2_tile(w, x, sx, blk, m0, res + m0 * 16, 2, v, 2, INT4);
    for (; m0 < M; ++m0) gemv2_tile(w, x, sx, blk, m0, res + m0 * 16, 1, 0, 4, INT4);
}

/* y (M, N) = x (M, K) @ w^T (+ bias) for int8 / int4 weights, float32 inputs, M <= GEMV2_MAX_M, over a new team:
 * each thread streams an equal run of consecutive blocks once, dequantizing in registers. Outputs as
 * linear_portable gives them. */
static rg_status linear_avx2(const rg_weight *w, const float *x, int64_t M, const float *biasf, uint16_t *yb,
                             float *yf, int round_bf16) {
    const int64_t N = w->N, K = w->K, ng = K / w->group, blocks = (N + 15) / 16;
    const int INT4 = w->kind == RG_W_INT4;
    float *sx = INT4 ? (float *)malloc(sizeof(float) * (size_t)(M * ng)) : NULL;
    if (INT4 && !sx) return RG_ERR_ALLOC;
    for (int64_t m = 0; INT4 && m < M; ++m) /* each row's group sums */
        for (int64_t g = 0; g < ng; ++g) {
            float t = 0.f;
            for (int64_t k = g * w->group; k < (g + 1) * w->group; ++k) t += x[m * K + k];
            sx[m * ng + g] = t;
        }
#pragma omp parallel
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        float res[GEMV2_MAX_M * 16];
        for (int64_t blk = blocks * me / team; blk < blocks * (me + 1) / team; ++blk) {
            if (INT4)
                gemv2_block(w, x, M, sx, blk, res, 1);
            else
                gemv2_block(w, x, M, sx, blk, res, 0);
            const int64_t n0 = blk * 16, nn = N - n0 < 16 ? N - n0 : 16;
            for (int64_t m = 0; m < M; ++m)
                for (int64_t j = 0; j < nn; ++j)
                    put_result(res[m * 16 + j], biasf, n0 + j, yb, yf, m * N + n0 + j, round_bf16);
        }
    }
    free(sx);
    return RG_OK;
}
#endif
#endif
