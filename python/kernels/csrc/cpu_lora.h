/* LoRA deltas of a batch with rows of several adapters (included by cpu_kernels.c; see radixgen.runtime.lora):
 * inside the fused bf16 decode step after each of a layer's matmuls (qkv, o, gate_up, down), and as one entry
 * point for the unfused path's steps (prefills).
 *
 * For each group of rows with the same adapter slot s, (x_rows @ A_s^T) @ B_s * scale_s is added to the matmul's
 * output: an adapter's weights are read once per group, never per row, and the batch is never split. They stay
 * in the pool's stacked buffers, passed by address, both in K-pair blocks of 16 (one sequential stream per block,
 * two values of the reduced dimension per vdpbf16ps, no horizontal sums):
 *   a (slots, ceil(nseg R / 16), K/2, 16, 2): shrink weights; a[blk][p][j] holds A's entries (rank 16 blk + j,
 *                         columns 2p and 2p+1); segment g (q | k | v of qkv, gate | up of gate_up) is ranks
 *                         [g R, g R + r)
 *   b (slots, ceil(N/16), R/2, 16, 2): expand weights; b[blk][p][j] holds ranks 2p and 2p+1 of output column
 *                         16 blk + j; column n of segment g reads ranks [0, r) at h's columns [g R, ...)
 * with R (even) the pool's rank and r <= R the slot's own for that matmul, rounded up to even (0: no delta), the
 * rest zero. Roundings follow the unfused torch path (runtime/layers/ops.py lora_delta_): h rounded to bf16, the
 * expand rounded, times the scale rounded, added to the output rounded. */

#define RG_LORA_MAX_ROWS 64 /* the fused step's largest batch */
#define RG_LORA_MATMULS 4   /* qkv, o, gate_up, down */

typedef struct { /* one step's rows that have an adapter, grouped by slot (written by the runtime per step) */
    int64_t n_groups;
    int64_t slot[RG_LORA_MAX_ROWS], start[RG_LORA_MAX_ROWS], len[RG_LORA_MAX_ROWS]; /* group g: rows[start, +len) */
    int64_t rows[RG_LORA_MAX_ROWS]; /* batch row indices, group after group */
    uint16_t *h;                    /* scratch (RG_LORA_MAX_ROWS, h_stride) bf16: the shrink's output per listed row */
    int64_t h_stride;               /* >= 16 ceil(3 R / 16): the widest shrink (q | k | v) */
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

#define LORA_PREFETCH 1024 /* elements (2 KiB) ahead in a weight stream, into L2: enough lines in flight to hide a
                             * DRAM round trip (every resident adapter's weights are read once per step) */

/* h[i][16 blk + j] = bf16(x[rows[i]] . A[16 blk + j]) for NI <= 8 rows and the 16 ranks of one K-pair block ab
 * (K/2 pairs of 16 ranks): one stream through the block, each vector used for the NI rows; lanes outside `keep`
 * are not stored. NI is a compile-time constant at each call (the accumulators stay in registers). */
static inline __attribute__((always_inline)) void lora_shrink_rows(
    const uint16_t *x, int64_t K, const uint16_t *ab, const int64_t *rows, const int NI, uint16_t *h,
    int64_t h_stride, __mmask16 keep) {
    __m512 acc[8];
    for (int i = 0; i < NI; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; ++p) {
        _mm_prefetch((const char *)(ab + p * 32 + LORA_PREFETCH), _MM_HINT_T1);
        const __m512bh w = (__m512bh)_mm512_loadu_si512(ab + p * 32);
        for (int i = 0; i < NI; ++i) {
            int32_t pair;
            memcpy(&pair, x + rows[i] * K + 2 * p, sizeof pair);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    for (int i = 0; i < NI; ++i) _mm256_mask_storeu_epi16(h + i * h_stride, keep, (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

/* The same for n rows, eight at a time. */
static void lora_shrink_block(const uint16_t *x, int64_t K, const uint16_t *ab, const int64_t *rows, int64_t n,
                              uint16_t *h, int64_t h_stride, __mmask16 keep) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) lora_shrink_rows(x, K, ab, rows + i, 8, h + i * h_stride, h_stride, keep);
    for (; i + 4 <= n; i += 4) lora_shrink_rows(x, K, ab, rows + i, 4, h + i * h_stride, h_stride, keep);
    for (; i < n; ++i) lora_shrink_rows(x, K, ab, rows + i, 1, h + i * h_stride, h_stride, keep);
}

/* y[rows[i], n0 + j] += bf16(bf16(h[i][hoff : hoff + r] @ B[0:r, n0 + j]) * scale) for NI <= 8 rows and the
 * columns j of blocks n0/16 and n0/16 + 1 that masks m0 and m1 keep (n0 a multiple of 16, r even). bk: the slot's
 * blocks; each block's rank pairs are contiguous, and each of its vectors is loaded once for the NI rows. NI is a
 * compile-time constant at each call (the accumulators stay in registers). */
static inline __attribute__((always_inline)) void lora_expand_rows(
    const uint16_t *h, int64_t h_stride, int64_t hoff, const uint16_t *bk, int64_t R, int64_t N, int64_t n0,
    __mmask16 m0, __mmask16 m1, int64_t r, __m512 sv, const int64_t *rows, const int NI, uint16_t *y) {
    const uint16_t *b0 = bk + n0 * R, *b1 = b0 + 16 * R; /* a block: R/2 pairs x 16 columns x 2 */
    __m512 lo[8], hi[8]; /* columns n0 + [0, 16) and n0 + [16, 32) of each row */
    for (int i = 0; i < NI; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < r / 2; ++p) {
        _mm_prefetch((const char *)(b0 + p * 32 + LORA_PREFETCH), _MM_HINT_T1); /* the tile's blocks are adjacent */
        /* masked lanes are never read: no load past the last block */
        const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, b0 + p * 32);
        const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, b1 + p * 32);
        for (int i = 0; i < NI; ++i) {
            int32_t pair;
            memcpy(&pair, h + i * h_stride + hoff + 2 * p, sizeof pair);
            const __m512bh hv = (__m512bh)_mm512_set1_epi32(pair);
            lo[i] = _mm512_dpbf16_ps(lo[i], hv, w0);
            hi[i] = _mm512_dpbf16_ps(hi[i], hv, w1);
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
static void lora_expand_chunk(const uint16_t *h, int64_t h_stride, int64_t hoff, const uint16_t *bk, int64_t R,
                              int64_t N, int64_t n0, __mmask16 m0, __mmask16 m1, int64_t r, float scale,
                              const int64_t *rows, int64_t n, uint16_t *y) {
    const __m512 sv = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        lora_expand_rows(h + i * h_stride, h_stride, hoff, bk, R, N, n0, m0, m1, r, sv, rows + i, 8, y);
    for (; i + 4 <= n; i += 4)
        lora_expand_rows(h + i * h_stride, h_stride, hoff, bk, R, N, n0, m0, m1, r, sv, rows + i, 4, y);
    for (; i < n; ++i) lora_expand_rows(h + i * h_stride, h_stride, hoff, bk, R, N, n0, m0, m1, r, sv, rows + i, 1, y);
}

/* The lanes of the 16 columns from n0 that lie in [c0, c1). */
static inline __mmask16 lora_lanes(int64_t n0, int64_t c0, int64_t c1) {
    const int64_t lo = c0 > n0 ? c0 - n0 : 0, hi = c1 < n0 + 16 ? c1 - n0 : 16;
    return hi <= lo ? 0 : (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
}

#define LORA_ROW_BLOCK 64 /* rows of one group per shrink work item */
#define LORA_ROW_TILE 16  /* rows of one group per expand work item */
#define LORA_COL_TILE 1024 /* output columns per expand work item: one long stream through b per item */

/* y (., N) += the LoRA deltas of one matmul (x (., K) its input) for n_groups groups of rows with one adapter
 * slot each (group g: rows[start[g] .. + len[g]], slot slot[g]), over the calling team. a, b, scales: the pool's
 * buffers for this matmul (see the top of this file); ranks[slot * rank_stride]: the slot's r (0: none); the
 * output's nseg segments end at seg_end[0..nseg); h (rows listed, h_stride >= 16 ceil(nseg R / 16)) bf16
 * scratch. Two
 * worksharing loops, so every thread of the team must call it. */
static void lora_delta_team(const uint16_t *x, int64_t K, uint16_t *y, int64_t N, const uint16_t *a,
                            const uint16_t *b, const float *scales, const int32_t *ranks, int64_t rank_stride,
                            int64_t R, const int64_t *seg_end, int nseg, const int64_t *rows, const int64_t *start,
                            const int64_t *len, const int64_t *slot, int64_t n_groups, uint16_t *h, int64_t h_stride) {
    const int64_t NR = nseg * R, rank_blocks = (NR + 15) / 16;
    int64_t row_blocks = 0; /* (group, block of LORA_ROW_BLOCK rows) pairs */
    for (int64_t g = 0; g < n_groups; ++g) row_blocks += (len[g] + LORA_ROW_BLOCK - 1) / LORA_ROW_BLOCK;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < row_blocks * rank_blocks; ++item) { /* (row block, block of 16 ranks) */
        int64_t rb = item / rank_blocks, g = 0;
        const int64_t j0 = item % rank_blocks * 16;
        for (;; ++g) { /* the row block's group */
            const int64_t blocks = (len[g] + LORA_ROW_BLOCK - 1) / LORA_ROW_BLOCK;
            if (rb < blocks) break;
            rb -= blocks;
        }
        const int64_t r = ranks[slot[g] * rank_stride];
        __mmask16 keep = 0, live = 0; /* lanes inside h; lanes of the slot's own ranks (the others are zero) */
        for (int j = 0; j < 16 && j0 + j < NR; ++j) {
            keep |= (__mmask16)(1u << j);
            if ((j0 + j) % R < r) live |= (__mmask16)(1u << j);
        }
        if (!live) continue;
        const int64_t i0 = start[g] + rb * LORA_ROW_BLOCK, n = len[g] - rb * LORA_ROW_BLOCK;
        lora_shrink_block(x, K, a + (slot[g] * rank_blocks + j0 / 16) * 16 * K, rows + i0,
                          n < LORA_ROW_BLOCK ? n : LORA_ROW_BLOCK, h + i0 * h_stride + j0, h_stride, keep);
    }
    /* column tiles: runs of LORA_COL_TILE columns (whole blocks of 16) within one segment; a block two segments
     * share is visited by each, masked to its own columns */
    int64_t tiles = 0;
    for (int s = 0; s < nseg; ++s) {
        const int64_t first = (s ? seg_end[s - 1] : 0) / 16, last = (seg_end[s] + 15) / 16; /* blocks [first, last) */
        tiles += (last - first + LORA_COL_TILE / 16 - 1) / (LORA_COL_TILE / 16);
    }
    int64_t row_tiles = 0; /* (group, block of LORA_ROW_TILE rows) pairs */
    for (int64_t g = 0; g < n_groups; ++g) row_tiles += (len[g] + LORA_ROW_TILE - 1) / LORA_ROW_TILE;
    /* (row block, column tile) items: y is updated block by block along its rows (sequential lines, no page
     * walk per row), and a tile's weights (r x tile, contiguous per block) stay in L1/L2 while its rows go by */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < row_tiles * tiles; ++item) {
        int64_t rb = item / tiles, t = item % tiles, g = 0, first = 0;
        int seg = 0;
        for (;; ++g) {
            const int64_t blocks = (len[g] + LORA_ROW_TILE - 1) / LORA_ROW_TILE;
            if (rb < blocks) break;
            rb -= blocks;
        }
        for (;; ++seg) { /* the tile's segment and its first block */
            first = (seg ? seg_end[seg - 1] : 0) / 16;
            const int64_t n_tiles = ((seg_end[seg] + 15) / 16 - first + LORA_COL_TILE / 16 - 1) / (LORA_COL_TILE / 16);
            if (t < n_tiles) break;
            t -= n_tiles;
        }
        const int64_t r = ranks[slot[g] * rank_stride];
        if (r == 0) continue;
        const int64_t c0 = seg ? seg_end[seg - 1] : 0, c1 = seg_end[seg];
        const int64_t n0 = (first + t * (LORA_COL_TILE / 16)) * 16;
        const int64_t n1 = c1 < n0 + LORA_COL_TILE ? c1 : n0 + LORA_COL_TILE;
        const int64_t i0 = start[g] + rb * LORA_ROW_TILE, left = len[g] - rb * LORA_ROW_TILE;
        const int64_t n = left < LORA_ROW_TILE ? left : LORA_ROW_TILE;
        const uint16_t *bk = b + slot[g] * ((N + 15) / 16) * 16 * R; /* the slot's blocks */
        for (int64_t c = n0; c < n1; c += 32)
            lora_expand_chunk(h + i0 * h_stride, h_stride, seg * R, bk, R, N, c, lora_lanes(c, c0, c1),
                              lora_lanes(c + 16, c0, c1), r, scales[slot[g]], rows + i0, n, y);
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
 * new team. ranks[slot * rank_stride]: this matmul's r per slot (even); h: (rows listed, 16 ceil(nseg R / 16))
 * bf16 scratch. */
rg_status rg_lora_delta_bf16(const uint16_t *x, int64_t K, uint16_t *y, int64_t N, const uint16_t *a,
                             const uint16_t *b, const float *scales, const int32_t *ranks, int64_t rank_stride,
                             int64_t R, const int64_t *seg_end, int64_t nseg, const int64_t *rows,
                             const int64_t *start, const int64_t *len, const int64_t *slot, int64_t n_groups,
                             uint16_t *h) {
#pragma omp parallel
    lora_delta_team(x, K, y, N, a, b, scales, ranks, rank_stride, R, seg_end, (int)nseg, rows, start, len, slot,
                    n_groups, h, (nseg * R + 15) / 16 * 16);
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
