/* The AVX512-BF16 streaming matmul (decode, up to GEMV_MAX_M rows) over the layouts of cpu_linear_layout.h, with
 * the deterministic mode's fixed-order tiles; and store16, the epilogue the GEMM (cpu_linear_avx512_gemm.h) and
 * the AMX GEMM share. Included by cpu_linear.h; the fused decode step and the expert blocks call
 * linear_team_bf16 / gemv_blocks inside their own teams. */
#ifndef RG_CPU_LINEAR_AVX512_H
#define RG_CPU_LINEAR_AVX512_H
#include "cpu_linear_layout.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <omp.h>
#include "cpu_profile.h" /* -DRG_PROFILE builds: cycle counters of the step's phases */

#define GEMV_PREFETCH 1024 /* bytes ahead within each weight stream */
/* The hint of the weight streams' prefetches. The weights are read once a step, and the best hint differs by
 * vendor: on a Zen 5, two threads streaming with T1 (into L2) prefetches topped out near 40 GB/s and with NTA ones
 * near 50, as fast as a copy; on a Xeon with AMX, NTA prefetches held the same streams to 11 GB/s where T0 ones
 * reached 29, the speed of a plain sum (a C test taking turns). _cpu_build defines RG_STREAM_NTA for the native
 * build of an AMD CPU. */
#ifdef RG_STREAM_NTA
#define GEMV_HINT _MM_HINT_NTA
#define GEMV_HINT_FAR _MM_HINT_NTA
#else
#define GEMV_HINT _MM_HINT_T0
#define GEMV_HINT_FAR _MM_HINT_T1 /* the next tile (up to 61 KB for int4 at K = 1536) into L2: into L1 it evicted the
                                   * tile being read, and the int4 step was 8% slower on that Xeon */
#endif
#define GEMV_MAX_M 16      /* rows up to which a matmul streams its weights (gemv); more run the blocked GEMM */
#define GEMM_NC 6          /* blocks per GEMM panel: 96 output columns, a panel of K = 1536 is 288 KiB (L2) */

/* 16 results of row `at`'s block at output column n0 (+ bias), rounded to bf16, into y or widened into yf. */
static inline void store16(__m512 v, const uint16_t *bias, uint16_t *y, float *yf, int64_t at, int64_t n0,
                           int64_t n) {
    const __mmask16 mk = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    if (bias)
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, bias + n0)), 16)));
    const __m256bh r = _mm512_cvtneps_pbh(v);
    if (yf)
        _mm512_mask_storeu_ps(yf + at, mk, _mm512_cvtpbh_ps(r));
    else
        _mm256_mask_storeu_epi16(y + at, mk, (__m256i)r);
}

static inline __m512bh bcast_pair(const uint16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* 32 int8 in K-pair order -> the 32 bf16 of one K-pair slice (exact: |q| <= 128). */
static inline __m512bh int8_slice(const uint8_t *p) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(b, a); /* lanes 0-15 from a */
}

/* 32 bytes of an int4 quad -> its two K-pair slices of bf16: lo as 128 + q (0x4300 | q, in one ternary-logic op),
 * hi as 2 + q / 64 (0x4000 | q, shifted in with the bits of 4 by one double shift), summed apart (gemv_tile_q's
 * ah): sum x (2 + q / 64) times 64 is sum x (128 + q), so the group's correction is unchanged. Five vector
 * operations a quad instead of seven (both halves as 128 + q): at one row the int4 stream is partly bound by them. */
static inline void int4_slices_row(const uint8_t *p, __m512bh *lo, __m512bh *hi) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    *lo = (__m512bh)_mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA);
#ifdef __AVX512VBMI2__
    *hi = (__m512bh)_mm512_shrdi_epi16(w, _mm512_set1_epi16(4), 4); /* (w >> 4) | 4 << 12 */
#else
    *hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi16(0x4000));
#endif
}

/* Rows [m0, m0+MB) x blocks [blk0, blk0+NB) of y = x @ w^T (+ bias) for bf16 K-pair weights (blocks that exist:
 * linear_team_bf16 never hands out more). */
static inline __attribute__((always_inline)) void gemv_tile_bf16(const rg_weight *w, const uint16_t *x,
                                                                const uint16_t *bias, uint16_t *y, float *yf,
                                                                int64_t blk0, int64_t m0, const int MB, const int NB) {
    const int64_t K = w->K, N = w->N, pairs = K / 2;
    const uint16_t *wb[4];
    for (int b = 0; b < NB; ++b) wb[b] = (const uint16_t *)w->data + (blk0 + b) * pairs * 32;
    __m512 acc[4][8];
    for (int b = 0; b < NB; ++b)
        for (int i = 0; i < MB; ++i) acc[b][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        __m512bh wv[4];
        for (int b = 0; b < NB; ++b) {
            _mm_prefetch((const char *)(wb[b] + p * 32) + GEMV_PREFETCH, GEMV_HINT);
            wv[b] = (__m512bh)_mm512_loadu_si512(wb[b] + p * 32);
        }
        for (int i = 0; i < MB; ++i) {
            const __m512bh xb = bcast_pair(x + (m0 + i) * K + 2 * p);
            for (int b = 0; b < NB; ++b) acc[b][i] = _mm512_dpbf16_ps(acc[b][i], xb, wv[b]);
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int i = 0; i < MB; ++i)
            store16(acc[b][i], bias, y, yf, (m0 + i) * N + (blk0 + b) * 16, (blk0 + b) * 16, N - (blk0 + b) * 16);
}

/* acc[i][b] += rows [m0, m0+MB) of x times NB blocks of pw (pw_stride values apart) over K pairs [p0, p1). */
static inline __attribute__((always_inline)) void fixed_pairs_bf16(__m512 acc[8][4], const uint16_t *x, int64_t K,
                                                                  const uint16_t *pw, int64_t pw_stride, int64_t m0,
                                                                  int64_t p0, int64_t p1, const int MB, const int NB) {
    for (int64_t p = p0; p < p1; ++p) {
        __m512bh wv[4];
        for (int b = 0; b < NB; ++b) {
            _mm_prefetch((const char *)(pw + b * pw_stride + p * 32) + GEMV_PREFETCH, GEMV_HINT);
            wv[b] = (__m512bh)_mm512_loadu_si512(pw + b * pw_stride + p * 32);
        }
        for (int i = 0; i < MB; ++i) {
            const __m512bh xb = bcast_pair(x + (m0 + i) * K + 2 * p);
            for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_dpbf16_ps(acc[i][b], xb, wv[b]);
        }
    }
}

/* The deterministic mode's bf16 tile (w->k_split or w->partial): the chains of gemv_tile_bf16 and gemm_tile_bf16
 * (one accumulator per output, the input pairs in order), input columns [0, k_split) and [k_split, K) in two
 * accumulators added at the end; a partial weight's results unrounded into yf. */
static inline __attribute__((always_inline)) void fixed_tile_bf16(const rg_weight *w, const uint16_t *x,
                                                                 const uint16_t *pw, int64_t pw_stride,
                                                                 const uint16_t *bias, uint16_t *y, float *yf,
                                                                 int64_t n0, int64_t m0, const int MB, const int NB) {
    const int64_t K = w->K, N = w->N, pairs = K / 2, split = w->k_split / 2;
    __m512 acc[8][4], rest[8][4];
    for (int i = 0; i < MB; ++i)
        for (int b = 0; b < NB; ++b) acc[i][b] = rest[i][b] = _mm512_setzero_ps();
    fixed_pairs_bf16(acc, x, K, pw, pw_stride, m0, 0, split ? split : pairs, MB, NB);
    if (split) fixed_pairs_bf16(rest, x, K, pw, pw_stride, m0, split, pairs, MB, NB);
    for (int b = 0; b < NB && n0 + b * 16 < N; ++b)
        for (int i = 0; i < MB; ++i) {
            const __m512 v = split ? _mm512_add_ps(acc[i][b], rest[i][b]) : acc[i][b];
            const int64_t at = (m0 + i) * N + n0 + b * 16, n = N - n0 - b * 16;
            if (w->partial && yf)
                _mm512_mask_storeu_ps(yf + at, n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1), v);
            else
                store16(v, bias, y, yf, at, n0 + b * 16, n);
        }
}

/* Every row of x through NB (1 to 4) blocks of a K-pair weight (consecutive blocks pw_stride values apart, the
 * first at output column n0) on the fixed tiles: the deterministic mode's gemv and GEMM alike (a row's bits do
 * not depend on the tile that computed it). Out of line, so that the default tiles compile as they did. */
static __attribute__((noinline)) void fixed_rows_bf16(const rg_weight *w, const uint16_t *x, int64_t M,
                                                     const uint16_t *pw, int64_t pw_stride, const uint16_t *bias,
                                                     uint16_t *y, float *yf, int64_t n0, int NB) {
#define FIXED(MB, NBC, B) fixed_tile_bf16(w, x, pw + (B) * pw_stride, pw_stride, bias, y, yf, n0 + (B) * 16, m0, MB, NBC)
#define FIXED_ALL(MB)                       \
    switch (NB) {                           \
    case 1: FIXED(MB, 1, 0); break;         \
    case 2: FIXED(MB, 2, 0); break;         \
    case 3: FIXED(MB, 3, 0); break;         \
    default: FIXED(MB, 4, 0); break;        \
    }
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8)
        for (int b = 0; b < NB; ++b) FIXED(8, 1, b);
    for (; m0 + 4 <= M; m0 += 4)
        for (int b = 0; b < NB; b += 2) {
            if (NB - b >= 2)
                FIXED(4, 2, b);
            else
                FIXED(4, 1, b);
        }
    for (; m0 + 2 <= M; m0 += 2) FIXED_ALL(2)
    for (; m0 < M; ++m0) FIXED_ALL(1)
#undef FIXED_ALL
#undef FIXED
}

/* The same for int8 / int4 weights: per group, vdpbf16ps sums of the dequantized slices, then scaled into the
 * result; sx (M x K/group) holds each input row's group sums (int4 only). Prefetches: with `near`, GEMV_PREFETCH
 * bytes ahead in each block's stream; and the first `far` blocks of the tile four blocks on (the caller's next)
 * at the position read here, a tile ahead: each group's scales, then its slices' lines. */
static inline __attribute__((always_inline)) void gemv_tile_q(const rg_weight *w, const uint16_t *x,
                                                             const float *sx, const uint16_t *bias, uint16_t *y,
                                                             float *yf, int64_t blk0, int64_t m0, const int MB,
                                                             const int NB, const int INT4, int near, int far) {
    const int64_t K = w->K, N = w->N, G = w->group, ng = K / G, gb = rg_w_group_bytes(w);
    const uint8_t *wb[4];
    for (int b = 0; b < NB; ++b) wb[b] = (const uint8_t *)w->data + (blk0 + b) * ng * gb;
    const int64_t ahead = 4 * ng * gb; /* the same position four blocks on */
#define Q_PREFETCH(q, b) do { if ((b) < far) _mm_prefetch((const char *)(q) + ahead, GEMV_HINT_FAR); \
                              if (near) _mm_prefetch((const char *)(q) + GEMV_PREFETCH, GEMV_HINT); } while (0)
    __m512 acc[4][4];
    for (int b = 0; b < NB; ++b)
        for (int i = 0; i < MB; ++i) acc[b][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
        /* the group's sums; int4 rows keep their quads' two halves apart (ah), so that each block has two
         * independent vdpbf16ps chains: one chain of two a quad held the stream to half the memory's speed at one
         * row. Every row tile sums them so (not only one row), so that a row's bits do not depend on how many rows
         * share the call (the deterministic mode's int4 matmuls). */
        __m512 ag[4][4], ah[4][4];
        for (int b = 0; b < NB; ++b)
            for (int i = 0; i < MB; ++i) ag[b][i] = ah[b][i] = _mm512_setzero_ps();
        const uint16_t *xg = x + m0 * K + g * G;
        for (int b = 0; b < NB && b < far; ++b) /* the next tile's group scales: a line the slices' lines miss */
            _mm_prefetch((const char *)(wb[b] + g * gb) + ahead, GEMV_HINT_FAR);
        if (INT4) {
            for (int64_t c = 0; c < G / 4; ++c) { /* a quad: pairs 2c and 2c+1 of the group */
                __m512bh lo[4], hi[4];
                for (int b = 0; b < NB; ++b) {
                    const uint8_t *q = wb[b] + g * gb + 64 + c * 32;
                    if (c % 2 == 0) Q_PREFETCH(q, b); /* once a cache line */
                    int4_slices_row(q, &lo[b], &hi[b]);
                }
                for (int i = 0; i < MB; ++i) {
                    const __m512bh x0 = bcast_pair(xg + i * K + 4 * c), x1 = bcast_pair(xg + i * K + 4 * c + 2);
                    for (int b = 0; b < NB; ++b) {
                        ag[b][i] = _mm512_dpbf16_ps(ag[b][i], x0, lo[b]);
                        ah[b][i] = _mm512_dpbf16_ps(ah[b][i], x1, hi[b]);
                    }
                }
            }
            for (int b = 0; b < NB; ++b)
                for (int i = 0; i < MB; ++i) ag[b][i] = _mm512_fmadd_ps(ah[b][i], _mm512_set1_ps(64.f), ag[b][i]);
            for (int b = 0; b < NB; ++b) {
                const uint8_t *gp = wb[b] + g * gb;
                const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp));
                const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp + 32)));
                /* the correction per unit of sum_k x_k: offset - 128 s, or -s (128 + z) with zero points */
                const __m512 c128 = _mm512_set1_ps(128.f);
                const __m512 corr = w->zero_points ? _mm512_mul_ps(s, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_add_ps(o, c128)))
                                                   : _mm512_fnmadd_ps(s, c128, o);
                for (int i = 0; i < MB; ++i)
                    acc[b][i] = _mm512_fmadd_ps(corr, _mm512_set1_ps(sx[(m0 + i) * ng + g]),
                                                _mm512_fmadd_ps(s, ag[b][i], acc[b][i]));
            }
        } else {
            for (int64_t pl = 0; pl < G / 2; ++pl) {
                __m512bh wv[4];
                for (int b = 0; b < NB; ++b) {
                    const uint8_t *q = wb[b] + g * gb + 64 + pl * 32;
                    if (pl % 2 == 0) Q_PREFETCH(q, b);
                    wv[b] = int8_slice(q);
                }
                for (int i = 0; i < MB; ++i) {
                    const __m512bh xb = bcast_pair(xg + i * K + 2 * pl);
                    for (int b = 0; b < NB; ++b) ag[b][i] = _mm512_dpbf16_ps(ag[b][i], xb, wv[b]);
                }
            }
            for (int b = 0; b < NB; ++b) {
                const __m512 s = _mm512_loadu_ps((const float *)(wb[b] + g * gb));
                for (int i = 0; i < MB; ++i) acc[b][i] = _mm512_fmadd_ps(s, ag[b][i], acc[b][i]);
            }
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int i = 0; i < MB; ++i)
            store16(acc[b][i], bias, y, yf, (m0 + i) * N + (blk0 + b) * 16, (blk0 + b) * 16, N - (blk0 + b) * 16);
#undef Q_PREFETCH
}

/* sx (M x K/G) = each row's sums over groups of G input columns (G a multiple of 16). */
static void group_sums_bf16(const uint16_t *x, int64_t M, int64_t K, int64_t G, float *sx) {
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < K / G; ++g) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) acc = _mm512_add_ps(acc, load16_bf16(x + m * K + k));
            sx[m * (K / G) + g] = _mm512_reduce_add_ps(acc);
        }
}

/* Rows of x through NB (1 to 4) consecutive blocks from blk0: eight (bf16) or four input rows at a time, then
 * two, then one. Quantized weights: near and far as gemv_tile_q takes them for the whole tile. */
static inline __attribute__((always_inline)) void gemv_blocks(const rg_weight *w, const uint16_t *x, int64_t M,
                                                             const float *sx, const uint16_t *bias, uint16_t *y,
                                                             float *yf, int64_t blk0, const int NB, int near,
                                                             int far) {
    const int H = NB < 2 ? NB : 2; /* the wide row tiles take two blocks at a time */
    int64_t m0 = 0;
    if (w->kind == RG_W_BF16 && (w->k_split || w->partial)) {
        fixed_rows_bf16(w, x, M, (const uint16_t *)w->data + blk0 * w->K * 16, w->K * 16, bias, y, yf, blk0 * 16, NB);
        return;
    }
    if (w->kind == RG_W_BF16) {
        for (; m0 + 8 <= M; m0 += 8) {
            gemv_tile_bf16(w, x, bias, y, yf, blk0, m0, 8, H);
            if (NB > 2) gemv_tile_bf16(w, x, bias, y, yf, blk0 + 2, m0, 8, NB - 2);
        }
        for (; m0 + 4 <= M; m0 += 4) gemv_tile_bf16(w, x, bias, y, yf, blk0, m0, 4, NB);
        for (; m0 + 2 <= M; m0 += 2) gemv_tile_bf16(w, x, bias, y, yf, blk0, m0, 2, NB);
        for (; m0 < M; ++m0) gemv_tile_bf16(w, x, bias, y, yf, blk0, m0, 1, NB);
        return;
    }
    const int INT4 = w->kind == RG_W_INT4;
#define Q_TILE(MB, B0, NBB, FAR) (INT4 ? gemv_tile_q(w, x, sx, bias, y, yf, B0, m0, MB, NBB, 1, near, FAR) \
                                   : gemv_tile_q(w, x, sx, bias, y, yf, B0, m0, MB, NBB, 0, near, FAR))
    for (; m0 + 4 <= M; m0 += 4) {
        Q_TILE(4, blk0, H, far);
        if (NB > 2) Q_TILE(4, blk0 + 2, NB - 2, far - 2);
    }
    for (; m0 + 2 <= M; m0 += 2) Q_TILE(2, blk0, NB, far);
    for (; m0 < M; ++m0) Q_TILE(1, blk0, NB, far);
#undef Q_TILE
}

/* y (M, N) = x (M, K) @ w^T (+ bias) for the calling team, bf16 in and out (or yf: float32 of the bf16-rounded
 * results), streaming the weights: each thread takes an equal run of consecutive 16-row blocks (a static split
 * of four-block tiles left a thread one tile more on the narrow matrices: a quarter more time on 576 outputs),
 * four blocks at a time. The streams of a tile are short (5.8 KB a block for int4 at K = 576), so prefetching a
 * fixed distance ahead left every tile's first bytes to wait on memory: bf16 tiles start the next tile's streams
 * before each tile; int4 / int8 ones prefetch the whole next tile while reading this one (the first tile of a
 * run also GEMV_PREFETCH ahead), about 7% faster than the former on int4. The team meets at the end. sx: the
 * calling thread's own scratch of M K / group floats for int4 weights, where each thread puts the group sums of
 * x it reads. */
static void linear_team_bf16(const rg_weight *w, const uint16_t *x, int64_t M, const uint16_t *bias, uint16_t *y,
                             float *yf, float *sx) {
    const int64_t blocks = (w->N + 15) / 16, team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t lo = blocks * me / team, hi = blocks * (me + 1) / team, block_bytes = rg_w_block_bytes(w);
    const int64_t head = block_bytes < GEMV_PREFETCH ? block_bytes : GEMV_PREFETCH;
    if (w->kind == RG_W_INT4) group_sums_bf16(x, M, w->K, w->group, sx);
    for (int64_t b = lo; b < hi; b += 4) {
        const int64_t rest = hi - b - 4; /* blocks after this tile */
        const int near = b == lo, far = (int)(rest < 0 ? 0 : rest < 4 ? rest : 4);
        if (w->kind == RG_W_BF16) {
            const char *next = (const char *)w->data + (b + 4) * block_bytes;
            for (int64_t j = 0; j < far; ++j)
                for (int64_t off = 0; off < head; off += 64) _mm_prefetch(next + j * block_bytes + off, GEMV_HINT);
        }
        switch (hi - b) {
        case 1: gemv_blocks(w, x, M, sx, bias, y, yf, b, 1, near, far); break;
        case 2: gemv_blocks(w, x, M, sx, bias, y, yf, b, 2, near, far); break;
        case 3: gemv_blocks(w, x, M, sx, bias, y, yf, b, 3, near, far); break;
        default: gemv_blocks(w, x, M, sx, bias, y, yf, b, 4, near, far); break;
        }
    }
    PROF_LAP(prof_phase);
#pragma omp barrier
    PROF_LAP(prof_phase + 1);
}
#endif /* AVX512-BF16 */
#endif
