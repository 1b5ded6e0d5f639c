/* The expert block inside the fused decode step (AVX512-BF16): cpu_moe.h's math for the step's team. Included by
 * cpu_kernels.c inside the fused step's section, after silu_mul_bf16.
 *
 * The team meets twice per block, as at a dense MLP (after gate_up, after down), however many experts the rows
 * select; on a shared machine every meeting waits for the slower thread, or for one the OS has preempted, so the
 * block was cut from six meetings to these two:
 *   - routing without meeting: every thread runs the router matmul (E rows: a few KiB to a few hundred, read from
 *     the cache by the second thread) and routes and groups all rows itself, with the same code, so every thread
 *     holds the same grouping;
 *   - gate_up pass: each thread takes an equal range of the intermediate's 16-column blocks, for every selected
 *     expert (and the shared one): the gate block and its up block (I apart), then the gated SiLU of those columns
 *     at once, since the same thread wrote both halves (I a multiple of 16, which moe_step_layer checks);
 *   - down pass: each thread an equal range of the output's 16-column blocks, for every selected expert (and the
 *     shared one), then the weighted sum over j of those columns, which it alone wrote.
 * At tp > 1 one thread then sums the ranks' partial sums (moe_reduce), a third meeting as at a dense MLP's
 * all-reduce. A split by columns across all experts also keeps the threads even when the experts' row counts
 * differ (b8). The math and roundings are those of the layer-by-layer C path (rg_moe_experts_bf16): each output
 * of a gemv tile has its own accumulator whatever tile or thread computes it. */

/* One tile of n (1 to 4) blocks of w from block b, out of line: every pass below shares one copy. */
static __attribute__((noinline)) void moe_tile(const rg_weight *w, const uint16_t *x, int64_t rows, const float *sx,
                                               uint16_t *y, int64_t b, int64_t n, int near, int far) {
    switch (n) {
    case 1: gemv_blocks(w, x, rows, sx, NULL, y, NULL, b, 1, near, far); break;
    case 2: gemv_blocks(w, x, rows, sx, NULL, y, NULL, b, 2, near, far); break;
    case 3: gemv_blocks(w, x, rows, sx, NULL, y, NULL, b, 3, near, far); break;
    default: gemv_blocks(w, x, rows, sx, NULL, y, NULL, b, 4, near, far); break;
    }
}

/* The first bytes of blocks [b, b + n) of a bf16 weight on their way (the next tile's streams; the quantized tiles
 * prefetch their next tile themselves: gemv_tile_q's far). */
static inline void moe_prefetch_heads(const rg_weight *w, int64_t b, int64_t n) {
    if (w->kind != RG_W_BF16) return;
    const int64_t bb = rg_w_block_bytes(w), head = bb < GEMV_PREFETCH ? bb : GEMV_PREFETCH;
    const char *p = (const char *)w->data + b * bb;
    for (int64_t j = 0; j < n; ++j)
        for (int64_t off = 0; off < head; off += 64) _mm_prefetch(p + j * bb + off, GEMV_HINT);
}

/* Blocks [c0, c1) of an (N, K) weight for `rows` input rows x, outputs y (rows, N), four blocks a tile; before each
 * tile, the next one's heads (or those of `then`'s blocks [c0, c1) after the last). */
static void moe_blocks(const rg_weight *w, const uint16_t *x, int64_t rows, const float *sx, uint16_t *y,
                       int64_t c0, int64_t c1, const rg_weight *then) {
    for (int64_t c = c0; c < c1; c += 4) {
        const int64_t n = c1 - c < 4 ? c1 - c : 4, rest = c1 - c - 4;
        if (rest > 0)
            moe_prefetch_heads(w, c + 4, rest < 4 ? rest : 4);
        else if (then)
            moe_prefetch_heads(then, c0, c1 - c0 < 4 ? c1 - c0 : 4);
        moe_tile(w, x, rows, sx, y, c, n, c == c0, (int)(rest < 0 ? 0 : rest < 4 ? rest : 4));
    }
}

/* Columns [16 c0, 16 c1) of the gated activation of `rows` rows x through gate_up w ((2I, K): gate rows, then up):
 * gate and up blocks into gu (rows, 2I), then silu(gate) * up into act (rows, I), a tile at a time. */
static void moe_gated_cols(const rg_weight *w, const uint16_t *x, int64_t rows, float *sx, uint16_t *gu,
                           uint16_t *act, int64_t I, int64_t c0, int64_t c1, const rg_weight *then) {
    const int64_t nb = I / 16;
    if (c0 >= c1) return;
    if (w->kind == RG_W_INT4) group_sums_bf16(x, rows, w->K, w->group, sx);
    for (int64_t c = c0; c < c1; c += 4) {
        const int64_t n = c1 - c < 4 ? c1 - c : 4, rest = c1 - c - 4;
        const int far = (int)(rest < 0 ? 0 : rest < 4 ? rest : 4);
        moe_prefetch_heads(w, nb + c, n); /* the up tile, next */
        moe_tile(w, x, rows, sx, gu, c, n, c == c0, far);
        if (rest > 0)
            moe_prefetch_heads(w, c + 4, far);
        else if (then)
            moe_prefetch_heads(then, c0, c1 - c0 < 4 ? c1 - c0 : 4);
        moe_tile(w, x, rows, sx, gu, nb + c, n, c == c0, far);
        for (int64_t r = 0; r < rows; ++r)
            silu_mul_row_bf16(gu + r * 2 * I + c * 16, gu + r * 2 * I + I + c * 16, act + r * I + c * 16, n * 16);
    }
}

/* The calling thread's routing of all M rows (hp: its copy of the normed rows): router logits (its own matmul over
 * all E rows: the same tiles, so the same bits, as a split one), softmax / top-k / norm_topk_prob as `route`,
 * ties to the lower expert, the places grouped by this rank's experts, the rows of experts with several gathered
 * (an expert with one reads it in place), and the shared expert's gates. */
static void moe_route_own(const rg_moe_layer *moe, const uint16_t *hp, int64_t M, int64_t H, moe_own_scratch *o,
                          float *sx) {
    const int64_t E = moe->num_experts, k = moe->top_k, n_local = moe->n_local, P = M * k;
    const rg_weight *r = &moe->router;
    const int64_t blocks = (r->N + 15) / 16;
    if (r->kind == RG_W_INT4) group_sums_bf16(hp, M, H, r->group, sx);
    for (int64_t b = 0; b < blocks; b += 4) moe_tile(r, hp, M, sx, o->logits, b, blocks - b < 4 ? blocks - b : 4, 1, 0);
    for (int64_t i = 0; i < M * E; ++i) o->lf[i] = bf16_to_f32(o->logits[i]);
    rg_moe_route(o->lf, M, E, k, moe->softmax_before_topk, moe->norm_topk_prob, o->ids, o->w);
    const int64_t mine = moe_group(o->ids, P, moe->first, n_local, o->start, o->order);
    for (int64_t p = 0; p < P; ++p) o->pos[p] = -1;
    for (int64_t i = 0; i < mine; ++i) o->pos[o->order[i]] = i;
    o->n_active = 0;
    for (int64_t e = 0; e < n_local; ++e) {
        const int64_t s = o->start[e], n = o->start[e + 1] - s;
        if (!n) continue;
        o->active[o->n_active++] = e;
        for (int64_t i = 0; i < n && n > 1; ++i)
            memcpy(o->xs + (s + i) * H, hp + o->order[s + i] / k * H, sizeof(uint16_t) * (size_t)H);
    }
    for (int64_t m = 0; m < M && moe->shared_I && moe->shared_gate; ++m) { /* sigmoid(x . g), rounded as torch's */
        float dot = 0.f;
        for (int64_t c = 0; c < H; ++c) dot += bf16_to_f32(hp[m * H + c]) * bf16_to_f32(moe->shared_gate[c]);
        dot = bf16_to_f32(f32_to_bf16(dot));
        o->sgate[m] = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-dot))));
    }
}

/* The rows of expert e (local index): its one row in place, or its gathered rows. */
static inline const uint16_t *moe_rows(const moe_own_scratch *o, const uint16_t *hp, int64_t e, int64_t k, int64_t H) {
    const int64_t s = o->start[e];
    return o->start[e + 1] - s == 1 ? hp + o->order[s] / k * H : o->xs + s * H;
}

#define MOE_R (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* 16 bf16 values (those of mask mk) widened */
static inline __m512 moe_load16(const uint16_t *p, __mmask16 mk) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
}

/* out + gate * shared (the block's routed sums, the shared expert's output, rounded bf16 values), each op rounded
 * to bf16 as torch's */
static inline __m512 moe_add_shared(__m512 v, float gate, __m512 sv) {
    const __m512 term = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_round_ps(_mm512_set1_ps(gate), sv, MOE_R)));
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_add_round_ps(v, term, MOE_R)));
}

/* Output columns [col0, col1) of the block for all M rows, from the expert outputs in y (places, H) and, with
 * `shared`, the shared expert's in sy: the k terms in order j = 0 .. k-1, each y * weight in float32 (mul and add
 * rounded apart, as the layer-by-layer path's terms are), rounded once; then out + sigmoid(x . g) * shared. */
static void moe_combine_cols(const rg_moe_layer *moe, const moe_own_scratch *o, const moe_team_scratch *t,
                             int64_t M, int64_t H, int64_t col0, int64_t col1, int shared, uint16_t *x) {
    const int64_t k = moe->top_k;
    const int R = MOE_R;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = col0; c < col1; c += 16) {
            const __mmask16 mk = col1 - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (col1 - c)) - 1);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < k; ++j) {
                const int64_t i = o->pos[m * k + j];
                __m512 term = _mm512_setzero_ps();
                if (i >= 0) {
                    term = _mm512_mul_round_ps(moe_load16(t->y + i * H + c, mk), _mm512_set1_ps(o->w[m * k + j]), R);
                }
                acc = j == 0 ? term : _mm512_add_round_ps(acc, term, R);
            }
            __m512 v = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(acc));
            if (shared) v = moe_add_shared(v, moe->shared_gate ? o->sgate[m] : 1.f, moe_load16(t->sy + m * H + c, mk));
            _mm256_mask_storeu_epi16(x + m * H + c, mk, (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* At tp > 1, the sums over the ranks, by one thread: the routed experts' partial sums in x all-reduced; with a shared
 * expert, its partial sums (sy) all-reduced too, apart (the layer-by-layer path's two all-reduces: the experts',
 * then the shared expert's row-parallel down projection), and then added behind their gates. */
static void moe_reduce(const rg_moe_layer *moe, const moe_own_scratch *o, const moe_team_scratch *t, int64_t M,
                       int64_t H, uint16_t *x, const rg_parallel *par) {
    par->all_reduce(par->ctx, x, M * H);
    if (!moe->shared_I) return;
    const size_t bytes = sizeof(uint16_t) * (size_t)(M * H);
    memcpy(t->y, x, bytes); /* the routed sums (y: at least M H, its expert outputs used up) */
    memcpy(x, t->sy, bytes);
    par->all_reduce(par->ctx, x, M * H);
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < H; c += 16) {
            const __mmask16 mk = H - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (H - c)) - 1);
            const __m512 v = moe_add_shared(moe_load16(t->y + m * H + c, mk), moe->shared_gate ? o->sgate[m] : 1.f,
                                            moe_load16(x + m * H + c, mk));
            _mm256_mask_storeu_epi16(x + m * H + c, mk, (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* hp (M, H): the normed rows (each thread's own copy); sx the thread's group sums (inter at least the block's
 * widest input); x (M, H): the block's output (at tp > 1 this rank's experts and columns, summed over the ranks by
 * par's all-reduce, which the fused step's hook makes, as after a dense MLP; not the deterministic mode's partials:
 * an expert block is refused there). */
static void moe_team_bf16(const rg_moe_layer *moe, const uint16_t *hp, int64_t M, int64_t H, uint16_t *x, float *sx,
                          const rg_parallel *par) {
    const int64_t E = moe->num_experts, k = moe->top_k, n_local = moe->n_local, I = moe->I, sI = moe->shared_I;
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    moe_team_scratch t;
    moe_own_scratch o;
    moe_team_layout((uintptr_t)moe->scratch, M, H, k, I, sI, &t);
    moe_own_layout((uintptr_t)moe->thread_scratch + (uintptr_t)(me * moe->thread_bytes), M, H, E, k, n_local, &o);

    moe_route_own(moe, hp, M, H, &o, sx);
    PROF_LAP(18);
    /* gate_up: this thread's share of the intermediate's blocks, for every selected expert, then the shared one */
    PROF_PHASE(20);
    const int64_t nb = I / 16, c0 = nb * me / team, c1 = nb * (me + 1) / team;
    const int64_t snb = sI / 16, s0 = snb * me / team, s1 = snb * (me + 1) / team;
    for (int64_t i = 0; i < o.n_active; ++i) {
        const int64_t e = o.active[i], s = o.start[e];
        const rg_weight *then = i + 1 < o.n_active ? moe->gate_up + o.active[i + 1] : NULL;
        moe_gated_cols(moe->gate_up + e, moe_rows(&o, hp, e, k, H), o.start[e + 1] - s, sx, t.gu + s * 2 * I,
                       t.act + s * I, I, c0, c1, then);
    }
    if (sI) moe_gated_cols(&moe->shared_gate_up, hp, M, sx, t.sgu, t.sact, sI, s0, s1, NULL);
    PROF_LAP(prof_phase);
#pragma omp barrier
    PROF_LAP(prof_phase + 1);
    /* down: this thread's share of the output's blocks, for every selected expert and the shared one, then the
     * weighted sum of those columns */
    PROF_PHASE(24);
    const int64_t hb = (H + 15) / 16, d0 = hb * me / team, d1 = hb * (me + 1) / team;
    for (int64_t i = 0; i < o.n_active; ++i) {
        const int64_t e = o.active[i], s = o.start[e], rows = o.start[e + 1] - s;
        const rg_weight *w = moe->down + e;
        if (d0 >= d1) break;
        if (w->kind == RG_W_INT4) group_sums_bf16(t.act + s * I, rows, I, w->group, sx);
        const rg_weight *then = i + 1 < o.n_active ? moe->down + o.active[i + 1] : sI ? &moe->shared_down : NULL;
        moe_blocks(w, t.act + s * I, rows, sx, t.y + s * H, d0, d1, then);
    }
    if (sI && d0 < d1) {
        if (moe->shared_down.kind == RG_W_INT4) group_sums_bf16(t.sact, M, sI, moe->shared_down.group, sx);
        moe_blocks(&moe->shared_down, t.sact, M, sx, t.sy, d0, d1, NULL);
    }
    const int reduce = par && par->all_reduce;
    moe_combine_cols(moe, &o, &t, M, H, d0 * 16, d1 * 16 < H ? d1 * 16 : H, sI && !reduce, x);
    PROF_LAP(prof_phase);
#pragma omp barrier
    PROF_LAP(prof_phase + 1);
    if (reduce) {
#pragma omp single
        moe_reduce(moe, &o, &t, M, H, x, par);
    }
}
