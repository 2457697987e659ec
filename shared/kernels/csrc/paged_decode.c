/*
 * Paged decode attention on the CPU: one new query token per sequence attends
 * to its whole context, read straight from the paged KV cache (no gather copy).
 *
 * Layouts (element strides given by the caller; q and out float32, the cache kv_t: float32 here,
 * bfloat16 in paged_decode_bf16.c, which compiles this file again with KV_KIND set, float8 in
 * paged_decode_e4m3.c and paged_decode_e5m2.c; see kv.h):
 *   q, out        [num_seqs, num_heads, head_dim], contiguous
 *   k/v cache     a layer's view [num_blocks, block_size, num_kv_heads, head_dim];
 *                 block_stride between blocks, rows of num_kv_heads * head_dim
 *   block_tables  [num_seqs, bt_stride] int32
 *   seq_lens      [num_seqs] int32
 * The query heads of one KV head (GQA group) share every K/V row read.
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv.h"
#include "pool.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float dot(const float *a, const kv_t *b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * kv_float(b[i]);
    return s;
}

/* Each of ``rows`` rows of seq_len scores becomes its softmax weights, unnormalised (sums[r] is what
 * they add up to: the caller divides at the end). */
static inline void softmax_rows(float *scores, int rows, int seq_len, float *sums) {
    for (int r = 0; r < rows; r++) {
        float *row = scores + (int64_t)r * seq_len;
        float m = -FLT_MAX, sum = 0.f;
        for (int t = 0; t < seq_len; t++) m = row[t] > m ? row[t] : m;
        for (int t = 0; t < seq_len; t++) row[t] = expf(row[t] - m);
        for (int t = 0; t < seq_len; t++) sum += row[t];
        sums[r] = sum;
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "simd.h"

#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4 /* blocks: one block's work is shorter than a memory round trip */
#endif
#define NEXT_ITEM_BLOCKS 4 /* of the next item, started while this one computes */

/* Start loading ``num_elems`` of each of ``rows`` rows (row_stride apart) into the cache; with ``to_l2``
 * (a constant) into the second-level cache only, for data wanted a little later. */
static inline __attribute__((always_inline)) void prefetch_rows(const kv_t *base, int64_t row_stride, int rows,
                                                                int num_elems, const int to_l2) {
    for (int i = 0; i < rows; i++)
        for (int d = 0; d < num_elems; d += KV_LINE) {
            const char *line = (const char *)(base + (int64_t)i * row_stride + d);
            if (to_l2)
                _mm_prefetch(line, _MM_HINT_T1);
            else
                _mm_prefetch(line, _MM_HINT_T0);
        }
}

/* The rows of one block's keys and values, from element ``at`` of each cache, into the second-level cache.
 * Inlined like prefetch_rows: as a call, it lost all of what the prefetches gain (measured). */
static inline __attribute__((always_inline)) void prefetch_kv_block(const kv_t *k_cache, const kv_t *v_cache,
                                                                    int64_t at, int64_t row_stride, int rows,
                                                                    int num_elems) {
    prefetch_rows(k_cache + at, row_stride, rows, num_elems, 1);
    prefetch_rows(v_cache + at, row_stride, rows, num_elems, 1);
}
#endif

#if defined(__AVX512F__)

/* scores[g][t0 .. t0 + n) = scale * q_g . k_t for n <= 16 float32 keys whose rows start at k (row_stride apart). */
static inline void score_rows(const float *q, const float *k, int64_t row_stride, int n, int group, int head_dim,
                              float scale, float *scores, int64_t seq_len, int t0) {
    const int nd = head_dim / 16;
    if (n == 16) { /* a full run of keys: 16 independent FMA chains, each K vector used from L1 per head */
        for (int g = 0; g < group; g++) {
            const float *qg = q + (int64_t)g * head_dim;
            __m512 p[16];
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) p[t] = _mm512_setzero_ps();
            for (int c = 0; c < nd; c++) {
                const __m512 qv = _mm512_loadu_ps(qg + 16 * c);
#pragma GCC unroll 16
                for (int t = 0; t < 16; t++)
                    p[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (int64_t)t * row_stride + 16 * c), p[t]);
            }
            _mm512_storeu_ps(scores + (int64_t)g * seq_len + t0, _mm512_mul_ps(sum16(p), _mm512_set1_ps(scale)));
        }
        return;
    }
    for (int g = 0; g < group; g++) {
        const float *qg = q + (int64_t)g * head_dim;
        __m512 p[16];
        for (int t = 0; t < 16; t++) {
            if (t >= n) {
                p[t] = _mm512_setzero_ps();
                continue;
            }
            const float *kt = k + (int64_t)t * row_stride;
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(kt));
            for (int c = 1; c < nd; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), _mm512_loadu_ps(kt + 16 * c), acc);
            p[t] = acc;
        }
        const __m512 s = _mm512_mul_ps(sum16(p), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + (int64_t)g * seq_len + t0, (__mmask16)((1u << n) - 1u), s);
    }
}

#if KV_KIND != 0
/* score_rows over 16 bfloat16 or float8 keys for a group of G <= 3 heads: each key's 16 values widened once, into
 * a register that every head's FMA reads (8 keys x G heads of sums stay in registers). Against widening the keys
 * into a float32 tile that each head then reads (the fallback below), six layers of 64 sequences x 256 tokens with
 * their cache in L3: e5m2 1.5-1.8 against 1.8-3.0 ms, bfloat16 1.65-1.9 against 1.8-2.2 (AVX-512 Zen 4). */
static inline __attribute__((always_inline)) void score_keys_group(const int G, const float *q, const kv_t *k,
                                                                    int64_t row_stride, int head_dim, float scale,
                                                                    float *scores, int64_t seq_len, int t0) {
    __m512 p[3][16];
    const int nd = head_dim / 16;
    for (int h = 0; h < 16; h += 8) {
        __m512 acc[3][8];
#pragma GCC unroll 3
        for (int g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) acc[g][t] = _mm512_setzero_ps();
        for (int c = 0; c < nd; c++) {
            __m512 qv[3];
#pragma GCC unroll 3
            for (int g = 0; g < G; g++) qv[g] = _mm512_loadu_ps(q + (int64_t)g * head_dim + 16 * c);
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) {
                const __m512 kv = kv_load16_raw(k + (int64_t)(h + t) * row_stride + 16 * c);
#pragma GCC unroll 3
                for (int g = 0; g < G; g++) acc[g][t] = _mm512_fmadd_ps(qv[g], kv, acc[g][t]);
            }
        }
#pragma GCC unroll 3
        for (int g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) p[g][h + t] = acc[g][t];
    }
    for (int g = 0; g < G; g++) /* kv.h's raw keys: the scale takes KV_RAW_SCALE back */
        _mm512_storeu_ps(scores + (int64_t)g * seq_len + t0,
                         _mm512_mul_ps(sum16(p[g]), _mm512_set1_ps(scale * KV_RAW_SCALE)));
}

static inline void score_keys(const float *q, const kv_t *k, int64_t row_stride, int n, int group, int head_dim,
                              float scale, float *scores, int64_t seq_len, int t0) {
    if (n == 16 && group <= 3) {
        if (group == 3)
            score_keys_group(3, q, k, row_stride, head_dim, scale, scores, seq_len, t0);
        else if (group == 2)
            score_keys_group(2, q, k, row_stride, head_dim, scale, scores, seq_len, t0);
        else
            score_keys_group(1, q, k, row_stride, head_dim, scale, scores, seq_len, t0);
        return;
    }
    /* Otherwise widened once into a float32 tile (in L1) that every head of the group reads. */
    float tile[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));
    for (int t = 0; t < n; t++)
        for (int c = 0; c < head_dim; c += 16)
            _mm512_store_ps(tile + t * head_dim + c, kv_load16(k + (int64_t)t * row_stride + c));
    score_rows(q, tile, head_dim, n, group, head_dim, scale, scores, seq_len, t0);
}
#else
#define score_keys score_rows
#endif

/* out[g] = sum_t w[g][t] v_t / sums[g] for head_dim % 64 == 0: up to four heads x 64 dims in registers. */
static void weigh_values(const float *scores, const kv_t *v_cache, int64_t block_stride, int64_t row_stride,
                         const int32_t *block_table, int seq_len, int kv_head, int group, int head_dim,
                         int block_size, const float *sums, float *out) {
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int g0 = 0; g0 < group; g0 += 4) {
        const int ng = group - g0 < 4 ? group - g0 : 4;
        for (int d0 = 0; d0 < head_dim; d0 += 64) {
            __m512 acc[4][4];
            for (int g = 0; g < 4; g++)
                for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
            for (int b = 0; b < num_blocks; b++) {
                const kv_t *base =
                    v_cache + (int64_t)block_table[b] * block_stride + (int64_t)kv_head * head_dim + d0;
                const int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
                for (int p = b == 0 ? 1 : b + PREFETCH_AHEAD; p <= b + PREFETCH_AHEAD && p < num_blocks; p++)
                    prefetch_rows(v_cache + (int64_t)block_table[p] * block_stride + (int64_t)kv_head * head_dim + d0,
                                  row_stride, block_size, 64, 0);
                const float *w = scores + (int64_t)g0 * seq_len + b * block_size;
                for (int i = 0; i < n; i++) {
                    const kv_t *v = base + (int64_t)i * row_stride;
                    /* kv.h's raw values: the division by the sums takes KV_RAW_SCALE back */
                    __m512 v0 = kv_load16_raw(v), v1 = kv_load16_raw(v + 16);
                    __m512 v2 = kv_load16_raw(v + 32), v3 = kv_load16_raw(v + 48);
                    /* In registers: loaded once, not again as a memory operand of every head's FMA. */
                    __asm__("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3));
#define CLEAVE_PV(g)                                                           \
    if (g < ng) {                                                              \
        const __m512 wg = _mm512_set1_ps(w[(int64_t)(g) * seq_len + i]);       \
        acc[g][0] = _mm512_fmadd_ps(wg, v0, acc[g][0]);                        \
        acc[g][1] = _mm512_fmadd_ps(wg, v1, acc[g][1]);                        \
        acc[g][2] = _mm512_fmadd_ps(wg, v2, acc[g][2]);                        \
        acc[g][3] = _mm512_fmadd_ps(wg, v3, acc[g][3]);                        \
    }
                    CLEAVE_PV(0) CLEAVE_PV(1) CLEAVE_PV(2) CLEAVE_PV(3)
#undef CLEAVE_PV
                }
            }
            for (int g = 0; g < ng; g++) {
                const __m512 inv = _mm512_set1_ps(KV_RAW_SCALE / sums[g0 + g]);
                float *dst = out + (int64_t)(g0 + g) * head_dim + d0;
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(acc[g][c], inv));
            }
        }
    }
}
#endif

#if defined(__AVX512F__) /* the one-head-per-item path (see decode_items) */
/* Pass 1: scores[g][t] = scale * q_g . k_t over the whole context. */
static void score_context(const float *q, const kv_t *k_cache, const kv_t *v_cache, int64_t block_stride,
                          int64_t row_stride, const int32_t *block_table, int seq_len, int kv_head, int group,
                          int head_dim, int block_size, float scale, float *scores) {
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int b = 0; b < num_blocks; b++) {
        const kv_t *base = k_cache + (int64_t)block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        const int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        if (head_dim % 16 == 0) {
            /* Blocks sit anywhere: start loading the one PREFETCH_AHEAD on (the blocks before it at the start),
             * its keys and its values (pass 3's) into the second-level cache, which holds more misses in flight
             * than the first: from DRAM this pass ran at a third of a streaming read with keys alone into L1. */
            for (int p = b == 0 ? 1 : b + PREFETCH_AHEAD; p <= b + PREFETCH_AHEAD && p < num_blocks; p++)
                prefetch_kv_block(k_cache, v_cache, (int64_t)block_table[p] * block_stride + (int64_t)kv_head * head_dim,
                                  row_stride, block_size, head_dim);
            for (int i = 0; i < n; i += 16)
                score_keys(q, base + (int64_t)i * row_stride, row_stride, n - i < 16 ? n - i : 16, group, head_dim,
                           scale, scores, seq_len, b * block_size + i);
            continue;
        }
        for (int i = 0; i < n; i++) {
            const kv_t *k = base + (int64_t)i * row_stride;
            for (int g = 0; g < group; g++)
                scores[(int64_t)g * seq_len + b * block_size + i] = dot(q + (int64_t)g * head_dim, k, head_dim) * scale;
        }
    }
}

static void one_head(const float *q, float *out, const kv_t *k_cache, const kv_t *v_cache, int64_t block_stride,
                     int64_t row_stride, const int32_t *block_table, int seq_len, int kv_head, int group,
                     int head_dim, int block_size, float scale, float *scores) {
    /* scores: [group, seq_len] scratch. */
    score_context(q, k_cache, v_cache, block_stride, row_stride, block_table, seq_len, kv_head, group, head_dim, block_size,
                  scale, scores);
    /* Pass 2: softmax weights (unnormalised; divided at the end). */
    float sums[MAX_GROUP];
    softmax_rows(scores, group, seq_len, sums);
    /* Pass 3: weighted sum of V rows. */
    const int num_blocks = (seq_len + block_size - 1) / block_size;
    if (head_dim % 64 == 0) {
        weigh_values(scores, v_cache, block_stride, row_stride, block_table, seq_len, kv_head, group, head_dim,
                     block_size, sums, out);
        return;
    }
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    memset(acc, 0, sizeof(float) * (size_t)group * (size_t)head_dim);
    for (int b = 0; b < num_blocks; b++) {
        const kv_t *base = v_cache + (int64_t)block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        for (int i = 0; i < n; i++) {
            const kv_t *v = base + (int64_t)i * row_stride;
            int t = b * block_size + i;
            for (int g = 0; g < group; g++) {
                float w = scores[(int64_t)g * seq_len + t];
                float *a = acc + g * head_dim;
                for (int d = 0; d < head_dim; d++) a[d] += w * kv_float(v[d]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = 1.f / sums[g];
        for (int d = 0; d < head_dim; d++) out[(int64_t)g * head_dim + d] = acc[g * head_dim + d] * inv;
    }
}

#else /* without AVX-512: items of several KV heads (head_range) */
#if defined(__AVX2__) && defined(__FMA__)
#define RANGE_TILES 1
#ifndef RANGE_AHEAD
#define RANGE_AHEAD 1
#endif

/* dst[0 .. n) = scale * q . k_t for n <= 8 keys (rows row_stride apart), head_dim % 8 == 0: eight FMA
 * chains, one per key (a missing key repeats the last; not stored), reduced together by sum8. */
static inline void score_keys8(const float *q, const kv_t *k, int64_t row_stride, int n, int head_dim, float scale,
                               float *dst) {
    const kv_t *kt[8];
    for (int t = 0; t < 8; t++) kt[t] = k + (int64_t)(t < n ? t : n - 1) * row_stride;
    __m256 p[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) p[t] = _mm256_setzero_ps();
    for (int c = 0; c < head_dim; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) p[t] = _mm256_fmadd_ps(qv, kv_load8(kt[t] + c), p[t]);
    }
    const __m256 s = _mm256_mul_ps(sum8(p), _mm256_set1_ps(scale));
    if (n == 8)
        _mm256_storeu_ps(dst, s);
    else
        _mm256_maskstore_ps(dst, lanes_below(n), s);
}
#endif

#define RANGE_FLOATS 4096 /* accumulators of one item, rows x head_dim: at least MAX_GROUP x MAX_HEAD_DIM */
#define RANGE_ROWS 256    /* and its rows (query heads) */

/* KV heads [h0, h1) of one sequence, block by block and row by row: the heads of a token sit side by
 * side in its cache row, so a range of several heads reads each block as one contiguous run instead
 * of every head reading its slice of each row in a pass of its own (which left half of every fetched
 * line to be fetched again). q, out: the sequence's [num_heads, head_dim]; scores: [(h1 - h0) * group,
 * seq_len] scratch. Each head's values are the same whatever the range (the same operations, in the
 * same order): a range of one head is the prefill kernel's single-token path. */
static void head_range(const float *q, float *out, const kv_t *k_cache, const kv_t *v_cache, int64_t block_stride,
                       int64_t row_stride, const int32_t *block_table, int seq_len, int h0, int h1, int group,
                       int head_dim, int block_size, float scale, float *scores) {
    const int num_blocks = (seq_len + block_size - 1) / block_size, rows = (h1 - h0) * group;
    const float *q0 = q + (int64_t)h0 * group * head_dim;
    for (int b = 0; b < num_blocks; b++) {
        const kv_t *base = k_cache + (int64_t)block_table[b] * block_stride + (int64_t)h0 * head_dim;
        const int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
#if defined(RANGE_TILES)
        if (head_dim % 8 == 0) {
            for (int i = 0; i < n; i += 8) {
                if (b + RANGE_AHEAD < num_blocks)
                    prefetch_rows(k_cache + (int64_t)block_table[b + RANGE_AHEAD] * block_stride + (int64_t)h0 * head_dim + (int64_t)i * row_stride,
                                  row_stride, 8, (h1 - h0) * head_dim, 0);
                /* and this block's value rows, which pass 3 reads: two streams in flight instead of one. */
                prefetch_rows(v_cache + (int64_t)block_table[b] * block_stride + (int64_t)h0 * head_dim + (int64_t)i * row_stride,
                              row_stride, 8, (h1 - h0) * head_dim, 1);
                for (int r = 0; r < rows; r++) /* row r: head h0 + r / group, its K at (r / group) * head_dim */
                    score_keys8(q0 + (int64_t)r * head_dim, base + (int64_t)i * row_stride + (int64_t)(r / group) * head_dim,
                                row_stride, n - i < 8 ? n - i : 8, head_dim, scale, scores + (int64_t)r * seq_len + b * block_size + i);
            }
            continue;
        }
#endif
        for (int i = 0; i < n; i++) {
            const int t = b * block_size + i;
            for (int r = 0; r < rows; r++)
                scores[(int64_t)r * seq_len + t] =
                    dot(q0 + (int64_t)r * head_dim, base + (int64_t)i * row_stride + (int64_t)(r / group) * head_dim,
                        head_dim) * scale;
        }
    }
    float sums[RANGE_ROWS];
    softmax_rows(scores, rows, seq_len, sums);
    float acc[RANGE_FLOATS];
    memset(acc, 0, sizeof(float) * (size_t)rows * (size_t)head_dim);
    for (int b = 0; b < num_blocks; b++) {
        const kv_t *base = v_cache + (int64_t)block_table[b] * block_stride + (int64_t)h0 * head_dim;
        const int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        int i = 0;
#if defined(RANGE_TILES)
        /* Two value rows per pass over the accumulators (each element still adds row t, then t + 1, as below). */
        for (; head_dim % 8 == 0 && i + 2 <= n; i += 2) {
            const int t = b * block_size + i;
            if (b + RANGE_AHEAD < num_blocks)
                prefetch_rows(v_cache + (int64_t)block_table[b + RANGE_AHEAD] * block_stride + (int64_t)h0 * head_dim + (int64_t)i * row_stride,
                              row_stride, 2, (h1 - h0) * head_dim, 0);
            const kv_t *row0 = base + (int64_t)i * row_stride, *row1 = row0 + row_stride;
            for (int h = 0; h < h1 - h0; h++)
                for (int g = 0; g < group; g++) {
                    const int r = h * group + g;
                    const __m256 w0 = _mm256_set1_ps(scores[(int64_t)r * seq_len + t]);
                    const __m256 w1 = _mm256_set1_ps(scores[(int64_t)r * seq_len + t + 1]);
                    const kv_t *v0 = row0 + (int64_t)h * head_dim, *v1 = row1 + (int64_t)h * head_dim;
                    float *a = acc + (int64_t)r * head_dim;
                    for (int d = 0; d < head_dim; d += 8) {
                        const __m256 once = _mm256_fmadd_ps(w0, kv_load8(v0 + d), _mm256_loadu_ps(a + d));
                        _mm256_storeu_ps(a + d, _mm256_fmadd_ps(w1, kv_load8(v1 + d), once));
                    }
                }
        }
#endif
        for (; i < n; i++) {
            const int t = b * block_size + i;
            for (int r = 0; r < rows; r++) {
                const kv_t *v = base + (int64_t)i * row_stride + (int64_t)(r / group) * head_dim;
                const float w = scores[(int64_t)r * seq_len + t];
                float *a = acc + (int64_t)r * head_dim;
                for (int d = 0; d < head_dim; d++) a[d] += w * kv_float(v[d]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.f / sums[r];
        for (int d = 0; d < head_dim; d++) out[(int64_t)(h0 * group + r) * head_dim + d] = acc[(int64_t)r * head_dim + d] * inv;
    }
}
#endif

#if KV_KIND == 0 /* the parts that do not read the cache: once, in the float32 build */
/* The most KV heads one item of decode_heads_* takes (1 with AVX-512: its one-head path). */
int decode_heads_per_item(int num_kv_heads, int group, int head_dim) {
#if defined(__AVX512F__)
    (void)num_kv_heads, (void)group, (void)head_dim;
    return 1;
#else
    int heads = RANGE_FLOATS / (group * head_dim);
    heads = heads > RANGE_ROWS / group ? RANGE_ROWS / group : heads;
    return heads > num_kv_heads ? num_kv_heads : heads < 1 ? 1 : heads;
#endif
}

/* The calling thread's scores buffer (also the prefill kernel's, for its single-token rows, and the
 * sampling race's in sample.c), kept across calls and grown as contexts grow (a fresh malloc per call is
 * an mmap and page faults at long contexts). NULL if it cannot grow to ``floats``. */
float *decode_thread_scores(size_t floats) {
    static __thread float *buffer = NULL;
    static __thread size_t capacity = 0;
    if (floats > capacity) {
        float *grown = realloc(buffer, sizeof(float) * floats);
        if (grown == NULL) return NULL;
        buffer = grown;
        capacity = floats;
    }
    return buffer;
}
#else
int decode_heads_per_item(int num_kv_heads, int group, int head_dim);
float *decode_thread_scores(size_t floats);
#endif

/* KV heads [h0, h1) of one decode row (exported for the prefill kernel's single-token rows): q, out the
 * row's [num_heads, head_dim]; scores: [(h1 - h0) * group, seq_len]. The same values as paged_decode_*. */
void KV_NAME(decode_heads)(const float *q, float *out, const kv_t *k_cache, const kv_t *v_cache, int64_t block_stride,
                      int64_t row_stride, const int32_t *block_table, int seq_len, int h0, int h1, int group,
                      int head_dim, int block_size, float scale, float *scores) {
#if defined(__AVX512F__)
    for (int h = h0; h < h1; h++) {
        const int64_t offset = (int64_t)h * group * head_dim;
        one_head(q + offset, out + offset, k_cache, v_cache, block_stride, row_stride, block_table, seq_len, h, group,
                 head_dim, block_size, scale, scores);
    }
#else
    head_range(q, out, k_cache, v_cache, block_stride, row_stride, block_table, seq_len, h0, h1, group, head_dim,
               block_size, scale, scores);
#endif
}

typedef struct {
    const float *q;
    const kv_t *k_cache, *v_cache;
    float *out;
    int64_t block_stride, row_stride, bt_stride;
    const int32_t *block_tables, *seq_lens;
    int num_heads, num_kv_heads, group, head_dim, block_size, max_seq_len, heads_per_item;
    float scale;
    atomic_int failed;
} DecodeArgs;

/* The first blocks of item i (its keys and values, all its heads) into the second-level cache: an item
 * otherwise starts on a cold miss, its own prefetches a few blocks ahead covering only what follows. */
static void prefetch_item_start(const DecodeArgs *a, int64_t i, int ranges) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const int s = (int)(i / ranges), h0 = (int)(i % ranges) * a->heads_per_item;
    const int heads = a->num_kv_heads - h0 < a->heads_per_item ? a->num_kv_heads - h0 : a->heads_per_item;
    const int32_t *table = a->block_tables + (int64_t)s * a->bt_stride;
    const int num_blocks = (a->seq_lens[s] + a->block_size - 1) / a->block_size;
    for (int p = 0; p < NEXT_ITEM_BLOCKS && p < num_blocks; p++)
        prefetch_kv_block(a->k_cache, a->v_cache, (int64_t)table[p] * a->block_stride + (int64_t)h0 * a->head_dim,
                          a->row_stride, a->block_size, heads * a->head_dim);
#else
    (void)a, (void)i, (void)ranges;
#endif
}

/* Items s * ranges + j: sequence s's KV heads [j * heads_per_item, (j + 1) * heads_per_item) (one head per
 * item with AVX-512: its paths keep one head's accumulators in registers). */
static void decode_items(void *p, int64_t i0, int64_t i1) {
    DecodeArgs *a = p;
    const int ranges = (a->num_kv_heads + a->heads_per_item - 1) / a->heads_per_item;
    float *scores = decode_thread_scores((size_t)a->heads_per_item * (size_t)a->group *
                                         (size_t)(a->max_seq_len > 0 ? a->max_seq_len : 1));
    if (scores == NULL) {
        atomic_store(&a->failed, 1);
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        const int s = (int)(i / ranges), h0 = (int)(i % ranges) * a->heads_per_item;
        const int h1 = h0 + a->heads_per_item < a->num_kv_heads ? h0 + a->heads_per_item : a->num_kv_heads;
        if (i + 1 < i1) prefetch_item_start(a, i + 1, ranges);
        const int64_t seq_offset = (int64_t)s * a->num_heads * a->head_dim;
        KV_NAME(decode_heads)(a->q + seq_offset, a->out + seq_offset, a->k_cache, a->v_cache, a->block_stride,
                         a->row_stride, a->block_tables + (int64_t)s * a->bt_stride, a->seq_lens[s], h0, h1, a->group,
                         a->head_dim, a->block_size, a->scale, scores);
    }
}

/* Returns 0 on success, 1 if the shapes are outside what this kernel handles. */
int KV_NAME(paged_decode)(const float *q, float *out, const kv_t *k_cache, const kv_t *v_cache, int64_t block_stride,
                     int64_t row_stride, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int max_seq_len) {
    int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads) return 1;
    /* Every KV head of a sequence in one item where there are enough sequences to share out. */
    const int heads_per_item = num_seqs >= 8 ? decode_heads_per_item(num_kv_heads, group, head_dim) : 1;
    DecodeArgs a = {q, k_cache, v_cache, out, block_stride, row_stride, bt_stride, block_tables, seq_lens,
                    num_heads, num_kv_heads, group, head_dim, block_size, max_seq_len, heads_per_item, scale, 0};
    const int64_t ranges = (num_kv_heads + heads_per_item - 1) / heads_per_item;
    pool_for((int64_t)num_seqs * ranges, heads_per_item > 1 ? 1 : 4, decode_items, &a);
    return atomic_load(&a.failed) ? 2 : 0;
}
