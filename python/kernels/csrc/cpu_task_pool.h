/* A small pool of worker threads for the decode step's many small matmuls (a 135M model's step is ~120 of them, a
 * few to a few hundred microseconds each), used instead of an OpenMP parallel region where a region's fork and
 * join would cost a visible share of the work, and where a join that waits for every thread of the team would
 * stall: on a machine whose cores are shared with other processes, a team thread that the OS has not scheduled
 * holds the whole region up to a scheduler time slice (milliseconds), once per matmul. Here a job is cut into
 * chunks that the threads claim one at a time (an atomic counter); the caller claims too, and waits only for the
 * chunks a worker has claimed and not finished, never for a worker that has not woken: with the other core busy
 * the caller runs every chunk itself, at one thread's speed, instead of waiting on the busy core.
 *
 * Each chunk runs the same code whichever thread claims it, so the kernels' results stay bit for bit independent
 * of the thread count and of who ran what. One job at a time (a mutex: concurrent callers take turns). Workers
 * spin a short while after a job (the next matmul of the step follows within microseconds), then sleep on a
 * futex. A child process after fork() starts its own workers (the parent's are not copied). Included by
 * cpu_linear_bf16_avx2.h and cpu_gguf_q.h; Linux only (futex), x86 (pause), which every build of these kernels is. */
#ifndef RG_TASK_POOL_H
#define RG_TASK_POOL_H
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TP_MAX_WORKERS 63
#define TP_SPIN 20000     /* pause iterations a worker spins for the next job before it sleeps (~100-300 us) */
#define TP_WAIT_SPIN 2000 /* the caller's pauses between sched_yield calls while a worker finishes its chunk */

typedef void (*tp_fn)(void *ctx, int64_t lo, int64_t hi);

static struct {
    pthread_mutex_t lock;       /* one job at a time, and starting workers */
    int started;                /* workers running */
    _Atomic uint32_t gen;       /* the job number (the futex word workers sleep on) */
    _Atomic int sleepers;       /* workers in futex_wait: the caller wakes them only then */
    _Atomic uint64_t claim;     /* gen << 32 | the next chunk: a claim is valid only for its own job */
    _Atomic int64_t done;       /* chunks finished, this job */
    _Atomic(tp_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t chunks, chunk_len, total;
    _Atomic int team;           /* workers 1 .. team - 1 take part in this job */
    pthread_t th[TP_MAX_WORKERS];
} tp = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline void tp_pause(void) { __builtin_ia32_pause(); }

/* Chunks of job g, claimed until none is left (by the caller and the workers alike). */
static void tp_run_chunks(uint32_t g) {
    const tp_fn fn = atomic_load(&tp.fn);
    void *ctx = atomic_load(&tp.ctx);
    const int64_t chunks = atomic_load(&tp.chunks), len = atomic_load(&tp.chunk_len), total = atomic_load(&tp.total);
    uint64_t c = atomic_load(&tp.claim);
    for (;;) {
        if ((uint32_t)(c >> 32) != g || (int64_t)(c & 0xFFFFFFFFu) >= chunks) return; /* another job, or none left */
        if (!atomic_compare_exchange_weak(&tp.claim, &c, c + 1)) continue;            /* c reloaded: try again */
        const int64_t i = (int64_t)(c & 0xFFFFFFFFu), lo = i * len, hi = lo + len < total ? lo + len : total;
        fn(ctx, lo, hi);
        atomic_fetch_add(&tp.done, 1);
        c = atomic_load(&tp.claim);
    }
}

static void *tp_worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&tp.gen);
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load(&tp.gen)) == seen) {
            if (++spins < TP_SPIN) {
                tp_pause();
                continue;
            }
            atomic_fetch_add(&tp.sleepers, 1);
            if (atomic_load(&tp.gen) == seen) syscall(SYS_futex, &tp.gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&tp.sleepers, 1);
            spins = 0;
        }
        seen = g;
        if (me < atomic_load(&tp.team)) tp_run_chunks(g);
    }
    return NULL;
}

static void tp_after_fork(void) { /* the child has no workers: start its own on its first job */
    pthread_mutex_init(&tp.lock, NULL);
    tp.started = 0;
    atomic_store(&tp.sleepers, 0);
}

/* Workers 1 .. want - 1 running (fewer if threads cannot be made: the caller then does more of the work). Under
 * tp.lock. */
static void tp_start(int want) {
    static int hooked;
    if (!hooked) hooked = !pthread_atfork(NULL, NULL, tp_after_fork);
    want = want > TP_MAX_WORKERS + 1 ? TP_MAX_WORKERS + 1 : want;
    while (tp.started + 1 < want) {
        const int me = tp.started + 1;
        if (pthread_create(&tp.th[me - 1], NULL, tp_worker, (void *)(intptr_t)me)) return;
        pthread_detach(tp.th[me - 1]);
        tp.started = me;
    }
}

/* fn(ctx, lo, hi) over [0, total) in chunks of chunk_len, on up to `threads` threads (the caller included). */
static void tp_parallel(tp_fn fn, void *ctx, int64_t total, int64_t chunk_len, int threads) {
    chunk_len = chunk_len < 1 ? 1 : chunk_len;
    const int64_t chunks = (total + chunk_len - 1) / chunk_len;
    if (threads <= 1 || chunks <= 1 || chunks > 0xFFFFFFFFll) {
        fn(ctx, 0, total);
        return;
    }
    pthread_mutex_lock(&tp.lock);
    tp_start(threads);
    atomic_store(&tp.fn, fn);
    atomic_store(&tp.ctx, ctx);
    atomic_store(&tp.chunks, chunks);
    atomic_store(&tp.chunk_len, chunk_len);
    atomic_store(&tp.total, total);
    atomic_store(&tp.team, threads);
    atomic_store(&tp.done, 0);
    const uint32_t g = atomic_load(&tp.gen) + 1;
    atomic_store(&tp.claim, (uint64_t)g << 32);
    atomic_store(&tp.gen, g); /* the job is public: workers that see g read the fields above */
    if (atomic_load(&tp.sleepers) > 0) syscall(SYS_futex, &tp.gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    tp_run_chunks(g);
    for (int spins = 0; atomic_load(&tp.done) < chunks;) { /* only chunks a worker claimed and has not finished */
        if (++spins % TP_WAIT_SPIN)
            tp_pause();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&tp.lock);
}

/* A scratch buffer of at least n floats owned by the calling thread (kept for its next chunk; one per thread, the
 * largest asked of it: a GEMM panel, 256 KB), or NULL when it cannot be had. */
static __attribute__((unused)) float *tp_scratch(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = (float *)malloc(sizeof(float) * n);
        cap = buf ? n : 0;
    }
    return buf;
}
#endif
