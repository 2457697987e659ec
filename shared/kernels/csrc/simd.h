/* Vector helpers shared by the kernels of this library (AVX-512, and AVX2 where that is what the CPU has). */
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

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Row sums of 8 partial-sum vectors: lane t of the result is the sum of p[t]'s lanes l0..l7, by the same
 * tree for every t, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), so a value does not depend on
 * which lane of the tile it was computed in (hsum8 adds one vector's lanes by the same tree). */
static inline __attribute__((always_inline)) __m256 sum8(const __m256 p[8]) {
    __m256 d[4];
#pragma GCC unroll 8
    for (int i = 0; i < 4; i++) /* lanes 0-3: p[i]'s halves added; lanes 4-7: p[i + 4]'s */
        d[i] = _mm256_add_ps(_mm256_permute2f128_ps(p[i], p[i + 4], 0x20), _mm256_permute2f128_ps(p[i], p[i + 4], 0x31));
    const __m256 e0 = _mm256_add_ps(_mm256_unpacklo_ps(d[0], d[1]), _mm256_unpackhi_ps(d[0], d[1]));
    const __m256 e1 = _mm256_add_ps(_mm256_unpacklo_ps(d[2], d[3]), _mm256_unpackhi_ps(d[2], d[3]));
    return _mm256_add_ps(_mm256_shuffle_ps(e0, e1, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(e0, e1, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* The sum of one vector's lanes by sum8's tree. */
static inline __attribute__((always_inline)) float hsum8(__m256 v) {
    const __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l_j + l_(j+4) */
    const __m128 h = _mm_add_ps(m, _mm_movehl_ps(m, m));                                    /* (m0 + m2), (m1 + m3) */
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* A mask with lanes [0, n) set, for _mm256_maskload_ps. */
static inline __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

#endif
#endif
