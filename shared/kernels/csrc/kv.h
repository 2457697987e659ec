/* The element type of the paged KV cache, for the attention kernels compiled once per type: a source defines
 * KV_KIND before including this (0: float32, 1: bfloat16, 2: float8 e4m3fn, 3: float8 e5m2). Queries, scores and
 * sums are float32 whatever the cache holds; an element widens to float32 exactly, a new one is rounded to
 * nearest even as torch's conversion rounds it (the float8 kinds saturating at their largest finite value). */
#ifndef CLEAVE_KV_H
#define CLEAVE_KV_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#ifndef KV_KIND
#define KV_KIND 0
#endif

static inline float kv_bits_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if KV_KIND == 1
typedef uint16_t kv_t;
#define KV_NAME(name) name##_bf16

static inline float kv_float(uint16_t x) { return kv_bits_float((uint32_t)x << 16); }

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

#elif KV_KIND == 2 || KV_KIND == 3
/* float8: a sign, 4 (e4m3) or 5 (e5m2) exponent bits of bias FP8_BIAS, FP8_MANT mantissa bits; subnormals, no infinities
 * written (e4m3fn has none; e5m2's are never stored, as nothing beyond FP8_MAX_CODE is). */
typedef uint8_t kv_t;
#if KV_KIND == 2
#define KV_NAME(name) name##_e4m3
#define FP8_MANT 3
#define FP8_BIAS 7
#define FP8_MAX_CODE 0x7Eu /* 448 */
#else
#define KV_NAME(name) name##_e5m2
#define FP8_MANT 2
#define FP8_BIAS 15
#define FP8_MAX_CODE 0x7Bu /* 57344 */
#endif

/* A code's value, computed: exact in float32 (a subnormal is m units of 2^(1 - bias - mantissa bits)). */
static inline float kv_fp8_value(uint8_t x) {
    const uint32_t sign = (uint32_t)(x & 0x80u) << 24, e = (x & 0x7Fu) >> FP8_MANT, m = x & ((1u << FP8_MANT) - 1);
    if (e == 0) {
        const float v = (float)m * kv_bits_float((uint32_t)(127 + 1 - FP8_BIAS - FP8_MANT) << 23);
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        return kv_bits_float(bits | sign);
    }
    return kv_bits_float(sign | (e + 127 - FP8_BIAS) << 23 | m << (23 - FP8_MANT));
}

/* Every code's value, filled as the library loads (the scalar paths, such as the prefill kernel's transposed keys,
 * read a code with one load). */
static float kv_fp8_values[256];
__attribute__((constructor)) static void kv_fp8_fill(void) {
    for (int i = 0; i < 256; i++) kv_fp8_values[i] = kv_fp8_value((uint8_t)i);
}

static inline float kv_float(uint8_t x) { return kv_fp8_values[x]; }

/* Round to nearest even (ties to the even code), saturating at +-FP8_MAX_CODE: for every finite float the code
 * torch's float32 -> float8 conversion gives after a clamp to the format's range (no NaNs reach the cache).
 * Without branches, so that the KV write's loop over a row vectorizes. */
static inline uint8_t kv_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, e = (bits >> 23) & 0xFFu, mant = bits & 0x7FFFFFu;
    const int normal = e >= 128 - FP8_BIAS;
    /* normal (or beyond the range, which the final minimum saturates): the top mantissa bits under the exponent */
    const uint32_t n_code = (e - (127 - FP8_BIAS)) << FP8_MANT | mant >> (23 - FP8_MANT);
    const uint32_t n_rest = mant & ((1u << (23 - FP8_MANT)) - 1);
    /* subnormal, or zero: the value in units of the smallest subnormal; from a shift of 25 on, below half of one */
    const uint32_t full = e ? mant | 0x800000u : mant;
    const uint32_t shift = normal ? 25u : (151 - FP8_BIAS - FP8_MANT - e < 25u ? 151 - FP8_BIAS - FP8_MANT - e : 25u);
    const uint32_t s_code = full >> shift, s_rest = full & ((1u << shift) - 1);
    uint32_t code = normal ? n_code : s_code;
    const uint32_t rest = normal ? n_rest : s_rest, half = normal ? 1u << (22 - FP8_MANT) : 1u << (shift - 1);
    code += rest > half || (rest == half && (code & 1u));
    return (uint8_t)(sign | (code > FP8_MAX_CODE ? FP8_MAX_CODE : code));
}

/* The codes as float16 bits (exact: float16 has more exponent and mantissa bits), which read as the values
 * divided by KV_RAW_SCALE (a power of two). */
#if KV_KIND == 2 /* e4m3's seven bits shifted under float16's sign; its bias 7 against float16's 15: times 2^8 */
#define KV_RAW_SCALE 256.f
#define KV_F16_256(v) _mm256_and_si256(_mm256_slli_epi16(v, 7), _mm256_set1_epi16((short)0xBF80))
#define KV_F16_128(v) _mm_and_si128(_mm_slli_epi16(v, 7), _mm_set1_epi16((short)0xBF80))
#else /* e5m2 is float16's top byte */
#define KV_RAW_SCALE 1.f
#define KV_F16_256(v) _mm256_slli_epi16(v, 8)
#define KV_F16_128(v) _mm_slli_epi16(v, 8)
#endif

#if defined(__AVX512F__)
/* 16 values divided by KV_RAW_SCALE (exact), for a caller that multiplies it back into a factor it applies
 * anyway. */
static inline __attribute__((always_inline)) __m512 kv_load16_raw(const kv_t *p) {
    /* sign-extended: a negative code's high byte is all ones, cleared by e4m3's mask below the sign bit */
    return _mm512_cvtph_ps(KV_F16_256(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p))));
}
static inline __attribute__((always_inline)) __m512 kv_load16(const kv_t *p) {
    const __m512 x = kv_load16_raw(p);
    return KV_RAW_SCALE == 1.f ? x : _mm512_mul_ps(x, _mm512_set1_ps(KV_RAW_SCALE));
}
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __attribute__((always_inline)) __m256 kv_load8(const kv_t *p) {
    const __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m256 x = _mm256_cvtph_ps(KV_F16_128(v));
    return KV_RAW_SCALE == 1.f ? x : _mm256_mul_ps(x, _mm256_set1_ps(KV_RAW_SCALE));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __attribute__((always_inline)) __m256 kv_load8(const kv_t *p) {
    return _mm256_setr_ps(kv_float(p[0]), kv_float(p[1]), kv_float(p[2]), kv_float(p[3]), kv_float(p[4]),
                          kv_float(p[5]), kv_float(p[6]), kv_float(p[7]));
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

#if KV_KIND < 2 /* float32 and bfloat16 widen to their values as they are */
#define KV_RAW_SCALE 1.f
#if defined(__AVX512F__)
#define kv_load16_raw kv_load16
#endif
#endif

#define KV_LINE ((int)(64 / sizeof(kv_t))) /* elements of one cache line */
#endif
