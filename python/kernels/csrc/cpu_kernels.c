/* radixgen's CPU kernels: decode attention through the slot table, KV store, fused residual-add RMSNorm
 * and in-place rotary embedding, for float32 and bfloat16 tensors. Built on first use
 * by radixgen.kernels.cpu (cc -O3 -march=native -fopenmp, or an explicit instruction set) and called through
 * ctypes; OpenMP resolves to the libgomp that torch has already loaded, so these kernels share torch's thread
 * pool. Every exported function (no `static`) has one declaration in radixgen/kernels/_cpu_bindings.py,
 * checked against these prototypes by tests/kernels/test_cpu_bindings.py: change both together.
 *
 * Longer than 400 lines: it is the one translation unit, holding every exported entry point (the kernels
 * themselves live in the headers it includes), so that each build is one compiler call and one library. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define D_MAX 512

/* What a kernel that can fail returns; the bindings raise on anything but RG_OK. */
typedef int rg_status;
enum { RG_OK = 0, RG_ERR_ALLOC = 1, RG_ERR_UNSUPPORTED = 2, RG_ERR_SCRATCH = 3 };

/* Bytes of scratch sized for n elements of `size` bytes, rounded up to a cache line. */
static inline size_t rg_span(int64_t n, size_t size) { return ((size_t)n * size + 63) & ~(size_t)63; }
/* Whether `splits` fixed pieces of `piece` positions cover every context lens[i] + add (i < n). */
static inline int pieces_cover(const int64_t *lens, int64_t n, int64_t add, int64_t splits, int64_t piece) {
    for (int64_t i = 0; i < n; ++i)
        if (lens[i] + add > splits * piece) return 0;
    return 1;
}

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN; branch-free */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* Slots are scattered over the pool, so the hardware prefetcher cannot follow a request's rows: attention
 * asks for the row PREFETCH positions ahead while it works on the current one. */
#define PREFETCH 16

static inline void prefetch_row(const void *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

/* exp for float32 that the compiler can vectorize (glibc's expf is a scalar call): 2^(x log2 e) as
 * 2^i * 2^f with i the nearest integer and |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error
 * about 1e-7). Arguments are clamped to the range whose result is a normal float, so exp(-inf) gives
 * 1.2e-38 rather than 0; callers that need an exact zero test for it. Needs -fno-trapping-math to vectorize
 * (floorf). */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.4426950408889634f;
    const float i = floorf(t + 0.5f);
    const float f = t - i;
    float p = 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)i + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* v[0..15] hold 16 partial sums each, one vector per key; returns the vector of the 16 keys' totals.
 * Each round adds even lanes to odd lanes across a pair of vectors, halving the partials per key and
 * packing two keys' halves into one vector; after four rounds lane i is key i's total. */
static inline __m512 hsum16(__m512 v[16]) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int w = 16; w > 1; w /= 2)
        for (int i = 0; i < w / 2; ++i)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], even, v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], odd, v[2 * i + 1]));
    return v[0];
}

/* 2^f for |f| <= 1/2 on 16 lanes: exp_f32's polynomial. */
static inline __m512 pow2_frac512(__m512 f) {
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

/* exp_f32 on 16 lanes (same polynomial and clamping). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 p = pow2_frac512(_mm512_sub_ps(t, i));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(i), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* 2^x on 16 lanes for x <= 0 (a softmax's shifted scores, base 2): 2^i * 2^f with i the nearest integer,
 * scaled by vscalefps, which underflows to an exact 0 (x = -1e30 gives 0; -inf and NaN are not allowed). */
static inline __m512 exp2_nonpos512(__m512 x) {
    const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(pow2_frac512(_mm512_sub_ps(x, i)), i);
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

#include "cpu_kv_quant.h" /* 8-bit KV pools: int8 and fp8 e4m3 codes with a bf16 scale per (slot, head) */

int rg_d_max(void) { return D_MAX; }

#define T float
#define LD(x) (x)
#define ST(f) (f)
#define FN(name) rg_##name##_f32
#define LOAD16(p) load16_f32(p)
#define IS_BF16 0
#include "cpu_kernels_impl.h" /* undefines T, LD, ST, FN, LOAD16 and IS_BF16 */

#define T uint16_t
#define LD(x) bf16_to_f32(x)
#define ST(f) f32_to_bf16(f)
#define FN(name) rg_##name##_bf16
#define LOAD16(p) load16_bf16(p)
#define IS_BF16 1
#include "cpu_kernels_impl.h" /* undefines T, LD, ST, FN, LOAD16 and IS_BF16 */

#include "cpu_lora.h" /* LoRA deltas of the fused decode step */
#include "cpu_linear.h" /* rg_weight and the matmuls over it */
#include "cpu_moe.h" /* expert blocks: routing and the grouped experts (rg_moe_layer) */
#include "cpu_bitmask.h" /* a grammar's token bitmask over float32 logits */
#include "cpu_kv_copy.h" /* row copies between KV pools (the hierarchical cache's tiers), every layer at once */
#include "cpu_gguf_k.h" /* GGUF Q4_K / Q5_K weights multiplied from their own bits */
#include "cpu_gguf_more.h" /* GGUF Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4 from their own bits */
#include "cpu_linear_f32_fixed.h" /* the deterministic mode's float32 matmul: one fixed chain per output */

typedef struct { /* one decoder layer: bf16 norm weights and bias, the four matmuls' weights, KV buffers */
    const uint16_t *input_norm, *qkv_bias, *post_norm;
    rg_weight qkv, o, gate_up, down;
    void *k_buf, *v_buf; /* (slots, Hkv, D): bf16, or the 8-bit codes of kv_format */
    const uint16_t *q_norm, *k_norm; /* (D,) RMSNorm over each query / key head before rotary (Qwen3), or NULL */
    uint16_t *k_scale, *v_scale; /* (slots, Hkv) bf16 scales of an 8-bit pool, else NULL */
    int64_t kv_format; /* KV_PLAIN, KV_INT8 or KV_FP8 (cpu_kv_quant.h) */
    const rg_lora_layer_bf16 *lora;  /* the adapters' weights for this layer (cpu_lora.h), or NULL */
    const rg_moe_layer *moe; /* an expert block in place of the gated MLP (cpu_moe.h; gate_up, down unused), or NULL */
} rg_layer_bf16;

#include "cpu_parallel.h" /* rg_parallel: the fused decode step on one rank of a tensor / pipeline parallel group */

/* The bfloat16-only entry points (AVX512-BF16). A build without it defines each as a stub returning
 * RG_ERR_UNSUPPORTED (at the end of this file); these prototypes make the compiler hold both to one signature. */
int rg_has_decode_step(void);
rg_status rg_silu_and_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I);
int64_t rg_decode_step_scratch_bytes_bf16(int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                                          int64_t inter, int64_t max_piece, int64_t threads);
rg_status rg_decode_step_bf16(const rg_layer_bf16 *layers, int64_t n_layers, const uint16_t *final_norm,
                              const rg_weight *lm_head, float *logits, const rg_weight *embed,
                              const int64_t *ids, int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                              int64_t inter, float eps, float scale, const int64_t *positions, const float *cos_sin,
                              const int64_t *out_slots, const int64_t *table, int64_t table_stride,
                              const int64_t *rows, int64_t splits, int64_t piece, uint16_t *x, uint16_t *out,
                              uint16_t *res_a, uint16_t *res_b, uint16_t *qkv, uint16_t *attn, uint16_t *gu, float *part,
                              void *scratch, int64_t scratch_bytes, int64_t threads, const rg_parallel *par);
rg_status rg_extend_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_buf,
                                   const uint16_t *v_buf, const int64_t *table, int64_t table_stride,
                                   const int64_t *rows, const int64_t *prefix_lens, const int64_t *extend_lens,
                                   const int64_t *q_start, uint16_t *out, int64_t B, int64_t H, int64_t Hkv,
                                   int64_t D, float scale, uint16_t *pack);
/* The same over 8-bit pools (KV_QUANT_EXTEND names one per code type). */
#define KV_QUANT_EXTEND(name, KT)                                                                                 \
    rg_status name(const uint16_t *q, int64_t q_stride, const KT *k_buf, const KT *v_buf, const uint16_t *k_scale, \
                   const uint16_t *v_scale, const int64_t *table, int64_t table_stride, const int64_t *rows,       \
                   const int64_t *prefix_lens, const int64_t *extend_lens, const int64_t *q_start, uint16_t *out,  \
                   int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, uint16_t *pack)
KV_QUANT_EXTEND(rg_extend_attention_i8_bf16, int8_t);
KV_QUANT_EXTEND(rg_extend_attention_f8_bf16, uint8_t);

/* ------------------------------------------------------------------------------------------------------
 * The fused decode step (bfloat16, CPUs with AVX512-BF16): every decoder layer of a Llama-family model
 * (optional qkv bias, optional per-head q/k RMSNorm, SiLU-gated MLP) for a small decode batch, in one call and one OpenMP team. At batch 1
 * the step is the weights streaming through the matmuls; the unfused path adds a Python round trip and a
 * thread fork/join per op between them, which this removes. Roundings follow the unfused path: every op
 * rounds its output to bf16, norms and attention compute in float32. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)

#include <omp.h>

/* One row of (2I) gate|up -> (I): silu(gate), rounded to bf16 as torch's silu returns it, times up. */
static inline void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t I) {
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
        const __m512 a = load16_bf16(g + i);
        const __m512 s = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        const __m512 sr = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(s));
        const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(sr, load16_bf16(u + i)));
        memcpy(o + i, &r, sizeof r);
    }
    for (; i < I; ++i) {
        const float a = bf16_to_f32(g[i]);
        const float s = bf16_to_f32(f32_to_bf16(a / (1.f + exp_f32(-a))));
        o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
    }
}

/* (M, 2I) gate|up -> (M, I) for the calling thread. */
static void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I) {
    for (int64_t m = 0; m < M; ++m) silu_mul_row_bf16(gu + m * 2 * I, gu + m * 2 * I + I, out + m * I, I);
}

/* The same over a new team, rows split between its threads: the MLP activation of a prefill. */
rg_status rg_silu_and_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (M * I >= 32768)
    for (int64_t m = 0; m < M; ++m) silu_mul_row_bf16(gu + m * 2 * I, gu + m * 2 * I + I, out + m * I, I);
    return RG_OK;
}

#include "cpu_moe_step.h" /* the expert block in the team */

/* The group sums an int4 matmul reads, per thread: M rows x (widest input) / 32 (the smallest int4 group). */
static inline size_t step_sums_bytes(int64_t M, int64_t hidden, int64_t H, int64_t D, int64_t inter) {
    const int64_t widest = hidden > inter ? (hidden > H * D ? hidden : H * D) : (inter > H * D ? inter : H * D);
    return rg_span(M * (widest / 32 + 1), sizeof(float));
}

/* The fused step's KV store and decode attention (the unfused kernels' code) for the layer's pool format. */
static void layer_store_kv_bf16(const rg_layer_bf16 *ly, const uint16_t *k, const uint16_t *v, int64_t stride,
                                const int64_t *slots, int64_t M, int64_t Hkv, int64_t D) {
    if (ly->kv_format == KV_INT8)
        rg_store_kv_i8_bf16(k, stride, v, stride, ly->k_buf, ly->v_buf, ly->k_scale, ly->v_scale, slots, M, Hkv, D);
    else if (ly->kv_format == KV_FP8)
        rg_store_kv_f8_bf16(k, stride, v, stride, ly->k_buf, ly->v_buf, ly->k_scale, ly->v_scale, slots, M, Hkv, D);
    else
        rg_store_kv_bf16(k, stride, v, stride, ly->k_buf, ly->v_buf, slots, M, Hkv * D);
}

static void layer_decode_attention_team_bf16(const rg_layer_bf16 *ly, const uint16_t *q, int64_t q_stride,
                                             const int64_t *table, int64_t table_stride, const int64_t *rows,
                                             const int64_t *seq_lens, uint16_t *out, int64_t M, int64_t H,
                                             int64_t Hkv, int64_t D, float scale, int64_t splits, int64_t piece,
                                             float *part,
                                             float *qf, float *sc) {
#define TEAM(fn) fn(q, q_stride, ly->k_buf, ly->v_buf, ly->k_scale, ly->v_scale, table, table_stride, rows, \
                    seq_lens, out, M, H, Hkv, D, scale, splits, piece, part, qf, sc)
    if (ly->kv_format == KV_INT8)
        TEAM(rg_decode_attention_team_i8_bf16);
    else if (ly->kv_format == KV_FP8)
        TEAM(rg_decode_attention_team_f8_bf16);
    else
        TEAM(rg_decode_attention_team_bf16);
#undef TEAM
}

/* Scratch of rg_decode_step_bf16 in bytes, for `threads` threads and pieces of at most max_piece positions:
 * the contexts (M int64) shared, then per thread a float32 query block (H D), scores (max_piece G), bf16
 * private rows: the normed and the residual stream (M hidden each) and the MLP activation (M inter), and the
 * group sums of int4 matmuls. */
int64_t rg_decode_step_scratch_bytes_bf16(int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                                          int64_t inter, int64_t max_piece, int64_t threads) {
    const size_t per_thread = rg_span(H * D, sizeof(float)) + rg_span(max_piece * (H / Hkv), sizeof(float)) +
                              2 * rg_span(M * hidden, sizeof(uint16_t)) + rg_span(M * inter, sizeof(uint16_t)) +
                              step_sums_bytes(M, hidden, H, D, inter);
    return (int64_t)(rg_span(M, sizeof(int64_t)) + (size_t)threads * per_thread);
}

/* ids (M,): the tokens, whose rows of embed (vocab rows of hidden) start the residual stream; positions (M,): theirs,
 * each request's context being its position + 1 (the token's own K/V included). out (M, hidden): the final
 * norm's output (inter: the widest MLP activation of the layers, dense or expert). x, res_a, res_b (M, hidden),
 * qkv (M, (H + 2 Hkv) D), attn (M, H D), gu (M, 2 inter) and
 * part (the attention pieces, M * Hkv * splits * (H / Hkv) * (D + 2) floats) are scratch, and so is `scratch`
 * (scratch_bytes, at least rg_decode_step_scratch_bytes_bf16 for the longest context: RG_ERR_SCRATCH
 * otherwise, before anything is written), for a team of at most `threads`: nothing is allocated here. The matmul
 * weights are descriptors (cpu_linear.h) of any layout. With an LM head (vocab rows), logits (M, vocab) float32
 * = out @ lm_head^T rounded to bf16, by the same team. par (NULL at tp 1, pp 1): the step on one rank of a
 * parallel group (cpu_parallel.h); embed is then read only for RG_STAGE_IDS. splits and piece cut the contexts
 * for attention as decode_attention's do (piece > 0: fixed pieces, the deterministic mode). */
rg_status rg_decode_step_bf16(const rg_layer_bf16 *layers, int64_t n_layers, const uint16_t *final_norm,
                              const rg_weight *lm_head, float *logits, const rg_weight *embed,
                              const int64_t *ids, int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                              int64_t inter, float eps, float scale, const int64_t *positions, const float *cos_sin,
                              const int64_t *out_slots, const int64_t *table, int64_t table_stride,
                              const int64_t *rows, int64_t splits, int64_t piece, uint16_t *x, uint16_t *out,
                              uint16_t *res_a, uint16_t *res_b, uint16_t *qkv, uint16_t *attn, uint16_t *gu, float *part,
                              void *scratch, int64_t scratch_bytes, int64_t threads, const rg_parallel *par) {
    const int64_t qsz = H * D, kvsz = Hkv * D, qkv_n = qsz + 2 * kvsz, G = H / Hkv;
    const size_t row_bytes = sizeof(uint16_t) * (size_t)(M * hidden);
    int64_t max_piece = 0;
    for (int64_t m = 0; m < M; ++m) {
        const int64_t len = piece > 0 ? piece : (positions[m] + 1 + splits - 1) / splits;
        max_piece = len > max_piece ? len : max_piece;
    }
    if (threads < 1 || (piece > 0 && !pieces_cover(positions, M, 1, splits, piece)) ||
        rg_decode_step_scratch_bytes_bf16(M, hidden, H, Hkv, D, inter, max_piece, threads) > scratch_bytes)
        return RG_ERR_SCRATCH;
    int64_t *seq_lens = (int64_t *)scratch;
    char *per_thread = (char *)scratch + rg_span(M, sizeof(int64_t));
    const size_t qf_bytes = rg_span(qsz, sizeof(float)), sc_bytes = rg_span(max_piece * G, sizeof(float));
    const size_t rows_bytes = rg_span(M * hidden, sizeof(uint16_t));
    const size_t ap_bytes = rg_span(M * inter, sizeof(uint16_t));
    const size_t thread_bytes = qf_bytes + sc_bytes + 2 * rows_bytes + ap_bytes + step_sums_bytes(M, hidden, H, D, inter);
    for (int64_t m = 0; m < M; ++m) {
        seq_lens[m] = positions[m] + 1;
        if (par_input(par) == RG_STAGE_IDS) rg_w_row(embed, ids[m], NULL, x + m * hidden);
    }
    /* The norms and the SiLU run redundantly in every thread, on private copies, so that only the matmuls
     * and attention need the team to meet: the residual stream alternates between two shared buffers
     * (res_a, res_b); every thread reads the current one, thread 0 alone writes the next, and a matmul's
     * barrier always lies between a write and the next read of the same buffer. */
#pragma omp parallel num_threads((int)threads)
    {
        const int tid = omp_get_thread_num();
        char *mine = per_thread + (size_t)tid * thread_bytes;
        float *qf = (float *)mine, *sc = (float *)(mine + qf_bytes);
        uint16_t *hp = (uint16_t *)(mine + qf_bytes + sc_bytes), *rp = (uint16_t *)(mine + qf_bytes + sc_bytes + rows_bytes);
        uint16_t *ap = (uint16_t *)(mine + qf_bytes + sc_bytes + 2 * rows_bytes);
        float *sx = (float *)(mine + qf_bytes + sc_bytes + 2 * rows_bytes + ap_bytes);
        uint16_t *res[2] = {res_a, res_b};
        int cur = 0; /* res[cur] holds the residual stream once layer 0 has started */
        PROF_START();
        for (int64_t l = 0; l < n_layers; ++l) {
            const rg_layer_bf16 *ly = layers + l;
            if (l == 0 && par_input(par) != RG_STAGE_HIDDEN) { /* the residual stream starts as the embeddings */
                memcpy(rp, x, row_bytes);
                rg_add_rmsnorm_bf16(rp, hidden, NULL, ly->input_norm, hp, M, hidden, eps);
            } else {
                memcpy(rp, res[cur], row_bytes);
                rg_add_rmsnorm_bf16(x, hidden, rp, ly->input_norm, hp, M, hidden, eps);
            }
            if (tid == 0) memcpy(res[cur ^ 1], rp, row_bytes);
            cur ^= 1;
            PROF_LAP(0);
            PROF_PHASE(2);
            linear_team_bf16(&ly->qkv, hp, M, ly->qkv_bias, qkv, NULL, sx);
            lora_add_team(ly->lora, 0, hp, hidden, qkv, qkv_n, (const int64_t[]){qsz, qsz + kvsz, qkv_n}, 3);
#pragma omp single
            {
                for (int64_t m = 0; m < M && ly->q_norm; ++m) /* in place, one row per head */
                    rg_add_rmsnorm_bf16(qkv + m * qkv_n, D, NULL, ly->q_norm, qkv + m * qkv_n, H, D, eps);
                for (int64_t m = 0; m < M && ly->k_norm; ++m)
                    rg_add_rmsnorm_bf16(qkv + m * qkv_n + qsz, D, NULL, ly->k_norm, qkv + m * qkv_n + qsz, Hkv, D, eps);
                rg_rotary_bf16(positions, qkv, qkv_n, H, qkv + qsz, qkv_n, Hkv, cos_sin, D, M);
                layer_store_kv_bf16(ly, qkv + qsz, qkv + qsz + kvsz, qkv_n, out_slots, M, Hkv, D);
            }
            layer_decode_attention_team_bf16(ly, qkv, qkv_n, table, table_stride, rows, seq_lens, attn, M, H, Hkv, D,
                                             scale, splits, piece, part, qf, sc);
            PROF_LAP(4);
            PROF_PHASE(6);
            linear_team_bf16(&ly->o, attn, M, NULL, x, par_partials(par), sx);
            lora_add_team(ly->lora, 1, attn, qsz, x, hidden, (const int64_t[]){hidden}, 1);
            par_all_reduce(par, x, M * hidden);
            memcpy(rp, res[cur], row_bytes);
            rg_add_rmsnorm_bf16(x, hidden, rp, ly->post_norm, hp, M, hidden, eps);
            if (tid == 0) memcpy(res[cur ^ 1], rp, row_bytes);
            cur ^= 1;
            PROF_LAP(8);
            if (ly->moe) {
                moe_team_bf16(ly->moe, hp, M, hidden, x, sx, par);
                continue;
            }
            const int64_t li = ly->gate_up.N / 2; /* this layer's intermediate size (inter: the widest layer's) */
            PROF_PHASE(10);
            linear_team_bf16(&ly->gate_up, hp, M, NULL, gu, NULL, sx);
            lora_add_team(ly->lora, 2, hp, hidden, gu, 2 * li, (const int64_t[]){li, 2 * li}, 2);
            silu_mul_bf16(gu, ap, M, li);
            PROF_LAP(12);
            PROF_PHASE(14);
            linear_team_bf16(&ly->down, ap, M, NULL, x, par_partials(par), sx);
            lora_add_team(ly->lora, 3, ap, li, x, hidden, (const int64_t[]){hidden}, 1);
            par_all_reduce(par, x, M * hidden);
            PROF_LAP(13);
        }
        if (par_final(par)) { /* else x and res[cur] (res_a: two swaps a layer) are the stage's output */
#pragma omp single
            rg_add_rmsnorm_bf16(x, hidden, res[cur], final_norm, out, M, hidden, eps);
            PROF_LAP(30);
            PROF_PHASE(28);
            if (lm_head) linear_team_bf16(lm_head, out, M, NULL, NULL, logits, sx);
        }
    }
    return RG_OK;
}


/* ------------------------------------------------------------------------------------------------------
 * Extend (prefill) attention for bfloat16, flash style: each new token attends to its request's prefix in
 * the pool and causally to the new tokens before it (all read through the slot table: the step's K/V are
 * stored first). Phase 1 packs each request's K and V per KV head into blocks of 16 keys, zero past the
 * sequence: K as rows of D, V as key pairs (per pair and dim, the two keys' values side by side).
 * Phase 2 gives each work item 16 consecutive new tokens of one query head, one token per vector lane. Scores
 * are then 16 vectors per key block (one per key, lanes over tokens), so the online softmax's maxima, sums and
 * rescaling are all lane-wise: no horizontal reductions. Q.K is a vdpbf16ps of the tokens' query pairs with
 * a key's dim pair broadcast; P.V a vdpbf16ps of the tokens' (p[2i], p[2i+1]) with V's key pair broadcast,
 * P rounded to bf16 for it as flash attention does. D must be a multiple of 32, at most 128. */
#define EXT_TOKENS 16 /* new tokens per work item, one per lane */

static const uint16_t EXT_INTERLEAVE[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

static inline __attribute__((always_inline)) void extend_item_bf16(
    const uint16_t *q, int64_t q_stride, const uint16_t *kpk, const uint16_t *vpk, uint16_t *out, int64_t H,
    int64_t head, int64_t t0, int64_t n, int64_t prefix, int64_t q0, float scale, const int64_t D) {
    const int64_t pairs = D / 2;
    int32_t qt[64 * 16] __attribute__((aligned(64))); /* [dim pair][token]: the tokens' query pairs */
    float o[128 * 16] __attribute__((aligned(64)));   /* [dim][token]: the unnormalised output */
    for (int64_t j = 0; j < 16; ++j) { /* lanes past the tail repeat the last token; never stored */
        const uint16_t *qr = q + (q0 + t0 + (j < n ? j : n - 1)) * q_stride + head * D;
        for (int64_t p = 0; p < pairs; ++p) memcpy(&qt[p * 16 + j], qr + 2 * p, sizeof(int32_t));
    }
    memset(o, 0, sizeof(float) * (size_t)(D * 16));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(prefix + t0)),
                                         _mm512_min_epi32(lane, _mm512_set1_epi32((int32_t)(n - 1))));
    const __m512i interleave = _mm512_loadu_si512(EXT_INTERLEAVE);
    const __m512 sc = _mm512_set1_ps(scale * 1.4426950408889634f); /* scores in base 2 */
    const int64_t first = prefix + t0, last = prefix + t0 + n - 1; /* the lanes' smallest and largest positions */
    __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();
    for (int64_t kb = 0; kb * 16 <= last; ++kb) {
        const uint16_t *kblk = kpk + kb * 16 * D, *vblk = vpk + kb * 16 * D;
        __m512 s[16];
        for (int k = 0; k < 16; ++k) s[k] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
            const __m512bh qv = (__m512bh)_mm512_load_si512(qt + p * 16);
            for (int k = 0; k < 16; ++k) {
                int32_t kp;
                memcpy(&kp, kblk + k * D + 2 * p, sizeof kp);
                s[k] = _mm512_dpbf16_ps(s[k], qv, (__m512bh)_mm512_set1_epi32(kp));
            }
        }
        /* only blocks reaching past the first lane's position need the causal mask; a hidden key's score is
         * -1e30, whose 2^ is an exact 0 */
        if (kb * 16 + 15 > first)
            for (int k = 0; k < 16; ++k)
                s[k] = _mm512_mask_mov_ps(
                    _mm512_set1_ps(-1e30f),
                    _mm512_cmp_epi32_mask(_mm512_set1_epi32((int32_t)(kb * 16 + k)), pos, _MM_CMPINT_LE), s[k]);
        __m512 mx = s[0];
        for (int k = 1; k < 16; ++k) mx = _mm512_max_ps(mx, s[k]);
        const __m512 mn = _mm512_max_ps(m, _mm512_mul_ps(mx, sc)); /* key 0 is visible to all: real scores */
        const __m512 corr = exp2_nonpos512(_mm512_sub_ps(m, mn));
        __m512 sum = _mm512_setzero_ps();
        for (int k = 0; k < 16; ++k) {
            s[k] = exp2_nonpos512(_mm512_fmsub_ps(s[k], sc, mn));
            sum = _mm512_add_ps(sum, s[k]);
        }
        l = _mm512_fmadd_ps(l, corr, sum);
        /* where no lane's maximum moved, corr is exactly 1 and the output needs no rescaling */
        const int rescale = _mm512_cmp_ps_mask(mn, m, _CMP_NEQ_OQ) != 0;
        m = mn;
        __m512bh pp[8]; /* lane i: (p[2kp][i], p[2kp + 1][i]) */
        for (int kp = 0; kp < 8; ++kp)
            pp[kp] = (__m512bh)_mm512_permutexvar_epi16(
                interleave, (__m512i)_mm512_cvtne2ps_pbh(s[2 * kp + 1], s[2 * kp]));
        for (int64_t d = 0; d < D; d += 4) {
            __m512 a[4];
            for (int u = 0; u < 4; ++u) {
                a[u] = _mm512_load_ps(o + (d + u) * 16);
                if (rescale) a[u] = _mm512_mul_ps(a[u], corr);
            }
            for (int kp = 0; kp < 8; ++kp) {
                const uint16_t *vr = vblk + (kp * D + d) * 2;
                for (int u = 0; u < 4; ++u) {
                    int32_t vp;
                    memcpy(&vp, vr + 2 * u, sizeof vp);
                    a[u] = _mm512_dpbf16_ps(a[u], pp[kp], (__m512bh)_mm512_set1_epi32(vp));
                }
            }
            for (int u = 0; u < 4; ++u) _mm512_store_ps(o + (d + u) * 16, a[u]);
        }
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
    uint16_t ob[128 * 16]; /* [dim][token], rounded */
    for (int64_t d = 0; d < D; ++d)
        _mm256_storeu_si256((__m256i *)(ob + d * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + d * 16), inv)));
    for (int64_t j = 0; j < n; ++j) {
        uint16_t *orow = out + ((q0 + t0 + j) * H + head) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = ob[d * 16 + j];
    }
}

/* One pool row (slot, head h) into the pack: K's D values to kd, V's to every other element of vd. An 8-bit
 * pool's row is dequantized here, code * scale rounded to bf16 (the torch backend's dequantized values). */
static inline void extend_pack_row(const void *k_buf, const void *v_buf, const uint16_t *k_scale,
                                   const uint16_t *v_scale, int kv_format, int64_t slot, int64_t Hkv, int64_t h,
                                   int64_t D, uint16_t *kd, uint16_t *vd) {
    const int64_t at = slot * Hkv + h;
    if (kv_format == KV_PLAIN) {
        memcpy(kd, (const uint16_t *)k_buf + at * D, sizeof(uint16_t) * (size_t)D);
        const uint16_t *vr = (const uint16_t *)v_buf + at * D;
        for (int64_t d = 0; d < D; ++d) vd[2 * d] = vr[d];
        return;
    }
    const float ks = bf16_to_f32(k_scale[at]), vs = bf16_to_f32(v_scale[at]);
    if (kv_format == KV_INT8) {
        const int8_t *kr = (const int8_t *)k_buf + at * D, *vr = (const int8_t *)v_buf + at * D;
        for (int64_t d = 0; d < D; ++d) {
            kd[d] = f32_to_bf16((float)kr[d] * ks);
            vd[2 * d] = f32_to_bf16((float)vr[d] * vs);
        }
    } else {
        const uint8_t *kr = (const uint8_t *)k_buf + at * D, *vr = (const uint8_t *)v_buf + at * D;
        for (int64_t d = 0; d < D; ++d) {
            kd[d] = f32_to_bf16(e4m3_to_f32(kr[d]) * ks);
            vd[2 * d] = f32_to_bf16(e4m3_to_f32(vr[d]) * vs);
        }
    }
}

/* q (T, H, D) rows q_stride apart, the B requests' new tokens back to back from q_start[b]; out (T, H, D).
 * pack: scratch of sum_b Hkv * 2 * ceil(L_b / 16) * 16 * D bf16, L_b = prefix_lens[b] + extend_lens[b].
 * The pool is bf16 (kv_format KV_PLAIN) or 8-bit codes with their scales. */
static rg_status extend_attention_bf16(const uint16_t *q, int64_t q_stride, const void *k_buf, const void *v_buf,
                                       const uint16_t *k_scale, const uint16_t *v_scale, int kv_format,
                                       const int64_t *table, int64_t table_stride, const int64_t *rows,
                                       const int64_t *prefix_lens, const int64_t *extend_lens,
                                       const int64_t *q_start, uint16_t *out, int64_t B, int64_t H, int64_t Hkv,
                                       int64_t D, float scale, uint16_t *pack) {
    if (D % 32 != 0 || D > 128) return RG_ERR_UNSUPPORTED;
    const int64_t G = H / Hkv;
    int64_t *base = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1)); /* pack offset of each request */
    int64_t *items = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first work item of each */
    if (!base || !items) {
        free(base);
        free(items);
        return RG_ERR_ALLOC;
    }
    base[0] = items[0] = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t blocks = (prefix_lens[b] + extend_lens[b] + 15) / 16;
        base[b + 1] = base[b] + Hkv * 2 * blocks * 16 * D;
        items[b + 1] = items[b] + H * ((extend_lens[b] + EXT_TOKENS - 1) / EXT_TOKENS);
    }
#pragma omp parallel
    {
        /* phase 1: pack K and V, one (request, KV head, key block) at a time, split over the team */
        for (int64_t b = 0; b < B; ++b) {
            const int64_t L = prefix_lens[b] + extend_lens[b], blocks = (L + 15) / 16;
            const int64_t *slots = table + rows[b] * table_stride;
#pragma omp for schedule(static) nowait
            for (int64_t hb = 0; hb < Hkv * blocks; ++hb) {
                const int64_t h = hb / blocks, kb = hb % blocks;
                uint16_t *kpk = pack + base[b] + h * 2 * blocks * 16 * D, *vpk = kpk + blocks * 16 * D;
                for (int64_t j = 0; j < 16; ++j) {
                    const int64_t pos = kb * 16 + j;
                    uint16_t *kd = kpk + pos * D, *vd = vpk + ((kb * 8 + j / 2) * D) * 2 + (j % 2);
                    if (pos < L) {
                        extend_pack_row(k_buf, v_buf, k_scale, v_scale, kv_format, slots[pos], Hkv, h, D, kd, vd);
                    } else {
                        memset(kd, 0, sizeof(uint16_t) * (size_t)D);
                        for (int64_t d = 0; d < D; ++d) vd[2 * d] = 0;
                    }
                }
            }
        }
#pragma omp barrier
        /* phase 2: one (request, query head, 16 new tokens) per item, the latest tokens (longest rows) first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items[B]; ++it) {
            int64_t b = 0;
            while (items[b + 1] <= it) ++b;
            const int64_t local = it - items[b], groups = (extend_lens[b] + EXT_TOKENS - 1) / EXT_TOKENS;
            const int64_t head = local % H, t0 = (groups - 1 - local / H) * EXT_TOKENS;
            const int64_t n = t0 + EXT_TOKENS < extend_lens[b] ? EXT_TOKENS : extend_lens[b] - t0;
            const int64_t blocks = (prefix_lens[b] + extend_lens[b] + 15) / 16;
            const uint16_t *kpk = pack + base[b] + (head / G) * 2 * blocks * 16 * D, *vpk = kpk + blocks * 16 * D;
            if (D == 64)
                extend_item_bf16(q, q_stride, kpk, vpk, out, H, head, t0, n, prefix_lens[b], q_start[b], scale, 64);
            else if (D == 128)
                extend_item_bf16(q, q_stride, kpk, vpk, out, H, head, t0, n, prefix_lens[b], q_start[b], scale, 128);
            else
                extend_item_bf16(q, q_stride, kpk, vpk, out, H, head, t0, n, prefix_lens[b], q_start[b], scale, D);
        }
    }
    free(base);
    free(items);
    return RG_OK;
}

rg_status rg_extend_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_buf,
                                   const uint16_t *v_buf, const int64_t *table, int64_t table_stride,
                                   const int64_t *rows, const int64_t *prefix_lens, const int64_t *extend_lens,
                                   const int64_t *q_start, uint16_t *out, int64_t B, int64_t H, int64_t Hkv,
                                   int64_t D, float scale, uint16_t *pack) {
    return extend_attention_bf16(q, q_stride, k_buf, v_buf, NULL, NULL, KV_PLAIN, table, table_stride, rows,
                                 prefix_lens, extend_lens, q_start, out, B, H, Hkv, D, scale, pack);
}

#define KV_QUANT_EXTEND_BODY(format)                                                                             \
    {                                                                                                            \
        return extend_attention_bf16(q, q_stride, k_buf, v_buf, k_scale, v_scale, format, table, table_stride,  \
                                     rows, prefix_lens, extend_lens, q_start, out, B, H, Hkv, D, scale, pack); \
    }
KV_QUANT_EXTEND(rg_extend_attention_i8_bf16, int8_t) KV_QUANT_EXTEND_BODY(KV_INT8)
KV_QUANT_EXTEND(rg_extend_attention_f8_bf16, uint8_t) KV_QUANT_EXTEND_BODY(KV_FP8)

int rg_has_decode_step(void) { return 1; }
#else
/* Built without AVX512-BF16: the same entry points, each refusing (the prototypes above keep their signatures
 * the real ones). */
int rg_has_decode_step(void) { return 0; }
rg_status rg_silu_and_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t M, int64_t I) {
    (void)gu, (void)out, (void)M, (void)I;
    return RG_ERR_UNSUPPORTED;
}
int64_t rg_decode_step_scratch_bytes_bf16(int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                                          int64_t inter, int64_t max_piece, int64_t threads) {
    (void)M, (void)hidden, (void)H, (void)Hkv, (void)D, (void)inter, (void)max_piece, (void)threads;
    return 0;
}
rg_status rg_decode_step_bf16(const rg_layer_bf16 *layers, int64_t n_layers, const uint16_t *final_norm,
                              const rg_weight *lm_head, float *logits, const rg_weight *embed,
                              const int64_t *ids, int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D,
                              int64_t inter, float eps, float scale, const int64_t *positions, const float *cos_sin,
                              const int64_t *out_slots, const int64_t *table, int64_t table_stride,
                              const int64_t *rows, int64_t splits, int64_t piece, uint16_t *x, uint16_t *out,
                              uint16_t *res_a, uint16_t *res_b, uint16_t *qkv, uint16_t *attn, uint16_t *gu, float *part,
                              void *scratch, int64_t scratch_bytes, int64_t threads, const rg_parallel *par) {
    (void)layers, (void)n_layers, (void)final_norm, (void)lm_head, (void)logits, (void)embed;
    (void)ids, (void)M, (void)hidden, (void)H, (void)Hkv, (void)D, (void)inter, (void)eps, (void)scale;
    (void)positions, (void)cos_sin, (void)out_slots, (void)table, (void)table_stride, (void)rows, (void)splits,
        (void)piece;
    (void)x, (void)out, (void)res_a, (void)res_b, (void)qkv, (void)attn, (void)gu, (void)part, (void)scratch;
    (void)scratch_bytes, (void)threads, (void)par;
    return RG_ERR_UNSUPPORTED;
}
rg_status rg_extend_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_buf,
                                   const uint16_t *v_buf, const int64_t *table, int64_t table_stride,
                                   const int64_t *rows, const int64_t *prefix_lens, const int64_t *extend_lens,
                                   const int64_t *q_start, uint16_t *out, int64_t B, int64_t H, int64_t Hkv,
                                   int64_t D, float scale, uint16_t *pack) {
    (void)q, (void)q_stride, (void)k_buf, (void)v_buf, (void)table, (void)table_stride, (void)rows;
    (void)prefix_lens, (void)extend_lens, (void)q_start, (void)out, (void)B, (void)H, (void)Hkv, (void)D;
    (void)scale, (void)pack;
    return RG_ERR_UNSUPPORTED;
}
#define KV_QUANT_EXTEND_STUB                                                                                     \
    {                                                                                                            \
        (void)q, (void)q_stride, (void)k_buf, (void)v_buf, (void)k_scale, (void)v_scale, (void)table;           \
        (void)table_stride, (void)rows, (void)prefix_lens, (void)extend_lens, (void)q_start, (void)out, (void)B; \
        (void)H, (void)Hkv, (void)D, (void)scale, (void)pack;                                                    \
        return RG_ERR_UNSUPPORTED;                                                                               \
    }
KV_QUANT_EXTEND(rg_extend_attention_i8_bf16, int8_t) KV_QUANT_EXTEND_STUB
KV_QUANT_EXTEND(rg_extend_attention_f8_bf16, uint8_t) KV_QUANT_EXTEND_STUB
#endif
