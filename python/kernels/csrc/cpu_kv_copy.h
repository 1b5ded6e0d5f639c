/* Row copies between two KV pools (the hierarchical cache's tiers: the device pool and the host tier), every
 * layer's K and V in one call, every build. A pool holds one buffer per layer and per K / V, so a call takes
 * arrays of n_bufs buffer addresses (src[b] -> dst[b]) and copies rows src_index[i] -> dst_index[i] of each:
 *   rg_kv_copy_rows            the same format: row_bytes bytes a row (values, 8-bit codes, or their scales);
 *   rg_kv_quantize_rows_{T}    T values (Hkv, D) a row -> 8-bit codes and a bf16 scale per (row, head), the
 *                              arithmetic of kv_quant_row (cpu_kv_quant.h), as the int8 / fp8 store kernels;
 *   rg_kv_dequantize_rows_{T}  8-bit codes and scales -> T values: code * scale in float32, rounded once to T.
 * `code` is KV_INT8 or KV_FP8. Rows (i, b) are spread over `threads` OpenMP threads (1: this thread alone, no
 * team woken); destination rows must be distinct. The AVX512 paths (D a multiple of 16) compute the same bits
 * as the scalar ones: max, division, clamping and the roundings are exact IEEE operations in any order. */

#if defined(__AVX512F__)
/* 16 floats to bf16, rounded to nearest even (f32_to_bf16's integer arithmetic: NaN stays NaN). */
static inline __m256i kvc_store16_bf16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)),
                                              16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

/* 16 floats, |y| <= 448, to e4m3 codes (f32_to_e4m3 on 16 lanes). */
static inline __m128i kvc_e4m3_16(__m512 y) {
    const __m512i u0 = _mm512_castps_si512(y);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u0, 24), _mm512_set1_epi32(0x80));
    const __m512i u = _mm512_and_si512(u0, _mm512_set1_epi32(0x7fffffff));
    const __m512 a = _mm512_castsi512_ps(u);
    const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.f)));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7ffff)), lsb);
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
    const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    return _mm512_cvtepi32_epi8(_mm512_or_si512(sign, _mm512_mask_blend_epi32(small, normal, sub)));
}

/* One (row, head) of D floats (D a multiple of 16, at most D_MAX) -> D codes, returns the bf16 scale. */
static inline __attribute__((always_inline)) uint16_t kvc_quant_row16(const void *x, const int bf16, int64_t D,
                                                                      void *codes, const int fp8) {
    __m512 v[D_MAX / 16];
    __m512 amax = _mm512_setzero_ps();
    for (int64_t j = 0; j < D / 16; ++j) {
        v[j] = bf16 ? load16_bf16((const uint16_t *)x + 16 * j) : _mm512_loadu_ps((const float *)x + 16 * j);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[j]));
    }
    const float qmax = fp8 ? KV_FP8_MAX : KV_INT8_MAX;
    const uint16_t s16 = f32_to_bf16(_mm512_reduce_max_ps(amax) / qmax);
    const float s = bf16_to_f32(s16);
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
    for (int64_t j = 0; j < D / 16; ++j) {
        const __m512 y = s > 0.f ? _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v[j], vs), lo), hi)
                                 : _mm512_setzero_ps();
        const __m128i c = fp8 ? kvc_e4m3_16(y) : _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(y));
        _mm_storeu_si128((__m128i *)((uint8_t *)codes + 16 * j), c);
    }
    return s16;
}
#endif

/* One (row, head): D values of T (bf16 when `bf16`, else float) -> D codes (int8, or e4m3 with fp8); returns the
 * bf16 scale. */
static inline __attribute__((always_inline)) uint16_t kvc_quant_row(const void *x, const int bf16, int64_t D,
                                                                    void *codes, const int fp8) {
#if defined(__AVX512F__)
    if (D % 16 == 0) return kvc_quant_row16(x, bf16, D, codes, fp8);
#endif
    float f[D_MAX];
    for (int64_t d = 0; d < D; ++d) f[d] = bf16 ? bf16_to_f32(((const uint16_t *)x)[d]) : ((const float *)x)[d];
    return kv_quant_row(f, D, codes, fp8);
}

/* One (row, head): D codes and scale s16 -> D values of T. */
static inline __attribute__((always_inline)) void kvc_dequant_row(const void *codes, uint16_t s16, int64_t D,
                                                                  void *out, const int bf16, const int fp8) {
    const float s = bf16_to_f32(s16);
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s);
    for (; d + 16 <= D; d += 16) {
        const __m512 y = _mm512_mul_ps(fp8 ? load16_e4m3((const uint8_t *)codes + d)
                                           : load16_i8((const int8_t *)codes + d), vs);
        if (bf16)
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + d), kvc_store16_bf16(y));
        else
            _mm512_storeu_ps((float *)out + d, y);
    }
#endif
    for (; d < D; ++d) {
        const float c = fp8 ? e4m3_to_f32(((const uint8_t *)codes)[d]) : (float)((const int8_t *)codes)[d];
        const float y = c * s;
        if (bf16)
            ((uint16_t *)out)[d] = f32_to_bf16(y);
        else
            ((float *)out)[d] = y;
    }
}

/* Rows are scattered over both pools (eviction order, free lists), so each loop asks for the rows KVC_AHEAD
 * iterations ahead, source for reading and destination for writing, while it converts the current one: the
 * conversion is too long for the core to overlap the next row's misses by itself (4x slower than contiguous rows
 * without it). */
#define KVC_AHEAD 8

static inline void kvc_prefetch(const void *src, size_t src_bytes, const void *dst, size_t dst_bytes) {
    for (size_t off = 0; off < src_bytes; off += 64) __builtin_prefetch((const char *)src + off, 0, 3);
    for (size_t off = 0; off < dst_bytes; off += 64) __builtin_prefetch((const char *)dst + off, 1, 3);
}

/* Every loop below goes over rows (i, b), i < n_rows, b < n_bufs, buffer-major, split evenly over `threads` (the if
 * clause: with 1 the loop runs on the calling thread, no parallel region). */
rg_status rg_kv_copy_rows(const void *const *src, void *const *dst, int64_t n_bufs, const int64_t *src_index,
                          const int64_t *dst_index, int64_t n_rows, int64_t row_bytes, int64_t threads) {
    if (threads < 1 || row_bytes < 0) return RG_ERR_UNSUPPORTED;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t k = 0; k < n_bufs * n_rows; ++k) {
        const int64_t b = k / n_rows, i = k % n_rows;
        if (i + KVC_AHEAD < n_rows)
            kvc_prefetch((const char *)src[b] + src_index[i + KVC_AHEAD] * row_bytes, (size_t)row_bytes,
                         (char *)dst[b] + dst_index[i + KVC_AHEAD] * row_bytes, (size_t)row_bytes);
        memcpy((char *)dst[b] + dst_index[i] * row_bytes, (const char *)src[b] + src_index[i] * row_bytes,
               (size_t)row_bytes);
    }
    return RG_OK;
}

/* The quantize / dequantize loops for one source element type and one code type (constants once inlined). */
static inline __attribute__((always_inline)) void kvc_quantize(const void *const *src, void *const *dst,
                                                               void *const *dst_scale, int64_t n_bufs,
                                                               const int64_t *src_index, const int64_t *dst_index,
                                                               int64_t n_rows, int64_t Hkv, int64_t D,
                                                               int64_t threads, const int bf16, const int fp8) {
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t k = 0; k < n_bufs * n_rows; ++k) {
        const int64_t b = k / n_rows, i = k % n_rows;
        if (i + KVC_AHEAD < n_rows)
            kvc_prefetch((const char *)src[b] + (size_t)(src_index[i + KVC_AHEAD] * Hkv * D) * esize,
                         (size_t)(Hkv * D) * esize, (uint8_t *)dst[b] + dst_index[i + KVC_AHEAD] * Hkv * D,
                         (size_t)(Hkv * D));
        const char *x = (const char *)src[b] + (size_t)(src_index[i] * Hkv * D) * esize;
        uint8_t *c = (uint8_t *)dst[b] + dst_index[i] * Hkv * D;
        uint16_t *s = (uint16_t *)dst_scale[b] + dst_index[i] * Hkv;
        for (int64_t h = 0; h < Hkv; ++h) s[h] = kvc_quant_row(x + (size_t)(h * D) * esize, bf16, D, c + h * D, fp8);
    }
}

static inline __attribute__((always_inline)) void kvc_dequantize(const void *const *src,
                                                                 const void *const *src_scale, void *const *dst,
                                                                 int64_t n_bufs, const int64_t *src_index,
                                                                 const int64_t *dst_index, int64_t n_rows,
                                                                 int64_t Hkv, int64_t D, int64_t threads,
                                                                 const int bf16, const int fp8) {
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t k = 0; k < n_bufs * n_rows; ++k) {
        const int64_t b = k / n_rows, i = k % n_rows;
        if (i + KVC_AHEAD < n_rows)
            kvc_prefetch((const uint8_t *)src[b] + src_index[i + KVC_AHEAD] * Hkv * D, (size_t)(Hkv * D),
                         (char *)dst[b] + (size_t)(dst_index[i + KVC_AHEAD] * Hkv * D) * esize,
                         (size_t)(Hkv * D) * esize);
        const uint8_t *c = (const uint8_t *)src[b] + src_index[i] * Hkv * D;
        const uint16_t *s = (const uint16_t *)src_scale[b] + src_index[i] * Hkv;
        char *y = (char *)dst[b] + (size_t)(dst_index[i] * Hkv * D) * esize;
        for (int64_t h = 0; h < Hkv; ++h) kvc_dequant_row(c + h * D, s[h], D, y + (size_t)(h * D) * esize, bf16, fp8);
    }
}

/* Whether a (code, D, threads) triple is one these kernels take. */
static inline int kvc_ok(int64_t code, int64_t D, int64_t threads) {
    return D >= 1 && D <= D_MAX && threads >= 1 && (code == KV_INT8 || code == KV_FP8);
}

/* The exported entry points, one per element type; the code type, a run-time argument, becomes a constant. */
rg_status rg_kv_quantize_rows_f32(const void *const *src, void *const *dst, void *const *dst_scale, int64_t n_bufs,
                                  const int64_t *src_index, const int64_t *dst_index, int64_t n_rows, int64_t Hkv,
                                  int64_t D, int64_t code, int64_t threads) {
    if (!kvc_ok(code, D, threads)) return RG_ERR_UNSUPPORTED;
    if (code == KV_FP8)
        kvc_quantize(src, dst, dst_scale, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 0, 1);
    else
        kvc_quantize(src, dst, dst_scale, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 0, 0);
    return RG_OK;
}

rg_status rg_kv_quantize_rows_bf16(const void *const *src, void *const *dst, void *const *dst_scale,
                                   int64_t n_bufs, const int64_t *src_index, const int64_t *dst_index,
                                   int64_t n_rows, int64_t Hkv, int64_t D, int64_t code, int64_t threads) {
    if (!kvc_ok(code, D, threads)) return RG_ERR_UNSUPPORTED;
    if (code == KV_FP8)
        kvc_quantize(src, dst, dst_scale, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 1, 1);
    else
        kvc_quantize(src, dst, dst_scale, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 1, 0);
    return RG_OK;
}

rg_status rg_kv_dequantize_rows_f32(const void *const *src, const void *const *src_scale, void *const *dst,
                                    int64_t n_bufs, const int64_t *src_index, const int64_t *dst_index,
                                    int64_t n_rows, int64_t Hkv, int64_t D, int64_t code, int64_t threads) {
    if (!kvc_ok(code, D, threads)) return RG_ERR_UNSUPPORTED;
    if (code == KV_FP8)
        kvc_dequantize(src, src_scale, dst, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 0, 1);
    else
        kvc_dequantize(src, src_scale, dst, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 0, 0);
    return RG_OK;
}

rg_status rg_kv_dequantize_rows_bf16(const void *const *src, const void *const *src_scale, void *const *dst,
                                     int64_t n_bufs, const int64_t *src_index, const int64_t *dst_index,
                                     int64_t n_rows, int64_t Hkv, int64_t D, int64_t code, int64_t threads) {
    if (!kvc_ok(code, D, threads)) return RG_ERR_UNSUPPORTED;
    if (code == KV_FP8)
        kvc_dequantize(src, src_scale, dst, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 1, 1);
    else
        kvc_dequantize(src, src_scale, dst, n_bufs, src_index, dst_index, n_rows, Hkv, D, threads, 1, 0);
    return RG_OK;
}
