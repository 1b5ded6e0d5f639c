/* LoRA deltas inside the fused bf16 decode step (included by cpu_kernels.c; see radixgen.runtime.lora).
 *
 * A decode batch holds rows of several adapters and of the base model. After each of a layer's matmuls
 * (qkv, o, gate_up, down) the step adds, for each group of rows with the same adapter slot s,
 * (x_rows @ A_s^T) @ B_s * scale_s to the matmul's output: A_s is read once per group, never per row, and the
 * batch is never split. The adapters' weights stay in the pool's stacked buffers, passed by descriptor:
 *   a (slots, nseg R, K): shrink weights; segment g (q | k | v of qkv, gate | up of gate_up) at rows [g R, g R + r)
 *   b (slots, R, N): expand weights; output column n of segment g reads ranks [0, r) at h's columns [g R, ...)
 * with R the pool's max rank and r <= R the slot's own rank for that matmul (0: no delta). Roundings follow the
 * unfused torch path (runtime/layers/ops.py lora_delta_): h rounded to bf16, the expand rounded, times the scale
 * rounded, added to the output rounded. */

#define RG_LORA_MAX_ROWS 64 /* the fused step's largest batch */
#define RG_LORA_MATMULS 4   /* qkv, o, gate_up, down */

typedef struct { /* one step's rows that have an adapter, grouped by slot (written by the runtime per step) */
    int64_t n_groups;
    int64_t slot[RG_LORA_MAX_ROWS], start[RG_LORA_MAX_ROWS], len[RG_LORA_MAX_ROWS]; /* group g: rows[start, +len) */
    int64_t rows[RG_LORA_MAX_ROWS]; /* batch row indices, group after group */
    float *h;                       /* scratch (RG_LORA_MAX_ROWS, h_stride): the shrink's output per listed row */
    int64_t h_stride;               /* >= 3 R: the widest shrink (q | k | v) */
} rg_lora_step_bf16;

typedef struct rg_lora_layer_bf16 { /* one decoder layer's adapter weights */
    const rg_lora_step_bf16 *step;
    const float *scales;                    /* (slots,) */
    const int32_t *ranks;                   /* (slots, RG_LORA_MATMULS): r of each slot's delta per matmul */
    int64_t max_rank;                       /* R */
    const uint16_t *a[RG_LORA_MATMULS];     /* per matmul, NULL where the pool holds no weights for it */
    const uint16_t *b[RG_LORA_MATMULS];
} rg_lora_layer_bf16;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <omp.h>

static inline __m512 lora_load16_bf16(const uint16_t *p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m512 lora_round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

/* h[i][j0 + j] = bf16(x[rows[i]] . a[j0 + j]) for j < nj <= 16 and the n rows listed; a (., K) row-major. The
 * block of a (nj rows) stays in L1/L2 while the rows go by. */
static void lora_shrink_block(const uint16_t *x, int64_t K, const uint16_t *a, int64_t j0, int nj,
                              const int64_t *rows, int64_t n, float *h, int64_t h_stride) {
    const __mmask32 tail = (__mmask32)((1ull << (K % 32)) - 1);
    for (int64_t i = 0; i < n; ++i) {
        const uint16_t *xr = x + rows[i] * K;
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
            for (int j = 0; j < nj; ++j)
                acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(a + (j0 + j) * K + k));
        }
        if (k < K) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + k);
            for (int j = 0; j < nj; ++j)
                acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, a + (j0 + j) * K + k));
        }
        float s[16];
        _mm512_storeu_ps(s, hsum16(acc)); /* lane j: row j's total */
        for (int j = 0; j < nj; ++j) h[i * h_stride + j0 + j] = bf16_to_f32(f32_to_bf16(s[j]));
    }
}

/* y[rows[i], n0 : n0 + w] += bf16(bf16(h[i][hoff : hoff + r] @ b[0:r, n0 : n0 + w]) * scale), w <= 16, eight
 * rows at a time so that each b vector is loaded once per eight rows. */
static void lora_expand_chunk(const float *h, int64_t h_stride, int64_t hoff, const uint16_t *b, int64_t N,
                              int64_t n0, int w, int64_t r, float scale, const int64_t *rows, int64_t n,
                              uint16_t *y) {
    const __mmask16 m = (__mmask16)((1u << w) - 1);
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
        const int ni = n - i0 < 8 ? (int)(n - i0) : 8;
        __m512 acc[8];
        for (int i = 0; i < ni; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < r; ++k) {
            const __m512 bv = lora_load16_bf16(b + k * N + n0, m);
            for (int i = 0; i < ni; ++i)
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(h[(i0 + i) * h_stride + hoff + k]), bv, acc[i]);
        }
        for (int i = 0; i < ni; ++i) {
            uint16_t *yr = y + rows[i0 + i] * N + n0;
            const __m512 d = lora_round_bf16(_mm512_mul_ps(lora_round_bf16(acc[i]), sv));
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(lora_load16_bf16(yr, m), d));
            _mm256_mask_storeu_epi16(yr, m, (__m256i)out);
        }
    }
}

/* y (M, N) += the deltas of matmul `mat` (x (M, K) its input) for every row group of the step, over the calling
 * team. The output's nseg segments end at seg_end[0..nseg). All threads take the same branch (the descriptor
 * is shared), so the two worksharing loops and their barriers match; nothing runs without an adapter row. */
static void lora_add_team(const rg_lora_layer_bf16 *lo, int mat, const uint16_t *x, int64_t K, uint16_t *y,
                          int64_t N, const int64_t *seg_end, int nseg) {
    if (lo == NULL || lo->a[mat] == NULL || lo->step->n_groups == 0) return;
    const rg_lora_step_bf16 *st = lo->step;
    const int64_t R = lo->max_rank, NR = nseg * R, rblocks = (R + 15) / 16, hs = st->h_stride;
    const int64_t shrink_items = st->n_groups * nseg * rblocks;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < shrink_items; ++item) { /* (group, segment, block of 16 ranks) */
        const int64_t g = item / (nseg * rblocks), seg = item / rblocks % nseg, j0 = seg * R + item % rblocks * 16;
        const int64_t slot = st->slot[g], r = lo->ranks[slot * RG_LORA_MATMULS + mat];
        if (j0 >= seg * R + r) continue; /* ranks past the slot's own are zero */
        const int nj = (int)(seg * R + r - j0 < 16 ? seg * R + r - j0 : 16);
        lora_shrink_block(x, K, lo->a[mat] + slot * NR * K, j0, nj, st->rows + st->start[g], st->len[g],
                          st->h + st->start[g] * hs, hs);
    }
    int64_t chunks = 0; /* blocks of 16 output columns, none straddling two segments */
    for (int s = 0; s < nseg; ++s) chunks += (seg_end[s] - (s ? seg_end[s - 1] : 0) + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
        int seg = 0;
        int64_t left = c, c0 = 0;
        for (;; ++seg) { /* the chunk's segment and its first column */
            const int64_t n_chunks = (seg_end[seg] - c0 + 15) / 16;
            if (left < n_chunks) break;
            left -= n_chunks;
            c0 = seg_end[seg];
        }
        const int64_t n0 = c0 + left * 16;
        const int w = (int)(seg_end[seg] - n0 < 16 ? seg_end[seg] - n0 : 16);
        for (int64_t g = 0; g < st->n_groups; ++g) {
            const int64_t slot = st->slot[g], r = lo->ranks[slot * RG_LORA_MATMULS + mat];
            if (r == 0) continue;
            lora_expand_chunk(st->h + st->start[g] * hs, hs, seg * R, lo->b[mat] + slot * R * N, N, n0, w, r,
                              lo->scales[slot], st->rows + st->start[g], st->len[g], y);
        }
    }
}
#endif
