/*
 * A linear layer's product y[M, N] = x[M, K] . w[N, K]^T from a bfloat16 copy of weights that are bfloat16
 * values (a bfloat16 checkpoint computed in float32): x's rows are rounded to bfloat16 (as a bfloat16
 * model's activations are), the products are summed in float32, and y is float32. On AMX where the CPU has
 * it and the kernel grants it (the tile unit), else with AVX512-BF16's pairwise dot products (Zen 4, Cooper
 * Lake): either way the weights are read at half their float32 bytes, and each instruction does twice the
 * multiply-adds of a float32 FMA.
 *
 * The weights are packed once (linear_amx_pack): per 16 output columns and 32 values of k, one B tile of
 * 16 rows x 64 bytes, row r holding the pairs (w[n][k0 + 2r], w[n][k0 + 2r + 1]) of its 16 columns (the
 * tile unit's pairwise layout); N and K are padded with zeros to multiples of 32. Per call, x is rounded
 * into a bfloat16 copy padded likewise (zero rows past M, zero columns past K), and threads split the
 * column pairs, in groups of up to PAIR_GROUP: per group, per 32 rows of x, per pair, four C tiles of
 * 16 x 16 sums, each k step two A tiles and two B tiles (per 16 rows for the last ones).
 *
 * Every output is the same sequence of tile products whatever M or the thread, so a row's result does
 * not depend on the rows around it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define WITH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

#define TILE_K 32 /* bfloat16 values of k per tile row: 64 bytes */
#define TILE_N 16

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

/* 1 where the tile unit runs: built with AMX, and the kernel grants this process the tile state (Linux
 * asks each process to request it before its first tile instruction). */
static int tiles_granted(void) {
#if defined(WITH_AMX)
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}

/* 1: built with AVX512-BF16, so linear_amx runs (on the tile unit where tiles_granted, else on vectors). */
int linear_amx_available(void) { return 1; }

/* 1 where linear_amx runs on the tile unit, 0 on vectors. */
int linear_amx_tiles(void) { return tiles_granted(); }

/* uint16 elements of the packed copy of a [n, k] weight. */
int64_t linear_amx_packed_elems(int n, int k) { return round_up(n, 2 * TILE_N) * round_up(k, TILE_K); }

static uint16_t to_bf16(float f) { /* round to nearest even; the kernel never sees NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

void linear_amx_pack(const float *w, int n, int k, uint16_t *packed) {
    const int64_t kp = round_up(k, TILE_K), tiles_k = kp / TILE_K, np = round_up(n, 2 * TILE_N);
    for (int64_t nt = 0; nt < np / TILE_N; nt++)
        for (int64_t kt = 0; kt < tiles_k; kt++) {
            uint16_t *tile = packed + (nt * tiles_k + kt) * (TILE_K * TILE_N);
            for (int r = 0; r < TILE_K / 2; r++)
                for (int c = 0; c < TILE_N; c++)
                    for (int p = 0; p < 2; p++) {
                        const int64_t col = nt * TILE_N + c, kk = kt * TILE_K + 2 * r + p;
                        tile[(r * TILE_N + c) * 2 + p] = col < n && kk < k ? to_bf16(w[col * k + kk]) : 0;
                    }
        }
}

/* out[0 .. k) = the float32 values of column col of a packed copy (exact: they are bfloat16 values). */
static void unpack_column(const uint16_t *packed, int64_t tiles_k, int64_t col, int k, float *out) {
    const uint16_t *tiles = packed + (col / TILE_N) * tiles_k * (TILE_K * TILE_N) + (col % TILE_N) * 2;
    for (int64_t kk = 0; kk < k; kk++) {
        const int64_t kt = kk / TILE_K, r = (kk % TILE_K) / 2, p = kk % 2;
        const uint32_t bits = (uint32_t)tiles[kt * (TILE_K * TILE_N) + r * TILE_N * 2 + p] << 16;
        memcpy(&out[kk], &bits, sizeof bits);
    }
}

/* w[n, k] from its packed copy (linear_amx_pack's inverse), for a weight held only as its copy where a
 * caller needs it whole. */
void linear_amx_unpack(const uint16_t *packed, int n, int k, float *w) {
    const int64_t tiles_k = round_up(k, TILE_K) / TILE_K;
    for (int64_t col = 0; col < n; col++) unpack_column(packed, tiles_k, col, k, w + col * k);
}

/* out[i] = w[ids[i]] (rows of k values) from w's packed copy: the embedding lookup of a table held only as its
 * copy. Returns the first i whose id is outside [0, n), or -1 (as gather_rows_f32). */
int64_t linear_amx_rows(const uint16_t *packed, int n, int k, const int64_t *ids, int64_t count, float *out) {
    const int64_t tiles_k = round_up(k, TILE_K) / TILE_K;
    for (int64_t i = 0; i < count; i++) {
        if (ids[i] < 0 || ids[i] >= n) return i;
        unpack_column(packed, tiles_k, ids[i], k, out + i * k);
    }
    return -1;
}

typedef struct {
    const uint16_t *xb, *packed;
    float *y;
    int64_t ldy, kp;
    int m, n;
} AmxArgs;

#if defined(WITH_AMX)
typedef struct __attribute__((packed)) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static void load_tile_config(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) { /* 0-3: sums (16 x 16 float); 4, 5: x; 6, 7: weights */
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* y's rows [m0, m0 + 16) x columns [n0, n0 + 16 * tiles) from C tiles 0 .. tiles - 1 (tiles 2 and 3, if
 * any, the next 16 rows): a tile that lies wholly inside y is stored there directly, the rest through
 * ``sums`` (masked vector stores: a call to memcpy per row cost the tile unit more time than its products). */
static void store_tiles(const AmxArgs *a, float (*sums)[16][16], int m0, int n0, int tiles) {
    for (int t = 0; t < tiles; t++) {
        const int r0 = m0 + (t / 2) * 16, c0 = n0 + (t % 2) * TILE_N;
        const int rows = a->m - r0 < 16 ? a->m - r0 : 16, cols = a->n - c0 < TILE_N ? a->n - c0 : TILE_N;
        if (rows <= 0 || cols <= 0) continue;
        float *dst = a->y + (int64_t)r0 * a->ldy + c0;
        if (rows == 16 && cols == TILE_N) {
            switch (t) { /* the tile's number is an immediate */
            case 0: _tile_stored(0, dst, a->ldy * 4); break;
            case 1: _tile_stored(1, dst, a->ldy * 4); break;
            case 2: _tile_stored(2, dst, a->ldy * 4); break;
            default: _tile_stored(3, dst, a->ldy * 4); break;
            }
            continue;
        }
        switch (t) {
        case 0: _tile_stored(0, sums[0], 64); break;
        case 1: _tile_stored(1, sums[1], 64); break;
        case 2: _tile_stored(2, sums[2], 64); break;
        default: _tile_stored(3, sums[3], 64); break;
        }
        const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps(dst + (int64_t)r * a->ldy, mask, _mm512_loadu_ps(sums[t][r]));
    }
}

/* Column pairs per group: a group's weight tiles (192 KB at k = 384) stay in L2 while every row of x goes
 * through them, and a row's sums are stored 1 KB at a time; one pair at a time over every row stored each
 * row's 128 bytes a whole row of y apart (a vocabulary-wide LM head ran at under half the tile unit's rate).
 * The order of the tile products for each sum is the same whatever the group. */
#define PAIR_GROUP 8

/* Column pairs [p0, p1): 32 columns each, a group of pairs at a time, every row of x: 32 rows at a time
 * (four C tiles: each weight tile loaded serves two row tiles), then the last 16 rows if any (two C tiles). */
static void amx_pairs(void *p, int64_t p0, int64_t p1) {
    const AmxArgs *a = p;
    const int64_t tiles_k = a->kp / TILE_K, tile_elems = TILE_K * TILE_N, x_stride = a->kp * 2;
    float sums[4][16][16];
    load_tile_config();
    for (int64_t g0 = p0; g0 < p1; g0 += PAIR_GROUP) {
        const int64_t g1 = g0 + PAIR_GROUP < p1 ? g0 + PAIR_GROUP : p1;
        int m0 = 0;
        for (; m0 + 16 < a->m; m0 += 32) { /* two row tiles (the second may be partly padding) */
            const uint16_t *x0 = a->xb + (int64_t)m0 * a->kp, *x1 = x0 + 16 * a->kp;
            for (int64_t pair = g0; pair < g1; pair++) {
                const uint16_t *b0 = a->packed + (2 * pair) * tiles_k * tile_elems, *b1 = b0 + tiles_k * tile_elems;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t kt = 0; kt < tiles_k; kt++) {
                    _tile_loadd(4, x0 + kt * TILE_K, x_stride);
                    _tile_loadd(5, x1 + kt * TILE_K, x_stride);
                    _tile_loadd(6, b0 + kt * tile_elems, 64);
                    _tile_loadd(7, b1 + kt * tile_elems, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                store_tiles(a, sums, m0, (int)(pair * 2 * TILE_N), 4);
            }
        }
        if (m0 < a->m) { /* the last 1-16 rows */
            const uint16_t *x0 = a->xb + (int64_t)m0 * a->kp;
            for (int64_t pair = g0; pair < g1; pair++) {
                const uint16_t *b0 = a->packed + (2 * pair) * tiles_k * tile_elems, *b1 = b0 + tiles_k * tile_elems;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t kt = 0; kt < tiles_k; kt++) {
                    _tile_loadd(4, x0 + kt * TILE_K, x_stride);
                    _tile_loadd(6, b0 + kt * tile_elems, 64);
                    _tile_loadd(7, b1 + kt * tile_elems, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
                store_tiles(a, sums, m0, (int)(pair * 2 * TILE_N), 2);
            }
        }
    }
    _tile_release();
}

#endif /* WITH_AMX */

#define DP_ROWS 6        /* a tile's rows: 6 x 4 sums + 4 weight vectors + 1 broadcast <= 32 registers */
#define DP_BLOCK_TILES 4 /* column tiles of 16 per block: 64 columns */

/* y[r][c] for r < rows <= R, c < cols (<= 16 * tiles, tiles <= 4) from the column tiles at b, tile_elems
 * apart, over every pair of k (kp / 2); missing rows repeat the last real one (not stored). */
static inline __attribute__((always_inline)) void dp_tile(const int R, const uint16_t *xb, int64_t kp,
                                                          const uint16_t *b, int64_t tile_elems, int tiles,
                                                          float *y, int64_t ldy, int rows, int cols) {
    const uint16_t *xr[DP_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) xr[r] = xb + (int64_t)(r < rows ? r : rows - 1) * kp;
    const uint16_t *bt[DP_BLOCK_TILES];
#pragma GCC unroll 4
    for (int t = 0; t < DP_BLOCK_TILES; t++) bt[t] = b + (t < tiles ? t : tiles - 1) * tile_elems;
    __m512 acc[DP_ROWS][DP_BLOCK_TILES];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < DP_BLOCK_TILES; t++) acc[r][t] = _mm512_setzero_ps();
    const int64_t pairs = kp / 2;
    for (int64_t j = 0; j < pairs; j++) {
        __m512bh w[DP_BLOCK_TILES];
#pragma GCC unroll 4
        for (int t = 0; t < DP_BLOCK_TILES; t++) w[t] = (__m512bh)_mm512_load_si512((const void *)(bt[t] + j * 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            /* the row's pair (2j, 2j + 1) in every lane: one 32-bit load (alias-safe), broadcast */
            const __m512bh xv = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(xr[r] + 2 * j));
#pragma GCC unroll 4
            for (int t = 0; t < DP_BLOCK_TILES; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv, w[t]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        if (r >= rows) break;
#pragma GCC unroll 4
        for (int t = 0; t < DP_BLOCK_TILES; t++) {
            const int left = cols - 16 * t;
            if (left <= 0) break;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            _mm512_mask_storeu_ps(y + (int64_t)r * ldy + 16 * t, mask, acc[r][t]);
        }
    }
}

static void dp_tile_6(const uint16_t *xb, int64_t kp, const uint16_t *b, int64_t tile_elems, int tiles, float *y,
                      int64_t ldy, int rows, int cols) {
    dp_tile(DP_ROWS, xb, kp, b, tile_elems, tiles, y, ldy, rows, cols);
}
static void dp_tile_4(const uint16_t *xb, int64_t kp, const uint16_t *b, int64_t tile_elems, int tiles, float *y,
                      int64_t ldy, int rows, int cols) {
    dp_tile(4, xb, kp, b, tile_elems, tiles, y, ldy, rows, cols);
}
static void dp_tile_2(const uint16_t *xb, int64_t kp, const uint16_t *b, int64_t tile_elems, int tiles, float *y,
                      int64_t ldy, int rows, int cols) {
    dp_tile(2, xb, kp, b, tile_elems, tiles, y, ldy, rows, cols);
}
static void dp_tile_1(const uint16_t *xb, int64_t kp, const uint16_t *b, int64_t tile_elems, int tiles, float *y,
                      int64_t ldy, int rows, int cols) {
    dp_tile(1, xb, kp, b, tile_elems, tiles, y, ldy, rows, cols);
}

/* Column blocks [b0, b1), every row: tiles of DP_ROWS rows, then the last 1-5 rows in one tile of 6, 4, 2
 * or 1 rows (where it has more rows than are left, one repeats: not stored). */
static void dp_blocks(void *p, int64_t b0, int64_t b1) {
    const AmxArgs *a = p;
    const int64_t tile_elems = a->kp * TILE_N, column_tiles = round_up(a->n, 2 * TILE_N) / TILE_N;
    for (int64_t blk = b0; blk < b1; blk++) {
        const int64_t t0 = blk * DP_BLOCK_TILES;
        const int tiles = column_tiles - t0 < DP_BLOCK_TILES ? (int)(column_tiles - t0) : DP_BLOCK_TILES;
        const int n0 = (int)(t0 * TILE_N), cols = a->n - n0 < 16 * tiles ? a->n - n0 : 16 * tiles;
        const uint16_t *b = a->packed + t0 * tile_elems;
        int r0 = 0;
        for (; r0 + DP_ROWS <= a->m; r0 += DP_ROWS)
            dp_tile_6(a->xb + (int64_t)r0 * a->kp, a->kp, b, tile_elems, tiles, a->y + (int64_t)r0 * a->ldy + n0,
                      a->ldy, DP_ROWS, cols);
        const int left = a->m - r0;
        if (left == 0) continue;
        float *y = a->y + (int64_t)r0 * a->ldy + n0;
        const uint16_t *x = a->xb + (int64_t)r0 * a->kp;
        if (left > 4)
            dp_tile_6(x, a->kp, b, tile_elems, tiles, y, a->ldy, left, cols);
        else if (left > 2)
            dp_tile_4(x, a->kp, b, tile_elems, tiles, y, a->ldy, left, cols);
        else if (left == 2)
            dp_tile_2(x, a->kp, b, tile_elems, tiles, y, a->ldy, left, cols);
        else
            dp_tile_1(x, a->kp, b, tile_elems, tiles, y, a->ldy, left, cols);
    }
}

static __thread uint16_t *x_copy;
static __thread int64_t x_copy_elems;

/* y (row stride ldy) = x (row stride ldx) . w^T from w's packed copy; 0, or -1 where x's bfloat16 copy
 * could not be allocated (y untouched). */
int linear_amx(const float *x, int64_t ldx, const uint16_t *packed, float *y, int64_t ldy, int m, int n, int k) {
    if (m <= 0 || n <= 0) return 0;
    const int tiles = tiles_granted();
    /* the tile unit reads rows 32 at a time (the padding rows zeros); the vectors read only x's rows */
    const int64_t kp = round_up(k, TILE_K), mp = tiles ? round_up(m, 32) : m, need = mp * kp;
    if (need > x_copy_elems) {
        uint16_t *grown = aligned_alloc(64, (size_t)round_up(need * 2, 64));
        if (grown == NULL) return -1;
        free(x_copy);
        x_copy = grown, x_copy_elems = need;
    }
    for (int64_t r = 0; r < mp; r++) {
        uint16_t *row = x_copy + r * kp;
        int64_t kk = 0;
        if (r < m) {
            const float *xr = x + r * ldx;
            for (; kk + 32 <= k; kk += 32) {
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + kk + 16), _mm512_loadu_ps(xr + kk));
                _mm512_storeu_si512((void *)(row + kk), (__m512i)v);
            }
            for (; kk < k; kk++) row[kk] = to_bf16(xr[kk]);
        }
        memset(row + kk, 0, sizeof(uint16_t) * (size_t)(kp - kk));
    }
    AmxArgs a = {x_copy, packed, y, ldy, kp, m, n};
    const int one_thread = (int64_t)m * n * k < 262144; /* too little work to wake a helper for */
    if (!tiles) {
        const int64_t blocks = (round_up(n, 2 * TILE_N) / TILE_N + DP_BLOCK_TILES - 1) / DP_BLOCK_TILES;
        if (one_thread)
            dp_blocks(&a, 0, blocks);
        else
            pool_for(blocks, 1, dp_blocks, &a);
        return 0;
    }
#if defined(WITH_AMX)
    const int64_t pairs = round_up(n, 2 * TILE_N) / (2 * TILE_N);
    if (one_thread) {
        amx_pairs(&a, 0, pairs);
    } else { /* threads take whole groups where there are enough to go round (8 chunks or more) */
        const int64_t grain = pairs / 8 < 1 ? 1 : pairs / 8 > PAIR_GROUP ? PAIR_GROUP : pairs / 8;
        pool_for(pairs, grain, amx_pairs, &a);
    }
#endif
    return 0;
}

#else /* no AVX512-BF16 in this build (nothing is ever packed for it): callers keep the float32 kernels */

int linear_amx_available(void) { return 0; }
int linear_amx_tiles(void) { return 0; }
int linear_amx(const float *x, int64_t ldx, const uint16_t *packed, float *y, int64_t ldy, int m, int n, int k) {
    (void)x, (void)ldx, (void)packed, (void)y, (void)ldy, (void)m, (void)n, (void)k;
    return -1;
}

#endif
