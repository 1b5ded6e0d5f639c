/* A grammar's token bitmask applied to float32 logits, every build: bit b of word w of a row allows token
 * 32 * w + b (xgrammar's layout); a disallowed token's logit becomes -inf, as do the ids from `vocab` up to the
 * row's end (padding with no token behind it). Cost follows the words: an all-allowed word is skipped, an
 * all-disallowed one is a run of stores, so a closed mask (a grammar in the middle of a JSON key) costs about a
 * memset of the row. Rows `rows[i]` of both the logits and the bitmask. */

rg_status rg_apply_token_bitmask_f32(float *logits, int64_t ld, const int32_t *bitmask, int64_t words,
                                     const int64_t *rows, int64_t n_rows, int64_t vocab) {
    if (ld < vocab || words * 32 < vocab) return RG_ERR_UNSUPPORTED;
    const float ninf = -INFINITY;
    for (int64_t i = 0; i < n_rows; i++) {
        float *l = logits + rows[i] * ld;
        const uint32_t *m = (const uint32_t *)(bitmask + rows[i] * words);
        for (int64_t w = 0; w * 32 < vocab; w++) {
            const uint32_t b = m[w];
            if (b == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32, n = vocab - base < 32 ? vocab - base : 32;
            if (b == 0) {
                for (int64_t j = 0; j < n; j++) l[base + j] = ninf;
            } else {
                for (int64_t j = 0; j < n; j++)
                    if (!((b >> j) & 1u)) l[base + j] = ninf;
            }
        }
        for (int64_t j = vocab; j < ld; j++) l[j] = ninf;
    }
    return RG_OK;
}
