/*
 * Random sampling's draw on the CPU, from float32 logits and a per-row inverse temperature: for each row,
 * the index of the largest p_i / E_i, where p_i = exp((l_i - max) * inv_temperature) (the softmax up to
 * the row's constant, which does not move the argmax) and the E_i ~ Exponential(1) are drawn
 * independently per element — the exponential race, in which token i wins with probability
 * softmax_i. torch's exponential_ draws each E_i with a scalar log: about 8 ms for 32 rows of a 7k
 * vocabulary, longer than the model's step; the division and the softmax before it were two more passes.
 *
 * A row's noise is a function of its 64-bit key alone, so a row draws the same tokens in any batch:
 * element i's uniform u_i is the top 24 bits of splitmix64's output i for that key, taken at the middle
 * of its interval (never 0 or 1), and E_i = -log(u_i), in (3e-8, 17.3). A -inf logit never wins over a
 * finite one; a NaN score wins, as in torch's argmax.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

int64_t argmax_row_f32(const float *row, int n); /* rows.c: the first largest value, or the first NaN */
float *decode_thread_scores(size_t floats);      /* paged_decode.c: the thread's scores buffer, grown as needed */

#define GOLDEN 0x9E3779B97F4A7C15ull

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct {
    const float *logits;
    int64_t stride;
    const float *inv_temperature;
    const int64_t *keys;
    int64_t *out;
    int n;
    int failed;
} RaceArgs;

/* -inf marks a removed token here: compiled without the build's finite-math assumption. */
#define WITH_INFINITIES __attribute__((optimize("no-finite-math-only")))

/* The largest of n floats (-inf if none is larger; a NaN is passed over), vectorised. */
WITH_INFINITIES static inline float row_max(const float *l, int n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int i = 0; i < n; i++) m = l[i] > m ? l[i] : m;
    return m;
}

WITH_INFINITIES static void race_rows(void *ctx, int64_t r0, int64_t r1) {
    RaceArgs *a = ctx;
    float *scores = decode_thread_scores((size_t)a->n); /* free here: sampling follows the step's attention */
    if (scores == NULL) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const float *l = a->logits + r * a->stride, s = a->inv_temperature[r];
        const float m = row_max(l, a->n);
        const uint64_t state = mix64((uint64_t)a->keys[r]);
        for (int i = 0; i < a->n; i++) {
            const uint64_t bits = mix64(state + (uint64_t)(i + 1) * GOLDEN);
            const float u = ((float)(uint32_t)(bits >> 40) + 0.5f) * 0x1p-24f;
            scores[i] = expf((l[i] - m) * s) / -logf(u);
        }
        a->out[r] = argmax_row_f32(scores, a->n);
    }
}

/* logits: [rows, n] with rows `stride` apart, n >= 1; inv_temperature, keys, out: [rows]. 0, or -1 where
 * a thread's scores buffer could not be allocated (out then incomplete). */
int sample_race_f32(const float *logits, int64_t stride, const float *inv_temperature, const int64_t *keys,
                    int64_t *out, int rows, int n) {
    RaceArgs a = {logits, stride, inv_temperature, keys, out, n, 0};
    pool_rows(rows, (int64_t)n * 8, race_rows, &a); /* a drawn element costs about eight compared ones */
    return a.failed ? -1 : 0;
}

/*
 * top-k, top-p, then min-p over rows of logits, in place (what sampler.apply_top_k, apply_top_p and
 * apply_min_p compute, without sorting the vocabulary): tokens outside become -inf. top-k keeps the k
 * largest logits and any tied with the k-th; top-p then keeps, in descending order, each token whose
 * higher-ranked tokens hold less than top_p of the remaining probability (so at least one), and any
 * tied with the last kept; min-p keeps the tokens whose probability is at least min_p times the largest
 * (compared as logits: l_i >= max + log(min_p)).
 *
 * Per row: e_i = exp(l_i - max) once; a histogram of count and mass over buckets of e (64 per octave,
 * from its float bits: a larger e never lands in a later bucket) finds the bucket where the k-th token
 * or the top_p mass falls; only that bucket's tokens are sorted.
 */
#define OCTAVE_BUCKETS 64
#define NUM_BUCKETS (150 * OCTAVE_BUCKETS) /* every positive float, subnormals included */

typedef struct {
    float logit, e;
} Token;

typedef struct {
    float *logits;
    int64_t stride;
    const int64_t *top_k;
    const float *top_p, *min_p;
    int n;
    int failed;
} FilterArgs;

static inline int bucket_of(float e) { /* 0 for e = 1, then 64 per halving */
    uint32_t bits;
    __builtin_memcpy(&bits, &e, sizeof bits);
    const uint32_t b = (0x3F800000u - bits) >> (23 - 6);
    return b < NUM_BUCKETS ? (int)b : NUM_BUCKETS - 1;
}

static int by_logit_descending(const void *a, const void *b) {
    const float x = ((const Token *)a)->logit, y = ((const Token *)b)->logit;
    return (x < y) - (x > y);
}

typedef struct {
    float *e;
    uint16_t *bucket;
    Token *tokens;
    int capacity;
    int32_t *count; /* [NUM_BUCKETS], zero between rows: a row clears what it used */
    double *mass;
} FilterScratch;

static FilterScratch *filter_scratch(int n) {
    static __thread FilterScratch s;
    if (s.count == NULL) {
        s.count = calloc(NUM_BUCKETS, sizeof(int32_t));
        s.mass = calloc(NUM_BUCKETS, sizeof(double));
        if (s.count == NULL || s.mass == NULL) {
            free(s.count), free(s.mass);
            s.count = NULL, s.mass = NULL;
            return NULL;
        }
    }
    if (n > s.capacity) {
        float *e = realloc(s.e, sizeof(float) * (size_t)n);
        if (e) s.e = e;
        uint16_t *bucket = realloc(s.bucket, sizeof(uint16_t) * (size_t)n);
        if (bucket) s.bucket = bucket;
        Token *tokens = realloc(s.tokens, sizeof(Token) * (size_t)n);
        if (tokens) s.tokens = tokens;
        if (!e || !bucket || !tokens) return NULL;
        s.capacity = n;
    }
    return &s;
}

/* The tokens of bucket b, sorted by logit, descending; their number. */
static int gather_bucket(const FilterScratch *s, const float *l, int n, int b) {
    int count = 0;
    for (int i = 0; i < n; i++)
        if (s->bucket[i] == b) s->tokens[count++] = (Token){l[i], s->e[i]};
    qsort(s->tokens, (size_t)count, sizeof(Token), by_logit_descending);
    return count;
}

/* The smallest logit the row keeps (-inf: all). */
WITH_INFINITIES static float row_threshold(FilterScratch *s, const float *l, int n, int k, float p) {
    const float m = row_max(l, n);
    if (!(m > -INFINITY)) return -INFINITY; /* nothing finite (or a NaN): left as it is */
    for (int i = 0; i < n; i++) s->e[i] = expf(l[i] - m);
    int32_t *count = s->count;
    double *mass = s->mass;
    int used = 0; /* buckets [0, used) may be nonzero */
    for (int i = 0; i < n; i++) {
        /* e = 0 (-inf, or below the smallest float): no probability, never counted; kept only where
         * nothing is removed */
        const int b = s->e[i] > 0.f ? bucket_of(s->e[i]) : NUM_BUCKETS;
        s->bucket[i] = (uint16_t)b;
        if (b < NUM_BUCKETS) {
            count[b]++, mass[b] += s->e[i];
            used = b + 1 > used ? b + 1 : used;
        }
    }
    float threshold = -INFINITY;
    int k_bucket = NUM_BUCKETS, gathered = -1; /* tokens[0 .. gathered) hold bucket k_bucket, sorted */
    double total = 0.0;
    if (k > 0) { /* the k-th largest: in the bucket where the count above reaches k */
        int above = 0, b = 0;
        for (; b < used - 1 && above + count[b] < k; b++) above += count[b];
        if (used > 0 && above + count[b] >= k) {
            k_bucket = b;
            gathered = gather_bucket(s, l, n, b);
            threshold = s->tokens[k - above - 1].logit;
            int kept = k - above;
            while (kept < gathered && s->tokens[kept].logit >= threshold) kept++; /* ties with the k-th */
            gathered = kept;
        }
    }
    for (int b = 0; b < k_bucket && b < used; b++) total += mass[b];
    for (int j = 0; j < gathered; j++) total += s->tokens[j].e;
    if (p < 1.f) {
        const double target = (double)p * total;
        double before = 0.0;
        int b = 0;
        for (; b < k_bucket && b < used - 1 && before + mass[b] < target; b++) before += mass[b];
        int count_b;
        if (b == k_bucket) {
            count_b = gathered;
        } else {
            count_b = gather_bucket(s, l, n, b);
        }
        /* Walk the bucket in order: a token is kept while the mass before it is below the target. */
        float last = count_b > 0 ? s->tokens[0].logit : threshold;
        for (int j = 0; j < count_b && before < target; j++) {
            last = s->tokens[j].logit;
            before += s->tokens[j].e;
        }
        threshold = last > threshold ? last : threshold;
    }
    memset(count, 0, sizeof(int32_t) * (size_t)used);
    memset(mass, 0, sizeof(double) * (size_t)used);
    return threshold;
}

WITH_INFINITIES static void filter_rows(void *ctx, int64_t r0, int64_t r1) {
    FilterArgs *a = ctx;
    FilterScratch *s = filter_scratch(a->n);
    if (s == NULL) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const int k = a->top_k[r] > 0 && a->top_k[r] < a->n ? (int)a->top_k[r] : 0;
        const float p = a->top_p[r], min_p = a->min_p[r];
        if (k == 0 && !(p < 1.f) && !(min_p > 0.f)) continue;
        float *l = a->logits + r * a->stride;
        float threshold = k > 0 || p < 1.f ? row_threshold(s, l, a->n, k, p) : -INFINITY;
        if (min_p > 0.f) { /* p_i >= min_p * p_max, as exp(l_i - max) >= min_p: after any filter, the max stays */
            const float floor = row_max(l, a->n) + logf(min_p);
            threshold = floor > threshold ? floor : threshold;
        }
#pragma omp simd
        for (int i = 0; i < a->n; i++) l[i] = l[i] < threshold ? -INFINITY : l[i];
    }
}

/* logits: [rows, n], rows `stride` apart, filtered in place; top_k (0: none), top_p (1: none), min_p (0:
 * none): [rows]. 0, or -1 where a thread's scratch could not be allocated (rows then partly filtered). */
int filter_logits_f32(float *logits, int64_t stride, const int64_t *top_k, const float *top_p, const float *min_p,
                      int rows, int n) {
    FilterArgs a = {logits, stride, top_k, top_p, min_p, n, 0};
    pool_rows(rows, (int64_t)n * 8, filter_rows, &a);
    return a.failed ? -1 : 0;
}

/*
 * Penalties on rows of logits, in place, from each row's token ids (what sampler.apply_repetition_penalty
 * then apply_frequency_presence_penalties compute over [rows, n] count tensors, touching only the tokens
 * a row has seen): HF's repetition penalty on every token of the row's prompt or output (a positive logit
 * divided by it, another multiplied), then OpenAI's penalties on its output tokens, logit - frequency x
 * count - presence. The same float operations in the same order as those (no contraction into FMAs), so
 * the same bits. Ids outside [0, n) are skipped.
 */
typedef struct {
    float *logits;
    int64_t stride;
    const int64_t *prompt_ids, *prompt_offsets, *output_ids, *output_offsets;
    const float *repetition, *frequency, *presence;
    int n;
    int failed;
} PenaltyArgs;

static int32_t *penalty_counts(int n) { /* zero between rows: a row clears what it set */
    static __thread int32_t *counts = NULL;
    static __thread int capacity = 0;
    if (n > capacity) {
        int32_t *grown = calloc((size_t)n, sizeof(int32_t));
        if (grown == NULL) return NULL;
        free(counts);
        counts = grown;
        capacity = n;
    }
    return counts;
}

#define EXACT_FLOATS __attribute__((optimize("no-fast-math", "fp-contract=off")))

EXACT_FLOATS static void penalty_rows(void *ctx, int64_t r0, int64_t r1) {
    PenaltyArgs *a = ctx;
    int32_t *counts = penalty_counts(a->n);
    if (counts == NULL) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        float *l = a->logits + r * a->stride;
        const int64_t *out = a->output_ids + a->output_offsets[r];
        const int64_t num_out = a->output_offsets[r + 1] - a->output_offsets[r];
        const float repetition = a->repetition[r], frequency = a->frequency[r], presence = a->presence[r];
        for (int64_t j = 0; j < num_out; j++)
            if (out[j] >= 0 && out[j] < a->n) counts[out[j]]++;
        if (repetition != 1.f) { /* every seen token once: its count goes negative (-1) once penalised */
            const int64_t *prompt = a->prompt_ids + a->prompt_offsets[r];
            const int64_t num_prompt = a->prompt_offsets[r + 1] - a->prompt_offsets[r];
            for (int pass = 0; pass < 2; pass++) {
                const int64_t *ids = pass ? out : prompt, num = pass ? num_out : num_prompt;
                for (int64_t j = 0; j < num; j++) {
                    const int64_t id = ids[j];
                    if (id < 0 || id >= a->n || counts[id] < 0) continue;
                    l[id] = l[id] > 0.f ? l[id] / repetition : l[id] * repetition;
                    counts[id] = -1 - counts[id]; /* -1 - count: penalised, count kept */
                }
            }
            for (int64_t j = 0; j < num_prompt; j++) /* prompt-only tokens back to zero */
                if (prompt[j] >= 0 && prompt[j] < a->n && counts[prompt[j]] == -1) counts[prompt[j]] = 0;
        }
        for (int64_t j = 0; j < num_out; j++) {
            const int64_t id = out[j];
            if (id < 0 || id >= a->n || counts[id] == 0) continue;
            const int32_t count = counts[id] < 0 ? -1 - counts[id] : counts[id];
            if (frequency != 0.f || presence != 0.f)
                l[id] = (l[id] - frequency * (float)count) - presence * 1.f;
            counts[id] = 0;
        }
    }
}

/* logits: [rows, n] (rows `stride` apart); prompt_ids / output_ids: every row's ids, row r's from
 * offsets[r] to offsets[r + 1]; repetition, frequency, presence: [rows] (1, 0, 0: off). 0, or -1 where
 * the counts could not be allocated (before any row: logits untouched, for the caller's fallback). */
int apply_penalties_f32(float *logits, int64_t stride, int rows, int n, const int64_t *prompt_ids,
                        const int64_t *prompt_offsets, const int64_t *output_ids, const int64_t *output_offsets,
                        const float *repetition, const float *frequency, const float *presence) {
    PenaltyArgs a = {logits, stride, prompt_ids, prompt_offsets, output_ids, output_offsets,
                     repetition, frequency, presence, n, 0};
    penalty_rows(&a, 0, rows); /* a few hundred ids a row: not worth a parallel loop */
    return a.failed ? -1 : 0;
}

/*
 * Logprobs of rows of logits: per row, the max and the log of the sum of exp(l - max) (in float32, as
 * torch's log_softmax), the logprob of the row's sampled token, and its num_top most likely
 * tokens with their logprobs, in descending order, the lower id first among equal logits (torch's topk
 * over the whole vocabulary, which this replaces: a partial sort per row of a 128k vocabulary took longer
 * than the step). num_top <= MAX_TOP; a logit larger than the num_top-th so far enters by insertion.
 * Optionally the token's rank: 1 + the number of tokens with a larger logit (prompt logprobs report it).
 */
#define MAX_TOP 64

typedef struct {
    const float *logits;
    int64_t stride;
    const int64_t *token_ids;
    float *logprobs, *top_logprobs;
    int64_t *top_ids, *ranks; /* ranks: NULL where not asked for */
    int n, num_top;
} LogprobArgs;

/* A logprob as torch's log_softmax forms it, (logit - max) - log(sum): m + log(sum) rounded first would
 * carry that sum's rounding (half an ulp of the larger max) into every logprob. Not inlined into the
 * fast-math caller, which may reassociate it. */
EXACT_FLOATS __attribute__((noinline)) static float log_prob(float logit, float max, float log_sum) {
    return (logit - max) - log_sum;
}

/* 1 + the number of logits above l[token] (a comparison of the logits themselves: no rounding of
 * logprobs can tie two distinct ones); 0 for a token outside the row. */
static int64_t rank_of(const float *l, int n, int64_t token) {
    if (token < 0 || token >= n) return 0;
    const float t = l[token];
    int64_t above = 0;
#pragma omp simd reduction(+ : above)
    for (int i = 0; i < n; i++) above += l[i] > t;
    return above + 1;
}

WITH_INFINITIES static void logprob_rows(void *ctx, int64_t r0, int64_t r1) {
    const LogprobArgs *a = ctx;
    for (int64_t r = r0; r < r1; r++) {
        const float *l = a->logits + r * a->stride;
        const float m = row_max(l, a->n);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < a->n; i++) sum += expf(l[i] - m);
        const float log_sum = logf(sum);
        const int64_t token = a->token_ids[r];
        a->logprobs[r] = token >= 0 && token < a->n ? log_prob(l[token], m, log_sum) : -INFINITY;
        if (a->ranks != NULL) a->ranks[r] = rank_of(l, a->n, token);
        const int k = a->num_top < a->n ? a->num_top : a->n;
        if (k <= 0) continue;
        float value[MAX_TOP];
        int64_t id[MAX_TOP];
        int count = 0;
        for (int i = 0; i < a->n; i++) {
            const float x = l[i];
            if (count == k && !(x > value[k - 1])) continue; /* the common case: not among the top */
            int at = count < k ? count++ : k - 1;
            while (at > 0 && x > value[at - 1]) { /* after any equal value: the lower id first */
                value[at] = value[at - 1], id[at] = id[at - 1];
                at--;
            }
            value[at] = x, id[at] = i;
        }
        for (int j = 0; j < k; j++) {
            a->top_ids[r * a->num_top + j] = id[j];
            a->top_logprobs[r * a->num_top + j] = log_prob(value[j], m, log_sum);
        }
    }
}

/* logits: [rows, n] (rows `stride` apart); token_ids, logprobs: [rows]; top_ids, top_logprobs: [rows,
 * num_top], num_top <= MAX_TOP and <= n; ranks: [rows] or NULL. 0, or -1 where num_top is out of range. */
int logprobs_f32(const float *logits, int64_t stride, const int64_t *token_ids, float *logprobs, int64_t *top_ids,
                 float *top_logprobs, int64_t *ranks, int rows, int n, int num_top) {
    if (num_top < 0 || num_top > MAX_TOP || num_top > n) return -1;
    LogprobArgs a = {logits, stride, token_ids, logprobs, top_logprobs, top_ids, ranks, n, num_top};
    pool_rows(rows, (int64_t)n * 2, logprob_rows, &a);
    return 0;
}
