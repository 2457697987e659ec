/*
 * pool.h's parallel loop. One job at a time (a second caller meanwhile runs its loop alone). The job
 * is one 64-bit word: generation (16 bits) | helpers allowed (6) | chunks (12) | claimed from the front
 * (15) | claimed from the back (15). The caller takes chunks from the front, helpers from the back, so
 * with one helper each thread walks a contiguous half (as a static split would, same cache reuse)
 * and they meet wherever the slower one has got to. A claim is one fetch-and-add on the word, valid
 * while front + back claims stay below the chunk count: it always names the job it belongs to, and a
 * helper that wakes up after the job ended claims nothing. A job's other fields sit in one of two
 * slots by generation parity; a slot is rewritten two jobs later, only after every chunk of its job,
 * the claimed ones included, is done.
 *
 * Helpers spin briefly for the next job (a step's kernels follow one another within microseconds),
 * then sleep on a futex; the caller wakes them only when one sleeps.
 */
#define _GNU_SOURCE
#include "pool.h"

#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_HELPERS 63
#define MAX_CHUNKS 4095 /* chunks + claims past the end stay below the 15-bit fields */
#define HELPER_SPIN_NS 50000
#define CALLER_SPIN_NS 200000

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ volatile("yield")
#else
#define cpu_relax() ((void)0)
#endif

typedef struct {
    pool_range_fn fn;
    void *ctx;
    int64_t n;
    int chunks;
    int wide; /* helpers may run on the lent CPUs for this job (else on the caller's own) */
    int own_helpers; /* helpers 0..own_helpers-1 stand for the caller's own threads, the rest for lent CPUs */
    atomic_int done;
} Job;

static Job jobs[2];
static _Atomic uint64_t word;    /* see above */
static atomic_uint generation;   /* the full count, for the futex */
static atomic_int sleepers;
static int num_helpers;          /* started; changed only by the caller holding caller_lock */
static uint32_t last_generation; /* likewise */
static pthread_mutex_t caller_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static __thread int inside_pool;
static atomic_int threads_override; /* pool_set_threads: 0 = omp_get_max_threads() */
static cpu_set_t helper_cpus; /* the own CPUs and the lent ones */
static cpu_set_t own_cpus;    /* the caller's CPUs when pool_set_helper_cpus was called */
static atomic_int helper_cpus_set;
#define MAX_LENDERS 64
static const volatile double *lender_slots;
static int lender_index[MAX_LENDERS];
static atomic_int num_lenders;

#define GEN(w) ((uint32_t)((w) >> 48))
#define HELPERS(w) ((int)(((w) >> 42) & 0x3f))
#define CHUNKS(w) ((int)(((w) >> 30) & 0xfff))
#define FRONT(w) ((int)(((w) >> 15) & 0x7fff))
#define BACK(w) ((int)((w) & 0x7fff))
#define FRONT_ONE ((uint64_t)1 << 15)
#define BACK_ONE ((uint64_t)1)

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void run_chunk(const Job *job, int c) {
    const int64_t begin = job->n * c / job->chunks, end = job->n * (c + 1) / job->chunks;
    job->fn(job->ctx, begin, end);
}

static int lender_busy(void);

/* Claims and runs chunks of the job the word names, from the front or the back, until none is left. A
 * helper on a job that borrows lent CPUs stops claiming once a lender computes again: the chunk it holds is
 * the last the caller may wait for, though that lender's own step has preempted it (a decode step of
 * milliseconds against a prefill's chunk of microseconds). */
static void work(int from_front, int borrowed) {
    for (;;) {
        if (borrowed && lender_busy()) return;
        const uint64_t w = atomic_fetch_add_explicit(&word, from_front ? FRONT_ONE : BACK_ONE, memory_order_acq_rel);
        const int chunks = CHUNKS(w);
        if (FRONT(w) + BACK(w) >= chunks) return;
        Job *job = &jobs[GEN(w) & 1];
        run_chunk(job, from_front ? FRONT(w) : chunks - 1 - BACK(w));
        atomic_fetch_add_explicit(&job->done, 1, memory_order_release);
    }
}

static void *helper_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals are the interpreter's main thread's */
    int wide = 1;
    if (atomic_load(&helper_cpus_set)) sched_setaffinity(0, sizeof(helper_cpus), &helper_cpus);
    inside_pool = 1;
    uint32_t seen = GEN(atomic_load(&word));
    for (;;) {
        int64_t spin_until = 0;
        for (int spins = 0;; spins++) {
            const uint64_t w = atomic_load_explicit(&word, memory_order_acquire);
            if (GEN(w) != seen) {
                seen = GEN(w);
                if (index < HELPERS(w) && FRONT(w) + BACK(w) < CHUNKS(w)) {
                    /* Off the lent CPUs while they are not lent (a lender computes, or nothing is
                     * borrowed): the helper then stays where the caller's own threads run. */
                    const Job *job = &jobs[GEN(w) & 1];
                    const int job_wide = job->wide;
                    if (job_wide != wide && atomic_load(&helper_cpus_set)) {
                        sched_setaffinity(0, sizeof(cpu_set_t), job_wide ? &helper_cpus : &own_cpus);
                        wide = job_wide;
                    }
                    work(0, job_wide && index >= job->own_helpers);
                }
                break;
            }
            if ((spins & 63) == 0) {
                const int64_t t = now_ns();
                if (spin_until == 0) spin_until = t + HELPER_SPIN_NS;
                if (t > spin_until) {
                    atomic_fetch_add(&sleepers, 1);
                    const unsigned g = atomic_load(&generation);
                    if (GEN(atomic_load(&word)) == seen) syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
                    atomic_fetch_sub(&sleepers, 1);
                    spin_until = 0;
                    continue;
                }
            }
            cpu_relax();
        }
    }
    return NULL;
}

/* In a forked child only the forking thread exists: start over with no helpers. */
static void after_fork_in_child(void) {
    num_helpers = 0;
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&caller_lock, NULL);
}

static void install_atfork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

static int start_helpers(int wanted) {
    pthread_once(&atfork_once, install_atfork);
    if (wanted > MAX_HELPERS) wanted = MAX_HELPERS;
    while (num_helpers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)num_helpers);
        pthread_attr_destroy(&attr);
        if (failed) break;
        num_helpers++;
    }
    return num_helpers < wanted ? num_helpers : wanted;
}

/* A lender whose CPUs this process borrows computes again (see pool_set_lenders). */
static int lender_busy(void) {
    const int n = atomic_load_explicit(&num_lenders, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (lender_slots[lender_index[i]] <= 0.0) return 1;
    return 0;
}

void pool_for(int64_t n, int64_t grain, pool_range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int64_t chunks = (n + grain - 1) / grain;
    if (chunks > MAX_CHUNKS) chunks = MAX_CHUNKS;
    const int override = atomic_load_explicit(&threads_override, memory_order_relaxed);
    const int lent = override > 0 && !lender_busy();
    const int threads = inside_pool ? 1 : lent ? override : omp_get_max_threads();
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&caller_lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    const int helpers = start_helpers(threads - 1);
    if (helpers == 0) {
        pthread_mutex_unlock(&caller_lock);
        fn(ctx, 0, n);
        return;
    }
    const uint32_t gen = (last_generation + 1) & 0xffff;
    last_generation = gen;
    Job *job = &jobs[gen & 1];
    job->fn = fn;
    job->ctx = ctx;
    job->n = n;
    job->chunks = (int)chunks;
    job->wide = lent;
    job->own_helpers = omp_get_max_threads() - 1;
    atomic_store_explicit(&job->done, 0, memory_order_relaxed);
    atomic_exchange(&word, ((uint64_t)gen << 48) | ((uint64_t)helpers << 42) | ((uint64_t)chunks << 30));
    atomic_fetch_add(&generation, 1);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    inside_pool = 1;
    work(1, 0);
    inside_pool = 0;
    /* Only chunks a helper has claimed can be left; wait for those. */
    int64_t spin_until = 0;
    for (int spins = 0; atomic_load_explicit(&job->done, memory_order_acquire) < (int)chunks; spins++) {
        if ((spins & 63) == 0) {
            const int64_t t = now_ns();
            if (spin_until == 0) spin_until = t + CALLER_SPIN_NS;
            if (t > spin_until) sched_yield(); /* the helper holding the chunk lost its core */
        }
        cpu_relax();
    }
    pthread_mutex_unlock(&caller_lock);
}

void pool_set_threads(int n) { atomic_store(&threads_override, n > 0 ? n : 0); }

void pool_set_lenders(const volatile double *slots, const int *index, int n) {
    atomic_store(&num_lenders, 0);
    if (n > MAX_LENDERS) n = MAX_LENDERS;
    for (int i = 0; i < n; i++) lender_index[i] = index[i];
    lender_slots = slots;
    atomic_store_explicit(&num_lenders, n > 0 && slots != NULL ? n : 0, memory_order_release);
}

void pool_set_helper_cpus(const int *cpus, int n) {
    sched_getaffinity(0, sizeof(own_cpus), &own_cpus);
    CPU_ZERO(&helper_cpus);
    for (int i = 0; i < n; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE) CPU_SET(cpus[i], &helper_cpus);
    atomic_store(&helper_cpus_set, n > 0);
}

void pool_rows(int64_t num_rows, int64_t row_elems, pool_range_fn fn, void *ctx) {
    const int64_t parallel_min_elems = 1 << 17, chunk_elems = 1 << 15;
    if (num_rows * row_elems < parallel_min_elems) {
        if (num_rows > 0) fn(ctx, 0, num_rows);
        return;
    }
    pool_for(num_rows, row_elems >= chunk_elems ? 1 : chunk_elems / row_elems, fn, ctx);
}

static void count_items(void *p, int64_t begin, int64_t end) {
    _Atomic int32_t *counts = p;
    for (int64_t i = begin; i < end; i++) atomic_fetch_add_explicit(&counts[i], 1, memory_order_relaxed);
}

/* For the tests: counts[i] += 1 for every item i of [0, n) that pool_for hands to a thread. */
void pool_count_items(int64_t n, int64_t grain, int32_t *counts) { pool_for(n, grain, count_items, counts); }

typedef struct {
    int32_t *cpus; /* per item: the CPU that ran it */
    int64_t spin_ns;
    volatile double *slot; /* a lender's slot, set busy (0.0) as item busy_at starts; NULL: none */
    int64_t busy_at;
    int32_t *after; /* per item: whether it started after that */
} WhereArgs;

static void record_cpus(void *p, int64_t begin, int64_t end) {
    const WhereArgs *a = p;
    for (int64_t i = begin; i < end; i++) {
        if (a->slot != NULL) {
            if (i == a->busy_at) *a->slot = 0.0;
            a->after[i] = *a->slot <= 0.0;
        }
        const int64_t until = now_ns() + a->spin_ns; /* long enough items that a helper wakes up for some */
        while (now_ns() < until) cpu_relax();
        a->cpus[i] = sched_getcpu();
    }
}

/* For the tests: cpus[i] = the CPU that ran item i of [0, n), each item spinning spin_ns. */
void pool_record_cpus(int64_t n, int64_t spin_ns, int32_t *cpus) {
    WhereArgs a = {cpus, spin_ns, NULL, 0, NULL};
    pool_for(n, 1, record_cpus, &a);
}

/* For the tests: as pool_record_cpus, and the lender whose slot is *slot computes again (0.0) from item
 * busy_at on; after[i]: whether item i started after that. */
void pool_record_cpus_lender_back(int64_t n, int64_t spin_ns, int32_t *cpus, double *slot, int64_t busy_at,
                                  int32_t *after) {
    WhereArgs a = {cpus, spin_ns, slot, busy_at, after};
    pool_for(n, 1, record_cpus, &a);
}
