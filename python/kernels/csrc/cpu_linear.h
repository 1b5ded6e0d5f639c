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
 * run float32 math: with AVX2 and FMA, bf16 K-pair weights through linear_bf16_avx2 (cpu_linear_bf16_avx2.h: each
 * bf16 widened in registers by a shift, streamed up to 4 rows, a panel GEMM beyond, batch invariant); with AVX2,
 * FMA and F16C, int8 / int4 weights up to GEMV2_MAX_M rows stream through linear_avx2 (dequantizing in registers);
 * everything else takes a portable path: each 16-row block dequantized to float32, then plain dot products.
 *
 * The files: cpu_linear_layout.h (the descriptor, validity, a row in plain C, the float32 epilogue), then one file
 * per kernel family, each including only the layout and what it calls, none including this one. */

#include "cpu_linear_layout.h"      /* rg_weight, rg_w_valid, rg_w_row, put_result */
#include "cpu_linear_avx2.h"        /* linear_avx2: int8 / int4 weights, float32 math, AVX2 builds */
#include "cpu_linear_bf16_avx2.h"   /* linear_bf16_avx2: bf16 K pairs, float32 math, AVX2 builds */
#include "cpu_linear_avx512.h"      /* linear_team_bf16: the AVX512-BF16 streaming matmul */
#include "cpu_linear_avx512_gemm.h" /* gemm_team_bf16: the AVX512-BF16 blocked GEMM */

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
#ifdef RG_AVX2_BF16
    if (w->kind == RG_W_BF16) return linear_bf16_avx2(w, xf, M, biasf, yb, yf, round_bf16);
#endif
#ifdef RG_AVX2_GEMV
    if (M <= GEMV2_MAX_M && (w->kind == RG_W_INT8 || w->kind == RG_W_INT4))
        return linear_avx2(w, xf, M, biasf, yb, yf, round_bf16);
#endif
    return linear_portable(w, xf, M, biasf, yb, yf, round_bf16);
}
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

/* Whether bf16 K-pair matmuls are fast in this build: vdpbf16ps (AVX512-BF16) or the float32-math kernels of
 * cpu_linear_bf16_avx2.h (AVX2 and FMA); elsewhere they take the portable path. */
int rg_has_fast_bf16_linear(void) {
#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || defined(RG_AVX2_BF16)
    return 1;
#else
    return 0;
#endif
}

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
    if (M == 0) return RG_OK; /* (an empty x may have no data pointer: widen_bf16 would take it for missing) */
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
