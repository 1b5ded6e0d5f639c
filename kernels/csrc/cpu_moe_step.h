/* The expert block inside the fused decode step (AVX512-BF16): cpu_moe.h's math for the step's team. Included by
 * cpu_kernels.c inside the fused step's section, after silu_mul_bf16.
 *
 * Every thread runs the whole block; only the matmuls split work (linear_team_bf16 ends with the team's barrier).
 * The router matmul, then one thread routes and groups the rows by expert (a single: its barrier publishes
 * them); then per expert with rows each thread gathers that expert's rows into its own buffer, the team runs
 * gate_up into the shared gu, each thread its own SiLU, the team down into the shared y, and thread 0 writes the
 * weighted terms (the next matmul's barrier lies between that and the next write of y). */

/* hp (M, H): the normed rows (each thread's own copy); gu (M, 2 inter) shared, ap (M, inter) and sx the thread's
 * (inter at least the block's I and shared_I); x (M, H): the block's output. */
static void moe_team_bf16(const rg_moe_layer *moe, const uint16_t *hp, int64_t M, int64_t H, uint16_t *x,
                          uint16_t *gu, uint16_t *ap, float *sx, const rg_parallel *par) {
    const int tid = omp_get_thread_num();
    const int64_t E = moe->num_experts, k = moe->top_k, n_local = moe->n_local, I = moe->I;
    char *s = (char *)moe->scratch;
    uint16_t *logits = (uint16_t *)s;
    float *lf = (float *)(s += rg_span(M * E, 2));
    int32_t *ids = (int32_t *)(s += rg_span(M * E, 4));
    float *w = (float *)(s += rg_span(M * k, 4));
    int64_t *start = (int64_t *)(s += rg_span(M * k, 4));
    int64_t *order = start + 2 * n_local + 1;
    uint16_t *y = (uint16_t *)(s += rg_span(2 * n_local + 1 + M * k, 8));
    uint16_t *sy = (uint16_t *)(s += rg_span(M * H, 2));
    float *terms = (float *)(s + rg_span(M * H, 2));
    uint16_t *xe = (uint16_t *)((char *)moe->thread_scratch + (size_t)tid * (size_t)moe->thread_bytes);

    linear_team_bf16(&moe->router, hp, M, NULL, logits, NULL, sx);
#pragma omp single
    {
        for (int64_t i = 0; i < M * E; ++i) lf[i] = bf16_to_f32(logits[i]);
        rg_moe_route(lf, M, E, k, moe->softmax_before_topk, moe->norm_topk_prob, ids, w);
        moe_group(ids, M * k, moe->first, n_local, start, order);
        memset(terms, 0, sizeof(float) * (size_t)(M * k * H));
    }
    for (int64_t e = 0; e < n_local; ++e) {
        const int64_t s0 = start[e], n = start[e + 1] - s0;
        if (!n) continue;
        for (int64_t i = 0; i < n; ++i) memcpy(xe + i * H, hp + order[s0 + i] / k * H, sizeof(uint16_t) * H);
        linear_team_bf16(moe->gate_up + e, xe, n, NULL, gu, NULL, sx);
        silu_mul_bf16(gu, ap, n, I);
        linear_team_bf16(moe->down + e, ap, n, NULL, y, NULL, sx);
        if (tid == 0)
            for (int64_t i = 0; i < n; ++i) {
                const int64_t p = order[s0 + i];
                for (int64_t c = 0; c < H; ++c) terms[p * H + c] = bf16_to_f32(y[i * H + c]) * w[p];
            }
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < H; ++c) {
            float acc = terms[m * k * H + c];
            for (int64_t j = 1; j < k; ++j) acc += terms[(m * k + j) * H + c];
            x[m * H + c] = f32_to_bf16(acc);
        }
    par_all_reduce(par, x, M * H);
    if (!moe->shared_I) return;
    linear_team_bf16(&moe->shared_gate_up, hp, M, NULL, gu, NULL, sx);
    silu_mul_bf16(gu, ap, M, moe->shared_I);
    linear_team_bf16(&moe->shared_down, ap, M, NULL, sy, NULL, sx);
#pragma omp single
    for (int64_t m = 0; m < M; ++m) { /* out + sigmoid(x . g) * shared, each op rounded to bf16 as torch's */
        float dot = 1.f;
        if (moe->shared_gate) {
            dot = 0.f;
            for (int64_t c = 0; c < H; ++c) dot += bf16_to_f32(hp[m * H + c]) * bf16_to_f32(moe->shared_gate[c]);
            dot = bf16_to_f32(f32_to_bf16(dot));
            dot = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-dot))));
        }
        for (int64_t c = 0; c < H; ++c) {
            const float t = bf16_to_f32(f32_to_bf16(dot * bf16_to_f32(sy[m * H + c])));
            x[m * H + c] = f32_to_bf16(bf16_to_f32(x[m * H + c]) + t);
        }
    }
}
