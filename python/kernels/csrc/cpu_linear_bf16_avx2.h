/* bf16 K-pair weights (RG_W_BF16) with float32 math, for builds without AVX512-BF16 that have AVX2 and FMA (the
 * x86-64-v3 and skylake-avx512 builds): the weights stay bf16 in memory (half float32's bytes) and each one is
 * widened in registers, which for bf16 is a 16-bit shift: a 32-byte load of one K-pair slice is 8 rows x 2 columns,
 * one 32-bit word per row (low half column 2p, high half column 2p+1), so `word << 16` gives the 8 rows' column
 * 2p as float32 and `word & 0xFFFF0000` their column 2p+1, with no shuffle. Included by cpu_linear.h.
 *
 * Two kernels, one order of operations. Every output (row m, column n) is one float32 FMA chain from zero over
 * the input columns in order, acc = fma(w[n][k], x[m][k], acc) for k = 0 .. K-1, then + bias, then one rounding
 * (to bf16 where the output is bf16). Neither the kernel chosen (by M), nor the tile a row lands in, nor the
 * thread count changes that chain, so a row's bits do not depend on the other rows of the call: batch invariant.
 *   - up to BF16F_GEMV_MAX_M rows (decode): the weights stream once, each thread an equal run of consecutive
 *     16-row blocks, up to four blocks at a time (one sequential stream each), widened in registers.
 *   - more rows (prefill): a blocked GEMM; each thread widens one panel of its blocks at a time into a float32
 *     buffer of its own ([block][pair][column 2p: 16 rows, column 2p+1: 16 rows], sized to stay in L2), then runs
 *     a 6-row x 16-column register tile over every input row against it: the widening is paid once per panel,
 *     not once per row. */
#ifndef RG_CPU_LINEAR_BF16_AVX2_H
#define RG_CPU_LINEAR_BF16_AVX2_H
#include "cpu_linear_layout.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "cpu_task_pool.h" /* the threads the matmuls below run on */
#define RG_AVX2_BF16 1
#define BF16F_GEMV_MAX_M 4         /* rows up to which the weights stream (more: the GEMM) */
#define BF16F_PREFETCH 2048        /* bytes ahead in each stream, into L2 (as linear_avx2 does) */
#define BF16F_PANEL_BYTES (256 << 10) /* a GEMM panel's float32 bytes, at most (at least one block): half an L2 */
#define BF16F_MR 6                 /* input rows of the GEMM's register tile: 12 accumulators, 2 weights, 1 input */

/* One K-pair slice's 8 rows (32 bytes at p): their column 2p (*e) and column 2p+1 (*o) as float32. */
static inline void bf16f_slice(const uint16_t *p, __m256 *e, __m256 *o) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* 16 results of one row (a block's outputs n0 .. n0+15: a0 rows 0-7, a1 rows 8-15) through put_result. By value:
 * an accumulator array whose address is taken stays in memory, stored on every step of the GEMM's loop. */
static inline void bf16f_store(__m256 a0, __m256 a1, const float *biasf, int64_t N, int64_t m, int64_t n0,
                               uint16_t *yb, float *yf, int round_bf16) {
    float t[16];
    _mm256_storeu_ps(t, a0);
    _mm256_storeu_ps(t + 8, a1);
    const int64_t nn = N - n0 < 16 ? N - n0 : 16;
    for (int64_t j = 0; j < nn; ++j) put_result(t[j], biasf, n0 + j, yb, yf, m * N + n0 + j, round_bf16);
}

/* Input rows [m0, m0+MB) against NB consecutive blocks from blk0, streaming the blocks' bf16 slices. */
static inline __attribute__((always_inline)) void bf16f_gemv_tile(const rg_weight *w, const float *x,
                                                                 const float *biasf, uint16_t *yb, float *yf,
                                                                 int round_bf16, int64_t blk0, int64_t m0,
                                                                 const int MB, const int NB) {
    const int64_t K = w->K, pairs = K / 2;
    const uint16_t *wb[4];
    for (int b = 0; b < NB; ++b) wb[b] = (const uint16_t *)w->data + (blk0 + b) * pairs * 32;
    __m256 acc[2][4][2];
    for (int i = 0; i < MB; ++i)
        for (int b = 0; b < NB; ++b) acc[i][b][0] = acc[i][b][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        for (int b = 0; b < NB; ++b) {
            const uint16_t *s = wb[b] + p * 32; /* one 64-byte line: the slice of 16 rows */
            _mm_prefetch((const char *)s + BF16F_PREFETCH, _MM_HINT_T1);
            __m256 e0, o0, e1, o1;
            bf16f_slice(s, &e0, &o0);
            bf16f_slice(s + 16, &e1, &o1);
            for (int i = 0; i < MB; ++i) { /* column 2p before column 2p+1: the chain's order */
                const __m256 xe = _mm256_broadcast_ss(x + (m0 + i) * K + 2 * p);
                const __m256 xo = _mm256_broadcast_ss(x + (m0 + i) * K + 2 * p + 1);
                acc[i][b][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, acc[i][b][0]));
                acc[i][b][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, acc[i][b][1]));
            }
        }
    }
    for (int i = 0; i < MB; ++i)
        for (int b = 0; b < NB; ++b)
            bf16f_store(acc[i][b][0], acc[i][b][1], biasf, w->N, m0 + i, (blk0 + b) * 16, yb, yf, round_bf16);
}

/* Every row (M <= BF16F_GEMV_MAX_M) against blocks [b, b+nb), nb <= 4: one row with all nb blocks (8
 * accumulators), pairs of rows with two blocks at a time. */
static void bf16f_gemv_blocks(const rg_weight *w, const float *x, int64_t M, const float *biasf, uint16_t *yb,
                              float *yf, int round_bf16, int64_t b, int64_t nb) {
    int64_t m0 = 0;
    for (; m0 + 2 <= M; m0 += 2)
        for (int64_t c = 0; c < nb; c += 2) {
            if (nb - c >= 2)
                bf16f_gemv_tile(w, x, biasf, yb, yf, round_bf16, b + c, m0, 2, 2);
            else
                bf16f_gemv_tile(w, x, biasf, yb, yf, round_bf16, b + c, m0, 2, 1);
        }
    for (; m0 < M; ++m0) switch (nb) {
        case 1: bf16f_gemv_tile(w, x, biasf, yb, yf, round_bf16, b, m0, 1, 1); break;
        case 2: bf16f_gemv_tile(w, x, biasf, yb, yf, round_bf16, b, m0, 1, 2); break;
        case 3: bf16f_gemv_tile(w, x, biasf, yb, yf, round_bf16, b, m0, 1, 3); break;
        default: bf16f_gemv_tile(w, x, biasf, yb, yf, round_bf16, b, m0, 1, 4); break;
        }
}

/* Blocks [blk0, blk0+nb) widened into the float32 panel pf: per block and pair, column 2p's 16 rows then column
 * 2p+1's (nb K 16 floats). */
static void bf16f_widen_panel(const rg_weight *w, int64_t blk0, int64_t nb, float *pf) {
    const int64_t pairs = w->K / 2;
    const uint16_t *src = (const uint16_t *)w->data + blk0 * pairs * 32;
    for (int64_t s = 0; s < nb * pairs; ++s) {
        __m256 e0, o0, e1, o1;
        bf16f_slice(src + s * 32, &e0, &o0);
        bf16f_slice(src + s * 32 + 16, &e1, &o1);
        _mm256_storeu_ps(pf + s * 32, e0);
        _mm256_storeu_ps(pf + s * 32 + 8, e1);
        _mm256_storeu_ps(pf + s * 32 + 16, o0);
        _mm256_storeu_ps(pf + s * 32 + 24, o1);
    }
}

/* Input rows [m0, m0+MR) against one widened block pb (its outputs from n0): the tail rows' tile (MR < 6). */
static inline __attribute__((always_inline)) void bf16f_gemm_tile(const float *x, int64_t K, const float *pb,
                                                                 const float *biasf, int64_t N, int64_t m0,
                                                                 int64_t n0, uint16_t *yb, float *yf,
                                                                 int round_bf16, const int MR) {
    __m256 acc[BF16F_MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const float *xr = x + m0 * K;
    for (int64_t p = 0; p < K / 2; ++p) {
        const float *s = pb + p * 32;
        const __m256 e0 = _mm256_loadu_ps(s), e1 = _mm256_loadu_ps(s + 8);
        for (int i = 0; i < MR; ++i) {
            const __m256 xe = _mm256_broadcast_ss(xr + i * K + 2 * p);
            acc[i][0] = _mm256_fmadd_ps(e0, xe, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(e1, xe, acc[i][1]);
        }
        const __m256 o0 = _mm256_loadu_ps(s + 16), o1 = _mm256_loadu_ps(s + 24);
        for (int i = 0; i < MR; ++i) {
            const __m256 xo = _mm256_broadcast_ss(xr + i * K + 2 * p + 1);
            acc[i][0] = _mm256_fmadd_ps(o0, xo, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(o1, xo, acc[i][1]);
        }
    }
    for (int i = 0; i < MR; ++i) bf16f_store(acc[i][0], acc[i][1], biasf, N, m0 + i, n0, yb, yf, round_bf16);
}

/* The same for six rows, its twelve accumulators named one by one: GCC keeps an array of them in memory (stored
 * on every step), and this tile is where a prefill spends its time. The operations are the tail tile's. */
static void bf16f_gemm_tile6(const float *x, int64_t K, const float *pb, const float *biasf, int64_t N, int64_t m0,
                             int64_t n0, uint16_t *yb, float *yf, int round_bf16) {
#define ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5)
#define ZERO(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = _mm256_setzero_ps();
#define FMA(i, c, v0, v1)                                                     \
    {                                                                         \
        const __m256 xb = _mm256_broadcast_ss(xr + (i) * K + 2 * p + (c));     \
        a##i##0 = _mm256_fmadd_ps(v0, xb, a##i##0);                           \
        a##i##1 = _mm256_fmadd_ps(v1, xb, a##i##1);                           \
    }
#define EVEN(i) FMA(i, 0, e0, e1)
#define ODD(i) FMA(i, 1, o0, o1)
#define STORE(i) bf16f_store(a##i##0, a##i##1, biasf, N, m0 + (i), n0, yb, yf, round_bf16);
    ROWS(ZERO)
    const float *xr = x + m0 * K;
    for (int64_t p = 0; p < K / 2; ++p) {
        const float *s = pb + p * 32;
        const __m256 e0 = _mm256_loadu_ps(s), e1 = _mm256_loadu_ps(s + 8);
        ROWS(EVEN)
        const __m256 o0 = _mm256_loadu_ps(s + 16), o1 = _mm256_loadu_ps(s + 24);
        ROWS(ODD)
    }
    ROWS(STORE)
#undef STORE
#undef ODD
#undef EVEN
#undef FMA
#undef ZERO
#undef ROWS
}

/* Every row against the nb widened blocks of panel pf (the first at block blk0): six rows at a time through each
 * block (the six rows' inputs stay in L1 while the panel streams from L2), then the rest in one shorter tile. */
static void bf16f_gemm_panel(const rg_weight *w, const float *x, int64_t M, const float *pf, int64_t blk0,
                             int64_t nb, const float *biasf, uint16_t *yb, float *yf, int round_bf16) {
    const int64_t K = w->K, N = w->N;
    for (int64_t m0 = 0; m0 < M; m0 += BF16F_MR)
        for (int64_t b = 0; b < nb; ++b) {
            const float *pb = pf + b * K * 16;
            const int64_t n0 = (blk0 + b) * 16;
            switch (M - m0 < BF16F_MR ? M - m0 : BF16F_MR) {
            case 1: bf16f_gemm_tile(x, K, pb, biasf, N, m0, n0, yb, yf, round_bf16, 1); break;
            case 2: bf16f_gemm_tile(x, K, pb, biasf, N, m0, n0, yb, yf, round_bf16, 2); break;
            case 3: bf16f_gemm_tile(x, K, pb, biasf, N, m0, n0, yb, yf, round_bf16, 3); break;
            case 4: bf16f_gemm_tile(x, K, pb, biasf, N, m0, n0, yb, yf, round_bf16, 4); break;
            case 5: bf16f_gemm_tile(x, K, pb, biasf, N, m0, n0, yb, yf, round_bf16, 5); break;
            default: bf16f_gemm_tile6(x, K, pb, biasf, N, m0, n0, yb, yf, round_bf16); break;
            }
        }
}

typedef struct {
    const rg_weight *w;
    const float *x, *biasf;
    int64_t M;
    uint16_t *yb;
    float *yf;
    int round_bf16, gemm;
    _Atomic int failed;
} bf16f_job;

/* Blocks [lo, hi) of one job: a panel widened into the thread's scratch and run against every row (GEMM), or
 * streamed four blocks at a time (gemv). */
static void bf16f_job_blocks(void *arg, int64_t lo, int64_t hi) {
    bf16f_job *j = (bf16f_job *)arg;
    if (j->gemm) {
        float *pf = tp_scratch((size_t)((hi - lo) * j->w->K * 16));
        if (!pf) {
            atomic_store(&j->failed, 1);
            return;
        }
        bf16f_widen_panel(j->w, lo, hi - lo, pf);
        bf16f_gemm_panel(j->w, j->x, j->M, pf, lo, hi - lo, j->biasf, j->yb, j->yf, j->round_bf16);
        return;
    }
    for (int64_t b = lo; b < hi; b += 4)
        bf16f_gemv_blocks(j->w, j->x, j->M, j->biasf, j->yb, j->yf, j->round_bf16, b, hi - b < 4 ? hi - b : 4);
}

/* y (M, N) = x (M, K) @ w^T (+ bias) for bf16 K-pair weights, float32 inputs, on the task pool (cpu_task_pool.h):
 * the threads claim a panel of blocks at a time (GEMM) or runs of blocks of about 64 KB (gemv), so a thread the
 * OS has not scheduled holds nothing up, and no OpenMP region is forked per matmul. Every output is computed by
 * one thread in one order whoever claims its block: outputs as linear_portable gives them. */
static rg_status linear_bf16_avx2(const rg_weight *w, const float *x, int64_t M, const float *biasf, uint16_t *yb,
                                  float *yf, int round_bf16) {
    const int64_t K = w->K, blocks = (w->N + 15) / 16;
    bf16f_job job = {.w = w, .x = x, .biasf = biasf, .M = M, .yb = yb, .yf = yf, .round_bf16 = round_bf16,
                     .gemm = M > BF16F_GEMV_MAX_M};
    int64_t chunk = job.gemm ? BF16F_PANEL_BYTES / (K * 64) /* a panel: 64 bytes of float32 per block and column */
                             : ((65536 / (K * 32)) & ~(int64_t)3); /* 64 KB of bf16 blocks, a multiple of four */
    chunk = chunk < (job.gemm ? 1 : 4) ? (job.gemm ? 1 : 4) : chunk;
    tp_parallel(bf16f_job_blocks, &job, blocks, chunk, omp_get_max_threads());
    return atomic_load(&job.failed) ? RG_ERR_ALLOC : RG_OK;
}
#endif /* AVX2 and FMA */
#endif
