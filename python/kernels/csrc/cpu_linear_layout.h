/* The weight layouts of the CPU matmuls (described in cpu_linear.h): the descriptor rg_weight, its validity, a
 * row dequantized in plain C (rg_w_row: the embedding gather and the portable path) and the float32-math
 * epilogue (put_result). Every cpu_linear_*.h includes it; it needs only cpu_kernels.c's bf16 helpers. */
#ifndef RG_CPU_LINEAR_LAYOUT_H
#define RG_CPU_LINEAR_LAYOUT_H

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
#endif
