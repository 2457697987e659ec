/* AVX-512 helpers shared by the kernels of this library. */
#ifndef CLEAVE_SIMD_H
#define CLEAVE_SIMD_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* Row sums of 16 partial-sum vectors: lane t of the result is the sum of p[t]'s lanes, by the same add
 * tree for every t (so a value does not depend on which lane of the tile it was computed in). */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 p[16]) {
    __m512 a[8], b[4], c[2];
#pragma GCC unroll 16
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [x, y, x, y], partial over pairs */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
#pragma GCC unroll 16
    for (int i = 0; i < 4; i++) /* per lane: [k0, k1, k2, k3] of four vectors, partial over lanes */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
#pragma GCC unroll 16
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#endif
#endif
