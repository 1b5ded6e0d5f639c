/* The AVX512-BF16 blocked GEMM (prefill, more than GEMV_MAX_M rows) over the layouts of cpu_linear_layout.h:
 * panels of GEMM_NC blocks, quantized ones dequantized to bf16 first (dequant_panel_bf16, which the AMX GEMM
 * shares). Included by cpu_linear.h. */
#ifndef RG_CPU_LINEAR_AVX512_GEMM_H
#define RG_CPU_LINEAR_AVX512_GEMM_H
#include "cpu_linear_avx512.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* Blocks [blk0, blk0+nb) of an int8 / int4 weight dequantized into a bf16 K-pair panel `out` (nb K 16 values),
 * each weight computed in float32 and rounded once. */
static void dequant_panel_bf16(const rg_weight *w, int64_t blk0, int64_t nb, uint16_t *out) {
    const int64_t K = w->K, G = w->group, ng = K / G, gb = rg_w_group_bytes(w);
    /* K-pair lane l is row l/2: a block's 16 per-row values spread over the 32 lanes of two pair halves */
    const __m512i rows_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i rows_hi = _mm512_add_epi32(rows_lo, _mm512_set1_epi32(8));
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *bp = (const uint8_t *)w->data + (blk0 + b) * ng * gb;
        uint16_t *ob = out + b * K * 16;
        for (int64_t g = 0; g < ng; ++g) {
            const uint8_t *gp = bp + g * gb, *q = gp + 64;
            uint16_t *og = ob + g * G * 16; /* pair g G/2 of the block */
            if (w->kind == RG_W_INT8) {
                const __m512 s = _mm512_loadu_ps((const float *)gp);
                const __m512 s_lo = _mm512_permutexvar_ps(rows_lo, s), s_hi = _mm512_permutexvar_ps(rows_hi, s);
                for (int64_t pl = 0; pl < G / 2; ++pl) {
                    const __m512 a = _mm512_mul_ps(s_lo, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + pl * 32)))));
                    const __m512 c = _mm512_mul_ps(s_hi, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + pl * 32 + 16)))));
                    _mm512_storeu_si512(og + pl * 32, (__m512i)_mm512_cvtne2ps_pbh(c, a));
                }
                continue;
            }
            const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp));
            const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp + 32)));
            const __m512 s_lo = _mm512_permutexvar_ps(rows_lo, s), s_hi = _mm512_permutexvar_ps(rows_hi, s);
            const __m512 o_lo = _mm512_permutexvar_ps(rows_lo, o), o_hi = _mm512_permutexvar_ps(rows_hi, o);
            const __m512i nib = _mm512_set1_epi32(15);
            for (int64_t c = 0; c < G / 4; ++c) {
                const __m512i blo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + c * 32)));
                const __m512i bhi = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + c * 32 + 16)));
                for (int h = 0; h < 2; ++h) { /* h = 0: low nibbles, pair 2c; h = 1: high nibbles, pair 2c+1 */
                    const __m512 qa = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(blo, 4 * h), nib));
                    const __m512 qb = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bhi, 4 * h), nib));
                    const __m512 a = w->zero_points ? _mm512_mul_ps(s_lo, _mm512_sub_ps(qa, o_lo)) : _mm512_fmadd_ps(s_lo, qa, o_lo);
                    const __m512 d = w->zero_points ? _mm512_mul_ps(s_hi, _mm512_sub_ps(qb, o_hi)) : _mm512_fmadd_ps(s_hi, qb, o_hi);
                    _mm512_storeu_si512(og + (2 * c + h) * 32, (__m512i)_mm512_cvtne2ps_pbh(d, a));
                }
            }
        }
    }
}

/* Rows [m0, m0+MR) x NR blocks of a bf16 K-pair panel pw (its first block at output column n0): the GEMM's
 * register tile, MR x NR accumulators fed by NR 64-byte weight loads and MR broadcasts per input pair. */
static inline __attribute__((always_inline)) void gemm_tile_bf16(const uint16_t *x, int64_t K, const uint16_t *pw,
                                                                const uint16_t *bias, uint16_t *y, float *yf,
                                                                int64_t N, int64_t m0, int64_t n0, const int MR,
                                                                const int NR) {
    const int64_t pairs = K / 2;
    __m512 acc[8][3];
    for (int i = 0; i < MR; ++i)
        for (int b = 0; b < NR; ++b) acc[i][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh wv[3];
        for (int b = 0; b < NR; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(pw + (b * pairs + p) * 32);
        for (int i = 0; i < MR; ++i) {
            const __m512bh xb = bcast_pair(x + (m0 + i) * K + 2 * p);
            for (int b = 0; b < NR; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], xb, wv[b]);
        }
    }
    for (int b = 0; b < NR && n0 + b * 16 < N; ++b)
        for (int i = 0; i < MR; ++i)
            store16(acc[i][b], bias, y, yf, (m0 + i) * N + n0 + b * 16, n0 + b * 16, N - n0 - b * 16);
}

/* All input rows against NR blocks of a panel, eight rows at a time, then four, two, one. */
static inline __attribute__((always_inline)) void gemm_rows_bf16(const uint16_t *x, int64_t M, int64_t K,
                                                                const uint16_t *pw, const uint16_t *bias,
                                                                uint16_t *y, float *yf, int64_t N, int64_t n0,
                                                                const int NR) {
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) gemm_tile_bf16(x, K, pw, bias, y, yf, N, m0, n0, 8, NR);
    for (; m0 + 4 <= M; m0 += 4) gemm_tile_bf16(x, K, pw, bias, y, yf, N, m0, n0, 4, NR);
    for (; m0 + 2 <= M; m0 += 2) gemm_tile_bf16(x, K, pw, bias, y, yf, N, m0, n0, 2, NR);
    for (; m0 < M; ++m0) gemm_tile_bf16(x, K, pw, bias, y, yf, N, m0, n0, 1, NR);
}

/* The GEMM for the calling team: panels of GEMM_NC blocks split over it, each panel (dequantized into the calling
 * thread's buf, GEMM_NC K 16 bf16, unless already bf16) against every input row, three blocks at a time. */
static void gemm_team_bf16(const rg_weight *w, const uint16_t *x, int64_t M, const uint16_t *bias, uint16_t *y,
                           float *yf, uint16_t *buf) {
    const int64_t K = w->K, N = w->N, blocks = (N + 15) / 16, panels = (blocks + GEMM_NC - 1) / GEMM_NC;
#pragma omp for schedule(static)
    for (int64_t pn = 0; pn < panels; ++pn) {
        const int64_t blk0 = pn * GEMM_NC, nb = blocks - blk0 < GEMM_NC ? blocks - blk0 : GEMM_NC;
        const uint16_t *pw = (const uint16_t *)w->data + blk0 * K * 16;
        if (w->kind != RG_W_BF16) {
            dequant_panel_bf16(w, blk0, nb, buf);
            pw = buf;
        }
        int64_t b = 0;
        if (w->k_split || w->partial) { /* bf16 only (rg_w_valid) */
            for (; b < nb; b += 4)
                fixed_rows_bf16(w, x, M, pw + b * K * 16, K * 16, bias, y, yf, (blk0 + b) * 16, nb - b < 4 ? (int)(nb - b) : 4);
            continue;
        }
        for (; b + 3 <= nb; b += 3) gemm_rows_bf16(x, M, K, pw + b * K * 16, bias, y, yf, N, (blk0 + b) * 16, 3);
        for (; b < nb; ++b) gemm_rows_bf16(x, M, K, pw + b * K * 16, bias, y, yf, N, (blk0 + b) * 16, 1);
    }
}
#endif /* AVX512-BF16 */
#endif
