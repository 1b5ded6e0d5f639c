/* GGUF Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 weights multiplied from their own bits, read as the file
 * stores them (no repacking: a weight costs exactly its file bytes). Included once by cpu_kernels.c after
 * cpu_linear.h (f16_to_f32, rg_status); radixgen.kernels.cpu_gguf_more checks every call's arguments.
 *
 * Every type is read in units of 32 consecutive values: 32 int8 codes q (signed, or unsigned for the types with a
 * min) and, per 16 values g, a float scale A_g and offset B_g, with w = A_g q + B_g:
 *   Q5_0    22 bytes / 32: d, qh (32 bits), qs[16]: q = (nibble | bit << 4) - 16            A = d
 *   Q5_1    24 bytes / 32: d, m, qh, qs[16]: q = nibble | bit << 4 (0..31)                   A = d, B = m
 *   IQ4_NL  18 bytes / 32: d, qs[16]: q = the non-linear table at the nibble                A = d
 *   MXFP4   17 bytes / 32: e (E8M0), qs[16]: q = twice the E2M1 value at the nibble         A = 2^(e - 128)
 *   IQ4_XS 136 bytes / 256: d, 16 high bits and 4 low bytes of 8 6-bit scales ls, qs[128]: unit u reads
 *           qs[16 u..16 u + 16) as IQ4_NL                                                    A = d (ls_u - 32)
 *   Q2_K    84 bytes / 256: sc[16] (scale nibble, min nibble), qs[64], d, dmin: unit u = 4 h + j is bits 2j, 2j + 1
 *           of qs[32 h + l]                                                       A = d (sc & 15), B = -dmin (sc >> 4)
 *   Q3_K   110 bytes / 256: hmask[32], qs[64], 12 bytes of 16 6-bit scales, d: unit u = 4 h + j is bits 2j, 2j + 1 of
 *           qs[32 h + l] minus 4 where bit u of hmask[l] is clear                       A = d (sc - 32)
 * For the 32-value types (nibble j of a block: value j from the low nibble of qs[j], value j + 16 from its high one;
 * bit j of qh above value j).
 *
 * y (M, N) = x (M, K) @ w^T quantizes each input row to int8 per 32 values (scale dx = max |x| / 127) and keeps
 * dx times the int8 sum of every 16 values (the offsets' term); per unit, the exact integer sum of q x_q over each
 * 16 values, to float32 times A_g dx:  y = sum_units sum_g A_g dx isum_g  +  sum_g B_g dx sum_g x_q.
 * Each output is computed by one thread in one fixed order, whatever M is and however the rows are split, so a
 * row's result is the same bits alone and in a batch. AVX2: maddubs of |q| against x_q signed by q (no saturation:
 * |q| <= 127), pairs summed by madd; with AVX512-VNNI one dpbusd; a portable C path decodes each block first. */

enum { RG_GM_Q5_0 = 0, RG_GM_Q5_1, RG_GM_Q2_K, RG_GM_Q3_K, RG_GM_IQ4_NL, RG_GM_IQ4_XS, RG_GM_MXFP4, RG_GM_KINDS };
#define GM_CHUNK_BYTES (1 << 18) /* int8 input rows per chunk: 256 KiB */

static const int8_t gm_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t gm_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int gm_qk(int kind) { return kind == RG_GM_Q2_K || kind == RG_GM_Q3_K || kind == RG_GM_IQ4_XS ? 256 : 32; }
static inline int gm_bytes(int kind) {
    static const int b[RG_GM_KINDS] = {22, 24, 84, 110, 18, 136, 17};
    return b[kind];
}
static inline int gm_has_min(int kind) { return kind == RG_GM_Q5_1 || kind == RG_GM_Q2_K; }
static inline int gm_signed(int kind) { return !gm_has_min(kind); }

#ifdef __F16C__
#include <immintrin.h>
#endif

static inline float gm_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return f16_to_f32(h);
#endif
}

static inline float gm_e8m0_half(uint8_t e) { /* 2^(e - 128), the E2M1 codes being twice their values */
    const uint32_t bits = e < 2 ? (uint32_t)0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A and B of the block's 16-value groups (QK / 16 of each; B left alone for the types without a min). */
static inline __attribute__((always_inline)) void gm_scales(const int kind, const uint8_t *blk, float *A, float *B) {
    switch (kind) {
    case RG_GM_Q5_1:
        B[0] = B[1] = gm_f16(blk + 2);
        /* fallthrough */
    case RG_GM_Q5_0:
    case RG_GM_IQ4_NL:
        A[0] = A[1] = gm_f16(blk);
        return;
    case RG_GM_MXFP4:
        A[0] = A[1] = gm_e8m0_half(blk[0]);
        return;
    case RG_GM_IQ4_XS: {
        const float d = gm_f16(blk);
        const int high = blk[2] | blk[3] << 8;
        for (int u = 0; u < 8; ++u) {
            const int ls = ((blk[4 + u / 2] >> (4 * (u % 2))) & 15) | (((high >> (2 * u)) & 3) << 4);
            A[2 * u] = A[2 * u + 1] = d * (float)(ls - 32);
        }
        return;
    }
    case RG_GM_Q2_K: {
        const float d = gm_f16(blk + 80), dmin = gm_f16(blk + 82);
        for (int g = 0; g < 16; ++g) {
            A[g] = d * (float)(blk[g] & 15);
            B[g] = -(dmin * (float)(blk[g] >> 4));
        }
        return;
    }
    case RG_GM_Q3_K: {
        const uint8_t *s = blk + 96;
        const float d = gm_f16(blk + 108);
        for (int g = 0; g < 16; ++g) {
            const int low = g < 8 ? s[g] & 15 : s[g - 8] >> 4;
            A[g] = d * (float)((low | (((s[8 + g % 4] >> (2 * (g / 4))) & 3) << 4)) - 32);
        }
        return;
    }
    }
}

/* The block's QK codes, in value order. */
static void gm_codes(int kind, const uint8_t *blk, int8_t *q) {
    if (kind == RG_GM_Q2_K || kind == RG_GM_Q3_K) {
        for (int u = 0; u < 8; ++u)
            for (int l = 0; l < 32; ++l) {
                int v = (blk[(kind == RG_GM_Q2_K ? 16 : 32) + 32 * (u / 4) + l] >> (2 * (u % 4))) & 3;
                if (kind == RG_GM_Q3_K && !((blk[l] >> u) & 1)) v -= 4;
                q[32 * u + l] = (int8_t)v;
            }
        return;
    }
    if (kind == RG_GM_Q5_0 || kind == RG_GM_Q5_1) {
        const uint8_t *qs = blk + (kind == RG_GM_Q5_1 ? 8 : 6);
        uint32_t qh;
        memcpy(&qh, qs - 4, sizeof qh);
        const int off = kind == RG_GM_Q5_0 ? 16 : 0;
        for (int l = 0; l < 16; ++l) {
            q[l] = (int8_t)(((qs[l] & 15) | ((qh >> l) & 1) << 4) - off);
            q[l + 16] = (int8_t)(((qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4) - off);
        }
        return;
    }
    const int8_t *table = kind == RG_GM_MXFP4 ? gm_mxfp4_values : gm_iq4nl_values;
    const uint8_t *qs = blk + (kind == RG_GM_MXFP4 ? 1 : kind == RG_GM_IQ4_XS ? 8 : 2);
    for (int u = 0; u < gm_qk(kind) / 32; ++u)
        for (int l = 0; l < 16; ++l) {
            q[32 * u + l] = table[qs[16 * u + l] & 15];
            q[32 * u + l + 16] = table[qs[16 * u + l] >> 4];
        }
}

/* x (K float32) -> xq (K int8), xd (K / 32 scales), xs (K / 16: the scale times the int8 sum of each 16 values). */
static void gm_quantize_row(const float *x, int64_t K, int8_t *xq, float *xd, float *xs) {
    for (int64_t g = 0; g < K / 32; ++g) {
        const float *xg = x + 32 * g;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) {
            const float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        xd[g] = amax / 127.f;
        for (int t = 0; t < 2; ++t) {
            int32_t sum = 0;
            for (int i = 16 * t; i < 16 * t + 16; ++i) {
                xq[32 * g + i] = (int8_t)lrintf(xg[i] * id);
                sum += xq[32 * g + i];
            }
            xs[2 * g + t] = xd[g] * (float)sum;
        }
    }
}

/* Portable tile: input rows i < MB against weight row wr (nb blocks), each block decoded once. */
static void gm_tile_portable(const uint8_t *wr, int64_t nb, int kind, const int8_t *xq, const float *xd,
                             const float *xs, int64_t K, int MB, float *out) {
    const int qk = gm_qk(kind), bb = gm_bytes(kind), mins = gm_has_min(kind);
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, accm[4] = {0.f, 0.f, 0.f, 0.f};
    int8_t q[256];
    float A[16], B[16];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wr + b * bb;
        gm_scales(kind, blk, A, B);
        gm_codes(kind, blk, q);
        for (int i = 0; i < MB; ++i) {
            const int8_t *xb = xq + i * K + b * qk;
            const float *db = xd + i * (K / 32) + b * (qk / 32), *sb = xs + i * (K / 16) + b * (qk / 16);
            for (int g = 0; g < qk / 16; ++g) {
                int32_t isum = 0;
                for (int l = 16 * g; l < 16 * g + 16; ++l) isum += q[l] * xb[l];
                acc[i] += (float)isum * (A[g] * db[g / 2]);
                if (mins) accm[i] += B[g] * sb[g];
            }
        }
    }
    for (int i = 0; i < MB; ++i) out[i] = acc[i] + accm[i];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RG_GM_AVX2 1

static inline float gm_hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* 16 bytes of nibbles -> 32 codes: the low nibbles (values 0..15), then the high ones (16..31). */
static inline __m256i gm_nibbles(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

/* The 32 bits of qh -> 32 bytes, 0x10 where the bit is set. */
static inline __m256i gm_high_bits(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(0x10));
}

/* The 32 codes of unit u of a block. */
static inline __attribute__((always_inline)) __m256i gm_unit(const int kind, const uint8_t *blk, const int u) {
    switch (kind) {
    case RG_GM_Q5_0:
        return _mm256_sub_epi8(_mm256_or_si256(gm_nibbles(blk + 6), gm_high_bits(blk + 2)), _mm256_set1_epi8(16));
    case RG_GM_Q5_1:
        return _mm256_or_si256(gm_nibbles(blk + 8), gm_high_bits(blk + 4));
    case RG_GM_IQ4_NL:
    case RG_GM_IQ4_XS:
    case RG_GM_MXFP4: {
        const __m128i t = _mm_loadu_si128((const __m128i *)(kind == RG_GM_MXFP4 ? gm_mxfp4_values : gm_iq4nl_values));
        const uint8_t *qs = kind == RG_GM_MXFP4 ? blk + 1 : kind == RG_GM_IQ4_NL ? blk + 2 : blk + 8 + 16 * u;
        return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), gm_nibbles(qs));
    }
    case RG_GM_Q2_K:
    case RG_GM_Q3_K: {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (kind == RG_GM_Q2_K ? 16 : 32) + 32 * (u / 4)));
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (u % 4))), _mm256_set1_epi8(3));
        if (kind == RG_GM_Q2_K) return lo;
        const __m256i clear = _mm256_cmpeq_epi8(
            _mm256_and_si256(_mm256_loadu_si256((const __m256i *)blk), _mm256_set1_epi8((char)(1 << u))),
            _mm256_setzero_si256());
        return _mm256_sub_epi8(lo, _mm256_and_si256(clear, _mm256_set1_epi8(4)));
    }
    }
    return _mm256_setzero_si256();
}

/* int32 x 8: lanes 0-3 sum the products of values 0..15, lanes 4-7 of 16..31 (a unsigned, b signed bytes). */
static inline __m256i gm_dot(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

static inline __attribute__((always_inline)) void gm_tile_avx2(const uint8_t *wr, int64_t nb, const int kind,
                                                              const int8_t *xq, const float *xd, const float *xs,
                                                              int64_t K, const int MB, float *out) {
    const int qk = gm_qk(kind), bb = gm_bytes(kind), units = qk / 32;
    const int64_t ng = K / 32;
    __m256 acc[4], accm[4]; /* accm: the offsets' term, in explicit FMAs (no order left to the compiler) */
    for (int i = 0; i < MB; ++i) acc[i] = accm[i] = _mm256_setzero_ps();
    float A[16], B[16];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wr + b * bb;
        _mm_prefetch((const char *)blk + (qk == 32 ? 16 : 4) * bb, _MM_HINT_T0); /* the row's stream ahead */
        gm_scales(kind, blk, A, B);
        for (int u = 0; u < units; ++u) {
            const __m256i q = gm_unit(kind, blk, u);
            const __m256i qa = gm_signed(kind) ? _mm256_abs_epi8(q) : q;
            for (int i = 0; i < MB; ++i) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * qk + 32 * u));
                if (gm_signed(kind)) xv = _mm256_sign_epi8(xv, q);
                const float dx = xd[i * ng + b * units + u];
                const __m256 s = _mm256_set_m128(_mm_set1_ps(A[2 * u + 1] * dx), _mm_set1_ps(A[2 * u] * dx));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gm_dot(qa, xv)), s, acc[i]);
            }
        }
        if (gm_has_min(kind))
            for (int i = 0; i < MB; ++i) {
                const float *sb = xs + i * (K / 16) + b * (qk / 16);
                if (qk == 256) {
                    accm[i] = _mm256_fmadd_ps(_mm256_loadu_ps(B), _mm256_loadu_ps(sb), accm[i]);
                    accm[i] = _mm256_fmadd_ps(_mm256_loadu_ps(B + 8), _mm256_loadu_ps(sb + 8), accm[i]);
                } else { /* one min for both halves: lanes 0 and 1 */
                    const __m128 two = _mm_castpd_ps(_mm_load_sd((const double *)sb));
                    accm[i] = _mm256_fmadd_ps(_mm256_set1_ps(B[0]), _mm256_zextps128_ps256(two), accm[i]);
                }
            }
    }
    for (int i = 0; i < MB; ++i) out[i] = gm_hsum(acc[i]) + gm_hsum(accm[i]);
}
#endif

#if defined(RG_GM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RG_GM_AVX512 1
/* AVX-512 (the 32-value types): two units (64 values: two 32-value blocks, or two of a super-block's) per step, one dpbusd of |q|
 * against x_q negated where q < 0; a scale per 16 values spread from four floats. A row of an odd number of 32-value
 * blocks ends on one unit, its other half zero codes against masked-off inputs. */
static inline __attribute__((always_inline)) void gm_tile_avx512(const uint8_t *wr, int64_t nb, const int kind,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t K, const int MB, float *out) {
    const int qk = gm_qk(kind), bb = gm_bytes(kind), units = qk / 32;
    const int64_t ng = K / 32, total = nb * units;
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc[4];
    __m256 accm[4];
    for (int i = 0; i < MB; ++i) {
        acc[i] = _mm512_setzero_ps();
        accm[i] = _mm256_setzero_ps();
    }
    float A[2][16], B[2][16];
    for (int64_t U = 0; U < total; U += 2) {
        const int two = U + 1 < total;
        const int64_t b0 = U / units, b1 = (U + 1) / units;
        const uint8_t *blk0 = wr + b0 * bb, *blk1 = wr + b1 * bb;
        const int u0 = (int)(U % units), u1 = (int)((U + 1) % units);
        if (u0 == 0) {
            _mm_prefetch((const char *)blk0 + (qk == 32 ? 16 : 4) * bb, _MM_HINT_T0);
            gm_scales(kind, blk0, A[0], B[0]);
        }
        if (two && u1 == 0) gm_scales(kind, blk1, A[1], B[1]);
        const float *a0 = A[0] + 2 * u0, *a1 = u1 == 0 ? A[1] : A[0] + 2 * u1;
        const __m128 sc = _mm_setr_ps(a0[0], a0[1], two ? a1[0] : 0.f, two ? a1[1] : 0.f);
        const __m256i q0 = gm_unit(kind, blk0, u0), q1 = two ? gm_unit(kind, blk1, u1) : _mm256_setzero_si256();
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
        const __m512i qa = gm_signed(kind) ? _mm512_abs_epi8(q) : q;
        const __mmask64 neg = _mm512_movepi8_mask(q), in = two ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu;
        for (int i = 0; i < MB; ++i) {
            __m512i xv = _mm512_maskz_loadu_epi8(in, xq + i * K + 32 * U);
            if (gm_signed(kind)) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
            const float *dx = xd + i * ng + U;
            const __m128 d = two ? _mm_castpd_ps(_mm_load_sd((const double *)dx)) : _mm_load_ss(dx);
            const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sc, _mm_unpacklo_ps(d, d))));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qa, xv)), s, acc[i]);
        }
        if (gm_has_min(kind)) /* each block's offsets once, when its last unit is done */
            for (int t = 0; t < 1 + two; ++t) {
                const int64_t b = t ? b1 : b0;
                const int u = t ? u1 : u0;
                if (u != units - 1) continue;
                const float *Bb = t && u1 == 0 ? B[1] : B[0];
                for (int i = 0; i < MB; ++i) {
                    const float *sb = xs + i * (K / 16) + b * (qk / 16);
                    if (qk == 256) {
                        accm[i] = _mm256_fmadd_ps(_mm256_loadu_ps(Bb), _mm256_loadu_ps(sb), accm[i]);
                        accm[i] = _mm256_fmadd_ps(_mm256_loadu_ps(Bb + 8), _mm256_loadu_ps(sb + 8), accm[i]);
                    } else {
                        const __m128 h = _mm_castpd_ps(_mm_load_sd((const double *)sb));
                        accm[i] = _mm256_fmadd_ps(_mm256_set1_ps(Bb[0]), _mm256_zextps128_ps256(h), accm[i]);
                    }
                }
            }
        if (two && u1 == 0) { /* the second block's scales become the first's */
            memcpy(A[0], A[1], sizeof A[0]);
            memcpy(B[0], B[1], sizeof B[0]);
        }
    }
    for (int i = 0; i < MB; ++i) out[i] = _mm512_reduce_add_ps(acc[i]) + gm_hsum(accm[i]);
}
#endif

/* Input rows i < MB (1..4) against weight row wr. */
static void gm_tile(const uint8_t *wr, int64_t nb, int kind, const int8_t *xq, const float *xd, const float *xs,
                    int64_t K, int MB, float *out) {
#ifdef RG_GM_AVX2
#ifdef RG_GM_AVX512 /* the 32-value types; the super-block ones keep the 256-bit tile, whose units unroll per block
                      * (the flat pairs measured up to 3x slower for Q3_K and IQ4_XS) */
#define GM_TILE(...) (gm_qk(kind) == 32 ? gm_tile_avx512(__VA_ARGS__) : gm_tile_avx2(__VA_ARGS__))
#else
#define GM_TILE gm_tile_avx2
#endif
#define GM_KIND(k)                                                                                                 \
    case k:                                                                                                        \
        switch (MB) {                                                                                              \
        case 1: GM_TILE(wr, nb, k, xq, xd, xs, K, 1, out); return;                                                 \
        case 2: GM_TILE(wr, nb, k, xq, xd, xs, K, 2, out); return;                                                 \
        case 3: GM_TILE(wr, nb, k, xq, xd, xs, K, 3, out); return;                                                 \
        default: GM_TILE(wr, nb, k, xq, xd, xs, K, 4, out); return;                                                \
        }
    switch (kind) {
        GM_KIND(RG_GM_Q5_0)
        GM_KIND(RG_GM_Q5_1)
        GM_KIND(RG_GM_Q2_K)
        GM_KIND(RG_GM_Q3_K)
        GM_KIND(RG_GM_IQ4_NL)
        GM_KIND(RG_GM_IQ4_XS)
        GM_KIND(RG_GM_MXFP4)
    }
#undef GM_KIND
#undef GM_TILE
#endif
    gm_tile_portable(wr, nb, kind, xq, xd, xs, K, MB, out);
}

static int gm_valid(const uint8_t *w, int64_t kind, int64_t N, int64_t K) {
    return w && kind >= 0 && kind < RG_GM_KINDS && N >= 1 && K >= gm_qk((int)kind) && K % gm_qk((int)kind) == 0;
}

/* y (M, N) float32 = x (M, K) float32 @ w^T; w (N, K / QK blocks) as the file stores it. */
rg_status rg_gguf_more_linear(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t M,
                              float *y) {
    if (!gm_valid(w, kind, N, K) || M < 0 || (M && (!x || !y))) return RG_ERR_UNSUPPORTED;
    if (M == 0) return RG_OK;
    const int64_t ng = K / 32, nb = K / gm_qk((int)kind), row_bytes = nb * gm_bytes((int)kind);
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xd = (float *)malloc(sizeof(float) * (size_t)(3 * M * ng));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return RG_ERR_ALLOC;
    }
    float *xs = xd + M * ng;
    int64_t chunk = (GM_CHUNK_BYTES / K) & ~(int64_t)3;
    chunk = chunk < 4 ? 4 : chunk;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) gm_quantize_row(x + m * K, K, xq + m * K, xd + m * ng, xs + m * 2 * ng);
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t n0 = N * me / team, n1 = N * (me + 1) / team;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
            for (int64_t n = n0; n < n1; ++n) {
                const uint8_t *wr = w + n * row_bytes;
                for (int64_t i = 0; i < mc; i += 4) {
                    const int mb = mc - i < 4 ? (int)(mc - i) : 4;
                    float r[4];
                    const int64_t at = m0 + i;
                    gm_tile(wr, nb, (int)kind, xq + at * K, xd + at * ng, xs + at * 2 * ng, K, mb, r);
                    for (int t = 0; t < mb; ++t) y[(at + t) * N + n] = r[t];
                }
            }
        }
    }
    free(xq);
    free(xd);
    return RG_OK;
}

/* out (n, K) float32: rows ids of w dequantized, w = A q + B (an embedding lookup, and the reference reading). */
rg_status rg_gguf_more_rows(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const int64_t *ids, int64_t n,
                            float *out) {
    if (!gm_valid(w, kind, N, K) || n < 0 || (n && (!ids || !out))) return RG_ERR_UNSUPPORTED;
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= N) return RG_ERR_UNSUPPORTED;
    const int qk = gm_qk((int)kind), bb = gm_bytes((int)kind), mins = gm_has_min((int)kind);
    const int64_t nb = K / qk;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; ++i) {
        int8_t q[256];
        float A[16], B[16];
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = w + (ids[i] * nb + b) * bb;
            gm_scales((int)kind, blk, A, B);
            gm_codes((int)kind, blk, q);
            float *o = out + i * K + b * qk;
            for (int e = 0; e < qk; ++e) o[e] = mins ? A[e / 16] * (float)q[e] + B[e / 16] : A[e / 16] * (float)q[e];
        }
    }
    return RG_OK;
}
