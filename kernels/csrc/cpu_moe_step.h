/* The expert block inside the fused decode step (AVX512-BF16): cpu_moe.h's math for the step's team. Included by
 * cpu_kernels.c inside the fused step's section, after silu_mul_bf16.
 *
 * The team meets a fixed number of times per block, however many experts the rows select: the router matmul;
 * one thread routes, groups the (token, j) places by expert and gathers their rows; then each of the two expert
 * matmuls is ONE pass over the selected experts' weights together (`experts_team_bf16`: their 16-row blocks
 * laid end to end and split evenly over the threads, so a thread's run crosses from one expert's matrix into
 * the next without a barrier); the gated SiLU and the weighted combine split rows over the team. At batch 1
 * with top-4 that is 4 barriers of matmuls instead of 8, and the threads' runs stay balanced. */

/* y_e = x_e @ w_e^T for the experts e with rows (n experts: weights w[e], rows x + start[e] * K, start[e + 1] -
 * start[e] of them, outputs y + start[e] * N), for the calling team: the concatenated blocks split evenly, each
 * thread streaming its run four blocks at a time as linear_team_bf16 does. The team meets at the end. */
static void experts_team_bf16(const rg_weight *w, const int64_t *start, int64_t n, const int64_t *expert_of,
                              const uint16_t *x, uint16_t *y, float *sx) {
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) total += (w[expert_of[i]].N + 15) / 16;
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t lo = total * me / team, hi = total * (me + 1) / team;
    int64_t base = 0; /* the first global block of expert i */
    for (int64_t i = 0; i < n && base < hi; ++i) {
        const int64_t e = expert_of[i];
        const rg_weight *we = w + e;
        const int64_t blocks = (we->N + 15) / 16, b0 = lo > base ? lo - base : 0;
        const int64_t b1 = hi - base < blocks ? hi - base : blocks;
        if (b0 < b1) {
            const int64_t rows = start[e + 1] - start[e], block_bytes = rg_w_block_bytes(we);
            const uint16_t *xe = x + start[e] * we->K;
            uint16_t *ye = y + start[e] * we->N;
            const int64_t head = block_bytes < GEMV_PREFETCH ? block_bytes : GEMV_PREFETCH;
            if (we->kind == RG_W_INT4) group_sums_bf16(xe, rows, we->K, we->group, sx);
            for (int64_t b = b0; b < b1; b += 4) {
                const int64_t rest = b1 - b - 4;
                const int near = b == b0, far = (int)(rest < 0 ? 0 : rest < 4 ? rest : 4);
                if (we->kind == RG_W_BF16) {
                    const char *next = (const char *)we->data + (b + 4) * block_bytes;
                    for (int64_t j = 0; j < far; ++j)
                        for (int64_t off = 0; off < head; off += 64) _mm_prefetch(next + j * block_bytes + off, GEMV_HINT);
                }
                switch (b1 - b) {
                case 1: gemv_blocks(we, xe, rows, sx, NULL, ye, NULL, b, 1, near, far); break;
                case 2: gemv_blocks(we, xe, rows, sx, NULL, ye, NULL, b, 2, near, far); break;
                case 3: gemv_blocks(we, xe, rows, sx, NULL, ye, NULL, b, 3, near, far); break;
                default: gemv_blocks(we, xe, rows, sx, NULL, ye, NULL, b, 4, near, far); break;
                }
            }
        }
        base += blocks;
    }
#pragma omp barrier
}

/* hp (M, H): the normed rows (each thread's own copy); gu, ap: the step's MLP buffers (unused here: the block
 * keeps its own, one row per place); sx the thread's group sums (inter at least the block's widest input);
 * x (M, H): the block's output. */
static void moe_team_bf16(const rg_moe_layer *moe, const uint16_t *hp, int64_t M, int64_t H, uint16_t *x,
                          uint16_t *gu, uint16_t *ap, float *sx, const rg_parallel *par) {
    const int64_t E = moe->num_experts, k = moe->top_k, n_local = moe->n_local, I = moe->I, P = M * k;
    moe_scratch s = moe_scratch_at(moe->scratch, M, H, E, k, n_local, I);

    linear_team_bf16(&moe->router, hp, M, NULL, s.logits, NULL, sx);
#pragma omp single
    {
        for (int64_t i = 0; i < M * E; ++i) s.lf[i] = bf16_to_f32(s.logits[i]);
        rg_moe_route(s.lf, M, E, k, moe->softmax_before_topk, moe->norm_topk_prob, s.ids, s.w);
        const int64_t mine = moe_group(s.ids, P, moe->first, n_local, s.start, s.order);
        for (int64_t p = 0; p < P; ++p) s.pos[p] = -1;
        for (int64_t i = 0; i < mine; ++i) {
            s.pos[s.order[i]] = i;
            memcpy(s.xs + i * H, hp + s.order[i] / k * H, sizeof(uint16_t) * H);
        }
        s.n_active[0] = 0;
        for (int64_t e = 0; e < n_local; ++e)
            if (s.start[e + 1] > s.start[e]) s.active[s.n_active[0]++] = e;
    }
    const int64_t rows = s.start[n_local];
    experts_team_bf16(moe->gate_up, s.start, s.n_active[0], s.active, s.xs, s.gu, sx);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) silu_mul_bf16(s.gu + r * 2 * I, s.act + r * I, 1, I);
    experts_team_bf16(moe->down, s.start, s.n_active[0], s.active, s.act, s.y, sx);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) /* the k terms in order j = 0 .. k-1, float32, as the reference */
        for (int64_t c = 0; c < H; ++c) {
            float acc = 0.f;
            for (int64_t j = 0; j < k; ++j) {
                const int64_t i = s.pos[m * k + j];
                const float t = i < 0 ? 0.f : bf16_to_f32(s.y[i * H + c]) * s.w[m * k + j];
                acc = j == 0 ? t : acc + t;
            }
            x[m * H + c] = f32_to_bf16(acc);
        }
    par_all_reduce(par, x, M * H);
    if (!moe->shared_I) return;
    linear_team_bf16(&moe->shared_gate_up, hp, M, NULL, gu, NULL, sx);
    silu_mul_bf16(gu, ap, M, moe->shared_I);
    linear_team_bf16(&moe->shared_down, ap, M, NULL, s.y, NULL, sx);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) { /* out + sigmoid(x . g) * shared, each op rounded to bf16 as torch's */
        float dot = 1.f;
        if (moe->shared_gate) {
            dot = 0.f;
            for (int64_t c = 0; c < H; ++c) dot += bf16_to_f32(hp[m * H + c]) * bf16_to_f32(moe->shared_gate[c]);
            dot = bf16_to_f32(f32_to_bf16(dot));
            dot = bf16_to_f32(f32_to_bf16(1.f / (1.f + expf(-dot))));
        }
        for (int64_t c = 0; c < H; ++c) {
            const float t = bf16_to_f32(f32_to_bf16(dot * bf16_to_f32(s.y[m * H + c])));
            x[m * H + c] = f32_to_bf16(bf16_to_f32(x[m * H + c]) + t);
        }
    }
}
