/* The element type of the paged KV cache, for the attention kernels compiled once per type: a source
 * defines KV_BF16 (0: float32, 1: bfloat16) before including this. Queries, scores and sums are float32
 * either way; a bfloat16 element widens to float32 exactly (its 16 bits are the float's top half). */
#ifndef CLEAVE_KV_H
#define CLEAVE_KV_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#ifndef KV_BF16
#define KV_BF16 0
#endif

#if KV_BF16
typedef uint16_t kv_t;
#define KV_NAME(name) name##_bf16

static inline float kv_float(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float32 -> bfloat16 conversion does (no NaNs reach the cache). */
static inline uint16_t kv_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 kv_load16(const kv_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) __m256 kv_load8(const kv_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#else
typedef float kv_t;
#define KV_NAME(name) name##_f32
static inline float kv_float(float x) { return x; }
static inline float kv_from_float(float f) { return f; }
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 kv_load16(const kv_t *p) { return _mm512_loadu_ps(p); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) __m256 kv_load8(const kv_t *p) { return _mm256_loadu_ps(p); }
#endif
#endif

#define KV_LINE ((int)(64 / sizeof(kv_t))) /* elements of one cache line */
#endif
