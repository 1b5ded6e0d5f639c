/* Cycle counters of the fused decode step's phases, per thread, in builds with -DRG_PROFILE only (elsewhere every
 * macro is empty): PROF_LAP(i) adds the cycles since the thread's previous lap to bucket i; the matmuls of the
 * team add their own work and their barrier's wait to buckets prof_phase and prof_phase + 1. rg_profile_take
 * copies the counters (threads x RG_PROF_BUCKETS) out and zeroes them. A tool for measuring where a step's time
 * goes (which phase, which wait), not part of any API. Included by cpu_linear.h after omp.h. */
#ifdef RG_PROFILE
#include <time.h>
#include <x86intrin.h>
/* RG_PROFILE=2: the thread's CPU time in ns (the time it was preempted left out), else the TSC */
static inline uint64_t prof_now(void) {
#if RG_PROFILE == 2
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
#else
    return __rdtsc();
#endif
}
#define RG_PROF_BUCKETS 32
#define RG_PROF_THREADS 64
static uint64_t rg_prof_acc[RG_PROF_THREADS][RG_PROF_BUCKETS], rg_prof_last[RG_PROF_THREADS];
static __thread int prof_phase;
#define PROF_LAP(i)                                                                         \
    do {                                                                                    \
        const int t_ = omp_get_thread_num() % RG_PROF_THREADS;                              \
        const uint64_t n_ = prof_now();                                                      \
        rg_prof_acc[t_][(i) % RG_PROF_BUCKETS] += n_ - rg_prof_last[t_];                    \
        rg_prof_last[t_] = n_;                                                              \
    } while (0)
#define PROF_START() (rg_prof_last[omp_get_thread_num() % RG_PROF_THREADS] = prof_now())
#define PROF_PHASE(p) (prof_phase = (p))
void rg_profile_take(uint64_t *out) {
    memcpy(out, rg_prof_acc, sizeof rg_prof_acc);
    memset(rg_prof_acc, 0, sizeof rg_prof_acc);
}
#else
#define PROF_LAP(i) ((void)0)
#define PROF_START() ((void)0)
#define PROF_PHASE(p) ((void)0)
#endif
