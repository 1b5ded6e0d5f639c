/* LoRA deltas inside the fused bf16 decode step (included by cpu_kernels.c; see radixgen.runtime.lora).
 *
 * A decode batch holds rows of several adapters and of the base model. After each of a layer's matmuls
 * (qkv, o, gate_up, down) the step adds, for each group of rows with the same adapter slot s,
 * (x_rows @ A_s^T) @ B_s * scale_s to the matmul's output: A_s is read once per group, never per row, and the
 * batch is never split. The adapters' weights stay in the pool's stacked buffers, passed by descriptor:
 *   a (slots, nseg R, K): shrink weights; segment g (q | k | v of qkv, gate | up of gate_up) at rows [g R, g R + r)
 *   b (slots, R/2, N, 2): expand weights, ranks in pairs (b[p][n] holds ranks 2p and 2p+1 of column n); output
 *                         column n of segment g reads ranks [0, r) at h's columns [g R, ...)
 * with R (even) the pool's rank and r <= R the slot's own for that matmul, rounded up to even (0: no delta). The
 * shrink is dot products along K (vdpbf16ps over x and a rows), the expand takes two ranks per vdpbf16ps (a pair
 * of h broadcast against 16 columns' pairs of b). Roundings follow the unfused torch path (runtime/layers/ops.py
 * lora_delta_): h rounded to bf16, the expand rounded, times the scale rounded, added to the output rounded. */

#define RG_LORA_MAX_ROWS 64 /* the fused step's largest batch */
#define RG_LORA_MATMULS 4   /* qkv, o, gate_up, down */

typedef struct { /* one step's rows that have an adapter, grouped by slot (written by the runtime per step) */
    int64_t n_groups;
    int64_t slot[RG_LORA_MAX_ROWS], start[RG_LORA_MAX_ROWS], len[RG_LORA_MAX_ROWS]; /* group g: rows[start, +len) */
    int64_t rows[RG_LORA_MAX_ROWS]; /* batch row indices, group after group */
    uint16_t *h;                    /* scratch (RG_LORA_MAX_ROWS, h_stride) bf16: the shrink's output per listed row */
    int64_t h_stride;               /* >= 3 R: the widest shrink (q | k | v) */
} rg_lora_step_bf16;

typedef struct rg_lora_layer_bf16 { /* one decoder layer's adapter weights */
    const rg_lora_step_bf16 *step;
    const float *scales;                    /* (slots,) */
    const int32_t *ranks;                   /* (slots, RG_LORA_MATMULS): r (even) of each slot's delta per matmul */
    int64_t max_rank;                       /* R */
    const uint16_t *a[RG_LORA_MATMULS];     /* per matmul, NULL where the pool holds no weights for it */
    const uint16_t *b[RG_LORA_MATMULS];
} rg_lora_layer_bf16;

/* The unfused path's entry point (below; a stub returning RG_ERR_UNSUPPORTED without AVX512-BF16). */
rg_status rg_lora_delta_bf16(const uint16_t *x, int64_t K, uint16_t *y, int64_t N, const uint16_t *a,
                             const uint16_t *b, const float *scales, const int32_t *ranks, int64_t rank_stride,
                             int64_t R, const int64_t *seg_end, int64_t nseg, const int64_t *rows,
                             const int64_t *start, const int64_t *len, const int64_t *slot, int64_t n_groups,
                             uint16_t *h);

#if defined(__AVX512BF16__) && defined(__AVX512F__)

static inline __m512 lora_load16_bf16(const uint16_t *p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m512 lora_round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

/* h[i][j0 + j] = bf16(x[rows[i]] . a[j0 + j]) for j < NJ and the n rows listed; a (., K) row-major. The block
 * of a (NJ rows) stays in L1/L2 while the rows go by. NJ is a compile-time constant at each call (the
 * accumulators stay in registers). */
static inline __attribute__((always_inline)) void lora_shrink_rows(
    const uint16_t *x, int64_t K, const uint16_t *a, int64_t j0, const int NJ, const int64_t *rows, int64_t n,
    uint16_t *h, int64_t h_stride) {
    const __mmask32 tail = (__mmask32)((1ull << (K % 32)) - 1);
    for (int64_t i = 0; i < n; ++i) {
        const uint16_t *xr = x + rows[i] * K;
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + k);
            for (int j = 0; j < NJ; ++j)
                acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(a + (j0 + j) * K + k));
        }
        if (k < K) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + k);
            for (int j = 0; j < NJ; ++j)
                acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, a + (j0 + j) * K + k));
        }
        float s[16];
        _mm512_storeu_ps(s, hsum16(acc)); /* lane j: rank j's total */
        for (int j = 0; j < NJ; ++j) h[i * h_stride + j0 + j] = f32_to_bf16(s[j]);
    }
}

static void lora_shrink_block(const uint16_t *x, int64_t K, const uint16_t *a, int64_t j0, int nj,
                              const int64_t *rows, int64_t n, uint16_t *h, int64_t h_stride) {
    switch (nj) { /* a slot's ranks in blocks of 16, then its last 1-15 (ranks 8 and 12 are common) */
    case 16: lora_shrink_rows(x, K, a, j0, 16, rows, n, h, h_stride); break;
    case 8: lora_shrink_rows(x, K, a, j0, 8, rows, n, h, h_stride); break;
    case 12: lora_shrink_rows(x, K, a, j0, 12, rows, n, h, h_stride); break;
    default:
        for (int j = 0; j < nj; j += 4) lora_shrink_rows(x, K, a, j0 + j, nj - j < 4 ? nj - j : 4, rows, n, h, h_stride);
    }
}

/* y[rows[i], n0 : n0 + w] += bf16(bf16(h[i][hoff : hoff + r] @ B[0:r, n0 : n0 + w]) * scale) for NI <= 8 rows,
 * w <= 32 columns (two vectors of 16 columns' rank pairs of b per rank pair), r even: each b vector is loaded
 * once for the NI rows. NI is a compile-time constant at each call (the accumulators stay in registers). */
static inline __attribute__((always_inline)) void lora_expand_rows(
    const uint16_t *h, int64_t h_stride, int64_t hoff, const uint16_t *b, int64_t N, int64_t n0, int w, int64_t r,
    __m512 sv, const int64_t *rows, const int NI, uint16_t *y) {
    const __mmask16 m0 = (__mmask16)((1u << (w < 16 ? w : 16)) - 1), m1 = (__mmask16)((1u << (w > 16 ? w - 16 : 0)) - 1);
    __m512 lo[8], hi[8]; /* columns n0 + [0, 16) and n0 + [16, 32) of each row */
    for (int i = 0; i < NI; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < r / 2; ++p) {
        const uint16_t *bp = b + (p * N + n0) * 2;
        const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, bp), b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, bp + 32);
        for (int i = 0; i < NI; ++i) {
            int32_t pair;
            memcpy(&pair, h + i * h_stride + hoff + 2 * p, sizeof pair);
            const __m512bh hv = (__m512bh)_mm512_set1_epi32(pair);
            lo[i] = _mm512_dpbf16_ps(lo[i], hv, b0);
            hi[i] = _mm512_dpbf16_ps(hi[i], hv, b1);
        }
    }
    for (int i = 0; i < NI; ++i) {
        uint16_t *yr = y + rows[i] * N + n0;
        const __m512 d0 = lora_round_bf16(_mm512_mul_ps(lora_round_bf16(lo[i]), sv));
        const __m512 d1 = lora_round_bf16(_mm512_mul_ps(lora_round_bf16(hi[i]), sv));
        const __m256bh o0 = _mm512_cvtneps_pbh(_mm512_add_ps(lora_load16_bf16(yr, m0), d0));
        const __m256bh o1 = _mm512_cvtneps_pbh(_mm512_add_ps(lora_load16_bf16(yr + 16, m1), d1));
        _mm256_mask_storeu_epi16(yr, m0, (__m256i)o0);
        _mm256_mask_storeu_epi16(yr + 16, m1, (__m256i)o1);
    }
}

/* The same for n rows, eight at a time. */
static void lora_expand_chunk(const uint16_t *h, int64_t h_stride, int64_t hoff, const uint16_t *b, int64_t N,
                              int64_t n0, int w, int64_t r, float scale, const int64_t *rows, int64_t n,
                              uint16_t *y) {
    const __m512 sv = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) lora_expand_rows(h + i * h_stride, h_stride, hoff, b, N, n0, w, r, sv, rows + i, 8, y);
    for (; i + 4 <= n; i += 4) lora_expand_rows(h + i * h_stride, h_stride, hoff, b, N, n0, w, r, sv, rows + i, 4, y);
    for (; i < n; ++i) lora_expand_rows(h + i * h_stride, h_stride, hoff, b, N, n0, w, r, sv, rows + i, 1, y);
}

#define LORA_ROW_BLOCK 64 /* rows of one group per shrink work item */
#define LORA_ROW_TILE 16  /* rows of one group per expand work item */
#define LORA_COL_TILE 256 /* output columns per expand work item */

/* y (., N) += the LoRA deltas of one matmul (x (., K) its input) for n_groups groups of rows with one adapter
 * slot each (group g: rows[start[g] .. + len[g]], slot slot[g]), over the calling team. a, b, scales: the pool's
 * buffers for this matmul (see the top of this file); ranks[slot * rank_stride]: the slot's r (0: none); the
 * output's nseg segments end at seg_end[0..nseg); h (rows listed, h_stride >= nseg R) bf16 scratch. Two
 * worksharing loops, so every thread of the team must call it. */
static void lora_delta_team(const uint16_t *x, int64_t K, uint16_t *y, int64_t N, const uint16_t *a,
                            const uint16_t *b, const float *scales, const int32_t *ranks, int64_t rank_stride,
                            int64_t R, const int64_t *seg_end, int nseg, const int64_t *rows, const int64_t *start,
                            const int64_t *len, const int64_t *slot, int64_t n_groups, uint16_t *h, int64_t h_stride) {
    const int64_t NR = nseg * R, rblocks = (R + 15) / 16;
    int64_t row_blocks = 0; /* (group, block of LORA_ROW_BLOCK rows) pairs */
    for (int64_t g = 0; g < n_groups; ++g) row_blocks += (len[g] + LORA_ROW_BLOCK - 1) / LORA_ROW_BLOCK;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < row_blocks * nseg * rblocks; ++item) { /* (row block, segment, 16 ranks) */
        int64_t rb = item / (nseg * rblocks), g = 0;
        const int64_t seg = item / rblocks % nseg, j0 = seg * R + item % rblocks * 16;
        for (;; ++g) { /* the row block's group */
            const int64_t blocks = (len[g] + LORA_ROW_BLOCK - 1) / LORA_ROW_BLOCK;
            if (rb < blocks) break;
            rb -= blocks;
        }
        const int64_t r = ranks[slot[g] * rank_stride];
        if (j0 >= seg * R + r) continue; /* ranks past the slot's own are zero */
        const int nj = (int)(seg * R + r - j0 < 16 ? seg * R + r - j0 : 16);
        const int64_t i0 = start[g] + rb * LORA_ROW_BLOCK, n = len[g] - rb * LORA_ROW_BLOCK;
        lora_shrink_block(x, K, a + slot[g] * NR * K, j0, nj, rows + i0, n < LORA_ROW_BLOCK ? n : LORA_ROW_BLOCK,
                          h + i0 * h_stride, h_stride);
    }
    int64_t tiles = 0; /* blocks of LORA_COL_TILE output columns, none straddling two segments */
    for (int s = 0; s < nseg; ++s) tiles += (seg_end[s] - (s ? seg_end[s - 1] : 0) + LORA_COL_TILE - 1) / LORA_COL_TILE;
    int64_t row_tiles = 0; /* (group, block of LORA_ROW_TILE rows) pairs */
    for (int64_t g = 0; g < n_groups; ++g) row_tiles += (len[g] + LORA_ROW_TILE - 1) / LORA_ROW_TILE;
    /* (row block, column tile) items: y is updated block by block along its rows (sequential lines, no page
     * walk per row), and a block's slice of b (r x tile) stays in L1/L2 while its rows go by */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < row_tiles * tiles; ++item) {
        int64_t rb = item / tiles, t = item % tiles, g = 0, c0 = 0;
        int seg = 0;
        for (;; ++g) {
            const int64_t blocks = (len[g] + LORA_ROW_TILE - 1) / LORA_ROW_TILE;
            if (rb < blocks) break;
            rb -= blocks;
        }
        for (;; ++seg) { /* the tile's segment and its first column */
            const int64_t n_tiles = (seg_end[seg] - c0 + LORA_COL_TILE - 1) / LORA_COL_TILE;
            if (t < n_tiles) break;
            t -= n_tiles;
            c0 = seg_end[seg];
        }
        const int64_t r = ranks[slot[g] * rank_stride];
        if (r == 0) continue;
        const int64_t n0 = c0 + t * LORA_COL_TILE, n1 = seg_end[seg] < n0 + LORA_COL_TILE ? seg_end[seg] : n0 + LORA_COL_TILE;
        const int64_t i0 = start[g] + rb * LORA_ROW_TILE, left = len[g] - rb * LORA_ROW_TILE;
        const int64_t n = left < LORA_ROW_TILE ? left : LORA_ROW_TILE;
        for (int64_t c = n0; c < n1; c += 32)
            lora_expand_chunk(h + i0 * h_stride, h_stride, seg * R, b + slot[g] * R * N, N, c,
                              (int)(n1 - c < 32 ? n1 - c : 32), r, scales[slot[g]], rows + i0, n, y);
    }
}

/* The fused step's call after matmul `mat` (qkv 0, o 1, gate_up 2, down 3): nothing without an adapter row. All
 * threads take the same branch (the descriptor is shared), so the worksharing loops and their barriers match. */
static void lora_add_team(const rg_lora_layer_bf16 *lo, int mat, const uint16_t *x, int64_t K, uint16_t *y,
                          int64_t N, const int64_t *seg_end, int nseg) {
    if (lo == NULL || lo->a[mat] == NULL || lo->step->n_groups == 0) return;
    const rg_lora_step_bf16 *st = lo->step;
    lora_delta_team(x, K, y, N, lo->a[mat], lo->b[mat], lo->scales, lo->ranks + mat, RG_LORA_MATMULS, lo->max_rank,
                    seg_end, nseg, st->rows, st->start, st->len, st->slot, st->n_groups, st->h, st->h_stride);
}

/* The same for a step of the unfused path (a prefill): y (M, N) += the deltas of x (M, K)'s listed rows, over a
 * new team. ranks[slot * rank_stride]: this matmul's r per slot (even); h: (rows listed, nseg R) bf16 scratch. */
rg_status rg_lora_delta_bf16(const uint16_t *x, int64_t K, uint16_t *y, int64_t N, const uint16_t *a,
                             const uint16_t *b, const float *scales, const int32_t *ranks, int64_t rank_stride,
                             int64_t R, const int64_t *seg_end, int64_t nseg, const int64_t *rows,
                             const int64_t *start, const int64_t *len, const int64_t *slot, int64_t n_groups,
                             uint16_t *h) {
#pragma omp parallel
    lora_delta_team(x, K, y, N, a, b, scales, ranks, rank_stride, R, seg_end, (int)nseg, rows, start, len, slot,
                    n_groups, h, nseg * R);
    return RG_OK;
}
#else
rg_status rg_lora_delta_bf16(const uint16_t *x, int64_t K, uint16_t *y, int64_t N, const uint16_t *a,
                             const uint16_t *b, const float *scales, const int32_t *ranks, int64_t rank_stride,
                             int64_t R, const int64_t *seg_end, int64_t nseg, const int64_t *rows,
                             const int64_t *start, const int64_t *len, const int64_t *slot, int64_t n_groups,
                             uint16_t *h) {
    (void)x, (void)K, (void)y, (void)N, (void)a, (void)b, (void)scales, (void)ranks, (void)rank_stride, (void)R;
    (void)seg_end;
    (void)nseg, (void)rows, (void)start, (void)len, (void)slot, (void)n_groups, (void)h;
    return RG_ERR_UNSUPPORTED;
}
#endif
