/*
 * The kernels' parallel loop: the calling thread and a few helper threads take chunks of a range
 * from one shared counter, and the caller returns when every chunk is done. Unlike an OpenMP
 * parallel region it never waits for a helper to arrive: a helper that is not running (its core
 * taken by another process of the box) simply takes no chunk, and the caller does the work itself.
 * The caller waits only for chunks a helper has already started.
 *
 * Results do not depend on which thread ran a chunk, or how many threads there were, as long as fn
 * computes each item of [begin, end) independently of the others.
 */
#ifndef CLEAVE_POOL_H
#define CLEAVE_POOL_H

#include <stdint.h>

typedef void (*pool_range_fn)(void *ctx, int64_t begin, int64_t end);

/* fn over [0, n) in chunks of about `grain` items; on the calling thread alone where the pool would
 * have one thread (omp_get_max_threads(), which torch.set_num_threads sets), where there is one
 * chunk, or where the call is made from inside another pool_for. */
void pool_for(int64_t n, int64_t grain, pool_range_fn fn, void *ctx);

/* The pool's thread count from now on (caller included): n > 0 replaces omp_get_max_threads(), 0 goes
 * back to it. A worker of cleave serve sets it to use CPUs another worker lends while that one is idle. */
void pool_set_threads(int n);

/* The CPUs helper threads may run on while CPUs are lent (the caller's mask where never set): the
 * caller's own CPUs, taken from its mask now, and the lent ones. A helper runs on these for a loop that
 * uses the lent CPUs, and on the caller's own for any other (moved when it takes the loop's first chunk).
 * Call it before the first loop with more than one thread. */
void pool_set_helper_cpus(const int *cpus, int n);

/* While pool_set_threads has lent CPUs in use: the lenders' slots (``slots[index[i]]`` for i < n, each
 * 0.0 while its lender computes, as cpu_threads.CoreShare writes them), read at every loop; a loop that
 * finds one busy runs on the pool's own threads, so a lender that starts again has its CPUs back from
 * the borrower's next loop (microseconds) instead of its next step. n = 0: none (the default). */
void pool_set_lenders(const volatile double *slots, const int *index, int n);

/* fn over rows [0, num_rows) of row_elems elements each: on the calling thread alone below
 * 2^17 elements (a decode step's rows are a few microseconds of work, not worth waking a helper
 * for; torch's element-wise grain is similar), else pool_for in chunks of about 2^15 elements. */
void pool_rows(int64_t num_rows, int64_t row_elems, pool_range_fn fn, void *ctx);

#endif
