/*
 * Row operations around a CPU step's forward (float32): the embedding lookup and greedy sampling's
 * argmax, neither of which starts torch's parallel threads (their spinning after a region takes the
 * core the native forward's helper needs).
 *
 * Greedy sampling's argmax over each row of the logits (float32): the index of the row's largest
 * value, the first where several are equal, and the first NaN where the row has one (NaN counts as
 * the largest) — what torch's max(dim=-1).indices returns. torch's CPU reduction with indices
 * compares one element at a time; here one vectorised pass finds the maximum and a second finds
 * where it first occurs (the row is still in the cache).
 */
#include <stdint.h>
#include <string.h>

#include "pool.h"

#pragma GCC optimize("no-fast-math") /* NaN must compare as NaN */

#if defined(__AVX2__)
#include <immintrin.h>

static int64_t row_argmax(const float *row, int n) {
    __m256 m0 = _mm256_set1_ps(row[0]), m1 = m0, unordered = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) { /* two independent chains */
        const __m256 x0 = _mm256_loadu_ps(row + i), x1 = _mm256_loadu_ps(row + i + 8);
        m0 = _mm256_max_ps(x0, m0); /* a NaN is not kept here: it is looked for below */
        m1 = _mm256_max_ps(x1, m1);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x0, x1, _CMP_UNORD_Q)); /* a NaN in either */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    float m = lanes[0];
    for (int j = 1; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    int any_nan = _mm256_movemask_ps(unordered) != 0;
    for (int t = i; t < n; t++) {
        m = row[t] > m ? row[t] : m;
        any_nan |= row[t] != row[t];
    }
    if (any_nan) {
        for (i = 0; i < n; i++)
            if (row[i] != row[i]) return i;
    }
    const __m256 target = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz((unsigned)hits);
    }
    for (; i < n; i++)
        if (row[i] == m) return i;
    return 0;
}
#else
static int64_t row_argmax(const float *row, int n) {
    int64_t best = 0;
    for (int i = 0; i < n; i++) {
        if (row[i] != row[i]) return i;
        if (row[i] > row[best]) best = i;
    }
    return best;
}
#endif

int64_t argmax_row_f32(const float *row, int n) { return row_argmax(row, n); } /* for sample.c */

typedef struct {
    const float *x;
    int64_t stride;
    int n;
    int64_t *out;
} ArgmaxArgs;

static void argmax_rows(void *p, int64_t r0, int64_t r1) {
    const ArgmaxArgs *a = p;
    for (int64_t r = r0; r < r1; r++) a->out[r] = row_argmax(a->x + r * a->stride, a->n);
}

/* x: [num_rows, n] with rows `stride` apart, n >= 1; out: [num_rows]. */
void argmax_rows_f32(const float *x, int64_t stride, int64_t *out, int num_rows, int n) {
    ArgmaxArgs a = {x, stride, n, out};
    pool_rows(num_rows, n, argmax_rows, &a);
}

/* out[i] = table[ids[i]] for rows of `dim` floats: the embedding lookup, on the calling thread (a
 * step's few hundred rows are a memcpy each; torch's index_select would start a parallel region).
 * Returns the first i whose id is outside [0, num_rows), or -1. */
int64_t gather_rows_f32(const float *table, int64_t num_rows, const int64_t *ids, float *out, int64_t n, int dim) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num_rows) return i;
        memcpy(out + i * dim, table + ids[i] * dim, sizeof(float) * (size_t)dim);
    }
    return -1;
}
