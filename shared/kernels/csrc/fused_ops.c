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
#include <stddef.h>
#include <stdint.h>

#include "pool.h"

#pragma GCC optimize("no-fast-math", "fp-contract=off")

#define LANES 16

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

typedef struct {
    const float *x, *weight;
    float *residual, *out;
    int64_t x_stride, residual_stride, out_stride;
    int size;
    float eps;
} NormArgs;

static void norm_rows(void *p, int64_t r0, int64_t r1) {
    const NormArgs *a = p;
    for (int64_t r = r0; r < r1; r++) norm_row(a->x + r * a->x_stride, a->weight, a->out + r * a->out_stride, a->size, a->eps);
}

static void add_norm_rows(void *p, int64_t r0, int64_t r1) {
    const NormArgs *a = p;
    for (int64_t r = r0; r < r1; r++) {
        const float *src = a->x + r * a->x_stride;
        float *row = a->residual + r * a->residual_stride;
        for (int i = 0; i < a->size; i++) row[i] = row[i] + src[i];
        norm_row(row, a->weight, a->out + r * a->out_stride, a->size, a->eps);
    }
}

void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t out_stride,
                  int num_rows, int size, float eps) {
    NormArgs a = {x, weight, NULL, out, x_stride, 0, out_stride, size, eps};
    pool_rows(num_rows, size, norm_rows, &a);
}

void add_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t residual_stride,
                      const float *weight, float *out, int64_t out_stride, int num_rows, int size, float eps) {
    NormArgs a = {x, weight, residual, out, x_stride, residual_stride, out_stride, size, eps};
    pool_rows(num_rows, size, add_norm_rows, &a);
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

typedef struct {
    float *qk;
    const float *cos_rows, *sin_rows;
    int64_t row_stride;
    int num_heads_total, head_dim;
} RopeArgs;

static void rope_rows(void *p, int64_t t0, int64_t t1) {
    const RopeArgs *a = p;
    for (int64_t t = t0; t < t1; t++) {
        const float *cos = a->cos_rows + t * a->head_dim, *sin = a->sin_rows + t * a->head_dim;
        float *row = a->qk + t * a->row_stride;
        for (int h = 0; h < a->num_heads_total; h++) rope_head(row + (int64_t)h * a->head_dim, cos, sin, a->head_dim / 2);
    }
}

/* qk: [num_tokens, row_stride]; the first num_heads_total heads of a row (q heads, then k heads) rotate.
 * cos/sin: [num_tokens, head_dim], each token's rows of the tables. */
void rope_f32(float *qk, int64_t row_stride, int num_tokens, int num_heads_total, int head_dim,
              const float *cos_rows, const float *sin_rows) {
    RopeArgs a = {qk, cos_rows, sin_rows, row_stride, num_heads_total, head_dim};
    pool_rows(num_tokens, (int64_t)num_heads_total * head_dim, rope_rows, &a);
}
