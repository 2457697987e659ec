/*
 * Prefill / chunked-prefill attention on the CPU over the paged KV cache, and
 * the KV write that precedes it.
 *
 * Each sequence's new tokens are the last q_len of its seq_len-token context;
 * new token j sits at position seq_len - q_len + j and sees positions up to it.
 * Causality is applied per key block (no mask is materialised), and the query
 * heads of one KV head (a GQA group) share every K/V row read (no K/V repeat).
 *
 * Layouts (element strides given by the caller; q and out float32, the cache kv_t: float32 here,
 * bfloat16 in paged_prefill_bf16.c, which compiles this file again with KV_KIND set, float8 in
 * paged_prefill_e4m3.c and paged_prefill_e5m2.c; see kv.h):
 *   q, out          [num_tokens, num_heads, head_dim], contiguous
 *   k/v cache       a layer's view [num_blocks, block_size, num_kv_heads, head_dim];
 *                   block_stride between blocks, rows of num_kv_heads * head_dim
 *   block_tables    [num_seqs, bt_stride] int32
 *   query_start_loc [num_seqs + 1] int32; seq_lens [num_seqs] int32
 *
 * Work item: (sequence, KV head, tile of TILE_Q new tokens). The tile's query
 * rows (token x group head) stream over the key blocks with an online softmax.
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv.h"
#include "pool.h"

#define TILE_Q 32
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 64
#define MAX_ROWS (TILE_Q * MAX_GROUP)
#define ROW_GROUP 4  /* query rows scored together: independent accumulators */
#define KEY_CHUNK 16 /* keys scored together: one vector of floats */

/* paged_decode.c: KV heads [h0, h1) of one decode row; scores is [(h1 - h0) * group, seq_len] scratch. */
void KV_NAME(decode_heads)(const float *q, float *out, const kv_t *k_cache, const kv_t *v_cache, int64_t block_stride,
                      int64_t row_stride, const int32_t *block_table, int seq_len, int h0, int h1, int group,
                      int head_dim, int block_size, float scale, float *scores);
int decode_heads_per_item(int num_kv_heads, int group, int head_dim);
float *decode_thread_scores(size_t floats);

typedef struct {
    int seq, kv_head, q_begin, q_end; /* q rows [q_begin, q_end) of the sequence's new tokens */
} Item;

typedef struct {
    const float *q;
    float *out;
    const kv_t *k_cache, *v_cache;
    int64_t block_stride, row_stride;
    const int32_t *block_tables;
    int64_t bt_stride;
    const int32_t *query_start_loc, *seq_lens;
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Args;

/* Scratch of one thread: query rows, accumulators, a transposed K block. */
typedef struct {
    float qs[(MAX_ROWS + ROW_GROUP) * MAX_HEAD_DIM]; /* padded: the last row group may overrun */
    float acc[(MAX_ROWS + ROW_GROUP) * MAX_HEAD_DIM];
    float kt[MAX_HEAD_DIM * MAX_BLOCK];
    float m[MAX_ROWS + ROW_GROUP], l[MAX_ROWS + ROW_GROUP];
} Scratch;

/* Scores of ROW_GROUP query rows against one key block: S[i][t] = q_{r0+i} . k_t (t < padded block). */
static void block_scores(const Scratch *w, int r0, int hd, int bsp, float S[ROW_GROUP][MAX_BLOCK]) {
    const float *q0 = w->qs + (int64_t)r0 * hd;
    for (int c = 0; c < bsp; c += KEY_CHUNK) {
        float s0[KEY_CHUNK] = {0}, s1[KEY_CHUNK] = {0}, s2[KEY_CHUNK] = {0}, s3[KEY_CHUNK] = {0};
        for (int d = 0; d < hd; d++) {
            const float *kd = w->kt + (int64_t)d * bsp + c;
            const float a0 = q0[d], a1 = q0[hd + d], a2 = q0[2 * hd + d], a3 = q0[3 * hd + d];
            for (int t = 0; t < KEY_CHUNK; t++) {
                s0[t] += a0 * kd[t];
                s1[t] += a1 * kd[t];
                s2[t] += a2 * kd[t];
                s3[t] += a3 * kd[t];
            }
        }
        memcpy(S[0] + c, s0, sizeof s0);
        memcpy(S[1] + c, s1, sizeof s1);
        memcpy(S[2] + c, s2, sizeof s2);
        memcpy(S[3] + c, s3, sizeof s3);
    }
}

/* Rows r = j * group + g; token j (absolute position first_pos + j) sees keys t <= first_pos + j. */
static inline int group_masked(int r0, int rows, int group, int first_pos, int block_start) {
    const int last_row = r0 + ROW_GROUP - 1 < rows ? r0 + ROW_GROUP - 1 : rows - 1;
    return first_pos + last_row / group + 1 - block_start <= 0; /* no row of the group sees the block */
}

/* Keys of this n-key block that row r sees (0 for padding rows past `rows`). */
static inline int row_valid(int r, int rows, int group, int first_pos, int block_start, int n) {
    const int valid = r < rows ? first_pos + r / group + 1 - block_start : 0;
    return valid < 0 ? 0 : valid > n ? n : valid;
}

static void block_update(const Args *a, Scratch *w, const kv_t *v_base, int rows, int group, int first_pos,
                         int block_start, int n, int bsp) {
    const int hd = a->head_dim;
    float S[ROW_GROUP][MAX_BLOCK];
    for (int r0 = 0; r0 < rows; r0 += ROW_GROUP) {
        if (group_masked(r0, rows, group, first_pos, block_start)) continue;
        block_scores(w, r0, hd, bsp, S);
        int max_valid = 0;
        for (int i = 0; i < ROW_GROUP; i++) {
            const int r = r0 + i;
            const int valid = row_valid(r, rows, group, first_pos, block_start, n);
            max_valid = valid > max_valid ? valid : max_valid;
            float *p = S[i];
            if (valid == 0) { /* masked (or padding) row: weights zero, state unchanged */
                for (int t = 0; t < n; t++) p[t] = 0.f;
                continue;
            }
            float m_new = w->m[r];
            for (int t = 0; t < valid; t++) m_new = p[t] > m_new ? p[t] : m_new;
            float correction = expf(w->m[r] - m_new), sum = 0.f;
            for (int t = 0; t < valid; t++) {
                p[t] = expf(p[t] - m_new);
                sum += p[t];
            }
            for (int t = valid; t < n; t++) p[t] = 0.f;
            w->l[r] = w->l[r] * correction + sum;
            w->m[r] = m_new;
            float *acc = w->acc + (int64_t)r * hd;
            for (int d = 0; d < hd; d++) acc[d] *= correction;
        }
        float *acc0 = w->acc + (int64_t)r0 * hd;
        for (int t = 0; t < max_valid; t++) {
            const kv_t *v = v_base + (int64_t)t * a->row_stride;
            const float p0 = S[0][t], p1 = S[1][t], p2 = S[2][t], p3 = S[3][t];
            for (int d = 0; d < hd; d++) {
                const float vd = kv_float(v[d]);
                acc0[d] += p0 * vd;
                acc0[hd + d] += p1 * vd;
                acc0[2 * hd + d] += p2 * vd;
                acc0[3 * hd + d] += p3 * vd;
            }
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __mmask16 lanes_below(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* e^x for x <= 0 (scores minus their running maximum): 2^(x log2 e) as 2^round * 2^frac, the fraction
 * by its Taylor series to degree 6 (relative error ~1e-7); vscalefps makes very negative x exactly 0. */
static inline __m512 exp_ps(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n); /* in [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* block_update for head_dim % 64 == 0 over a span of up to MAX_BLOCK keys (several cache blocks; V row
 * t at v_rows[t]): the scores of ROW_GROUP rows x 16 keys and the rows' accumulators (64 dims at a time)
 * stay in registers, and each row's online-softmax update is paid once per span, not per block. */
static void block_update_fast(Scratch *w, const kv_t *const *v_rows, int hd, int rows, int group, int first_pos,
                                int block_start, int n, int bsp) {
    float S[ROW_GROUP][MAX_BLOCK];
    for (int r0 = 0; r0 < rows; r0 += ROW_GROUP) {
        if (group_masked(r0, rows, group, first_pos, block_start)) continue;
        const float *q0 = w->qs + (int64_t)r0 * hd;
        for (int c = 0; c < bsp; c += KEY_CHUNK) {
            /* Even and odd dims in separate sums: eight independent FMA chains instead of four. */
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, e0 = s0, e1 = s0, e2 = s0, e3 = s0;
            for (int d = 0; d < hd; d += 2) {
                const __m512 kd = _mm512_loadu_ps(w->kt + (int64_t)d * bsp + c);
                const __m512 ke = _mm512_loadu_ps(w->kt + (int64_t)(d + 1) * bsp + c);
                s0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), kd, s0);
                s1 = _mm512_fmadd_ps(_mm512_set1_ps(q0[hd + d]), kd, s1);
                s2 = _mm512_fmadd_ps(_mm512_set1_ps(q0[2 * hd + d]), kd, s2);
                s3 = _mm512_fmadd_ps(_mm512_set1_ps(q0[3 * hd + d]), kd, s3);
                e0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d + 1]), ke, e0);
                e1 = _mm512_fmadd_ps(_mm512_set1_ps(q0[hd + d + 1]), ke, e1);
                e2 = _mm512_fmadd_ps(_mm512_set1_ps(q0[2 * hd + d + 1]), ke, e2);
                e3 = _mm512_fmadd_ps(_mm512_set1_ps(q0[3 * hd + d + 1]), ke, e3);
            }
            _mm512_storeu_ps(S[0] + c, _mm512_add_ps(s0, e0));
            _mm512_storeu_ps(S[1] + c, _mm512_add_ps(s1, e1));
            _mm512_storeu_ps(S[2] + c, _mm512_add_ps(s2, e2));
            _mm512_storeu_ps(S[3] + c, _mm512_add_ps(s3, e3));
        }
        int max_valid = 0;
        float correction[ROW_GROUP];
        for (int i = 0; i < ROW_GROUP; i++) {
            const int r = r0 + i;
            const int valid = row_valid(r, rows, group, first_pos, block_start, n);
            max_valid = valid > max_valid ? valid : max_valid;
            float *p = S[i];
            correction[i] = 1.f;
            if (valid == 0) { /* masked (or padding) row: weights zero, state unchanged */
                for (int t = 0; t < n; t++) p[t] = 0.f;
                continue;
            }
            float m_new = w->m[r];
            for (int c = 0; c < valid; c += 16) {
                const __mmask16 live = lanes_below(valid - c);
                m_new = fmaxf(m_new, _mm512_mask_reduce_max_ps(live, _mm512_maskz_loadu_ps(live, p + c)));
            }
            correction[i] = expf(w->m[r] - m_new);
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < bsp; c += 16) { /* keys at or past `valid` get weight 0 */
                const __mmask16 live = c < valid ? lanes_below(valid - c) : 0;
                const __m512 e = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p + c), _mm512_set1_ps(m_new))));
                _mm512_storeu_ps(p + c, e);
                sum = _mm512_add_ps(sum, e);
            }
            w->l[r] = w->l[r] * correction[i] + _mm512_reduce_add_ps(sum);
            w->m[r] = m_new;
        }
        for (int d0 = 0; d0 < hd; d0 += 64) {
            __m512 acc[ROW_GROUP][4];
            for (int i = 0; i < ROW_GROUP; i++) {
                const float *src = w->acc + (int64_t)(r0 + i) * hd + d0;
                const __m512 corr = _mm512_set1_ps(correction[i]);
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(src + 16 * c), corr);
            }
            for (int t = 0; t < max_valid; t++) {
                const kv_t *v = v_rows[t] + d0;
                const __m512 v0 = kv_load16(v), v1 = kv_load16(v + 16);
                const __m512 v2 = kv_load16(v + 32), v3 = kv_load16(v + 48);
                for (int i = 0; i < ROW_GROUP; i++) {
                    const __m512 p = _mm512_set1_ps(S[i][t]);
                    acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
                    acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
                    acc[i][2] = _mm512_fmadd_ps(p, v2, acc[i][2]);
                    acc[i][3] = _mm512_fmadd_ps(p, v3, acc[i][3]);
                }
            }
            for (int i = 0; i < ROW_GROUP; i++) {
                float *dst = w->acc + (int64_t)(r0 + i) * hd + d0;
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(dst + 16 * c, acc[i][c]);
            }
        }
    }
}
#define FAST_PREFILL_DIMS 64 /* head_dim multiple for block_update_fast */
#elif defined(__AVX2__) && defined(__FMA__)
#include "simd.h"

/* e^x for x <= 0, as exp_ps above: the power of two is built in the exponent bits (x clamped at -87, so
 * the smallest result is ~2^-126 rather than 0: below the precision of any sum it joins). */
static inline __m256 exp_ps(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The AVX-512 block_update_fast with 8 lanes (head_dim % 16 == 0): ROW_GROUP rows x 16 keys of scores and the
 * rows' accumulators 16 dims at a time in registers; the online-softmax update once per span. */
static void block_update_fast(Scratch *w, const kv_t *const *v_rows, int hd, int rows, int group, int first_pos,
                              int block_start, int n, int bsp) {
    float S[ROW_GROUP][MAX_BLOCK];
    for (int r0 = 0; r0 < rows; r0 += ROW_GROUP) {
        if (group_masked(r0, rows, group, first_pos, block_start)) continue;
        const float *q0 = w->qs + (int64_t)r0 * hd;
        for (int c = 0; c < bsp; c += KEY_CHUNK) {
            __m256 s[ROW_GROUP][2];
            for (int i = 0; i < ROW_GROUP; i++) s[i][0] = s[i][1] = _mm256_setzero_ps();
            for (int d = 0; d < hd; d++) {
                const __m256 k0 = _mm256_loadu_ps(w->kt + (int64_t)d * bsp + c);
                const __m256 k1 = _mm256_loadu_ps(w->kt + (int64_t)d * bsp + c + 8);
#pragma GCC unroll 4
                for (int i = 0; i < ROW_GROUP; i++) {
                    const __m256 qd = _mm256_broadcast_ss(q0 + (int64_t)i * hd + d);
                    s[i][0] = _mm256_fmadd_ps(qd, k0, s[i][0]);
                    s[i][1] = _mm256_fmadd_ps(qd, k1, s[i][1]);
                }
            }
            for (int i = 0; i < ROW_GROUP; i++) {
                _mm256_storeu_ps(S[i] + c, s[i][0]);
                _mm256_storeu_ps(S[i] + c + 8, s[i][1]);
            }
        }
        int max_valid = 0;
        float correction[ROW_GROUP];
        for (int i = 0; i < ROW_GROUP; i++) {
            const int r = r0 + i;
            const int valid = row_valid(r, rows, group, first_pos, block_start, n);
            max_valid = valid > max_valid ? valid : max_valid;
            float *p = S[i];
            correction[i] = 1.f;
            if (valid == 0) { /* masked (or padding) row: weights zero, state unchanged */
                for (int t = 0; t < n; t++) p[t] = 0.f;
                continue;
            }
            __m256 mv = _mm256_set1_ps(w->m[r]);
            for (int c = 0; c < valid; c += 8) {
                const __m256 live = _mm256_castsi256_ps(lanes_below(valid - c));
                mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), _mm256_loadu_ps(p + c), live));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float m_new = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            correction[i] = expf(w->m[r] - m_new);
            __m256 sum = _mm256_setzero_ps();
            for (int c = 0; c < bsp; c += 8) { /* keys at or past `valid` get weight 0 */
                const __m256 live = _mm256_castsi256_ps(lanes_below(valid - c));
                const __m256 e = _mm256_and_ps(live, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p + c), _mm256_set1_ps(m_new))));
                _mm256_storeu_ps(p + c, e);
                sum = _mm256_add_ps(sum, e);
            }
            w->l[r] = w->l[r] * correction[i] + hsum8(sum);
            w->m[r] = m_new;
        }
        for (int d0 = 0; d0 < hd; d0 += 16) {
            __m256 acc[ROW_GROUP][2];
            for (int i = 0; i < ROW_GROUP; i++) {
                const float *src = w->acc + (int64_t)(r0 + i) * hd + d0;
                const __m256 corr = _mm256_set1_ps(correction[i]);
                acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(src), corr);
                acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(src + 8), corr);
            }
            for (int t = 0; t < max_valid; t++) {
                const __m256 v0 = kv_load8(v_rows[t] + d0), v1 = kv_load8(v_rows[t] + d0 + 8);
#pragma GCC unroll 4
                for (int i = 0; i < ROW_GROUP; i++) {
                    const __m256 p = _mm256_broadcast_ss(S[i] + t);
                    acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
                }
            }
            for (int i = 0; i < ROW_GROUP; i++) {
                float *dst = w->acc + (int64_t)(r0 + i) * hd + d0;
                _mm256_storeu_ps(dst, acc[i][0]);
                _mm256_storeu_ps(dst + 8, acc[i][1]);
            }
        }
    }
}
#define FAST_PREFILL_DIMS 16 /* head_dim multiple for block_update_fast */
#endif

static void run_item(const Args *a, const Item *it, Scratch *w) {
    const int hd = a->head_dim, bs = a->block_size, group = a->num_heads / a->num_kv_heads;
    const int q_start = a->query_start_loc[it->seq];
    const int q_len = a->query_start_loc[it->seq + 1] - q_start;
    const int seq_len = a->seq_lens[it->seq];
    const int first_pos = seq_len - q_len + it->q_begin; /* position of the tile's first token */
    const int tile = it->q_end - it->q_begin, rows = tile * group;
    const int32_t *table = a->block_tables + (int64_t)it->seq * a->bt_stride;
    for (int j = 0; j < tile; j++) {
        const float *src = a->q + ((int64_t)(q_start + it->q_begin + j) * a->num_heads + it->kv_head * group) * hd;
        for (int i = 0; i < group * hd; i++) w->qs[(int64_t)j * group * hd + i] = src[i] * a->scale;
    }
    memset(w->qs + (int64_t)rows * hd, 0, sizeof(float) * ROW_GROUP * (size_t)hd);
    for (int r = 0; r < rows + ROW_GROUP; r++) {
        w->m[r] = -FLT_MAX;
        w->l[r] = 0.f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)(rows + ROW_GROUP) * (size_t)hd);
    const int bsp = (bs + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK; /* keys padded to whole chunks */
    const int last_pos = first_pos + tile - 1;
#if defined(FAST_PREFILL_DIMS)
    if (hd % FAST_PREFILL_DIMS == 0) {
        /* Spans of whole blocks, up to MAX_BLOCK keys: K transposed into kt, V rows by pointer. */
        const int span_blocks = MAX_BLOCK / bs;
        const kv_t *v_rows[MAX_BLOCK];
        for (int b0 = 0; b0 * bs <= last_pos; b0 += span_blocks) {
            const int span_start = b0 * bs;
            const int span_end_pos = seq_len < span_start + span_blocks * bs ? seq_len : span_start + span_blocks * bs;
            const int n = span_end_pos - span_start;
            const int np = (n + KEY_CHUNK - 1) / KEY_CHUNK * KEY_CHUNK;
            for (int t = 0; t < np; t++) { /* keys past n are padding: read as zeros */
                if (t < n) {
                    const int64_t row = (int64_t)table[b0 + t / bs] * a->block_stride + (int64_t)(t % bs) * a->row_stride +
                                        (int64_t)it->kv_head * hd;
                    const kv_t *k = a->k_cache + row;
                    for (int d = 0; d < hd; d++) w->kt[(int64_t)d * np + t] = kv_float(k[d]);
                    v_rows[t] = a->v_cache + row;
                } else {
                    for (int d = 0; d < hd; d++) w->kt[(int64_t)d * np + t] = 0.f;
                }
            }
            block_update_fast(w, v_rows, hd, rows, group, first_pos, span_start, n, np);
        }
    } else
#endif
    for (int b = 0; b * bs <= last_pos; b++) {
        const int block_start = b * bs;
        const int n = seq_len - block_start < bs ? seq_len - block_start : bs;
        const int64_t offset = (int64_t)table[b] * a->block_stride + (int64_t)it->kv_head * hd;
        const kv_t *k_base = a->k_cache + offset;
        for (int t = 0; t < bsp; t++) { /* keys past n are padding: read as zeros */
            const kv_t *k = k_base + (int64_t)t * a->row_stride;
            for (int d = 0; d < hd; d++) w->kt[(int64_t)d * bsp + t] = t < n ? kv_float(k[d]) : 0.f;
        }
        block_update(a, w, a->v_cache + offset, rows, group, first_pos, block_start, n, bsp);
    }
    for (int j = 0; j < tile; j++) {
        float *dst = a->out + ((int64_t)(q_start + it->q_begin + j) * a->num_heads + it->kv_head * group) * hd;
        for (int g = 0; g < group; g++) {
            const int r = j * group + g;
            const float inv = 1.f / w->l[r];
            for (int d = 0; d < hd; d++) dst[(int64_t)g * hd + d] = w->acc[(int64_t)r * hd + d] * inv;
        }
    }
}

typedef struct {
    const Args *a;
    const Item *items;
    atomic_int failed;
    int max_seq_len, row_heads; /* row_heads: KV heads per item of a single-token row */
} PrefillRun;

static void prefill_items(void *p, int64_t i0, int64_t i1) {
    PrefillRun *run = p;
    const Args *a = run->a;
    const int group = a->num_heads / a->num_kv_heads;
    /* Kept per thread across calls: a fresh ~600 KB malloc is an mmap and page faults every layer. */
    static __thread Scratch *w = NULL;
    if (w == NULL) w = malloc(sizeof(Scratch));
    float *scores = decode_thread_scores((size_t)run->row_heads * (size_t)group * (size_t)run->max_seq_len);
    if (w == NULL || scores == NULL) {
        atomic_store(&run->failed, 1);
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        const Item *it = &run->items[i];
        const int q_len = a->query_start_loc[it->seq + 1] - a->query_start_loc[it->seq];
        if (q_len == 1) { /* single-token rows (decode rows of a mixed step) take the decode path: no K transpose */
            const int64_t offset = (int64_t)a->query_start_loc[it->seq] * a->num_heads * a->head_dim;
            const int h1 = it->kv_head + run->row_heads < a->num_kv_heads ? it->kv_head + run->row_heads : a->num_kv_heads;
            KV_NAME(decode_heads)(a->q + offset, a->out + offset, a->k_cache, a->v_cache, a->block_stride, a->row_stride,
                             a->block_tables + (int64_t)it->seq * a->bt_stride, a->seq_lens[it->seq], it->kv_head, h1,
                             group, a->head_dim, a->block_size, a->scale, scores);
        } else if (q_len > 1) {
            run_item(a, it, w);
        }
    }
}

/* Returns 0 on success, 1 if the shapes are outside what this kernel handles, 2 if out of memory. */
int KV_NAME(paged_prefill)(const float *q, float *out, const kv_t *k_cache, const kv_t *v_cache, int64_t block_stride,
                      int64_t row_stride, const int32_t *block_tables, int64_t bt_stride,
                      const int32_t *query_start_loc, const int32_t *seq_lens, int num_seqs, int num_heads,
                      int num_kv_heads, int head_dim, int block_size, float scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
    if (num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK) return 1;
    Args a = {q, out, k_cache, v_cache, block_stride, row_stride, block_tables, bt_stride, query_start_loc,
              seq_lens, num_heads, num_kv_heads, head_dim, block_size, scale};
    int64_t num_items = 0;
    int max_seq_len = 1;
    for (int s = 0; s < num_seqs; s++) max_seq_len = seq_lens[s] > max_seq_len ? seq_lens[s] : max_seq_len;
    /* A single-token row's KV heads in items of row_heads (each reads its cache rows once for them all). */
    const int row_heads = decode_heads_per_item(num_kv_heads, num_heads / num_kv_heads, head_dim);
    const int row_items = (num_kv_heads + row_heads - 1) / row_heads;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = query_start_loc[s + 1] - query_start_loc[s];
        num_items += q_len == 1 ? row_items : (int64_t)num_kv_heads * ((q_len + TILE_Q - 1) / TILE_Q);
    }
    Item *items = malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    if (items == NULL) return 2;
    int64_t k = 0;
    /* Later tiles see more keys: list them first so the dynamic schedule ends on short ones. */
    for (int s = 0; s < num_seqs; s++) {
        int q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len == 1) {
            for (int j = 0; j < row_items; j++) {
                Item it = {s, j * row_heads, 0, 1};
                items[k++] = it;
            }
            continue;
        }
        for (int begin = ((q_len - 1) / TILE_Q) * TILE_Q; begin >= 0 && q_len > 0; begin -= TILE_Q) {
            for (int h = 0; h < num_kv_heads; h++) {
                Item it = {s, h, begin, begin + TILE_Q < q_len ? begin + TILE_Q : q_len};
                items[k++] = it;
            }
        }
    }
    PrefillRun run = {&a, items, 0, max_seq_len, row_heads};
    pool_for(num_items, 1, prefill_items, &run);
    free(items);
    return atomic_load(&run.failed) ? 2 : 0;
}

static inline void store_row(kv_t *dst, const float *src, int n) {
#if KV_KIND != 0
    for (int d = 0; d < n; d++) dst[d] = kv_from_float(src[d]);
#else
    memcpy(dst, src, sizeof(float) * (size_t)n);
#endif
}

/* Stores each new token's K and V rows (num_kv_heads * head_dim floats) at its slot, as kv_t. */
void KV_NAME(write_kv)(const float *key, const float *value, int64_t key_stride, int64_t value_stride, kv_t *k_cache,
                       kv_t *v_cache, int64_t block_stride, int64_t row_stride, const int64_t *slot_mapping,
                       int num_tokens, int row_elems, int block_size) {
    for (int i = 0; i < num_tokens; i++) {
        int64_t slot = slot_mapping[i];
        int64_t dst = (slot / block_size) * block_stride + (slot % block_size) * row_stride;
        store_row(k_cache + dst, key + (int64_t)i * key_stride, row_elems);
        store_row(v_cache + dst, value + (int64_t)i * value_stride, row_elems);
    }
}
