/* GGUF K-quant weights (Q4_K, Q5_K, Q6_K), and (cpu_gguf_q.h) Q4_0, Q4_1, Q8_0, multiplied from their own bits: no dequantized copy of the weight exists.
 * Included once by cpu_kernels.c, after cpu_linear.h (f16_to_f32, rg_status). radixgen.kernels.cpu_gguf repacks
 * the file's blocks (in torch, at load) into the row-major layout read here and checks every call's arguments.
 *
 * Layout: row n of the (N, K) weight is K / 256 super-blocks back to back, each
 *   Q4_K (148 bytes): d, dmin (fp16), sc[8], m[8] (uint8, 6 bits used), qs[128]
 *   Q5_K (180 bytes): d, dmin, sc[8], m[8], qh[32], qs[128]
 * the file's blocks with their packed 6-bit scales and mins spread into a byte each (4 bytes more per block:
 * +2.8% for Q4_K, +2.3% for Q5_K). Value e of a super-block, in chunk c = e / 64 and l = e % 64: sub-block
 * j = e / 32, q = qs[32 c + l % 32] low nibble (l < 32) or high nibble (l >= 32), for Q5_K plus 16 times bit
 * (2 c + (l >= 32)) of qh[l % 32]; w = d sc[j] q - dmin m[j].
 *   Q6_K (210 bytes): the file's block as it is: ql[128], qh[64], sc[16] (int8), d; value e in half h = e / 128,
 *   r = e % 128, c = r / 32, l = r % 32: the low nibble (c < 2) or high nibble of ql[64 h + 32 (c % 2) + l] and
 *   bits 2c, 2c + 1 of qh[32 h + l] above it; w = d sc[e / 16] (q - 32) (no mins).
 *
 * The matmul y (M, N) = x (M, K) @ w^T quantizes each input row to int8 per 256-value super-block first (scale
 * dx = max |x| / 127, and the int8 sums per 16 values for the mins' and Q6_K's -32 terms), then per output and
 * super-block sums every product in int32 (exact: sub-block scale times maddubs pairs, vpdpwssd on VNNI builds)
 * and takes one float32 step per block:
 *   y = sum_blocks dx (d sum_j sc_j sum q x_q  -  dmin sum_j m_j sum x_q)      (Q6_K: d sum_g sc_g sum (q - 32) x_q)
 * Each output is computed by one thread in one fixed order, whatever M is and however the rows are split, so a
 * row's result is the same bits alone and in a batch. Threads take equal runs of output rows; input rows go
 * in chunks of 64 KiB, four at a time against one weight row (read from L1 after the first). The 32-value kinds
 * (cpu_gguf_q.h) keep their inputs per 32 values, through the same driver. */

#include <omp.h>

enum { RG_GK_Q4_K = 0, RG_GK_Q5_K = 1, RG_GK_Q6_K = 2 };
#define GK_QK 256
/* int8 input rows per chunk (each weight row runs over a chunk's rows, 4 at a time): 64 KiB (256 KiB ran 64+ rows of
 * K = 2048 at half the speed of 32: L2-bound; 32 KiB re-read long weight rows too often) */
#define GK_CHUNK_BYTES (64 << 10)

static inline int64_t gk_block_bytes(int64_t kind) { return kind == RG_GK_Q6_K ? 210 : kind == RG_GK_Q5_K ? 180 : 148; }
static inline int64_t gk_row_bytes(int64_t kind, int64_t K); /* (after cpu_gguf_q.h) */

/* x (K float32) -> xq (K int8), xd and xs (K / 32 each: scale, and scale times the sum of the int8 values). The
 * mins' term takes the quantized sum, not the raw one: then both terms see the same x and the error is that of
 * x_q against w itself; with the raw sum it was against d sc q alone, which a file's mins make several times |w|
 * (a tiny Q4_K model's logits moved 6% instead of 1.5%). */
static void gk_quantize_row(const float *x, int64_t K, int8_t *xq, float *xd, float *xs, int16_t *s16) {
    for (int64_t g = 0; g < K / 32; ++g) {
        const float *xg = x + 32 * g;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) {
            const float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) {
            xq[32 * g + i] = (int8_t)lrintf(xg[i] * id);
            sum += xq[32 * g + i];
        }
        xd[g] = amax / 127.f;
        xs[g] = xd[g] * (float)sum;
        for (int t = 0; t < 2; ++t) { /* the int8 sums per 16 values (Q6_K's -32 term) */
            int32_t half = 0;
            for (int i = 16 * t; i < 16 * t + 16; ++i) half += xq[32 * g + i];
            s16[2 * g + t] = (int16_t)half;
        }
    }
}

static inline float gk_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return f16_to_f32(h);
}

/* 6-bit value of element e (0..255) of a super-block */
static inline int gk_q(const uint8_t *blk, int Q5, int e) {
    const uint8_t *qs = blk + (Q5 ? 52 : 20);
    const int c = e / 64, l = e % 64;
    int q = l < 32 ? qs[32 * c + l] & 15 : qs[32 * c + l - 32] >> 4;
    if (Q5) q |= ((blk[20 + l % 32] >> (2 * c + (l >= 32))) & 1) << 4;
    return q;
}

/* Q6_K: q - 32 of element e (0..255) of a block */
static inline int gk6_q(const uint8_t *blk, int e) {
    const int h = e / 128, c = (e % 128) / 32, l = e % 32;
    const uint8_t byte = blk[64 * h + 32 * (c % 2) + l];
    return ((c < 2 ? byte & 15 : byte >> 4) | (((blk[128 + 32 * h + l] >> (2 * c)) & 3) << 4)) - 32;
}

static void gq_block_row(const uint8_t *blk, int64_t kind, float *out);

/* Row n dequantized to float32 (K values). */
static void gk_row(const uint8_t *w, int64_t kind, int64_t K, int64_t n, float *out) {
    if (kind >= 3) { /* RG_GK_Q4_0 .. RG_GK_Q8_0: blocks of 32 */
        const uint8_t *wr = w + n * gk_row_bytes(kind, K);
        for (int64_t b = 0; b < K / 32; ++b) gq_block_row(wr + b * gk_row_bytes(kind, 32), kind, out + 32 * b);
        return;
    }
    const int64_t nb = K / GK_QK, bb = gk_block_bytes(kind);
    const int Q5 = kind == RG_GK_Q5_K;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = w + (n * nb + b) * bb;
        if (kind == RG_GK_Q6_K) {
            const float d = gk_f16(blk + 208);
            for (int e = 0; e < GK_QK; ++e) out[b * GK_QK + e] = d * (float)(int8_t)blk[192 + e / 16] * (float)gk6_q(blk, e);
            continue;
        }
        const float d = gk_f16(blk), dmin = gk_f16(blk + 2);
        for (int e = 0; e < GK_QK; ++e)
            out[b * GK_QK + e] = d * (float)blk[4 + e / 32] * (float)gk_q(blk, Q5, e) - dmin * (float)blk[12 + e / 32];
    }
}

/* The K-quants' inputs: x (K float32) -> xq (K int8) with one scale per 256 values, xd[K / 256] = max |x| / 127 over
 * the super-block, and s16 (K / 16) the int8 sums per 16 values (the mins' and Q6_K's -32 terms). One scale per
 * super-block (not per 32) lets a whole block's products sum in int32, one float32 step per block and row. */
static void gk_quantize_row256(const float *x, int64_t K, int8_t *xq, float *xd, int16_t *s16) {
    for (int64_t b = 0; b < K / GK_QK; ++b) {
        const float *xb = x + GK_QK * b;
        float amax = 0.f;
        for (int i = 0; i < GK_QK; ++i) {
            const float a = fabsf(xb[i]);
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < GK_QK; ++i) xq[GK_QK * b + i] = (int8_t)lrintf(xb[i] * id);
        xd[b] = amax / 127.f;
        for (int g = 0; g < 16; ++g) {
            int32_t sum = 0;
            for (int i = 16 * g; i < 16 * g + 16; ++i) sum += xq[GK_QK * b + i];
            s16[16 * b + g] = (int16_t)sum;
        }
    }
}

/* Portable Q6_K tile: per block the exact integer sum_g sc_g sum (q - 32) x_q, to float32 times d dx. */
static void gk6_tile_portable(const uint8_t *wr, int64_t nb, const int8_t *xq, const float *xd, int64_t K, int MB,
                              float *out) {
    for (int i = 0; i < MB; ++i) {
        const int8_t *xr = xq + i * K;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = wr + b * 210;
            int32_t isum = 0;
            for (int g = 0; g < 16; ++g) {
                int32_t part = 0;
                for (int e = 16 * g; e < 16 * g + 16; ++e) part += gk6_q(blk, e) * xr[b * GK_QK + e];
                isum += part * (int8_t)blk[192 + g];
            }
            acc += gk_f16(blk + 208) * xd[i * (K / 32) + b] * (float)isum;
        }
        out[i] = acc;
    }
}

/* Portable tile: input rows i < MB against weight row wr (nb super-blocks), results into out[i]: per block the
 * exact integers sum_j sc_j sum q x_q and sum_j m_j sum x_q, to float32 times d dx and dmin dx. */
static void gk_tile_portable(const uint8_t *wr, int64_t nb, int64_t bb, int Q5, const int8_t *xq, const float *xd,
                             const int16_t *s16, int64_t K, int MB, float *out) {
    for (int i = 0; i < MB; ++i) {
        const int8_t *xr = xq + i * K;
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = wr + b * bb;
            const int16_t *sb = s16 + i * (K / 16) + b * 16;
            int32_t isum = 0, msum = 0;
            for (int j = 0; j < 8; ++j) {
                int32_t part = 0;
                for (int e = 32 * j; e < 32 * j + 32; ++e) part += gk_q(blk, Q5, e) * xr[b * GK_QK + e];
                isum += part * blk[4 + j];
                msum += blk[12 + j] * (sb[2 * j] + sb[2 * j + 1]);
            }
            const float dx = xd[i * (K / 32) + b];
            acc += gk_f16(blk) * dx * (float)isum - gk_f16(blk + 2) * dx * (float)msum;
        }
        out[i] = acc;
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RG_GK_AVX2 1

static inline float gk_hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* acc + the int16 pairs of p times those of s, summed into int32 (exact): one vpdpwssd with VNNI, madd + add else */
static inline __m256i gk_dot16(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

/* the int16 word pair (lo in the low 128-bit lane, hi in the high one) of a vector holding 8 words per lane, in
 * every word of its lane */
#define GK_WORDS(v, lo, hi) \
    _mm256_shuffle_epi8((v), _mm256_set_m128i(_mm_set1_epi16((short)((2 * (hi) + 1) << 8 | 2 * (hi))), \
                                              _mm_set1_epi16((short)((2 * (lo) + 1) << 8 | 2 * (lo)))))

/* Input rows i < MB against weight row wr: per chunk of 64 values the two sub-blocks' codes unpacked once (32 bytes
 * each) and, per row, maddubs with its int8 values (u8 x s8 pairs into int16, at most 2 * 31 * 127: no saturation),
 * then the pairs times the sub-block scale summed into the row's int32 block sum (vpdpwssd); the mins' term as
 * one madd of the mins against the row's sums per 16; per block and row two FMAs (d dx, dmin dx). */
static inline __attribute__((always_inline)) void gk_tile_avx2(const uint8_t *wr, int64_t nb, const int Q5,
                                                              const int8_t *xq, const float *xd, const int16_t *s16,
                                                              int64_t K, const int MB, float *out) {
    const int64_t bb = Q5 ? 180 : 148, ng = K / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[4];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wr + b * bb, *qs = blk + (Q5 ? 52 : 20);
        _mm_prefetch((const char *)blk + 4 * bb, _MM_HINT_T0); /* the row's stream, a few blocks ahead */
        const __m256i qh = Q5 ? _mm256_loadu_si256((const __m256i *)(blk + 20)) : _mm256_setzero_si256();
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(blk + 4))));
        __m256i is[4];
        for (int i = 0; i < MB; ++i) is[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (Q5) { /* bit 2c (low half) and 2c + 1 (high half) of each qh byte, to bit 4 */
                const __m256i hl = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), one);
                const __m256i hh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + 1)), one);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(hl, 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(hh, 4));
            }
            const __m256i slo = GK_WORDS(sc, 2 * c, 2 * c), shi = GK_WORDS(sc, 2 * c + 1, 2 * c + 1);
            for (int i = 0; i < MB; ++i) {
                const int8_t *xb = xq + i * K + b * GK_QK + 64 * c;
                is[i] = gk_dot16(is[i], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xb)), slo);
                is[i] = gk_dot16(is[i], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb + 32))), shi);
            }
        }
        const __m128i m8 = _mm_loadl_epi64((const __m128i *)(blk + 12));
        const __m256i mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)); /* m0 m0 m1 m1 .. m7 m7 */
        const float d = gk_f16(blk), dmin = gk_f16(blk + 2);
        for (int i = 0; i < MB; ++i) {
            const float dx = xd[i * ng + b];
            const __m256i ms = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)(s16 + i * (K / 16) + b * 16)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[i]), _mm256_set1_ps(d * dx), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(dmin * dx), acc[i]);
        }
    }
    for (int i = 0; i < MB; ++i) out[i] = gk_hsum(acc[i]);
}

/* Q6_K: per 32 values the 6-bit codes q unpacked once (ql nibble, two qh bits above it), and per row maddubs(q, x)
 * (int16 pairs, at most 2 * 63 * 127) times the two 16-value sub-blocks' scales (low and high 128-bit lane) into
 * the row's int32 block sum; the -32 of every code as 32 sum_g sc_g s16_g (one madd) taken off it; per block and
 * row one FMA (d dx). */
static inline __attribute__((always_inline)) void gk6_tile_avx2(const uint8_t *wr, int64_t nb, const int8_t *xq,
                                                               const float *xd, const int16_t *s16, int64_t K,
                                                               const int MB, float *out) {
    const int64_t ng = K / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    __m256 acc[4];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wr + b * 210;
        _mm_prefetch((const char *)blk + 4 * 210, _MM_HINT_T0);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192))); /* s0 .. s15 */
        __m256i is[4];
        for (int i = 0; i < MB; ++i) is[i] = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {
            const __m256i half = _mm256_permute4x64_epi64(sc16, h ? 0xEE : 0x44); /* s8h .. s8h+7, both lanes */
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
            for (int c = 0; c < 4; ++c) {
                const int j = 4 * h + c; /* the 32 values' group in the block: sub-blocks 2j, 2j + 1 */
                const __m256i sc = GK_WORDS(half, 2 * c, 2 * c + 1);
                for (int i = 0; i < MB; ++i) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * GK_QK + 32 * j));
                    is[i] = gk_dot16(is[i], _mm256_maddubs_epi16(q[c], xv), sc);
                }
            }
        }
        const float d = gk_f16(blk + 208);
        for (int i = 0; i < MB; ++i) {
            const __m256i sums = _mm256_loadu_si256((const __m256i *)(s16 + i * (K / 16) + b * 16));
            const __m256i t = _mm256_sub_epi32(is[i], _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(d * xd[i * ng + b]), acc[i]);
        }
    }
    for (int i = 0; i < MB; ++i) out[i] = gk_hsum(acc[i]);
}
#endif

#include "cpu_gguf_q.h" /* Q4_0, Q4_1, Q8_0: the 32-value block kinds' tiles */

static inline int64_t gk_row_bytes(int64_t kind, int64_t K) {
    return gq_is32(kind) ? K / 32 * gq_block_bytes(kind) : K / GK_QK * gk_block_bytes(kind);
}

/* Input rows i < MB (1..4) against weight row wr. */
static void gk_tile(const uint8_t *wr, int64_t nb, int64_t kind, const int8_t *xq, const float *xd,
                    const float *xs, const int16_t *s16, int64_t K, int MB, float *out) {
    if (gq_is32(kind)) {
        gq_tile(wr, K / 32, kind, xq, xd, xs, K, MB, out);
        return;
    }
#ifdef RG_GK_AVX2
#define GK_CASE(mb)                                                                   \
    case mb:                                                                          \
        if (kind == RG_GK_Q6_K)                                                       \
            gk6_tile_avx2(wr, nb, xq, xd, s16, K, mb, out);                           \
        else if (kind == RG_GK_Q5_K)                                                  \
            gk_tile_avx2(wr, nb, 1, xq, xd, s16, K, mb, out);                         \
        else                                                                          \
            gk_tile_avx2(wr, nb, 0, xq, xd, s16, K, mb, out);                         \
        return;
    switch (MB) {
        GK_CASE(1)
        GK_CASE(2)
        GK_CASE(3)
        GK_CASE(4)
    }
#undef GK_CASE
#endif
    if (kind == RG_GK_Q6_K)
        gk6_tile_portable(wr, nb, xq, xd, K, MB, out);
    else
        gk_tile_portable(wr, nb, gk_block_bytes(kind), kind == RG_GK_Q5_K, xq, xd, s16, K, MB, out);
}

static int gk_valid(const uint8_t *w, int64_t kind, int64_t N, int64_t K) {
    const int64_t qk = gq_is32(kind) ? 32 : GK_QK;
    return w && kind >= RG_GK_Q4_K && kind <= RG_GK_Q8_0 && N >= 1 && K >= qk && K % qk == 0;
}

/* y (M, N) float32 = x (M, K) float32 @ w^T; w in kind's layout (above). */
rg_status rg_gguf_k_linear(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t M,
                           float *y) {
    if (!gk_valid(w, kind, N, K) || M < 0 || (M && (!x || !y))) return RG_ERR_UNSUPPORTED;
    if (M == 0) return RG_OK;
#ifdef RG_GQ_GEMM
    if (gq_is32(kind) && M >= GQ_GEMM_MIN_M) return gq_gemm(w, kind, N, K, x, M, y);
#endif
    if (gq_is32(kind) && M <= GQ_POOL_MAX_M) return gq_linear(w, kind, N, K, x, NULL, M, y, NULL); /* cpu_gguf_q.h */
    /* the int8 rows' stride (KS / 32 scales, KS / 16 sums per row): one cache line past K for the K-quants, so that
     * the rows of a tile do not all fall in one L1 set where K is a multiple of 4096 */
    const int64_t KS = gq_is32(kind) ? K : K + 64, ng = KS / 32, nb = K / GK_QK, rb = gk_row_bytes(kind, K);
    int8_t *xq = (int8_t *)malloc((size_t)(M * KS));
    float *xd = (float *)malloc(sizeof(float) * (size_t)(2 * M * ng));
    int16_t *s16 = (int16_t *)malloc(sizeof(int16_t) * (size_t)(2 * M * ng));
    if (!xq || !xd || !s16) {
        free(xq);
        free(xd);
        free(s16);
        return RG_ERR_ALLOC;
    }
    float *xs = xd + M * ng;
    int64_t chunk = (GK_CHUNK_BYTES / KS) & ~(int64_t)3;
    chunk = chunk < 4 ? 4 : chunk;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            if (gq_is32(kind)) /* per 32 values (cpu_gguf_q.h's tiles) */
                gk_quantize_row(x + m * K, K, xq + m * K, xd + m * ng, xs + m * ng, s16 + m * 2 * ng);
            else /* per super-block */
                gk_quantize_row256(x + m * K, K, xq + m * KS, xd + m * ng, s16 + m * 2 * ng);
        }
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t n0 = N * me / team, n1 = N * (me + 1) / team;
        for (int64_t m0 = 0; m0 < M; m0 += chunk) {
            const int64_t mc = M - m0 < chunk ? M - m0 : chunk;
            for (int64_t n = n0; n < n1; ++n) {
                const uint8_t *wr = w + n * rb;
                for (int64_t i = 0; i < mc; i += 4) {
                    const int mb = mc - i < 4 ? (int)(mc - i) : 4;
                    float r[4];
                    const int64_t at = m0 + i;
                    gk_tile(wr, nb, kind, xq + at * KS, xd + at * ng, xs + at * ng, s16 + at * 2 * ng, KS, mb, r);
                    for (int t = 0; t < mb; ++t) y[(at + t) * N + n] = r[t];
                }
            }
        }
    }
    free(xq);
    free(xd);
    free(s16);
    return RG_OK;
}

/* out (n, K) float32: rows ids of w dequantized (an embedding lookup, and the layout's reference reading). */
rg_status rg_gguf_k_rows(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const int64_t *ids, int64_t n,
                         float *out) {
    if (!gk_valid(w, kind, N, K) || n < 0 || (n && (!ids || !out))) return RG_ERR_UNSUPPORTED;
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= N) return RG_ERR_UNSUPPORTED;
#pragma omp parallel for schedule(static) if (n * K >= 65536)
    for (int64_t i = 0; i < n; ++i) gk_row(w, kind, K, ids[i], out + i * K);
    return RG_OK;
}

/* Loading: raw (N rows of K / 256 blocks as the file stores them) -> out in the layout above (Q4_K 144 -> 148 bytes,
 * Q5_K 176 -> 180: the 12 bytes of packed 6-bit scales and mins spread to a byte each), rows in parallel. In C
 * because torch's byte ops over strided slices of a 1.7B model took ~20 s; this is one pass over the bytes. */
rg_status rg_gguf_k_repack(const uint8_t *raw, int64_t kind, int64_t N, int64_t K, uint8_t *out) {
    if (!raw || !out || (kind != RG_GK_Q4_K && kind != RG_GK_Q5_K) || N < 0 || K < GK_QK || K % GK_QK)
        return RG_ERR_UNSUPPORTED;
    const int64_t fb = kind == RG_GK_Q5_K ? 176 : 144, bb = gk_block_bytes(kind), blocks = N * (K / GK_QK);
#pragma omp parallel for schedule(static) if (blocks >= 4096)
    for (int64_t i = 0; i < blocks; ++i) {
        const uint8_t *s = raw + i * fb + 4;
        uint8_t *o = out + i * bb;
        memcpy(o, raw + i * fb, 4); /* d, dmin */
        for (int j = 0; j < 4; ++j) {
            o[4 + j] = s[j] & 63;
            o[12 + j] = s[j + 4] & 63;
            o[8 + j] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
            o[16 + j] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
        }
        memcpy(o + 20, raw + i * fb + 16, (size_t)(fb - 16)); /* (qh) qs */
    }
    return RG_OK;
}

/* Loading, the int8 layout of a Q6_K weight (where a layer runs it on cpu_linear's int8 kernels): q (N, K) int8 the
 * codes minus 32, s (N, K / 16) float32 d times each 16 values' int8 scale; rows in parallel. */
rg_status rg_gguf_q6k_int8(const uint8_t *raw, int64_t N, int64_t K, int8_t *q, float *s) {
    if (!raw || !q || !s || N < 0 || K < GK_QK || K % GK_QK) return RG_ERR_UNSUPPORTED;
    const int64_t blocks = N * (K / GK_QK);
#pragma omp parallel for schedule(static) if (blocks >= 4096)
    for (int64_t i = 0; i < blocks; ++i) {
        const uint8_t *blk = raw + i * 210;
        const float d = gk_f16(blk + 208);
        for (int e = 0; e < GK_QK; ++e) q[i * GK_QK + e] = (int8_t)gk6_q(blk, e);
        for (int g = 0; g < 16; ++g) s[i * 16 + g] = d * (float)(int8_t)blk[192 + g];
    }
    return RG_OK;
}
