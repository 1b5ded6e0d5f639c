/* The prefill GEMM on AMX tiles: y (M, N) = x (M, K) @ w^T (+ bias) for bf16 inputs over the layouts of
 * cpu_linear.h, read in place. Included by cpu_linear.h after the AVX512-BF16 GEMM, whose epilogue (store16) and
 * panel dequantization (dequant_panel_bf16) it shares.
 *
 * Why it reads the K-pair layout directly: within a block of 16 output rows, 16 consecutive K pairs are 1024
 * contiguous bytes, 16 rows of 64 bytes, each row one pair's 16 outputs x 2 values: exactly the B operand of
 * TDPBF16PS (VNNI order), loaded with a stride of 64 bytes. A is 16 rows of 32 bf16 of x (stride 2K), C a 16 x 16
 * float32 tile. The C blocked GEMM's vdpbf16ps rate is about a fifth of the tiles', and oneDNN's tiles need the
 * weight copied out of the layout on every call (about half of a prefill linear's time at 70 rows).
 *
 * All eight tiles, one configuration (16 rows x 64 bytes each): C 0-3 (two 16-row tiles of x by two blocks), A 4-5,
 * B 6-7. An item of work is one pair of blocks (32 outputs) against a chunk of input rows; the team splits the
 * items statically (consecutive items: the same rows against the next blocks); each thread configures its tiles
 * and releases them. Each C tile runs over the whole K, starting from zero, the K tiles in order, then goes
 * through a float32 scratch to store16 (bias, one rounding to bf16). An output's operations therefore do not
 * depend on M, on the chunking, on the other rows of the call or on the thread count: the kernel is batch
 * invariant (a row's bits are those it gets alone). M tails: the last rows (M not a multiple of 16) are copied
 * into a zero-padded 16-row staging tile, and only the rows that exist are stored; N tails: rows past N are zero
 * in the layout, their columns are not stored. K must be a multiple of 32 (whole tiles), else it refuses (the
 * caller keeps the other kernels). int8 / int4 weights: each item's pair of blocks is dequantized into the
 * thread's bf16 K-pair panel first (dequant_panel_bf16: each weight rounded to bf16 once, as the C GEMM does).
 *
 * It needs the build to target AMX-BF16 (-march=native on such a CPU defines __AMX_TILE__ and __AMX_BF16__) and
 * Linux to grant the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once; every
 * thread of the process has it then). Other builds export rg_has_amx (0) and a stub that refuses. */

#include "cpu_linear_avx512_gemm.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__) && \
    defined(__linux__)
#define RG_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_REQ_XCOMP_PERM 0x1023 /* arch_prctl: ask for a dynamically enabled state component */
#define AMX_XTILEDATA 18          /* the tile data state component */
#define AMX_CHUNK_BYTES (768 * 1024) /* rows of x per item: about this many bytes of them (L2), in pairs of tiles */

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_state; /* 0: not asked yet, 1: granted, 2: refused */

/* Whether this process may use the tiles: asked of the kernel once (a race only asks twice). */
static int amx_granted(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, AMX_REQ_XCOMP_PERM, AMX_XTILEDATA) == 0 ? 1 : 2;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

static void amx_configure(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* C tiles (i, j) for rows tiles a0, a1 (MA of them, lda bytes apart) x blocks b0, b1 (NB, K-pair panels) over kt
 * K tiles, into c (MA NB 256 floats, tile 2i + j at c + (2i + j) 256, rows of 16). */
static inline __attribute__((always_inline)) void amx_tiles(const uint16_t *a0, const uint16_t *a1, int64_t lda,
                                                           const uint16_t *b0, const uint16_t *b1, int64_t kt,
                                                           float *c, const int MA, const int NB) {
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (MA > 1) _tile_zero(2);
    if (MA > 1 && NB > 1) _tile_zero(3);
    for (int64_t t = 0; t < kt; ++t) {
        _tile_loadd(6, b0 + t * 512, 64);
        _tile_loadd(4, a0 + t * 32, lda);
        _tile_dpbf16ps(0, 4, 6);
        if (NB > 1) {
            _tile_loadd(7, b1 + t * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (MA > 1) {
            _tile_loadd(5, a1 + t * 32, lda);
            _tile_dpbf16ps(2, 5, 6);
            if (NB > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    if (NB > 1) _tile_stored(1, c + 256, 64);
    if (MA > 1) _tile_stored(2, c + 512, 64);
    if (MA > 1 && NB > 1) _tile_stored(3, c + 768, 64);
}

/* The first `rows` rows of a C tile (output rows from m0, columns from n0) through store16. */
static inline void amx_store(const float *c, int64_t rows, const uint16_t *bias, uint16_t *y, float *yf, int64_t N,
                             int64_t m0, int64_t n0) {
    if (n0 >= N) return; /* a block past N (the pair's padding) */
    for (int64_t r = 0; r < rows; ++r) store16(_mm512_loadu_ps(c + r * 16), bias, y, yf, (m0 + r) * N + n0, n0, N - n0);
}

/* Input row tiles per item: an even number of them holding about AMX_CHUNK_BYTES of x (at least one pair), four
 * times that for quantized weights (each item dequantizes its blocks once). */
static int64_t amx_chunk_tiles(const rg_weight *w) {
    const int64_t bytes = w->kind == RG_W_BF16 ? AMX_CHUNK_BYTES : 4 * AMX_CHUNK_BYTES;
    const int64_t pairs = bytes / (32 * 2 * w->K);
    return 2 * (pairs > 1 ? pairs : 1);
}

/* The GEMM for the calling team. xs: the zero-padded staging tile of x's last M % 16 rows (NULL when there are
 * none); c: the thread's 1024 floats; panel: its 2 K 16 bf16 for quantized weights. */
static void amx_team(const rg_weight *w, const uint16_t *x, const uint16_t *xs, int64_t M, const uint16_t *bias,
                     uint16_t *y, float *yf, float *c, uint16_t *panel) {
    const int64_t K = w->K, N = w->N, blocks = (N + 15) / 16, pairs = (blocks + 1) / 2;
    const int64_t mtiles = (M + 15) / 16, full = M / 16, chunk = amx_chunk_tiles(w);
    const int64_t chunks = (mtiles + chunk - 1) / chunk, kt = K / 32, lda = 2 * K;
    amx_configure();
#pragma omp for schedule(static)
    for (int64_t it = 0; it < chunks * pairs; ++it) {
        const int64_t ch = it / pairs, blk = it % pairs * 2, nb = blocks - blk < 2 ? 1 : 2;
        const uint16_t *pw = (const uint16_t *)w->data + blk * K * 16;
        if (w->kind != RG_W_BF16) {
            dequant_panel_bf16(w, blk, nb, panel);
            pw = panel;
        }
        const uint16_t *b1 = pw + K * 16;
        const int64_t t1 = (ch + 1) * chunk < mtiles ? (ch + 1) * chunk : mtiles;
        for (int64_t t = ch * chunk; t < t1; t += 2) {
            const uint16_t *a0 = t < full ? x + t * 16 * K : xs, *a1 = t + 1 < full ? x + (t + 1) * 16 * K : xs;
            const int ma = t + 1 < t1 ? 2 : 1;
            if (ma == 2 && nb == 2)
                amx_tiles(a0, a1, lda, pw, b1, kt, c, 2, 2);
            else if (ma == 2)
                amx_tiles(a0, a1, lda, pw, b1, kt, c, 2, 1);
            else if (nb == 2)
                amx_tiles(a0, a1, lda, pw, b1, kt, c, 1, 2);
            else
                amx_tiles(a0, a1, lda, pw, b1, kt, c, 1, 1);
            for (int i = 0; i < ma; ++i) {
                const int64_t m0 = (t + i) * 16, rows = M - m0 < 16 ? M - m0 : 16;
                for (int j = 0; j < nb; ++j) amx_store(c + (2 * i + j) * 256, rows, bias, y, yf, N, m0, (blk + j) * 16);
            }
        }
    }
    _tile_release();
}

int rg_has_amx(void) { return amx_granted(); }

/* y (M, N) = x (M, K) @ w^T (+ bias (N,)) on AMX tiles, bf16 in and out (yf: the rounded results widened to
 * float32 instead): bf16, int8 and int4 layouts with K a multiple of 32; refuses the deterministic mode's weights
 * (k_split, partial), other K, and a process without the tile state. */
rg_status rg_linear_amx_bf16(const rg_weight *w, const uint16_t *x, int64_t M, const uint16_t *bias, uint16_t *y,
                             float *yf) {
    if (!rg_w_valid(w, 1) || w->k_split || w->partial || w->K % 32 || M < 0 || !amx_granted())
        return RG_ERR_UNSUPPORTED;
    if (M == 0) return RG_OK;
    const int64_t K = w->K, tail = M % 16;
    const size_t c_bytes = rg_span(1024, sizeof(float));
    const size_t bytes = c_bytes + (w->kind == RG_W_BF16 ? 0 : rg_span(2 * K * 16, sizeof(uint16_t)));
    const int threads = omp_get_max_threads();
    char *scratch = (char *)malloc(bytes * (size_t)threads + (tail ? rg_span(16 * K, sizeof(uint16_t)) : 0));
    if (!scratch) return RG_ERR_ALLOC;
    uint16_t *xs = NULL;
    if (tail) {
        xs = (uint16_t *)(scratch + bytes * (size_t)threads);
        memset(xs, 0, sizeof(uint16_t) * (size_t)(16 * K));
        memcpy(xs, x + (M - tail) * K, sizeof(uint16_t) * (size_t)(tail * K));
    }
#pragma omp parallel num_threads(threads)
    {
        char *mine = scratch + bytes * (size_t)omp_get_thread_num();
        amx_team(w, x, xs, M, bias, y, yf, (float *)mine,
                 w->kind == RG_W_BF16 ? NULL : (uint16_t *)(mine + c_bytes));
    }
    free(scratch);
    return RG_OK;
}
#else
int rg_has_amx(void) { return 0; }

rg_status rg_linear_amx_bf16(const rg_weight *w, const uint16_t *x, int64_t M, const uint16_t *bias, uint16_t *y,
                             float *yf) {
    (void)w, (void)x, (void)M, (void)bias, (void)y, (void)yf;
    return RG_ERR_UNSUPPORTED;
}
#endif
