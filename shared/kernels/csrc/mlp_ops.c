/*
 * The MLP's activation in one pass (float32): out[t][i] = silu(gate[t][i]) * up[t][i], where
 * gate and up are the two halves of each row of the fused gate|up projection, so the
 * halves are never split into tensors of their own. silu(x) = x / (1 + exp(-x)).
 */
#include <math.h>
#include <stdint.h>

#include "pool.h"

typedef struct {
    const float *gate_up;
    float *out;
    int64_t row_stride;
    int size;
} SiluArgs;

static void silu_rows(void *p, int64_t t0, int64_t t1) {
    const SiluArgs *a = p;
    for (int64_t t = t0; t < t1; t++) {
        const float *gate = a->gate_up + t * a->row_stride, *up = gate + a->size;
        float *dst = a->out + t * a->size;
        for (int i = 0; i < a->size; i++) dst[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}

/* gate_up: [num_tokens, row_stride] with gate in [0, size) and up in [size, 2 * size); out: [num_tokens, size]. */
void silu_mul_f32(const float *gate_up, int64_t row_stride, float *out, int num_tokens, int size) {
    SiluArgs a = {gate_up, out, row_stride, size};
    pool_rows(num_tokens, size, silu_rows, &a);
}
