/*
 * Paged decode attention on the CPU: one new query token per sequence attends
 * to its whole context, read straight from the paged KV cache (no gather copy).
 *
 * Layouts (element strides given by the caller, float32):
 *   q, out        [num_seqs, num_heads, head_dim], contiguous
 *   k/v cache     a layer's view [num_blocks, block_size, num_kv_heads, head_dim];
 *                 block_stride between blocks, rows of num_kv_heads * head_dim
 *   block_tables  [num_seqs, bt_stride] int32
 *   seq_lens      [num_seqs] int32
 * The query heads of one KV head (GQA group) share every K/V row read.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void one_head(const float *q, float *out, const float *k_cache, const float *v_cache, int64_t block_stride,
                     int64_t row_stride, const int32_t *block_table, int seq_len, int kv_head, int group,
                     int head_dim, int block_size, float scale, float *scores) {
    /* scores: [group, seq_len] scratch. Pass 1: q.k and the row maxima, block by block. */
    float maxima[MAX_GROUP];
    for (int g = 0; g < group; g++) maxima[g] = -FLT_MAX;
    int num_blocks = (seq_len + block_size - 1) / block_size;
    for (int b = 0; b < num_blocks; b++) {
        const float *base = k_cache + (int64_t)block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        for (int i = 0; i < n; i++) {
            const float *k = base + (int64_t)i * row_stride;
            int t = b * block_size + i;
            for (int g = 0; g < group; g++) {
                float s = dot(q + (int64_t)g * head_dim, k, head_dim) * scale;
                scores[(int64_t)g * seq_len + t] = s;
                maxima[g] = s > maxima[g] ? s : maxima[g];
            }
        }
    }
    /* Pass 2: softmax weights. */
    float sums[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *row = scores + (int64_t)g * seq_len;
        float m = maxima[g], sum = 0.f;
        for (int t = 0; t < seq_len; t++) row[t] = expf(row[t] - m);
        for (int t = 0; t < seq_len; t++) sum += row[t];
        sums[g] = sum;
    }
    /* Pass 3: weighted sum of V rows. */
    float acc[MAX_GROUP * MAX_HEAD_DIM];
    memset(acc, 0, sizeof(float) * (size_t)group * (size_t)head_dim);
    for (int b = 0; b < num_blocks; b++) {
        const float *base = v_cache + (int64_t)block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        int n = seq_len - b * block_size < block_size ? seq_len - b * block_size : block_size;
        for (int i = 0; i < n; i++) {
            const float *v = base + (int64_t)i * row_stride;
            int t = b * block_size + i;
            for (int g = 0; g < group; g++) {
                float w = scores[(int64_t)g * seq_len + t];
                float *a = acc + g * head_dim;
                for (int d = 0; d < head_dim; d++) a[d] += w * v[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = 1.f / sums[g];
        for (int d = 0; d < head_dim; d++) out[(int64_t)g * head_dim + d] = acc[g * head_dim + d] * inv;
    }
}

/* Returns 0 on success, 1 if the shapes are outside what this kernel handles. */
int paged_decode_f32(const float *q, float *out, const float *k_cache, const float *v_cache, int64_t block_stride,
                     int64_t row_stride, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int max_seq_len) {
    int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads) return 1;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)group * (size_t)(max_seq_len > 0 ? max_seq_len : 1));
        if (scores == NULL) failed = 1;
#pragma omp for collapse(2) schedule(dynamic, 4)
        for (int s = 0; s < num_seqs; s++) {
            for (int h = 0; h < num_kv_heads; h++) {
                if (scores == NULL) continue;
                int64_t offset = ((int64_t)s * num_heads + (int64_t)h * group) * head_dim;
                one_head(q + offset, out + offset, k_cache, v_cache, block_stride, row_stride,
                         block_tables + (int64_t)s * bt_stride, seq_lens[s], h, group, head_dim, block_size, scale,
                         scores);
            }
        }
        free(scores);
    }
    return failed ? 2 : 0;
}
