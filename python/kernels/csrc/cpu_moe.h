/* Mixture-of-experts blocks on the CPU: routing (router logits -> each token's top-k experts and weights) and
 * the experts' gated MLPs over the rows routed to them, reading only the selected experts' weights (rg_weight
 * descriptors of cpu_linear.h: bf16 K pairs, int8, int4) with every expert's rows in one matmul. Included by
 * cpu_kernels.c after cpu_linear.h; the fused decode step's team version is cpu_moe_step.h.
 *
 * The math and roundings are those of radixgen.runtime.layers.moe (route, experts_forward): router logits
 * rounded to the activation dtype, softmax and top-k in float32 (ties to the lower expert), each expert's
 * gate_up, silu(gate) rounded, times up rounded, down rounded; its term times the routing weight in float32;
 * a token's k terms summed in order j = 0 .. k-1, rounded once. */

/* One expert block as the fused decode step reads it (rg_layer_bf16.moe); the unfused entry point takes the
 * same expert arrays as arguments. Scratch is the runtime's (set before each step): one region for the team
 * (moe_team_scratch below), and per thread thread_scratch + t * thread_bytes (moe_own_scratch), both sized by
 * rg_moe_step_bytes. */
typedef struct rg_moe_layer {
    const rg_weight *gate_up, *down; /* n_local descriptors each: (2I, H) gate rows first, (H, I) */
    int64_t n_local, first, I;       /* experts [first, first + n_local) of num_experts are these */
    int64_t num_experts, top_k, softmax_before_topk, norm_topk_prob;
    rg_weight router;                                  /* (num_experts, H) */
    rg_weight shared_gate_up, shared_down;             /* the shared expert (Qwen2-MoE), kind ignored when ... */
    int64_t shared_I;                                  /* ... this is 0: no shared expert */
    const uint16_t *shared_gate;                       /* (H,) bf16: sigmoid(x . g) scales the shared expert */
    void *scratch, *thread_scratch;
    int64_t thread_bytes;
} rg_moe_layer;

/* Routing of one token: logits (E,) float32 -> ids (k,) in descending weight order and weights (k,). */
static void moe_route_row(const float *logits, int64_t E, int64_t k, int softmax_before, int norm_topk,
                          int32_t *ids, float *w) {
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = logits[e] > mx ? logits[e] : mx;
    float sum = 0.f;
    if (softmax_before)
        for (int64_t e = 0; e < E; ++e) sum += expf(logits[e] - mx);
    for (int64_t j = 0; j < k; ++j) { /* the j-th largest, the lowest index among equals (torch.topk's order) */
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
            int taken = 0;
            for (int64_t i = 0; i < j; ++i) taken |= ids[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        ids[j] = (int32_t)best;
        w[j] = softmax_before ? expf(logits[best] - mx) / sum : logits[best];
    }
    if (!softmax_before) { /* softmax over the k chosen logits */
        const float top = w[0];
        float s = 0.f;
        for (int64_t j = 0; j < k; ++j) s += (w[j] = expf(w[j] - top));
        for (int64_t j = 0; j < k; ++j) w[j] /= s;
    } else if (norm_topk) {
        float s = 0.f;
        for (int64_t j = 0; j < k; ++j) s += w[j];
        for (int64_t j = 0; j < k; ++j) w[j] /= s;
    }
}

/* The (token, j) places routed to this rank's experts grouped by expert, experts in order and places in
 * order within one (a counting sort): order[start[e] .. start[e + 1]) are expert e's; returns how many. */
static int64_t moe_group(const int32_t *ids, int64_t places, int64_t first, int64_t n_local, int64_t *start,
                         int64_t *order) {
    for (int64_t e = 0; e <= n_local; ++e) start[e] = 0;
    for (int64_t p = 0; p < places; ++p) {
        const int64_t e = (int64_t)ids[p] - first;
        if (e >= 0 && e < n_local) ++start[e + 1];
    }
    for (int64_t e = 0; e < n_local; ++e) start[e + 1] += start[e];
    int64_t *fill = start + n_local + 1; /* n_local running positions after start's n_local + 1 */
    for (int64_t e = 0; e < n_local; ++e) fill[e] = start[e];
    for (int64_t p = 0; p < places; ++p) {
        const int64_t e = (int64_t)ids[p] - first;
        if (e >= 0 && e < n_local) order[fill[e]++] = p;
    }
    return start[n_local];
}

/* The unfused expert forward, once per activation type: x (T, H) rows, ids / weights (T, k) from the routing,
 * out (T, H) = sum_j weights[t, j] * expert ids[t, j] (x_t) over this rank's experts (others add zero). Each
 * expert with rows: its rows gathered, one gate_up matmul, the gated SiLU, one down matmul. */
#define MOE_EXPERTS(SUF, T, LD, ST)                                                                            \
    rg_status rg_moe_experts_##SUF(const rg_weight *gate_up, const rg_weight *down, int64_t n_local,           \
                                   int64_t first, const T *x, int64_t n_tok, int64_t H, int64_t I,           \
                                   const int32_t *ids, const float *weights, int64_t k, T *out) {             \
        const int64_t places = n_tok * k;                                                                      \
        for (int64_t e = 0; e < n_local; ++e)                                                                  \
            if (!rg_w_valid(gate_up + e, 1) || !rg_w_valid(down + e, 1) || gate_up[e].N != 2 * I ||           \
                gate_up[e].K != H || down[e].N != H || down[e].K != I)                                         \
                return RG_ERR_UNSUPPORTED;                                                                     \
        int64_t *start = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * n_local + 1 + places));            \
        T *xs = (T *)malloc(sizeof(T) * (size_t)(places * (H + 3 * I + H) + 1));                              \
        float *terms = (float *)calloc((size_t)(places * H + 1), sizeof(float));                             \
        rg_status st = (start && xs && terms) ? RG_OK : RG_ERR_ALLOC;                                         \
        int64_t *order = start + 2 * n_local + 1;                                                              \
        T *gu = xs + places * H, *act = gu + places * 2 * I, *y = act + places * I;                           \
        if (st == RG_OK) moe_group(ids, places, first, n_local, start, order);                                 \
        for (int64_t e = 0; e < n_local && st == RG_OK; ++e) {                                                 \
            const int64_t s = start[e], n = start[e + 1] - s;                                                  \
            if (!n) continue;                                                                                  \
            for (int64_t i = 0; i < n; ++i) memcpy(xs + (s + i) * H, x + order[s + i] / k * H, sizeof(T) * H);  \
            st = rg_linear_##SUF(gate_up + e, xs + s * H, n, NULL, gu + s * 2 * I, NULL);                      \
            if (st != RG_OK) break;                                                                            \
            for (int64_t i = 0; i < n * I; ++i) {                                                              \
                const int64_t r = i / I, c = i % I;                                                            \
                const float g = LD(gu[(s + r) * 2 * I + c]);                                                   \
                const float sg = LD(ST(g / (1.f + expf(-g))));                                                 \
                act[s * I + i] = ST(sg * LD(gu[(s + r) * 2 * I + I + c]));                                     \
            }                                                                                                  \
            st = rg_linear_##SUF(down + e, act + s * I, n, NULL, y + s * H, NULL);                             \
            for (int64_t i = 0; i < n && st == RG_OK; ++i) {                                                   \
                const int64_t p = order[s + i];                                                                \
                for (int64_t c = 0; c < H; ++c) terms[p * H + c] = LD(y[(s + i) * H + c]) * weights[p];        \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t t = 0; t < n_tok && st == RG_OK; ++t)                                                     \
            for (int64_t c = 0; c < H; ++c) {                                                                  \
                float acc = terms[t * k * H + c];                                                              \
                for (int64_t j = 1; j < k; ++j) acc += terms[(t * k + j) * H + c];                             \
                out[t * H + c] = ST(acc);                                                                      \
            }                                                                                                  \
        free(start);                                                                                           \
        free(xs);                                                                                              \
        free(terms);                                                                                           \
        return st;                                                                                             \
    }

#define MOE_ID(v) (v)
MOE_EXPERTS(f32, float, MOE_ID, MOE_ID)
MOE_EXPERTS(bf16, uint16_t, bf16_to_f32, f32_to_bf16)
#undef MOE_ID
#undef MOE_EXPERTS

/* Routing of n_tok rows of float32 logits (n_tok, E) -> ids, weights (n_tok, k): the reference's rules. */
rg_status rg_moe_route(const float *logits, int64_t n_tok, int64_t E, int64_t k, int64_t softmax_before_topk,
                       int64_t norm_topk_prob, int32_t *ids, float *weights) {
    if (k < 1 || k > E) return RG_ERR_UNSUPPORTED;
    for (int64_t t = 0; t < n_tok; ++t)
        moe_route_row(logits + t * E, E, k, (int)softmax_before_topk, (int)norm_topk_prob, ids + t * k,
                      weights + t * k);
    return RG_OK;
}

/* The fused step's scratch of a block for M rows. The team's region (shared): per grouped place (token, j) routed
 * here, its gate|up (2I), activation (I) and expert output (H), bf16, and the shared expert's activation (M, sI)
 * and output (M, H) (and its gate|up, M 2sI). Each thread's own region: its copy of the routing (every thread routes all rows itself, with
 * the same code, so all hold the same grouping without meeting): logits (M, E) bf16 and float32, ids and weights
 * (M, k), the group starts (2 n_local + 1), order and each place's grouped row (M k each), the experts with rows
 * (n_local + 1), the shared expert's gates (M floats), and the gathered input rows of experts with several (M k, H). */
typedef struct {
    uint16_t *gu, *act, *y, *sgu, *sact, *sy;
} moe_team_scratch;

typedef struct {
    uint16_t *logits;
    float *lf, *w, *sgate;
    int32_t *ids;
    int64_t *start, *order, *pos, *active, n_active;
    uint16_t *xs;
} moe_own_scratch;

/* Places the team's region at base (or only sizes it, base 0): returns its bytes. */
static inline size_t moe_team_layout(uintptr_t base, int64_t M, int64_t H, int64_t k, int64_t I, int64_t sI,
                                     moe_team_scratch *s) {
    const int64_t P = M * k;
    size_t at = 0;
#define MOE_AT(field, n, size) (s->field = (uint16_t *)(base + at), at += rg_span(n, size))
    MOE_AT(gu, P * 2 * I, 2);
    MOE_AT(act, P * I, 2);
    MOE_AT(y, P * H, 2);
    MOE_AT(sgu, M * 2 * sI, 2);
    MOE_AT(sact, M * sI, 2);
    MOE_AT(sy, M * H, 2);
#undef MOE_AT
    return at;
}

static inline size_t moe_own_layout(uintptr_t base, int64_t M, int64_t H, int64_t E, int64_t k, int64_t n_local,
                                    moe_own_scratch *s) {
    const int64_t P = M * k;
    size_t at = 0;
#define MOE_AT(field, type, n) (s->field = (type *)(base + at), at += rg_span(n, sizeof(type)))
    MOE_AT(logits, uint16_t, M * E);
    MOE_AT(lf, float, M * E);
    MOE_AT(ids, int32_t, P);
    MOE_AT(w, float, P);
    MOE_AT(sgate, float, M);
    MOE_AT(start, int64_t, 2 * n_local + 1);
    MOE_AT(order, int64_t, P);
    MOE_AT(pos, int64_t, P);
    MOE_AT(active, int64_t, n_local);
    MOE_AT(xs, uint16_t, P * H);
#undef MOE_AT
    s->n_active = 0;
    return at;
}

/* The fused step's scratch bytes of a block of M rows (sI: the shared expert's intermediate size, 0 without one):
 * the team's region; *thread_bytes: each thread's. */
int64_t rg_moe_step_bytes(int64_t M, int64_t H, int64_t E, int64_t k, int64_t n_local, int64_t I, int64_t sI,
                          int64_t *thread_bytes) {
    moe_team_scratch t;
    moe_own_scratch o;
    *thread_bytes = (int64_t)moe_own_layout(0, M, H, E, k, n_local, &o);
    return (int64_t)moe_team_layout(0, M, H, k, I, sI, &t);
}
