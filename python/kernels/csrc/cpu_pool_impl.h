/* The KV pool's kernels for one (dtype, pool format); cpu_kernels_impl.h includes this file once per format with
 * KV_FORMAT defined (KV_PLAIN, KV_INT8, KV_FP8: cpu_kv_quant.h), inside its own instantiation for T. From the
 * format: KT (a pool element), KLD(x) (one element to float), KLOAD16(p) (16 to a float vector), KV_SCALED
 * (whether the pool has a bf16 scale per (slot, head), applied after the dot products: to a key's score and
 * to a value's softmax weight) and PFN(name) (the name with the format's and the dtype's suffixes:
 * rg_store_kv_bf16, rg_store_kv_i8_bf16, ...). Undefines them and KV_FORMAT at its end. */
#ifndef ATT_TEAM_MIN_WORK
/* K and V values (summed over the batch's rows) from which decode attention runs on the OpenMP team: below it a
 * step is a few microseconds of work, less than the team's fork and join, and a team member the OS has not
 * scheduled (a core shared with other processes) would stall the step for a time slice */
#define ATT_TEAM_MIN_WORK (1 << 17)
#endif
#if KV_FORMAT == KV_PLAIN
#define KT T
#define KLD(x) LD(x)
#define KLOAD16(p) LOAD16(p)
#define KV_SCALED 0
#define PFN(name) FN(name)
#elif KV_FORMAT == KV_INT8
#define KT int8_t
#define KLD(x) ((float)(x))
#define KLOAD16(p) load16_i8(p)
#define KV_SCALED 1
#define KV_QUANT_ROW(x, D, codes) kv_quant_row(x, D, codes, 0)
#define PFN(name) FN(name##_i8)
#else
#define KT uint8_t
#define KLD(x) e4m3_to_f32(x)
#define KLOAD16(p) load16_e4m3(p)
#define KV_SCALED 1
#define KV_QUANT_ROW(x, D, codes) kv_quant_row(x, D, codes, 1)
#define PFN(name) FN(name##_f8)
#endif

#if KV_SCALED
/* Quantize this step's K and V rows into the pool: head h of row t becomes the D codes of (slots[t], h) and
 * their scale, written once (cpu_kv_quant.h). Rows are k_stride / v_stride apart, heads D. */
void PFN(store_kv)(const T *k, int64_t k_stride, const T *v, int64_t v_stride, KT *k_buf, KT *v_buf,
                   uint16_t *k_scale, uint16_t *v_scale, const int64_t *slots, int64_t n_tok, int64_t Hkv,
                   int64_t D) {
#pragma omp parallel for if (n_tok * Hkv * D >= 65536)
    for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t h = 0; h < Hkv; ++h) {
            const int64_t at = slots[t] * Hkv + h; /* the (slot, head) row */
            float kf[D_MAX], vf[D_MAX];
            for (int64_t d = 0; d < D; ++d) {
                kf[d] = LD(k[t * k_stride + h * D + d]);
                vf[d] = LD(v[t * v_stride + h * D + d]);
            }
            k_scale[at] = KV_QUANT_ROW(kf, D, k_buf + at * D);
            v_scale[at] = KV_QUANT_ROW(vf, D, v_buf + at * D);
        }
}
#else
/* Write this step's K and V rows into the pool: row t goes to slot slots[t]. */
void FN(store_kv)(const T *k, int64_t k_stride, const T *v, int64_t v_stride, T *k_buf, T *v_buf,
                         const int64_t *slots, int64_t n_tok, int64_t row_elems) {
    for (int64_t t = 0; t < n_tok; ++t) {
        memcpy(k_buf + slots[t] * row_elems, k + t * k_stride, (size_t)row_elems * sizeof(T));
        memcpy(v_buf + slots[t] * row_elems, v + t * v_stride, (size_t)row_elems * sizeof(T));
    }
}
#endif

#if defined(__AVX512F__)
/* Scores of the G query rows against keys j .. j+15 of a piece, 16 keys at a time: each (row, key) dot
 * product leaves a vector of 16 partial sums and hsum16 turns 16 of them into 16 scores with no
 * per-key horizontal reduction. D must be a multiple of 16. Returns how many keys it scored.
 * The dot products are float32 FMAs of the scaled query rows qf, or with dp (bf16, D a multiple of 32,
 * AVX512-BF16) vdpbf16ps of the unscaled bf16 rows q and the keys as stored (products exact, summed in
 * float32, no conversions), the scale then applied to the 16 scores. */
static inline __attribute__((always_inline)) int64_t PFN(qk_blocks16)(
    const float *qf, const T *q, float scale, const int dp, const KT *k_buf, const uint16_t *k_scale,
    const int64_t *slots, int64_t n, int64_t Hkv, int64_t h, int64_t G, const int64_t D, float *sc) {
    (void)q, (void)scale, (void)dp, (void)k_scale;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const KT *kr[16];
#if KV_SCALED
        float ks[16]; /* the 16 keys' scales */
#endif
        for (int jj = 0; jj < 16; ++jj) {
            kr[jj] = k_buf + (slots[j + jj] * Hkv + h) * D;
#if KV_SCALED
            ks[jj] = bf16_to_f32(k_scale[slots[j + jj] * Hkv + h]);
#endif
            if (j + jj + PREFETCH < n) prefetch_row(k_buf + (slots[j + jj + PREFETCH] * Hkv + h) * D, D * sizeof(KT));
        }
        for (int64_t g = 0; g < G; ++g) {
            __m512 part[16];
#if defined(__AVX512BF16__) && IS_BF16 && !KV_SCALED
            if (dp) {
                const T *qg = q + g * D;
                for (int jj = 0; jj < 16; ++jj) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t d = 0; d < D; d += 32)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + d),
                                               (__m512bh)_mm512_loadu_si512(kr[jj] + d));
                    part[jj] = acc;
                }
                _mm512_storeu_ps(sc + g * n + j, _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scale)));
                continue;
            }
#endif
            const float *qg = qf + g * D;
            for (int jj = 0; jj < 16; ++jj) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), KLOAD16(kr[jj]));
                for (int64_t d = 16; d < D; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), KLOAD16(kr[jj] + d), acc);
                part[jj] = acc;
            }
#if KV_SCALED
            _mm512_storeu_ps(sc + g * n + j, _mm512_mul_ps(hsum16(part), _mm512_loadu_ps(ks)));
#else
            _mm512_storeu_ps(sc + g * n + j, hsum16(part));
#endif
        }
    }
    return j;
}

/* P.V of a piece for D a multiple of 16, at most 128: the G rows' exponentials sc (G x n) against the V rows,
 * four rows at a time (two at D > 64), so that each V row is loaded and converted once per group instead of
 * once per row; a group past G repeats the last row and is not stored. Writes the D outputs of each row. */
static inline __attribute__((always_inline)) void PFN(pv_rows16)(
    const float *sc, int64_t n, const KT *v_buf, const uint16_t *v_scale, const int64_t *slots, int64_t Hkv,
    int64_t h, int64_t G, const int64_t D, float *pr) {
    (void)v_scale;
    const int R = D <= 64 ? 4 : 2, C = (int)(D / 16);
    for (int64_t g0 = 0; g0 < G; g0 += R) {
        __m512 o[4][8];
        const float *pg[4];
        for (int r = 0; r < R; ++r) {
            pg[r] = sc + (g0 + r < G ? g0 + r : G - 1) * n;
            for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < n; ++j) {
            if (g0 == 0 && j + PREFETCH < n) prefetch_row(v_buf + (slots[j + PREFETCH] * Hkv + h) * D, D * sizeof(KT));
            const KT *vr = v_buf + (slots[j] * Hkv + h) * D;
            const float vs = KV_SCALED ? bf16_to_f32(v_scale[slots[j] * Hkv + h]) : 1.f; /* into the weights */
            __m512 p[4];
            for (int r = 0; r < R; ++r) p[r] = _mm512_set1_ps(KV_SCALED ? pg[r][j] * vs : pg[r][j]);
            for (int c = 0; c < C; ++c) {
                const __m512 vv = KLOAD16(vr + c * 16);
                for (int r = 0; r < R; ++r) o[r][c] = _mm512_fmadd_ps(p[r], vv, o[r][c]);
            }
        }
        for (int r = 0; r < R && g0 + r < G; ++r)
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(pr + (g0 + r) * (D + 2) + 2 + c * 16, o[r][c]);
    }
}
#endif

/* One piece of decode attention: the G query rows of one KV head h (q: as stored; qf: float32, scaled) against
 * positions j0 .. j0+n-1 of one request. Leaves per query row [max score, sum of exponentials, D unnormalised
 * outputs] in pr. Inlined with D a constant for the common head sizes, so the row loops fully unroll. */
static inline __attribute__((always_inline)) void PFN(attend_piece)(
    const T *q, float scale, const float *qf, const KT *k_buf, const KT *v_buf, const uint16_t *k_scale,
    const uint16_t *v_scale, const int64_t *slots, int64_t n, int64_t Hkv, int64_t h, int64_t G, const int64_t D,
    float *sc, float *pr) {
    int64_t j0 = 0;
    (void)q, (void)scale, (void)k_scale, (void)v_scale;
#if defined(__AVX512F__)
    if (D % 32 == 0 && !KV_SCALED) /* (the bf16 dot products where the build has them) */
        j0 = PFN(qk_blocks16)(qf, q, scale, 1, k_buf, k_scale, slots, n, Hkv, h, G, D, sc);
    else if (D % 16 == 0)
        j0 = PFN(qk_blocks16)(qf, q, scale, 0, k_buf, k_scale, slots, n, Hkv, h, G, D, sc);
#endif
    for (int64_t j = j0; j < n; ++j) {
        if (j + PREFETCH < n) prefetch_row(k_buf + (slots[j + PREFETCH] * Hkv + h) * D, D * sizeof(KT));
        const KT *kr = k_buf + (slots[j] * Hkv + h) * D;
        const float ks = KV_SCALED ? bf16_to_f32(k_scale[slots[j] * Hkv + h]) : 1.f;
        float kf[D_MAX];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kf[d] = KLD(kr[d]);
        for (int64_t g = 0; g < G; ++g) {
            const float *qg = qf + g * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qg[d] * kf[d];
            sc[g * n + j] = KV_SCALED ? acc * ks : acc;
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float *sg = sc + g * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = sg[j] > m ? sg[j] : m;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
            sg[j] = exp_f32(sg[j] - m);
            sum += sg[j];
        }
        pr[g * (D + 2)] = m;
        pr[g * (D + 2) + 1] = sum;
    }
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 128) {
        PFN(pv_rows16)(sc, n, v_buf, v_scale, slots, Hkv, h, G, D, pr);
        return;
    }
#endif
    for (int64_t g = 0; g < G; ++g) {
        float o[D_MAX];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
        const float *pg = sc + g * n;
        for (int64_t j = 0; j < n; ++j) {
            if (g == 0 && j + PREFETCH < n)
                prefetch_row(v_buf + (slots[j + PREFETCH] * Hkv + h) * D, D * sizeof(KT));
            const KT *vr = v_buf + (slots[j] * Hkv + h) * D;
            const float p = KV_SCALED ? pg[j] * bf16_to_f32(v_scale[slots[j] * Hkv + h]) : pg[j];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p * KLD(vr[d]);
        }
        float *po = pr + g * (D + 2) + 2;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) po[d] = o[d];
    }
}

/* A piece's K and V rows (every head), loaded once up front, one word per cache line, when they are at most
 * 128 KiB: the line misses then overlap, as many as the core tracks, instead of each key waiting on its own DRAM
 * round trip, which at batch 1 is most of the attention's time. Plain loads: software prefetches were dropped
 * often enough here to be measurably slower. */
static inline void PFN(touch_piece)(const KT *k_buf, const KT *v_buf, const int64_t *slots, int64_t n,
                                    int64_t row_elems) {
    const size_t row_bytes = (size_t)row_elems * sizeof(KT);
    if (2 * (size_t)n * row_bytes > (128 << 10)) return;
    int32_t acc = 0;
    for (int64_t j = 0; j < n; ++j) {
        const char *kr = (const char *)(k_buf + slots[j] * row_elems), *vr = (const char *)(v_buf + slots[j] * row_elems);
        for (size_t off = 0; off < row_bytes; off += 64)
            acc += *(const volatile int32_t *)(kr + off) + *(const volatile int32_t *)(vr + off);
    }
    __asm__ volatile("" : : "r"(acc)); /* keep the loads */
}

#if KV_FORMAT == KV_PLAIN
/* The longest piece of decode attention's work items: the score buffer holds that many positions per query row
 * of a KV head (G of them). */
static inline int64_t FN(max_piece)(const int64_t *seq_lens, int64_t B, int64_t splits) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t piece = (seq_lens[b] + splits - 1) / splits;
        longest = piece > longest ? piece : longest;
    }
    return longest;
}
#endif

/* The body of decode_attention (below) for the calling team: qf (H*D floats) and sc (max_piece * G floats) are
 * the calling thread's scratch. */
static void PFN(decode_attention_team)(const T *q, int64_t q_stride, const KT *k_buf, const KT *v_buf,
                                       const uint16_t *k_scale, const uint16_t *v_scale, const int64_t *table,
                                       int64_t table_stride, const int64_t *rows, const int64_t *seq_lens, T *out,
                                       int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, int64_t splits,
                                       int64_t piece, float *part, float *qf, float *sc) {
    const int64_t G = H / Hkv;
    const int64_t part_len = G * (D + 2); /* per (b, h, split): G x [max, sum, D outputs] */
    const int64_t n_items = B * splits;
    /* one work item = one piece of one request, all its KV heads: the heads of a slot share its row, so
     * the item streams whole rows */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; ++item) {
        const int64_t b = item / splits, s = item % splits;
        const int64_t L = seq_lens[b];
        const int64_t chunk = piece > 0 ? piece : (L + splits - 1) / splits;
        const int64_t j0 = s * chunk, j1 = j0 + chunk < L ? j0 + chunk : L;
        const int64_t n = j1 > j0 ? j1 - j0 : 0;
        const int64_t *slots = table + rows[b] * table_stride + j0;
        PFN(touch_piece)(k_buf, v_buf, slots, n, Hkv * D);
        for (int64_t h = 0; h < Hkv; ++h) {
            float *pr = part + ((b * Hkv + h) * splits + s) * part_len;
            if (n == 0) { /* an empty piece: contributes nothing */
                for (int64_t g = 0; g < G; ++g) { pr[g * (D + 2)] = -INFINITY; pr[g * (D + 2) + 1] = 0.f; }
                continue;
            }
            for (int64_t g = 0; g < G; ++g) {
                const T *qr = q + b * q_stride + (h * G + g) * D;
                for (int64_t d = 0; d < D; ++d) qf[g * D + d] = LD(qr[d]) * scale;
            }
            const T *qg = q + b * q_stride + h * G * D;
            switch (D) {
#define ATTEND(d) PFN(attend_piece)(qg, scale, qf, k_buf, v_buf, k_scale, v_scale, slots, n, Hkv, h, G, d, sc, pr)
            case 64: ATTEND(64); break;
            case 128: ATTEND(128); break;
            default: ATTEND(D); break;
#undef ATTEND
            }
        }
    }
    /* merge the pieces of each (request, query head) */
#pragma omp for
    for (int64_t bq = 0; bq < B * H; ++bq) {
        const int64_t b = bq / H, hq = bq % H, h = hq / G, g = hq % G;
        const float *first = part + ((b * Hkv + h) * splits) * part_len + g * (D + 2);
        float m = -INFINITY;
        for (int64_t s = 0; s < splits; ++s) {
            const float ms = first[s * part_len];
            m = ms > m ? ms : m;
        }
        float acc[D_MAX];
        float total = 0.f;
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
        for (int64_t s = 0; s < splits; ++s) {
            const float *pr = first + s * part_len;
            if (pr[1] == 0.f) continue;
            const float w = exp_f32(pr[0] - m);
            total += w * pr[1];
            for (int64_t d = 0; d < D; ++d) acc[d] += w * pr[2 + d];
        }
        T *o = out + (b * H + hq) * D;
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = ST(acc[d] * inv);
    }
}

/* Decode attention through the request->slot table.
 * q (B, H, D) with row stride q_stride, head stride D; out (B, H, D) contiguous.
 * k_buf / v_buf (slots, Hkv, D), and for an 8-bit pool k_scale / v_scale (slots, Hkv). The query heads
 * h*G .. h*G+G-1 share KV head h.
 * Each request is cut into `splits` pieces along the context so that a few long requests still use every
 * thread; a piece leaves its running max, its sum of exponentials and its unnormalised output in `part`,
 * and the pieces are merged at the end, in the order of their positions. piece > 0 fixes the pieces instead:
 * positions [s piece, (s + 1) piece) of every request (splits >= ceil(longest / piece) of them, those past a
 * request's context empty), so that a query's sums run in an order set by its own context length alone, not by
 * the batch it is in (the deterministic mode); piece == 0: `splits` equal pieces of each context. The work is in decode_attention_team, whose worksharing loops bind
 * to whatever team calls it (here a new one; the fused decode step calls it from inside its own). Each thread
 * allocates its scratch; if any allocation fails, no thread works and the call returns RG_ERR_ALLOC. */
#if KV_SCALED
rg_status PFN(decode_attention)(const T *q, int64_t q_stride, const KT *k_buf, const KT *v_buf,
                                const uint16_t *k_scale, const uint16_t *v_scale, const int64_t *table,
                                int64_t table_stride, const int64_t *rows, const int64_t *seq_lens, T *out,
                                int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, int64_t splits,
                                int64_t piece, float *part) {
#else
rg_status FN(decode_attention)(const T *q, int64_t q_stride, const T *k_buf, const T *v_buf,
                               const int64_t *table, int64_t table_stride, const int64_t *rows,
                               const int64_t *seq_lens, T *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                               float scale, int64_t splits, int64_t piece, float *part) {
    const uint16_t *k_scale = NULL, *v_scale = NULL;
#endif
    if (piece > 0 && !pieces_cover(seq_lens, B, 0, splits, piece)) return RG_ERR_UNSUPPORTED;
    const int64_t sc_len = (piece > 0 ? piece : FN(max_piece)(seq_lens, B, splits)) * (H / Hkv);
    int failed = 0;
    int64_t work = 0; /* K and V values read: a short step (a few microseconds) runs on the calling thread alone */
    for (int64_t b = 0; b < B; ++b) work += seq_lens[b] * Hkv * D;
#pragma omp parallel if (work >= ATT_TEAM_MIN_WORK)
    {
        float *qf = (float *)malloc(sizeof(float) * (size_t)(H * D));
        float *sc = (float *)malloc(sizeof(float) * (size_t)(sc_len > 0 ? sc_len : 1));
        if (!qf || !sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        int stop;
#pragma omp atomic read
        stop = failed;
        if (!stop) /* the same answer in every thread: all of them meet the worksharing loops, or none */
            PFN(decode_attention_team)(q, q_stride, k_buf, v_buf, k_scale, v_scale, table, table_stride, rows,
                                       seq_lens, out, B, H, Hkv, D, scale, splits, piece, part, qf, sc);
        free(sc);
        free(qf);
    }
    return failed ? RG_ERR_ALLOC : RG_OK;
}

#undef KT
#undef KLD
#undef KLOAD16
#undef KV_SCALED
#undef PFN
#undef KV_QUANT_ROW
#undef KV_FORMAT
