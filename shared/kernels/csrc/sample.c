/*
 * Random sampling's draw on the CPU (float32 probabilities): for each row, the index of the largest
 * p_i / E_i where the E_i ~ Exponential(1) are drawn independently per element — the exponential race,
 * in which token i wins with probability p_i (torch's exponential_ draws each E_i with a scalar log,
 * about 8 ms for 32 rows of a 7k vocabulary, longer than the model's step).
 *
 * A row's noise is a function of its 64-bit key alone, so a row draws the same tokens in any batch:
 * element i's uniform u_i is the top 24 bits of splitmix64's output i for that key, taken at the middle
 * of its interval (never 0 or 1), and E_i = -log(u_i), in (3e-8, 17.3). A zero probability never wins
 * over a positive one; a NaN wins, as in torch's argmax of the quotients.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pool.h"

int64_t argmax_row_f32(const float *row, int n); /* rows.c: the first largest value, or the first NaN */

#define GOLDEN 0x9E3779B97F4A7C15ull

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct {
    const float *p;
    int64_t stride;
    const int64_t *keys;
    int64_t *out;
    int n;
    int failed;
} RaceArgs;

static float *thread_scores(int n) {
    static __thread float *buffer = NULL;
    static __thread int capacity = 0;
    if (n > capacity) {
        float *grown = realloc(buffer, sizeof(float) * (size_t)n);
        if (grown == NULL) return NULL;
        buffer = grown;
        capacity = n;
    }
    return buffer;
}

static void race_rows(void *ctx, int64_t r0, int64_t r1) {
    RaceArgs *a = ctx;
    float *scores = thread_scores(a->n);
    if (scores == NULL) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *p = a->p + r * a->stride;
        const uint64_t state = mix64((uint64_t)a->keys[r]);
        for (int i = 0; i < a->n; i++) {
            const uint64_t bits = mix64(state + (uint64_t)(i + 1) * GOLDEN);
            const float u = ((float)(uint32_t)(bits >> 40) + 0.5f) * 0x1p-24f;
            scores[i] = p[i] / -logf(u);
        }
        a->out[r] = argmax_row_f32(scores, a->n);
    }
}

/* p: [rows, n] with rows `stride` apart, n >= 1; keys, out: [rows]. 0, or -1 where a thread's scores
 * buffer could not be allocated (out then incomplete). */
int sample_race_f32(const float *p, int64_t stride, const int64_t *keys, int64_t *out, int rows, int n) {
    RaceArgs a = {p, stride, keys, out, n, 0};
    pool_rows(rows, (int64_t)n * 8, race_rows, &a); /* a drawn element costs about eight compared ones */
    return a.failed ? -1 : 0;
}
