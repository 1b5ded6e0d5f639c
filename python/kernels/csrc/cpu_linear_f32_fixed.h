/* The deterministic mode's float32 matmul: float32 weights, float32 activations, each output one accumulator fed
 * the input features in order (acc = fma(x[k], w[k], acc) for k = 0 .. K-1, from 0), then the bias added once.
 * That chain is the same whatever the row count of the call, the row tile a row falls in, the thread count and the
 * instruction set (a fused multiply-add rounds once, in AVX-512, AVX2 and scalar fmaf alike), so a row's bits
 * never depend on the batch, nor on the build. Included by cpu_kernels.c.
 *
 * Layout (pack_f32_fixed): [ceil(N / 16)][K][16] float32, the output rows of a 16-block side by side per input
 * feature, zero rows past N: one contiguous stream per block, every input feature's 16 weights one vector load.
 * Tiles: up to 4 rows times FIXED_F32_BLOCKS blocks of 16 outputs share each weight load (independent chains,
 * which also hide the FMA latency at one row); threads split the blocks. */

#if defined(__AVX512F__)
#define FIXED_F32_BLOCKS 2
typedef __m512 f32x16;
static inline f32x16 f16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline f32x16 f16_zero(void) { return _mm512_setzero_ps(); }
static inline f32x16 f16_fma(float a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(_mm512_set1_ps(a), b, c); }
static inline void f16_store(float *p, f32x16 v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define FIXED_F32_BLOCKS 1
typedef struct { __m256 lo, hi; } f32x16;
static inline f32x16 f16_load(const float *p) { return (f32x16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline f32x16 f16_zero(void) { return (f32x16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline f32x16 f16_fma(float a, f32x16 b, f32x16 c) {
    const __m256 s = _mm256_set1_ps(a);
    return (f32x16){_mm256_fmadd_ps(s, b.lo, c.lo), _mm256_fmadd_ps(s, b.hi, c.hi)};
}
static inline void f16_store(float *p, f32x16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
#else
#define FIXED_F32_BLOCKS 1
typedef struct { float v[16]; } f32x16;
static inline f32x16 f16_load(const float *p) { f32x16 r; memcpy(r.v, p, sizeof r.v); return r; }
static inline f32x16 f16_zero(void) { f32x16 r = {{0}}; return r; }
static inline f32x16 f16_fma(float a, f32x16 b, f32x16 c) {
    for (int i = 0; i < 16; ++i) c.v[i] = fmaf(a, b.v[i], c.v[i]);
    return c;
}
static inline void f16_store(float *p, f32x16 v) { memcpy(p, v.v, sizeof v.v); }
#endif

#define FIXED_F32_ROWS 4

/* y[m, n0 .. n0 + 16 * nblk) for rows m0 .. m0 + rows of x: the chains of blocks b0 .. b0 + nblk. */
static inline __attribute__((always_inline)) void fixed_f32_tile(const float *w, int64_t N, int64_t K, const float *x, int64_t m0, int rows,
                                  int64_t b0, int nblk, const float *bias, float *y) {
    f32x16 acc[FIXED_F32_ROWS][FIXED_F32_BLOCKS];
    for (int r = 0; r < FIXED_F32_ROWS; ++r)
        for (int b = 0; b < FIXED_F32_BLOCKS; ++b) acc[r][b] = f16_zero();
    const float *wb = w + b0 * K * 16;
    for (int64_t k = 0; k < K; ++k) {
        for (int b = 0; b < nblk; ++b) {
            const f32x16 wk = f16_load(wb + (b * K + k) * 16);
            for (int r = 0; r < rows; ++r) acc[r][b] = f16_fma(x[(m0 + r) * K + k], wk, acc[r][b]);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int b = 0; b < nblk; ++b) {
            float out[16];
            f16_store(out, acc[r][b]);
            const int64_t n0 = (b0 + b) * 16;
            for (int64_t i = 0; i < 16 && n0 + i < N; ++i)
                y[(m0 + r) * N + n0 + i] = bias ? out[i] + bias[n0 + i] : out[i];
        }
}

/* y (M, N) = x (M, K) @ w^T + bias, w in the layout above (N outputs of K inputs), bias (N,) or NULL; all float32,
 * contiguous. */
rg_status rg_linear_f32_fixed(const float *w, int64_t N, int64_t K, const float *x, int64_t M, const float *bias,
                              float *y) {
    if (N < 1 || K < 1 || M < 0) return RG_ERR_UNSUPPORTED;
    const int64_t blocks = (N + 15) / 16, groups = (blocks + FIXED_F32_BLOCKS - 1) / FIXED_F32_BLOCKS;
#pragma omp parallel for schedule(static) if (M * N * K >= (1 << 18))
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t b0 = g * FIXED_F32_BLOCKS;
        const int nblk = (int)(blocks - b0 < FIXED_F32_BLOCKS ? blocks - b0 : FIXED_F32_BLOCKS);
        for (int64_t m0 = 0; m0 < M; m0 += FIXED_F32_ROWS) {
            const int rows = (int)(M - m0 < FIXED_F32_ROWS ? M - m0 : FIXED_F32_ROWS);
            /* constant tile sizes, so that the accumulators stay in registers (the chains are the same) */
#define FIXED_F32_CALL(R) nblk == FIXED_F32_BLOCKS ? \
    fixed_f32_tile(w, N, K, x, m0, R, b0, FIXED_F32_BLOCKS, bias, y) : fixed_f32_tile(w, N, K, x, m0, R, b0, 1, bias, y)
            switch (rows) {
            case 4: FIXED_F32_CALL(4); break;
            case 3: FIXED_F32_CALL(3); break;
            case 2: FIXED_F32_CALL(2); break;
            default: FIXED_F32_CALL(1); break;
            }
#undef FIXED_F32_CALL
        }
    }
    return RG_OK;
}
