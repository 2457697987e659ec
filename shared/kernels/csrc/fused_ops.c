/*
 * Element-wise model ops fused into one pass each (float32, rows may be strided).
 *
 *   rms_norm_f32      out[i] = w * (x[i] * 1/sqrt(mean(x[i]^2) + eps)), one row per token
 *   add_rms_norm_f32  residual[i] += x[i], then out[i] = rms_norm(residual[i]): the residual add of
 *                     one sublayer and the norm of the next in one pass
 *   rope_f32      in place on the q and k heads of each token: x * cos + rotate_half(x) * sin
 *
 * Compiled without fast-math or FMA contraction: RoPE keeps the torch op order
 * (two products rounded, then the sum), so it is bit-identical to the torch
 * formulation; RMSNorm differs from torch only in the order of its sum of squares.
 */
#include <math.h>
#include <stdint.h>

#pragma GCC optimize("no-fast-math", "fp-contract=off")

#define LANES 16
/* Threads only for work worth a fork/join (torch's element-wise grain is similar): a decode
 * step's rows are a few microseconds of work, less than a barrier costs on a busy machine. */
#define PARALLEL_MIN_ELEMS (1 << 17)

static void norm_row(const float *row, const float *weight, float *dst, int size, float eps) {
    float partial[LANES] = {0}; /* independent lanes: vectorizes without reassociating */
    int i = 0;
    for (; i + LANES <= size; i += LANES)
        for (int j = 0; j < LANES; j++) partial[j] += row[i + j] * row[i + j];
    float sum = 0.f;
    for (int j = 0; j < LANES; j++) sum += partial[j];
    for (; i < size; i++) sum += row[i] * row[i];
    const float inv = 1.f / sqrtf(sum / (float)size + eps);
    for (int i = 0; i < size; i++) dst[i] = weight[i] * (row[i] * inv);
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t out_stride,
                  int num_rows, int size, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)num_rows * size >= PARALLEL_MIN_ELEMS)
    for (int r = 0; r < num_rows; r++)
        norm_row(x + (int64_t)r * x_stride, weight, out + (int64_t)r * out_stride, size, eps);
}

void add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                      const float *weight, float *out, int64_t out_stride, int num_rows, int size, float eps) {
#pragma omp parallel for schedule(static) if ((int64_t)num_rows * size >= PARALLEL_MIN_ELEMS)
    for (int r = 0; r < num_rows; r++) {
        const float *src = x + (int64_t)r * x_stride;
        float *row = residual + (int64_t)r * residual_stride;
        for (int i = 0; i < size; i++) row[i] = row[i] + src[i];
        norm_row(row, weight, out + (int64_t)r * out_stride, size, eps);
    }
}

static void rope_head(float *x, const float *cos, const float *sin, int half) {
    for (int d = 0; d < half; d++) {
        const float x1 = x[d], x2 = x[d + half];
        const float a = x1 * cos[d], b = -x2 * sin[d];
        const float c = x2 * cos[d + half], e = x1 * sin[d + half];
        x[d] = a + b;
        x[d + half] = c + e;
    }
}

/* qk: [num_tokens, row_stride]; the first num_heads_total heads of a row (q heads, then k heads) rotate.
 * cos/sin: [num_tokens, head_dim], each token's rows of the tables. */
void rope_f32(float *qk, int64_t row_stride, int num_tokens, int num_heads_total, int head_dim,
              const float *cos_rows, const float *sin_rows) {
#pragma omp parallel for schedule(static) if ((int64_t)num_tokens * num_heads_total * head_dim >= PARALLEL_MIN_ELEMS)
    for (int t = 0; t < num_tokens; t++) {
        const float *cos = cos_rows + (int64_t)t * head_dim, *sin = sin_rows + (int64_t)t * head_dim;
        float *row = qk + (int64_t)t * row_stride;
        for (int h = 0; h < num_heads_total; h++) rope_head(row + (int64_t)h * head_dim, cos, sin, head_dim / 2);
    }
}
