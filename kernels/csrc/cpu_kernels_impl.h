/* One dtype's instantiation of the CPU kernels; cpu_kernels.c includes this file once per element type
 * with T (storage type), LD(x) (to float), ST(f) (from float), FN(name) (name with a dtype suffix),
 * LOAD16(p) (16 elements to a float vector) and IS_BF16 defined; the file undefines them at its end.
 * Every kernel computes in float32. Tensors are passed as base pointers plus the strides that vary. */

/* Write this step's K and V rows into the pool: row t goes to slot slots[t]. */
void FN(store_kv)(const T *k, int64_t k_stride, const T *v, int64_t v_stride, T *k_buf, T *v_buf,
                         const int64_t *slots, int64_t n_tok, int64_t row_elems) {
    for (int64_t t = 0; t < n_tok; ++t) {
        memcpy(k_buf + slots[t] * row_elems, k + t * k_stride, (size_t)row_elems * sizeof(T));
        memcpy(v_buf + slots[t] * row_elems, v + t * v_stride, (size_t)row_elems * sizeof(T));
    }
}

#if defined(__AVX512F__)
/* Scores of the G query rows against keys j .. j+15 of a piece, 16 keys at a time: each (row, key) dot
 * product leaves a vector of 16 partial sums and hsum16 turns 16 of them into 16 scores with no
 * per-key horizontal reduction. D must be a multiple of 16. Returns how many keys it scored.
 * The dot products are float32 FMAs of the scaled query rows qf, or with dp (bf16, D a multiple of 32,
 * AVX512-BF16) vdpbf16ps of the unscaled bf16 rows q and the keys as stored (products exact, summed in
 * float32, no conversions), the scale then applied to the 16 scores. */
static inline __attribute__((always_inline)) int64_t FN(qk_blocks16)(
    const float *qf, const T *q, float scale, const int dp, const T *k_buf, const int64_t *slots, int64_t n,
    int64_t Hkv, int64_t h, int64_t G, const int64_t D, float *sc) {
    (void)q, (void)scale, (void)dp;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const T *kr[16];
        for (int jj = 0; jj < 16; ++jj) {
            kr[jj] = k_buf + (slots[j + jj] * Hkv + h) * D;
            if (j + jj + PREFETCH < n) prefetch_row(k_buf + (slots[j + jj + PREFETCH] * Hkv + h) * D, D * sizeof(T));
        }
        for (int64_t g = 0; g < G; ++g) {
            __m512 part[16];
#if defined(__AVX512BF16__) && IS_BF16
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
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), LOAD16(kr[jj]));
                for (int64_t d = 16; d < D; d += 16)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), LOAD16(kr[jj] + d), acc);
                part[jj] = acc;
            }
            _mm512_storeu_ps(sc + g * n + j, hsum16(part));
        }
    }
    return j;
}

/* P.V of a piece for D a multiple of 16, at most 128: the G rows' exponentials sc (G x n) against the V rows,
 * four rows at a time (two at D > 64), so that each V row is loaded and converted once per group instead of
 * once per row; a group past G repeats the last row and is not stored. Writes the D outputs of each row. */
static inline __attribute__((always_inline)) void FN(pv_rows16)(
    const float *sc, int64_t n, const T *v_buf, const int64_t *slots, int64_t Hkv, int64_t h, int64_t G,
    const int64_t D, float *pr) {
    const int R = D <= 64 ? 4 : 2, C = (int)(D / 16);
    for (int64_t g0 = 0; g0 < G; g0 += R) {
        __m512 o[4][8];
        const float *pg[4];
        for (int r = 0; r < R; ++r) {
            pg[r] = sc + (g0 + r < G ? g0 + r : G - 1) * n;
            for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
        }
        for (int64_t j = 0; j < n; ++j) {
            if (g0 == 0 && j + PREFETCH < n) prefetch_row(v_buf + (slots[j + PREFETCH] * Hkv + h) * D, D * sizeof(T));
            const T *vr = v_buf + (slots[j] * Hkv + h) * D;
            __m512 p[4];
            for (int r = 0; r < R; ++r) p[r] = _mm512_set1_ps(pg[r][j]);
            for (int c = 0; c < C; ++c) {
                const __m512 vv = LOAD16(vr + c * 16);
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
static inline __attribute__((always_inline)) void FN(attend_piece)(
    const T *q, float scale, const float *qf, const T *k_buf, const T *v_buf, const int64_t *slots, int64_t n,
    int64_t Hkv, int64_t h, int64_t G, const int64_t D, float *sc, float *pr) {
    int64_t j0 = 0;
    (void)q, (void)scale;
#if defined(__AVX512F__)
    if (D % 32 == 0) /* (the bf16 dot products where the build has them) */
        j0 = FN(qk_blocks16)(qf, q, scale, 1, k_buf, slots, n, Hkv, h, G, D, sc);
    else if (D % 16 == 0)
        j0 = FN(qk_blocks16)(qf, q, scale, 0, k_buf, slots, n, Hkv, h, G, D, sc);
#endif
    for (int64_t j = j0; j < n; ++j) {
        if (j + PREFETCH < n) prefetch_row(k_buf + (slots[j + PREFETCH] * Hkv + h) * D, D * sizeof(T));
        const T *kr = k_buf + (slots[j] * Hkv + h) * D;
        float kf[D_MAX];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) kf[d] = LD(kr[d]);
        for (int64_t g = 0; g < G; ++g) {
            const float *qg = qf + g * D;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; ++d) acc += qg[d] * kf[d];
            sc[g * n + j] = acc;
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
        FN(pv_rows16)(sc, n, v_buf, slots, Hkv, h, G, D, pr);
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
                prefetch_row(v_buf + (slots[j + PREFETCH] * Hkv + h) * D, D * sizeof(T));
            const T *vr = v_buf + (slots[j] * Hkv + h) * D;
            const float p = pg[j];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p * LD(vr[d]);
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
static inline void FN(touch_piece)(const T *k_buf, const T *v_buf, const int64_t *slots, int64_t n,
                                   int64_t row_elems) {
    const size_t row_bytes = (size_t)row_elems * sizeof(T);
    if (2 * (size_t)n * row_bytes > (128 << 10)) return;
    int32_t acc = 0;
    for (int64_t j = 0; j < n; ++j) {
        const char *kr = (const char *)(k_buf + slots[j] * row_elems), *vr = (const char *)(v_buf + slots[j] * row_elems);
        for (size_t off = 0; off < row_bytes; off += 64)
            acc += *(const volatile int32_t *)(kr + off) + *(const volatile int32_t *)(vr + off);
    }
    __asm__ volatile("" : : "r"(acc)); /* keep the loads */
}

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

/* The body of decode_attention (below) for the calling team: qf (H*D floats) and sc (max_piece * G floats) are
 * the calling thread's scratch. */
static void FN(decode_attention_team)(const T *q, int64_t q_stride, const T *k_buf, const T *v_buf,
                                      const int64_t *table, int64_t table_stride, const int64_t *rows,
                                      const int64_t *seq_lens, T *out, int64_t B, int64_t H, int64_t Hkv,
                                      int64_t D, float scale, int64_t splits, float *part, float *qf, float *sc) {
    const int64_t G = H / Hkv;
    const int64_t part_len = G * (D + 2); /* per (b, h, split): G x [max, sum, D outputs] */
    const int64_t n_items = B * splits;
    /* one work item = one piece of one request, all its KV heads: the heads of a slot share its row, so
     * the item streams whole rows */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < n_items; ++item) {
        const int64_t b = item / splits, s = item % splits;
        const int64_t L = seq_lens[b];
        const int64_t chunk = (L + splits - 1) / splits;
        const int64_t j0 = s * chunk, j1 = j0 + chunk < L ? j0 + chunk : L;
        const int64_t n = j1 > j0 ? j1 - j0 : 0;
        const int64_t *slots = table + rows[b] * table_stride + j0;
        FN(touch_piece)(k_buf, v_buf, slots, n, Hkv * D);
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
            case 64: FN(attend_piece)(qg, scale, qf, k_buf, v_buf, slots, n, Hkv, h, G, 64, sc, pr); break;
            case 128: FN(attend_piece)(qg, scale, qf, k_buf, v_buf, slots, n, Hkv, h, G, 128, sc, pr); break;
            default: FN(attend_piece)(qg, scale, qf, k_buf, v_buf, slots, n, Hkv, h, G, D, sc, pr); break;
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
 * k_buf / v_buf (slots, Hkv, D). The query heads h*G .. h*G+G-1 share KV head h.
 * Each request is cut into `splits` pieces along the context so that a few long requests still use every
 * thread; a piece leaves its running max, its sum of exponentials and its unnormalised output in `part`,
 * and the pieces are merged at the end. The work is in decode_attention_team, whose worksharing loops bind
 * to whatever team calls it (here a new one; the fused decode step calls it from inside its own). Each thread
 * allocates its scratch; if any allocation fails, no thread works and the call returns RG_ERR_ALLOC. */
rg_status FN(decode_attention)(const T *q, int64_t q_stride, const T *k_buf, const T *v_buf,
                               const int64_t *table, int64_t table_stride, const int64_t *rows,
                               const int64_t *seq_lens, T *out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                               float scale, int64_t splits, float *part) {
    const int64_t sc_len = FN(max_piece)(seq_lens, B, splits) * (H / Hkv);
    int failed = 0;
#pragma omp parallel
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
            FN(decode_attention_team)(q, q_stride, k_buf, v_buf, table, table_stride, rows, seq_lens, out, B, H,
                                      Hkv, D, scale, splits, part, qf, sc);
        free(sc);
        free(qf);
    }
    return failed ? RG_ERR_ALLOC : RG_OK;
}

/* out = rmsnorm(x [+ residual]) * weight, per row of N. With a residual, the sum (rounded to T, as the
 * unfused torch code rounds it) is written back into `residual` first. x rows have stride x_stride. */
#if defined(__AVX512BF16__) && IS_BF16
/* add_rmsnorm's row for bf16 with N a multiple of 16, 16 lanes at a time: the same float32 operations and
 * roundings in the same order, the sum of squares accumulated in 16 lanes. */
static inline void FN(add_rmsnorm_row16)(const T *xr, T *rr, const T *weight, T *o, int64_t N, float eps) {
    __m512 acc = _mm512_setzero_ps();
    if (rr) {
        for (int64_t i = 0; i < N; i += 16) {
            const __m256bh sum = _mm512_cvtneps_pbh(_mm512_add_ps(load16_bf16(xr + i), load16_bf16(rr + i)));
            _mm256_storeu_si256((__m256i *)(rr + i), (__m256i)sum);
            const __m512 v = _mm512_cvtpbh_ps(sum);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        xr = rr;
    } else {
        for (int64_t i = 0; i < N; i += 16) {
            const __m512 v = load16_bf16(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
    }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)N + eps));
    for (int64_t i = 0; i < N; i += 16) {
        const __m512 y = _mm512_mul_ps(load16_bf16(weight + i), _mm512_mul_ps(load16_bf16(xr + i), inv));
        _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(y));
    }
}
#endif

void FN(add_rmsnorm)(const T *x, int64_t x_stride, T *residual, const T *weight, T *out, int64_t n_rows,
                     int64_t N, float eps) {
#pragma omp parallel for if (n_rows * N >= 65536)
    for (int64_t r = 0; r < n_rows; ++r) {
        const T *xr = x + r * x_stride;
        T *o = out + r * N;
#if defined(__AVX512BF16__) && IS_BF16
        if (N % 16 == 0) {
            FN(add_rmsnorm_row16)(xr, residual ? residual + r * N : NULL, weight, o, N, eps);
            continue;
        }
#endif
        float ss = 0.f;
        if (residual) {
            T *rr = residual + r * N;
            for (int64_t i = 0; i < N; ++i) {
                rr[i] = ST(LD(xr[i]) + LD(rr[i]));
            }
            xr = rr;
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < N; ++i) {
            const float v = LD(xr[i]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)N + eps);
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) o[i] = ST(LD(weight[i]) * (LD(xr[i]) * inv));
    }
}

/* In-place rotate-half rotary embedding of q (T, Hq, D) and k (T, Hk, D); heads are D apart, rows
 * q_stride / k_stride apart. cos_sin (P, D) float32: cos in the first D/2 columns, sin in the rest. */
void FN(rotary)(const int64_t *positions, T *q, int64_t q_stride, int64_t Hq, T *k, int64_t k_stride,
                int64_t Hk, const float *cos_sin, int64_t D, int64_t n_tok) {
    const int64_t half = D / 2;
#pragma omp parallel for if (n_tok * (Hq + Hk) * D >= 65536)
    for (int64_t t = 0; t < n_tok; ++t) {
        const float *c = cos_sin + positions[t] * D, *s = c + half;
        for (int64_t hh = 0; hh < Hq + Hk; ++hh) {
            T *x = hh < Hq ? q + t * q_stride + hh * D : k + t * k_stride + (hh - Hq) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = LD(x[i]), x2 = LD(x[i + half]);
                x[i] = ST(x1 * c[i] - x2 * s[i]);
                x[i + half] = ST(x2 * c[i] + x1 * s[i]);
            }
        }
    }
}

#undef T
#undef LD
#undef ST
#undef FN
#undef LOAD16
#undef IS_BF16
