/* Linear layers on the CPU: every weight in the one layout its matmul reads, named by a descriptor (rg_weight),
 * and the matmuls over those layouts, for bfloat16 weights and for int8 / int4 quantized ones. Included once by
 * cpu_kernels.c, after its helpers (bf16 conversions, load16_bf16) and before the fused decode step, whose four
 * matmuls per layer, LM head and embedding gather go through these descriptors. radixgen.kernels.cpu_linear
 * packs the layouts (in torch) and builds the descriptors.
 *
 * Layouts. All but ROWS keep blocks of 16 output rows, one sequential stream per block; rows past N are zero.
 *   RG_W_ROWS_BF16  (N, K) row-major bf16: an embedding table, read by rows only (no matmul).
 *   RG_W_BF16       K pairs: per block and pair of input columns (2p, 2p+1), the 16 rows' two values side by side
 *                   ([N/16][K/2][16][2] bf16): one 64-byte load is a 16-row x 2-column slice, the operand of one
 *                   vdpbf16ps against the input pair broadcast.
 *   RG_W_INT8       per block, per group of `group` input columns: 16 float32 scales, then the group's int8
 *                   values in K-pair order (group/2 slices of 32 bytes). w = scale * q.
 *   RG_W_INT4       per block, per group: 16 fp16 scales, 16 fp16 offsets, then group/4 slices of 32 bytes, one
 *                   per quad of input columns 4c .. 4c+3: byte j holds, in its low nibble, element j of the K-pair
 *                   slice of pair 2c (row j/2, column 4c + j%2) and in its high nibble element j of pair 2c+1
 *                   (column 4c + 2 + j%2). q in 0..15; w = scale * q + offset, or with zero_points set
 *                   w = scale * (q - offset) (the offsets are then zero points).
 * int8 needs K and group multiples of 16, int4 multiples of 32, group dividing K; BF16 an even K.
 *
 * The matmuls. M up to GEMV_MAX_M rows (decode) stream the weights once, dequantizing in registers: int8 by
 * widening to float32 and packing to bf16, int4 by writing each nibble q into the low mantissa bits of the bf16
 * 128.0 (0x4300 | q is exactly 128 + q), so a group's vdpbf16ps sums give sum_k x_k (128 + q_k) exactly, and
 * scale * that + (offset - 128 scale) * sum_k x_k is the group's part of the dot product (sum_k x_k per row and
 * group computed first). More rows (prefill) run a blocked GEMM over panels of GEMM_NC blocks: bf16 panels are
 * read in place, quantized ones are dequantized to a bf16 panel first (each weight rounded to bf16 once), which
 * the GEMM then reads once per 8 input rows. On AMX-BF16 builds the runtime sends prefill matmuls of 8 rows or more
 * to rg_linear_amx_bf16 instead (cpu_linear_amx.h, included at the end: TDPBF16PS tiles loading the K-pair blocks in
 * place, K a multiple of 32); decode steps, draft verifications and the deterministic mode stay on these
 * kernels. Builds without AVX512-BF16 (and float32 activations everywhere)
 * run float32 math: with AVX2, FMA and F16C, int8 / int4 weights up to GEMV2_MAX_M rows stream through
 * linear_avx2 (dequantizing in registers); everything else takes a portable path: each 16-row block
 * dequantized to float32, then plain dot products. */

enum { RG_W_ROWS_BF16 = 0, RG_W_BF16 = 1, RG_W_INT8 = 2, RG_W_INT4 = 3 };

typedef struct {
    int64_t kind;        /* RG_W_* */
    int64_t N, K;        /* output rows, input columns */
    int64_t group;       /* int8 / int4: input columns per scale, a divisor of K */
    int64_t zero_points; /* int4: the offsets are zero points */
    const void *data;
    /* The deterministic mode's row-parallel matmuls (AVX512-BF16 builds, bf16 weights; 0 elsewhere): k_split > 0
     * (even, < K) sums input columns [0, k_split) and [k_split, K) as two accumulators, added in float32 before
     * the one rounding, which is what two tensor-parallel ranks holding those columns give (their partial sums
     * added by rg_sum_partials_bf16); `partial`: float32 outputs (yf) are such a rank's unrounded sums, no bias.
     * Either sends the matmul to the *_fixed tiles, so the default ones stay as they are. */
    int64_t k_split;
    int64_t partial;
} rg_weight;

static inline int64_t rg_w_group_bytes(const rg_weight *w) {
    return w->kind == RG_W_INT8 ? 64 + 16 * w->group : 64 + 8 * w->group;
}

/* bytes of one 16-row block: blocks follow each other */
static inline int64_t rg_w_block_bytes(const rg_weight *w) {
    if (w->kind == RG_W_BF16) return 32 * w->K;
    return w->K / w->group * rg_w_group_bytes(w);
}

/* whether the kernels take w (as a matmul weight when `matmul`, else for rows only) */
static int rg_w_valid(const rg_weight *w, int matmul) {
    if (!w || !w->data || w->N < 1 || w->K < 1) return 0;
    if (w->k_split || w->partial) { /* the fixed bf16 tiles only */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        if (w->kind != RG_W_BF16 || w->k_split < 0 || w->k_split % 2 || w->k_split >= w->K) return 0;
#else
        return 0;
#endif
    }
    switch (w->kind) {
    case RG_W_ROWS_BF16: return !matmul;
    case RG_W_BF16: return w->K % 2 == 0;
    case RG_W_INT8: return w->group > 0 && w->group % 16 == 0 && w->K % w->group == 0;
    case RG_W_INT4: return w->group > 0 && w->group % 32 == 0 && w->K % w->group == 0;
    default: return 0;
    }
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f)
        u = sign | 0x7f800000u | (man << 13); /* inf, NaN */
    else if (exp)
        u = sign | ((exp + 112) << 23) | (man << 13);
    else { /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Row n of w dequantized: into of (float32) or ob (bf16, each value rounded once), K values. */
static void rg_w_row(const rg_weight *w, int64_t n, float *of, uint16_t *ob) {
    const int64_t K = w->K, blk = n / 16, j = n % 16;
#define RG_PUT(k, v) (of ? (void)(of[k] = (v)) : (void)(ob[k] = f32_to_bf16(v)))
    if (w->kind == RG_W_ROWS_BF16 || w->kind == RG_W_BF16) { /* bf16 as stored: no rounding */
        const uint16_t *base = (const uint16_t *)w->data;
        for (int64_t k = 0; k < K; ++k) {
            const uint16_t v = w->kind == RG_W_ROWS_BF16 ? base[n * K + k]
                                                         : base[blk * 16 * K + ((k / 2) * 16 + j) * 2 + k % 2];
            if (of)
                of[k] = bf16_to_f32(v);
            else
                ob[k] = v;
        }
        return;
    }
    const int64_t G = w->group, gb = rg_w_group_bytes(w);
    const uint8_t *bp = (const uint8_t *)w->data + blk * rg_w_block_bytes(w);
    for (int64_t g = 0; g < K / G; ++g) {
        const uint8_t *gp = bp + g * gb, *q = gp + 64;
        if (w->kind == RG_W_INT8) {
            float s;
            memcpy(&s, gp + 4 * j, sizeof s);
            for (int64_t kk = 0; kk < G; ++kk) RG_PUT(g * G + kk, s * (float)((const int8_t *)q)[((kk / 2) * 16 + j) * 2 + kk % 2]);
        } else {
            uint16_t sh, oh;
            memcpy(&sh, gp + 2 * j, sizeof sh);
            memcpy(&oh, gp + 32 + 2 * j, sizeof oh);
            const float s = f16_to_f32(sh), o = f16_to_f32(oh);
            for (int64_t kk = 0; kk < G; ++kk) { /* column 4c + 2 hi + t: byte j*2 + t of quad c, nibble hi */
                const uint8_t byte = q[(kk / 4) * 32 + j * 2 + kk % 2];
                const float v = (float)((kk / 2) % 2 ? byte >> 4 : byte & 15);
                RG_PUT(g * G + kk, w->zero_points ? s * (v - o) : s * v + o);
            }
        }
    }
#undef RG_PUT
}

/* Output `at` of a float32-math matmul: v + bias[n], into yb (bf16, rounded) or yf (float32; rounded to bf16
 * first when round_bf16). */
static inline void put_result(float v, const float *biasf, int64_t n, uint16_t *yb, float *yf, int64_t at,
                              int round_bf16) {
    v += biasf ? biasf[n] : 0.f;
    if (yb)
        yb[at] = f32_to_bf16(v);
    else
        yf[at] = round_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

#include "cpu_linear_avx2.h" /* linear_avx2: int8 / int4 weights, float32 inputs, AVX2 builds */

/* ---------------------------------------------------------------------------------------- portable path */

/* y (M, N) = x (M, K) @ w^T (+ bias) with float32 inputs, over a new team: each thread dequantizes a 16-row
 * block at a time to float32 (wf, 16 K) and takes dot products. Results go to yb (bf16, rounded), or yf (float32;
 * rounded to bf16 first when round_bf16). */
static rg_status linear_portable(const rg_weight *w, const float *xf, int64_t M, const float *biasf, uint16_t *yb,
                                 float *yf, int round_bf16) {
    const int64_t N = w->N, K = w->K, blocks = (N + 15) / 16;
    int failed = 0;
#pragma omp parallel
    {
        float *wf = (float *)malloc(sizeof(float) * (size_t)(16 * K));
        if (!wf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; ++blk) {
            if (!wf) continue;
            const int64_t n0 = blk * 16, nn = N - n0 < 16 ? N - n0 : 16;
            for (int64_t j = 0; j < nn; ++j) rg_w_row(w, n0 + j, wf + j * K, NULL);
            for (int64_t m = 0; m < M; ++m) {
                const float *xr = xf + m * K;
                for (int64_t j = 0; j < nn; ++j) {
                    const float *wr = wf + j * K;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t k = 0; k < K; ++k) acc += xr[k] * wr[k];
                    put_result(acc, biasf, n0 + j, yb, yf, m * N + n0 + j, round_bf16);
                }
            }
        }
        free(wf);
    }
    return failed ? RG_ERR_ALLOC : RG_OK;
}

/* The float32-math matmul (builds without AVX512-BF16, and float32 inputs everywhere): int8 / int4 weights up to
 * GEMV2_MAX_M rows stream through linear_avx2 where the build has it, everything else takes the portable path. */
static rg_status linear_f32math(const rg_weight *w, const float *xf, int64_t M, const float *biasf, uint16_t *yb,
                                float *yf, int round_bf16) {
#ifdef RG_AVX2_GEMV
    if (M <= GEMV2_MAX_M && (w->kind == RG_W_INT8 || w->kind == RG_W_INT4))
        return linear_avx2(w, xf, M, biasf, yb, yf, round_bf16);
#endif
    return linear_portable(w, xf, M, biasf, yb, yf, round_bf16);
}

/* ------------------------------------------------------------------------- AVX512-BF16 decode and prefill */
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

/* 32 bytes of an int4 quad -> its two K-pair slices of bf16 (128 + q). */
static inline void int4_slices(const uint8_t *p, __m512bh *lo, __m512bh *hi) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); /* a byte per 16-bit lane */
    const __m512i bias = _mm512_set1_epi16(0x4300);
    *lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi16(0x000F)), bias);
    *hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), bias);
}

/* The same for one input row, in fewer instructions: lo as above in one ternary-logic op, hi as the bf16
 * 2 + q / 64 (0x4000 | q, shifted in with the bits of 4 by one double shift), summed apart (gemv_tile_q's ah):
 * sum x (2 + q / 64) times 64 is sum x (128 + q), so the group's correction is unchanged. Five vector operations a
 * quad instead of seven: at one row the int4 stream is partly bound by them. */
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
        /* the group's sums; a single input row keeps its quads' two halves apart (ah), so that each block has two
         * independent vdpbf16ps chains: one chain of two a quad held the stream to half the memory's speed */
        __m512 ag[4][4], ah[4];
        for (int b = 0; b < NB; ++b) {
            ah[b] = _mm512_setzero_ps();
            for (int i = 0; i < MB; ++i) ag[b][i] = _mm512_setzero_ps();
        }
        const uint16_t *xg = x + m0 * K + g * G;
        for (int b = 0; b < NB && b < far; ++b) /* the next tile's group scales: a line the slices' lines miss */
            _mm_prefetch((const char *)(wb[b] + g * gb) + ahead, GEMV_HINT_FAR);
        if (INT4) {
            for (int64_t c = 0; c < G / 4; ++c) { /* a quad: pairs 2c and 2c+1 of the group */
                __m512bh lo[4], hi[4];
                for (int b = 0; b < NB; ++b) {
                    const uint8_t *q = wb[b] + g * gb + 64 + c * 32;
                    if (c % 2 == 0) Q_PREFETCH(q, b); /* once a cache line */
                    if (MB == 1)
                        int4_slices_row(q, &lo[b], &hi[b]);
                    else
                        int4_slices(q, &lo[b], &hi[b]);
                }
                for (int i = 0; i < MB; ++i) {
                    const __m512bh x0 = bcast_pair(xg + i * K + 4 * c), x1 = bcast_pair(xg + i * K + 4 * c + 2);
                    for (int b = 0; b < NB; ++b) {
                        ag[b][i] = _mm512_dpbf16_ps(ag[b][i], x0, lo[b]);
                        if (MB == 1)
                            ah[b] = _mm512_dpbf16_ps(ah[b], x1, hi[b]);
                        else
                            ag[b][i] = _mm512_dpbf16_ps(ag[b][i], x1, hi[b]);
                    }
                }
            }
            if (MB == 1)
                for (int b = 0; b < NB; ++b) ag[b][0] = _mm512_fmadd_ps(ah[b], _mm512_set1_ps(64.f), ag[b][0]);
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
#endif

/* ------------------------------------------------------------------------------------------ entry points */

#if !defined(__AVX512BF16__) || !defined(__AVX512F__)
/* float32 copies of n bf16 values, malloc'ed (NULL when src is NULL or the allocation failed: check src). */
static float *widen_bf16(const uint16_t *src, int64_t n) {
    if (!src) return NULL;
    float *out = (float *)malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    if (out)
        for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(src[i]);
    return out;
}
#endif

/* y (M, N) = x (M, K) @ w^T (+ bias (N,)), float32; with yf non-NULL the results go there instead of y. */
rg_status rg_linear_f32(const rg_weight *w, const float *x, int64_t M, const float *bias, float *y, float *yf) {
    if (!rg_w_valid(w, 1)) return RG_ERR_UNSUPPORTED;
    return linear_f32math(w, x, M, bias, NULL, yf ? yf : y, 0);
}

/* y (M, N) = x (M, K) @ w^T (+ bias (N,)), bf16 in and out, computed in float32 and rounded once; with yf
 * non-NULL, the rounded results go there widened to float32 instead of into y (logits). */
rg_status rg_linear_bf16(const rg_weight *w, const uint16_t *x, int64_t M, const uint16_t *bias, uint16_t *y,
                         float *yf) {
    if (!rg_w_valid(w, 1) || (w->partial && bias)) return RG_ERR_UNSUPPORTED;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    const int64_t K = w->K;
    const int gemm = M > GEMV_MAX_M;
    /* per thread: the dequantized panel of the GEMM, or the group sums of the gemv on int4 weights; one
     * allocation for the team, made before it starts */
    const size_t bytes = gemm ? (w->kind == RG_W_BF16 ? 0 : rg_span(GEMM_NC * K * 16, sizeof(uint16_t)))
                              : (w->kind == RG_W_INT4 ? rg_span(M * (K / w->group), sizeof(float)) : 0);
    const int threads = omp_get_max_threads();
    char *scratch = bytes ? (char *)malloc(bytes * (size_t)threads) : NULL;
    if (bytes && !scratch) return RG_ERR_ALLOC;
#pragma omp parallel num_threads(threads)
    {
        void *mine = scratch ? scratch + bytes * (size_t)omp_get_thread_num() : NULL;
        if (gemm)
            gemm_team_bf16(w, x, M, bias, y, yf, (uint16_t *)mine);
        else
            linear_team_bf16(w, x, M, bias, y, yf, (float *)mine);
    }
    free(scratch);
    return RG_OK;
#else
    const int64_t K = w->K;
    float *xf = widen_bf16(x, M * K), *bf = widen_bf16(bias, w->N);
    rg_status st = RG_ERR_ALLOC;
    if (xf && (bf || !bias)) {
        st = linear_f32math(w, xf, M, bf, yf ? NULL : y, yf, 1);
    }
    free(xf);
    free(bf);
    return st;
#endif
}

/* out (M, N) = bf16((parts[0] + parts[1] + ... + parts[S-1]) + bias), added in that order and rounded once: S
 * tensor-parallel ranks' partial sums of a row-parallel matmul (`partial` weights), gathered in rank order, with
 * the instructions of fixed_tile_bf16 (the same bits as one rank's k_split sums: the deterministic mode).
 * parts (S, M, N) float32, contiguous; bias (N,) or NULL. AVX512-BF16 builds only. */
rg_status rg_sum_partials_bf16(const float *parts, int64_t S, int64_t M, int64_t N, const uint16_t *bias,
                               uint16_t *out) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (S < 1 || M < 0 || N < 1) return RG_ERR_UNSUPPORTED;
    const int64_t n = M * N;
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < N; c += 16) {
            const int64_t at = m * N + c;
            const __mmask16 mk = N - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - c)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(mk, parts + at);
            for (int64_t s = 1; s < S; ++s) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mk, parts + s * n + at));
            store16(v, bias, out, NULL, at, c, N - c);
        }
    return RG_OK;
#else
    (void)parts, (void)S, (void)M, (void)N, (void)bias, (void)out;
    return RG_ERR_UNSUPPORTED;
#endif
}

/* out (n, K) = rows ids[0 .. n) of w, dequantized (an embedding lookup); ids must lie in [0, N). */
rg_status rg_weight_rows_f32(const rg_weight *w, const int64_t *ids, int64_t n, float *out) {
    if (!rg_w_valid(w, 0)) return RG_ERR_UNSUPPORTED;
#pragma omp parallel for schedule(static) if (n * w->K >= 65536)
    for (int64_t i = 0; i < n; ++i) rg_w_row(w, ids[i], out + i * w->K, NULL);
    return RG_OK;
}

rg_status rg_weight_rows_bf16(const rg_weight *w, const int64_t *ids, int64_t n, uint16_t *out) {
    if (!rg_w_valid(w, 0)) return RG_ERR_UNSUPPORTED;
#pragma omp parallel for schedule(static) if (n * w->K >= 65536)
    for (int64_t i = 0; i < n; ++i) rg_w_row(w, ids[i], NULL, out + i * w->K);
    return RG_OK;
}

#include "cpu_linear_amx.h" /* rg_linear_amx_bf16: the prefill GEMM on AMX tiles (AMX-BF16 builds; a stub elsewhere) */
