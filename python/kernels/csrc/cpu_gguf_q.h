/* GGUF 32-value block weights (Q4_0, Q4_1, Q8_0) multiplied from the file's own blocks, as stored: the tiles the
 * driver of cpu_gguf_k.h (rg_gguf_k_linear) runs for these kinds, and their rows in plain C. Included once by
 * cpu_gguf_k.h, after its input quantization (int8 per 32 values: scale dx, and dx times the int8 sum) and gk_hsum.
 *
 * Layout: row n is K / 32 blocks back to back, exactly the file's bytes (each weight byte read once per call):
 *   Q4_0 (18 bytes): d (fp16), qs[16]: value j in the low nibble of qs[j], value j + 16 in its high nibble;
 *                    w = d (q - 8)
 *   Q4_1 (20 bytes): d, m (fp16), the same nibbles; w = d q + m
 *   Q8_0 (34 bytes): d (fp16), 32 int8 q; w = d q
 * Per block and input row the integer sum of q x_q is exact (u8 x s8 pairs: at most 2 * 15 * 127 for the nibbles;
 * Q8_0 as |q| times x_q carrying q's sign, at most 2 * 128 * 127), by vpdpbusd on AVX-512 VNNI builds and by
 * maddubs + madd on AVX2 ones (the same int32 sums), then to float32 times d dx in two FMA chains per row (even
 * and odd blocks, added at the end):
 *   Q4_0: y = sum_b d_b (dx_b isum_b - 8 xs_b)      Q4_1: y = sum_b (d_b dx_b isum_b + m_b xs_b)
 * Each input row's chain is the same instructions whatever rows share its tile, so a row's bits do not depend on
 * the batch or the thread count (the driver gives each output to one thread). From GQ_GEMM_MIN_M rows on AVX2
 * builds (prefill) the rows go through a panel GEMM instead (gq_gemm, at the end): float32 inputs against the
 * blocks' exact values, batch invariant within that regime too. */

enum { RG_GK_Q4_0 = 3, RG_GK_Q4_1 = 4, RG_GK_Q8_0 = 5 };

static inline int gq_is32(int64_t kind) { return kind >= RG_GK_Q4_0 && kind <= RG_GK_Q8_0; }
static inline int64_t gq_block_bytes(int64_t kind) { return kind == RG_GK_Q8_0 ? 34 : kind == RG_GK_Q4_1 ? 20 : 18; }

/* Block b of row wr dequantized to float32 (32 values). */
static void gq_block_row(const uint8_t *blk, int64_t kind, float *out) {
    const float d = gk_f16(blk);
    if (kind == RG_GK_Q8_0) {
        for (int e = 0; e < 32; ++e) out[e] = d * (float)(int8_t)blk[2 + e];
        return;
    }
    const uint8_t *qs = blk + (kind == RG_GK_Q4_1 ? 4 : 2);
    for (int e = 0; e < 32; ++e) {
        const int q = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
        out[e] = kind == RG_GK_Q4_1 ? d * (float)q + gk_f16(blk + 2) : d * (float)(q - 8);
    }
}

/* Portable tile: input rows i < MB against weight row wr (nb blocks of 32), the same sums in plain C. */
static void gq_tile_portable(const uint8_t *wr, int64_t nb, int64_t kind, const int8_t *xq, const float *xd,
                             const float *xs, int64_t K, int MB, float *out) {
    const int64_t bb = gq_block_bytes(kind);
    for (int i = 0; i < MB; ++i) {
        const int8_t *xr = xq + i * K;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = wr + b * bb;
            int32_t isum = 0;
            if (kind == RG_GK_Q8_0) {
                for (int e = 0; e < 32; ++e) isum += (int8_t)blk[2 + e] * xr[32 * b + e];
            } else {
                const uint8_t *qs = blk + (kind == RG_GK_Q4_1 ? 4 : 2);
                for (int e = 0; e < 16; ++e) isum += (qs[e] & 15) * xr[32 * b + e] + (qs[e] >> 4) * xr[32 * b + 16 + e];
            }
            const float d = gk_f16(blk), dx = xd[i * (K / 32) + b], s = xs[i * (K / 32) + b];
            if (kind == RG_GK_Q4_0)
                acc += d * (dx * (float)isum - 8.f * s);
            else if (kind == RG_GK_Q4_1)
                acc += d * dx * (float)isum + gk_f16(blk + 2) * s;
            else
                acc += d * dx * (float)isum;
        }
        out[i] = acc;
    }
}

#ifdef RG_GK_AVX2
static inline float gq_f16(const uint8_t *p) { /* F16C: the same value as f16_to_f32, one instruction */
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RG_GQ_VNNI 1
/* the 8 int32 sums of u (unsigned bytes) times s (signed bytes), four products each */
static inline __m256i gq_dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#else
static inline __m256i gq_dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

/* Input rows i < MB against weight row wr: per block the codes unpacked once (32 bytes), then per row one dot
 * product, to float32 times d dx (Q4_0's -8 and Q4_1's min as a scalar term per block, in the same order). */
static inline __attribute__((always_inline)) void gq_tile_avx2(const uint8_t *wr, int64_t nb, const int64_t kind,
                                                              const int8_t *xq, const float *xd, const float *xs,
                                                              int64_t K, const int MB, float *out) {
    const int64_t bb = gq_block_bytes(kind), ng = K / 32;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m256 acc[4][2]; /* even and odd blocks apart: two FMA chains, not one latency-bound one */
    float accs[4][2];
    for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps(), accs[i][0] = accs[i][1] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const int h = (int)(b & 1);
        const uint8_t *blk = wr + b * bb;
        _mm_prefetch((const char *)blk + 8 * bb, _MM_HINT_T0); /* the row's stream, a few blocks ahead */
        const float d = gq_f16(blk);
        __m256i u;
        __m256i sgn = _mm256_setzero_si256();
        if (kind == RG_GK_Q8_0) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
            u = _mm256_sign_epi8(q, q); /* |q| (128 for -128: as an unsigned byte, right) */
            sgn = q;
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + (kind == RG_GK_Q4_1 ? 4 : 2)));
            u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        }
        const float m = kind == RG_GK_Q4_1 ? gq_f16(blk + 2) : kind == RG_GK_Q4_0 ? -8.f * d : 0.f;
        for (int i = 0; i < MB; ++i) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + 32 * b));
            if (kind == RG_GK_Q8_0) xv = _mm256_sign_epi8(xv, sgn);
            const __m256 p = _mm256_cvtepi32_ps(gq_dot(u, xv));
            acc[i][h] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * xd[i * ng + b]), acc[i][h]);
            if (kind != RG_GK_Q8_0) accs[i][h] = fmaf(m, xs[i * ng + b], accs[i][h]);
        }
    }
    for (int i = 0; i < MB; ++i) out[i] = gk_hsum(_mm256_add_ps(acc[i][0], acc[i][1])) + (accs[i][0] + accs[i][1]);
}
#endif

/* Input rows i < MB (1..4) against weight row wr of a 32-value block kind. */
static void gq_tile(const uint8_t *wr, int64_t nb, int64_t kind, const int8_t *xq, const float *xd, const float *xs,
                    int64_t K, int MB, float *out) {
#ifdef RG_GK_AVX2
#define GQ_CASE(mb)                                                                       \
    case mb:                                                                              \
        if (kind == RG_GK_Q8_0)                                                           \
            gq_tile_avx2(wr, nb, RG_GK_Q8_0, xq, xd, xs, K, mb, out);                     \
        else if (kind == RG_GK_Q4_1)                                                      \
            gq_tile_avx2(wr, nb, RG_GK_Q4_1, xq, xd, xs, K, mb, out);                     \
        else                                                                              \
            gq_tile_avx2(wr, nb, RG_GK_Q4_0, xq, xd, xs, K, mb, out);                     \
        return;
    switch (MB) {
        GQ_CASE(1)
        GQ_CASE(2)
        GQ_CASE(3)
        GQ_CASE(4)
    }
#undef GQ_CASE
#endif
    gq_tile_portable(wr, nb, kind, xq, xd, xs, K, MB, out);
}

#ifdef RG_AVX2_BF16
#define RG_GQ_GEMM 1
#define GQ_GEMM_MIN_M 9 /* rows from which a 32-value block kind runs the panel GEMM (fewer: the tiles above) */

/* Prefill (M >= GQ_GEMM_MIN_M rows): the threads claim a panel of 16-row output blocks at a time (the task pool,
 * cpu_task_pool.h), each dequantizes their rows to float32 (the blocks' exact values) into the panel layout of
 * cpu_linear_bf16_avx2.h ([block][pair p][column 2p: 16 rows, column 2p+1: 16 rows]), then runs that file's 6 x 16
 * FMA tiles over every input row (float32 inputs, not int8): the dequantization is paid once per panel, not once
 * per row. Every output is one FMA chain over k in order, so within this regime too a row's bits do not depend on
 * the other rows or the thread count (they differ from the tiles' int8-input sums: two regimes, by M). */
typedef struct {
    const uint8_t *w;
    int64_t kind, N, K, M;
    const float *x;
    float *y;
    _Atomic int failed;
} gq_gemm_job;

/* 16-row blocks [lo, hi) (one panel): dequantized into the thread's scratch, then every input row against them. */
static void gq_gemm_blocks(void *arg, int64_t lo, int64_t hi) {
    gq_gemm_job *j = (gq_gemm_job *)arg;
    const int64_t K = j->K, N = j->N, nb = hi - lo, bb = gq_block_bytes(j->kind), rb = K / 32 * bb;
    float *pf = tp_scratch((size_t)(nb * K * 16 + K));
    if (!pf) {
        atomic_store(&j->failed, 1);
        return;
    }
    float *row = pf + nb * K * 16;
    for (int64_t jj = 0; jj < nb * 16; ++jj) {
        const int64_t n = lo * 16 + jj;
        if (n < N)
            for (int64_t c = 0; c < K / 32; ++c) gq_block_row(j->w + n * rb + c * bb, j->kind, row + 32 * c);
        float *dst = pf + (jj / 16) * K * 16 + jj % 16;
        for (int64_t k = 0; k < K; ++k) dst[(k >> 1) * 32 + (k & 1) * 16] = n < N ? row[k] : 0.f;
    }
    const rg_weight shape = {.N = N, .K = K}; /* what the GEMM tiles read of a weight */
    bf16f_gemm_panel(&shape, j->x, j->M, pf, lo, nb, NULL, NULL, j->y, 0);
}

static rg_status gq_gemm(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t M, float *y) {
    int64_t panel = BF16F_PANEL_BYTES / (K * 64);
    panel = panel < 1 ? 1 : panel;
    gq_gemm_job job = {.w = w, .kind = kind, .N = N, .K = K, .M = M, .x = x, .y = y};
    tp_parallel(gq_gemm_blocks, &job, (N + 15) / 16, panel, omp_get_max_threads()); /* a panel a chunk */
    return atomic_load(&job.failed) ? RG_ERR_ALLOC : RG_OK;
}
#endif

#include "cpu_task_pool.h"
#define GQ_POOL_MAX_M 8          /* rows up to which a 32-value block kind runs gq_linear (decode steps) */
#define GQ_POOL_CHUNK_BYTES 16384 /* weight bytes per claimed chunk: a few microseconds of work */

typedef struct {
    const uint8_t *w;
    int64_t kind, N, K, M, rb;
    const int8_t *xq;
    const float *xd, *xs;
    float *y;
    uint16_t *y16; /* instead of y where set: the outputs rounded to bf16 (nearest even, as torch rounds) */
} gq_job;

/* Output columns [lo, hi) of every row: per weight row the tiles of up to 4 input rows, as in the driver. */
static void gq_job_rows(void *arg, int64_t lo, int64_t hi) {
    const gq_job *j = (const gq_job *)arg;
    const int64_t ng = j->K / 32;
    for (int64_t n = lo; n < hi; ++n)
        for (int64_t i = 0; i < j->M; i += 4) {
            const int mb = j->M - i < 4 ? (int)(j->M - i) : 4;
            float r[4];
            gq_tile(j->w + n * j->rb, ng, j->kind, j->xq + i * j->K, j->xd + i * ng, j->xs + i * ng, j->K, mb, r);
            for (int t = 0; t < mb; ++t)
                if (j->y16)
                    j->y16[(i + t) * j->N + n] = f32_to_bf16(r[t]);
                else
                    j->y[(i + t) * j->N + n] = r[t];
        }
}

/* A few input rows (M <= GQ_POOL_MAX_M: decode) against a 32-value block kind, on the task pool (cpu_task_pool.h)
 * rather than an OpenMP region: chunks of whole 16-output runs (no cache line of y written by two threads),
 * claimed by whichever thread is free. The inputs are quantized by the caller first (M rows: microseconds). Each
 * output is the tile's chain exactly as in rg_gguf_k_linear, so the bits are the same as there. */
static rg_status gq_linear(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x,
                           const uint16_t *x16, int64_t M, float *y, uint16_t *y16) {
    const int64_t ng = K / 32;
    enum { CAP = 65536 }; /* input values quantized on the stack (a decode step's rows); more: malloc */
    int8_t xq[CAP];
    float xd[CAP / 16];
    int16_t s16[CAP / 16];
    const int fits = M * K <= CAP;
    int8_t *q = fits ? xq : (int8_t *)malloc((size_t)(M * K));
    float *d = fits ? xd : (float *)malloc(sizeof(float) * (size_t)(2 * M * ng));
    int16_t *s = fits ? s16 : (int16_t *)malloc(sizeof(int16_t) * (size_t)(2 * M * ng));
    rg_status st = RG_OK;
    if (!q || !d || !s) {
        st = RG_ERR_ALLOC;
    } else {
        for (int64_t m = 0; m < M; ++m) {
            float row[4096]; /* a bf16 input row widened (K <= 4096; larger: rejected by the caller) */
            if (x16)
                for (int64_t k = 0; k < K; ++k) row[k] = bf16_to_f32(x16[m * K + k]);
            gk_quantize_row(x16 ? row : x + m * K, K, q + m * K, d + m * ng, d + M * ng + m * ng, s + m * 2 * ng);
        }
        gq_job job = {.w = w, .kind = kind, .N = N, .K = K, .M = M, .rb = ng * gq_block_bytes(kind), .xq = q,
                      .xd = d, .xs = d + M * ng, .y = y, .y16 = y16};
        int64_t rows = (GQ_POOL_CHUNK_BYTES / (job.rb * M)) & ~(int64_t)15;
        rows = rows < 16 ? 16 : rows;
        tp_parallel(gq_job_rows, &job, N, rows, omp_get_max_threads());
    }
    if (q != xq) free(q);
    if (d != xd) free(d);
    if (s != s16) free(s);
    return st;
}

/* y (M, N) bf16 = x (M, K) bf16 @ w^T for a Q4_0 / Q4_1 / Q8_0 weight (kind 3..5, the file's blocks) and a decode
 * step's rows (M <= GQ_POOL_MAX_M, K <= 4096): the bf16 activations widened and the outputs rounded here, so that
 * a bf16 model's matmul is one call, not three (torch's conversions to float32 and back cost more than a small
 * matmul on one core). The same bits as rg_gguf_k_linear on the widened rows, then rounded as torch rounds.
 * RG_ERR_UNSUPPORTED for other kinds or shapes (the caller takes the float32 entry). */
static int gk_valid(const uint8_t *w, int64_t kind, int64_t N, int64_t K); /* cpu_gguf_k.h */

rg_status rg_gguf_q_linear_bf16(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const uint16_t *x, int64_t M,
                                uint16_t *y) {
    if (!gk_valid(w, kind, N, K) || !gq_is32(kind) || M < 0 || M > GQ_POOL_MAX_M || K > 4096 ||
        (M && (!x || !y)))
        return RG_ERR_UNSUPPORTED;
    return M ? gq_linear(w, kind, N, K, NULL, x, M, NULL, y) : RG_OK;
}
