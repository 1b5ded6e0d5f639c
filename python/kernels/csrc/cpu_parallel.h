/* Tensor and pipeline parallelism in the fused decode step: what rg_decode_step_bf16 does differently on one
 * rank of a parallel group (its `par` argument; NULL at tp 1 and pp 1, which is the plain step). Included by
 * cpu_kernels.c; the group's communication itself stays in the runtime (torch.distributed), reached through
 * the all_reduce callback. */

typedef struct {
    /* Sums x (n bf16 values, the whole (M, hidden) buffer) over the tensor-parallel ranks, in place. Called by
     * one thread of the team, between barriers, after each layer's attention output projection and MLP down
     * projection (the row-parallel matmuls, whose outputs are partial sums); NULL at tp 1. */
    void (*all_reduce)(void *ctx, uint16_t *x, int64_t n);
    void *ctx;
    int64_t input;  /* where the residual stream starts: one of RG_STAGE_* */
    int64_t output; /* 0: the final norm (and LM head) as at pp 1; 1 (a stage before the last): stop after the
                     * last layer, x and res_a holding its output and the residual stream for the next stage */
    /* The deterministic mode (NULL otherwise): the row-parallel matmuls (`partial` weights) write their unrounded
     * float32 partial sums (M, hidden) here instead of bf16 into x, and all_reduce sums the ranks' in rank order
     * into x (rg_sum_partials_bf16), so that tp 2 rounds as tp 1 does. */
    float *partials;
} rg_parallel;

enum {
    RG_STAGE_IDS = 0,      /* the rows of embed for ids (a full vocabulary) */
    RG_STAGE_EMBEDDED = 1, /* x holds the embedded rows already (a vocabulary-parallel embedding, summed) */
    RG_STAGE_HIDDEN = 2    /* x and res_a hold the previous pipeline stage's output and residual stream */
};

static inline int par_input(const rg_parallel *par) { return par ? (int)par->input : RG_STAGE_IDS; }
static inline int par_final(const rg_parallel *par) { return !par || !par->output; }
static inline float *par_partials(const rg_parallel *par) { return par ? par->partials : NULL; }

/* Inside the team, every thread calls it: the partial sums in x summed over the ranks by one thread, the
 * others waiting at the single's barrier. */
static inline void par_all_reduce(const rg_parallel *par, uint16_t *x, int64_t n) {
    if (!par || !par->all_reduce) return;
#pragma omp single
    par->all_reduce(par->ctx, x, n);
}
