/*
 * The MLP's activation in one pass (float32): out[t][i] = silu(gate[t][i]) * up[t][i], where
 * gate and up are the two halves of each row of the fused gate|up projection, so the
 * halves are never split into tensors of their own. silu(x) = x / (1 + exp(-x)).
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMS (1 << 17)

/* gate_up: [num_tokens, row_stride] with gate in [0, size) and up in [size, 2 * size); out: [num_tokens, size]. */
void silu_mul_f32(const float *gate_up, int64_t row_stride, float *out, int num_tokens, int size) {
#pragma omp parallel for schedule(static) if ((int64_t)num_tokens * size >= PARALLEL_MIN_ELEMS)
    for (int t = 0; t < num_tokens; t++) {
        const float *gate = gate_up + (int64_t)t * row_stride, *up = gate + size;
        float *dst = out + (int64_t)t * size;
        for (int i = 0; i < size; i++) dst[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}
