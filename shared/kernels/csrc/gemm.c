/*
 * A linear layer's product, y[M, N] = x[M, K] . w[N, K]^T in float32.
 *
 * With AVX-512, on a packed copy of the weights (linear_f32_pack: panels of 32 columns, each stored
 * k-major, [K][32]): tiles of R rows x 64 columns (two panels) keep R x 4 vectors of sums in registers;
 * per k, four vectors of the panels and R broadcast values of x give 4R FMAs, and the sums are the
 * outputs themselves, stored once at the end. Every output is one FMA chain over k = 0, 1, ... K - 1
 * from zero, whatever M, N, the tile or the thread, so a row's result does not depend on the other
 * rows of the batch (a request's tokens do not change with who else is in the step), and the model's
 * Python path and its one-call forward (llama_forward.c), which both come here, agree bit for bit.
 *
 * On the weights as the model holds them (linear_f32, no packed copy; what AVX2 builds and callers
 * without a packed copy use): tiles of R rows x C columns that take dot products along k. With
 * AVX-512, R * C = 16 (4 x 4, 2 x 8, 1 x 16): per 16 values of k, R rows of x and C rows of w are
 * loaded once and give 16 lane-wise FMAs, and a tile's 16 partial-sum vectors are reduced together in
 * one add tree; with AVX2 and FMA (16 registers of 8 lanes), tiles of 3 x 4, 2 x 4 and 1 x 8, in column
 * blocks that stay in L1. Each is likewise the same sequence of operations for every output (16 or 8
 * lanes accumulate k = lane, lane + 16 or 8, ... in order, then one fixed tree adds the lanes); the
 * three are consistent each with itself, not with one another.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include "pool.h"
#include "simd.h"

#define COLUMN_BLOCK 64 /* columns of w a thread keeps in its caches while it walks down the rows of x */

/* acc[r * C + c] += x_r[kk ..] * w_c[kk ..] lane-wise, for the 16 values of k from kk (the lanes outside
 * ``live`` load zeros and add exact zeros). Each vector is loaded once, into a register: not repeated as
 * a memory operand of every FMA that uses it. */
static inline __attribute__((always_inline)) void k_step(const int R, const int C, const float *const *xr,
                                                         const float *const *wc, int kk, __mmask16 live,
                                                         __m512 *acc) {
    __m512 xv[4], wv[16];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        xv[r] = _mm512_maskz_loadu_ps(live, xr[r] + kk);
        __asm__("" : "+v"(xv[r]));
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) {
        wv[c] = _mm512_maskz_loadu_ps(live, wc[c] + kk);
        __asm__("" : "+v"(wv[c]));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 16
        for (int c = 0; c < C; c++) acc[r * C + c] = _mm512_fmadd_ps(xv[r], wv[c], acc[r * C + c]);
}

/* y[r][c] for r < rows <= R, c < cols <= C; missing rows and columns repeat the last real one (their
 * results are not stored), so every tile runs the same instructions. */
static inline __attribute__((always_inline)) void tile(const int R, const int C, const float *x, int64_t ldx,
                                                       const float *w, int64_t ldw, float *y, int64_t ldy,
                                                       int rows, int cols, int k) {
    const float *xr[4], *wc[16];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) xr[r] = x + (int64_t)(r < rows ? r : rows - 1) * ldx;
#pragma GCC unroll 16
    for (int c = 0; c < C; c++) wc[c] = w + (int64_t)(c < cols ? c : cols - 1) * ldw;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int kk = 0;
    for (; kk + 16 <= k; kk += 16) k_step(R, C, xr, wc, kk, (__mmask16)0xFFFF, acc);
    if (kk < k) k_step(R, C, xr, wc, kk, (__mmask16)((1u << (k - kk)) - 1u), acc); /* the last k % 16 */
    const __m512 s = sum16(acc); /* lane r * C + c is y[r][c] */
    const __mmask16 row_mask = (__mmask16)((1u << cols) - 1u);
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) /* lanes r*C .. r*C + cols - 1 land on y[r][0 .. cols) */
        _mm512_mask_storeu_ps(y + (int64_t)r * ldy - r * C, (__mmask16)(row_mask << (r * C)), s);
}

/* The tiles (rows x columns): tallest first, then 2 rows and 1 row; and the columns of a thread's block. */
#define TILE_A_ROWS 4
#define TILE_A_COLS 4
#define TILE_B_COLS 8
#define TILE_ROW_COLS 16
static int block_columns(int k) {
    (void)k;
    return COLUMN_BLOCK;
}
#define NATIVE_LINEAR 1

/* The packed layout (see linear_f32_pack): panels of 32 columns (two vectors); a tile covers two panels. */
#define PANEL 32
#define BLOCK_PANELS 2
#define PACKED_ROWS 6 /* a tile's rows: 6 x 4 sums + 4 weight vectors + 1 broadcast <= 32 registers */
#ifndef PACKED_K_CHUNK
#define PACKED_K_CHUNK 1024
#endif

/* y[r][c] for r < rows <= R, c < cols <= 64 from the panels at p and p + panel_floats (where cols <= 32
 * the second is p again: its sums are computed and not stored); missing rows repeat the last real one.
 * Sums over k in [k0, k1): from zero where k0 is 0, else on from the partial sums y holds (a float32
 * stored and loaded again is the same float, so each output is the same FMA chain either way). */
static inline __attribute__((always_inline)) void packed_tile(const int R, const float *x, int64_t ldx,
                                                              const float *p, int64_t panel_floats, float *y,
                                                              int64_t ldy, int rows, int cols, int k0, int k1) {
    const float *p0 = p, *p1 = cols > PANEL ? p + panel_floats : p;
    const float *xr[PACKED_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) xr[r] = x + (int64_t)(r < rows ? r : rows - 1) * ldx;
    __mmask16 mask[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; v++) {
        const int left = cols - 16 * v;
        mask[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
    }
    __m512 acc[PACKED_ROWS][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++)
            acc[r][v] = k0 > 0 && r < rows ? _mm512_maskz_loadu_ps(mask[v], y + (int64_t)r * ldy + 16 * v)
                                           : _mm512_setzero_ps();
    for (int kk = k0; kk < k1; kk++) {
        const __m512 w0 = _mm512_load_ps(p0 + (int64_t)kk * PANEL), w1 = _mm512_load_ps(p0 + (int64_t)kk * PANEL + 16);
        const __m512 w2 = _mm512_load_ps(p1 + (int64_t)kk * PANEL), w3 = _mm512_load_ps(p1 + (int64_t)kk * PANEL + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 b = _mm512_set1_ps(xr[r][kk]);
            acc[r][0] = _mm512_fmadd_ps(b, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(b, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(b, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(b, w3, acc[r][3]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4 && r < rows; v++) _mm512_mask_storeu_ps(y + (int64_t)r * ldy + 16 * v, mask[v], acc[r][v]);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "pool.h"
#include "simd.h"

/* acc[r * C + c] += x_r[kk ..] * w_c[kk ..] lane-wise for 8 values of k (with ``tail``, the lanes
 * outside ``live`` load zeros and add exact zeros). The R rows of x are loaded first, then one column of
 * w at a time is loaded and used by its R FMAs: R + 1 + R * C <= 16 vectors, all in registers (3 x 4:
 * twelve accumulators, enough FMA chains in flight to cover the FMA latency). */
static inline __attribute__((always_inline)) void k_step(const int R, const int C, const float *const *xr,
                                                         const float *const *wc, int kk, const int tail,
                                                         __m256i live, __m256 *acc) {
    __m256 xv[3];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        xv[r] = tail ? _mm256_maskload_ps(xr[r] + kk, live) : _mm256_loadu_ps(xr[r] + kk);
        __asm__("" : "+v"(xv[r]));
    }
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) {
        __m256 wv = tail ? _mm256_maskload_ps(wc[c] + kk, live) : _mm256_loadu_ps(wc[c] + kk);
        __asm__("" : "+v"(wv));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[r * C + c] = _mm256_fmadd_ps(xv[r], wv, acc[r * C + c]);
    }
}

/* y[r][c] for r < rows <= R, c < cols <= C, R * C <= 12; missing rows and columns repeat the last real
 * one (their results are not stored). The sums of eight accumulators come from one sum8, the others'
 * from hsum8: the same tree either way. */
static inline __attribute__((always_inline)) void tile(const int R, const int C, const float *x, int64_t ldx,
                                                       const float *w, int64_t ldw, float *y, int64_t ldy,
                                                       int rows, int cols, int k) {
    const float *xr[3], *wc[8];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) xr[r] = x + (int64_t)(r < rows ? r : rows - 1) * ldx;
#pragma GCC unroll 8
    for (int c = 0; c < C; c++) wc[c] = w + (int64_t)(c < cols ? c : cols - 1) * ldw;
    __m256 acc[12];
#pragma GCC unroll 12
    for (int i = 0; i < R * C; i++) acc[i] = _mm256_setzero_ps();
    int kk = 0;
    for (; kk + 8 <= k; kk += 8) k_step(R, C, xr, wc, kk, 0, _mm256_setzero_si256(), acc);
    if (kk < k) k_step(R, C, xr, wc, kk, 1, lanes_below(k - kk), acc); /* the last k % 8 */
    float s[12];
    _mm256_storeu_ps(s, sum8(acc));
#pragma GCC unroll 4
    for (int i = 8; i < R * C; i++) s[i] = hsum8(acc[i]);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) y[(int64_t)r * ldy + c] = s[r * C + c];
}

#define TILE_A_ROWS 3
#define TILE_A_COLS 4
#define TILE_B_COLS 4
#define TILE_ROW_COLS 8
#define L1_WEIGHT_BYTES 20480 /* of w per column block: with a tile's rows of x it stays in a 32 KiB L1 */
/* A multiple of 24 columns (the 3-, 4- and 8-column tiles divide it), as many as fit in L1. */
static int block_columns(int k) {
    const int fit = L1_WEIGHT_BYTES / (4 * (k > 0 ? k : 1));
    return fit >= 24 ? fit / 24 * 24 : 24;
}
#define NATIVE_LINEAR 1
#endif

#if defined(NATIVE_LINEAR)
static void tile_a(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int rows, int cols,
                   int k) {
    tile(TILE_A_ROWS, TILE_A_COLS, x, ldx, w, ldw, y, ldy, rows, cols, k);
}
static void tile_b(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int rows, int cols,
                   int k) {
    tile(2, TILE_B_COLS, x, ldx, w, ldw, y, ldy, rows, cols, k);
}
static void tile_row(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int rows,
                     int cols, int k) {
    tile(1, TILE_ROW_COLS, x, ldx, w, ldw, y, ldy, rows, cols, k);
}

/* Columns [n0, n0 + nc) of y for every row: tiles of TILE_A_ROWS rows, then 2-row and 1-row tiles. While
 * the tall tiles run, the weights of the block this thread takes next (next_bytes from next; 0: none) are
 * loaded a share per tile: the block's first tiles otherwise wait on memory for the whole block, the
 * later ones find it in the caches (AVX2, one thread, the weights cold: 1.2-1.4x at 4-64 rows). Below
 * TILE_A_ROWS rows the block is one pass, left to the hardware's own prefetching (fetching ahead there
 * measured no faster at one row). */
static void column_block(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int m, int n0, int nc,
                         int k, const char *next, int64_t next_bytes) {
    const int tiles = m / TILE_A_ROWS * ((nc + TILE_A_COLS - 1) / TILE_A_COLS);
    const int64_t share = tiles > 0 ? (next_bytes / tiles + 64) / 64 * 64 : 0; /* whole lines, all covered */
    int64_t fetched = 0;
    int r0 = 0;
    for (; r0 + TILE_A_ROWS <= m; r0 += TILE_A_ROWS)
        for (int c0 = 0; c0 < nc; c0 += TILE_A_COLS) {
            for (const int64_t end = fetched + share; fetched < end && fetched < next_bytes; fetched += 64)
                _mm_prefetch(next + fetched, _MM_HINT_T0);
            tile_a(x + (int64_t)r0 * ldx, ldx, w + (int64_t)(n0 + c0) * k, k, y + (int64_t)r0 * ldy + n0 + c0, ldy,
                   TILE_A_ROWS, nc - c0 < TILE_A_COLS ? nc - c0 : TILE_A_COLS, k);
        }
    for (; r0 + 2 <= m; r0 += 2)
        for (int c0 = 0; c0 < nc; c0 += TILE_B_COLS)
            tile_b(x + (int64_t)r0 * ldx, ldx, w + (int64_t)(n0 + c0) * k, k, y + (int64_t)r0 * ldy + n0 + c0, ldy, 2,
                   nc - c0 < TILE_B_COLS ? nc - c0 : TILE_B_COLS, k);
    if (r0 < m)
        for (int c0 = 0; c0 < nc; c0 += TILE_ROW_COLS)
            tile_row(x + (int64_t)r0 * ldx, ldx, w + (int64_t)(n0 + c0) * k, k, y + (int64_t)r0 * ldy + n0 + c0, ldy,
                     1, nc - c0 < TILE_ROW_COLS ? nc - c0 : TILE_ROW_COLS, k);
}

int linear_f32_available(void) { return 1; }

#if defined(PANEL)
/* The packed copy: panel p holds columns [PANEL p, PANEL (p + 1)) of y as [K][PANEL] floats (w transposed;
 * the columns past N are zeros). */
int64_t linear_f32_packed_floats(int n, int k) {
    return n > 0 && k > 0 ? (int64_t)((n + PANEL - 1) / PANEL) * PANEL * k : 0;
}

typedef struct {
    const float *w;
    float *packed;
    int n, k;
} PackArgs;

static void pack_panels(void *p, int64_t p0, int64_t p1) {
    const PackArgs *a = p;
    for (int64_t panel = p0; panel < p1; panel++) {
        float *dst = a->packed + panel * PANEL * a->k;
        for (int j = 0; j < PANEL; j++) {
            const int64_t col = panel * PANEL + j;
            if (col < a->n) {
                const float *src = a->w + col * a->k;
                for (int kk = 0; kk < a->k; kk++) dst[(int64_t)kk * PANEL + j] = src[kk];
            } else {
                for (int kk = 0; kk < a->k; kk++) dst[(int64_t)kk * PANEL + j] = 0.f;
            }
        }
    }
}

/* packed (linear_f32_packed_floats(n, k) floats) = w [n, k] in panels. */
void linear_f32_pack(const float *w, int n, int k, float *packed) {
    if (n <= 0 || k <= 0) return;
    PackArgs a = {w, packed, n, k};
    pool_for((n + PANEL - 1) / PANEL, 1, pack_panels, &a);
}

static void packed_tile_a(const float *x, int64_t ldx, const float *p, int64_t panel_floats, float *y,
                          int64_t ldy, int rows, int cols, int k0, int k1) {
    packed_tile(PACKED_ROWS, x, ldx, p, panel_floats, y, ldy, rows, cols, k0, k1);
}
static void packed_tile_4(const float *x, int64_t ldx, const float *p, int64_t panel_floats, float *y,
                          int64_t ldy, int rows, int cols, int k0, int k1) {
    packed_tile(4, x, ldx, p, panel_floats, y, ldy, rows, cols, k0, k1);
}
static void packed_tile_2(const float *x, int64_t ldx, const float *p, int64_t panel_floats, float *y,
                          int64_t ldy, int rows, int cols, int k0, int k1) {
    packed_tile(2, x, ldx, p, panel_floats, y, ldy, rows, cols, k0, k1);
}
static void packed_tile_row(const float *x, int64_t ldx, const float *p, int64_t panel_floats, float *y,
                            int64_t ldy, int rows, int cols, int k0, int k1) {
    packed_tile(1, x, ldx, p, panel_floats, y, ldy, rows, cols, k0, k1);
}

typedef struct {
    const float *x, *packed;
    float *y;
    int64_t ldx, ldy;
    int m, n, k;
} PackedArgs;

/* Column blocks [b0, b1) of BLOCK_PANELS panels, every row: tiles of 6 rows, then the last 1-5 rows in
 * one tile of 6, 4, 2 or 1 rows (where it has more rows than are left, one repeats: not stored). */
static void packed_blocks(void *p, int64_t b0, int64_t b1) {
    const PackedArgs *a = p;
    const int64_t panel_floats = (int64_t)PANEL * a->k, block_cols = (int64_t)BLOCK_PANELS * PANEL;
    for (int64_t b = b0; b < b1; b++) {
        const int n0 = (int)(b * block_cols), cols = a->n - n0 < block_cols ? a->n - n0 : (int)block_cols;
        const float *panels = a->packed + b * BLOCK_PANELS * panel_floats, *x = a->x;
        float *y = a->y + n0;
        for (int k0 = 0; k0 < a->k; k0 += PACKED_K_CHUNK) {
            const int k1 = a->k - k0 < PACKED_K_CHUNK ? a->k : k0 + PACKED_K_CHUNK;
            int r0 = 0;
            for (; r0 + PACKED_ROWS <= a->m; r0 += PACKED_ROWS)
                packed_tile_a(x + r0 * a->ldx, a->ldx, panels, panel_floats, y + r0 * a->ldy, a->ldy, PACKED_ROWS,
                              cols, k0, k1);
            const int left = a->m - r0;
            const float *xl = x + r0 * a->ldx;
            float *yl = y + r0 * a->ldy;
            if (left == 5)
                packed_tile_a(xl, a->ldx, panels, panel_floats, yl, a->ldy, left, cols, k0, k1);
            else if (left >= 3)
                packed_tile_4(xl, a->ldx, panels, panel_floats, yl, a->ldy, left, cols, k0, k1);
            else if (left == 2)
                packed_tile_2(xl, a->ldx, panels, panel_floats, yl, a->ldy, left, cols, k0, k1);
            else if (left == 1)
                packed_tile_row(xl, a->ldx, panels, panel_floats, yl, a->ldy, left, cols, k0, k1);
        }
    }
}

/* y (row stride ldy) = x (row stride ldx) . w^T from w's packed copy (linear_f32_pack; 64-byte aligned).
 * Threads split the column blocks. */
void linear_f32_packed(const float *x, int64_t ldx, const float *packed, float *y, int64_t ldy, int m, int n, int k) {
    if (m <= 0 || n <= 0) return;
    const int block_cols = BLOCK_PANELS * PANEL, blocks = (n + block_cols - 1) / block_cols;
    PackedArgs a = {x, packed, y, ldx, ldy, m, n, k};
    if ((int64_t)m * n * k < 65536)
        packed_blocks(&a, 0, blocks);
    else
        pool_for(blocks, 64 / block_cols, packed_blocks, &a); /* 64 columns a chunk, as linear_f32's blocks */
}
#endif

typedef struct {
    const float *x, *w;
    float *y;
    int64_t ldx, ldy;
    int m, n, k, block;
} LinearArgs;

/* Column blocks a thread takes at a time: runs of several, so that column_block has the next one to fetch
 * while it computes (AVX2, two threads, against single blocks: 1.1-1.2x at 64 rows, 1.2-1.7x at 16). */
#define LINEAR_GRAIN 4

static void column_blocks(void *p, int64_t b0, int64_t b1) {
    const LinearArgs *a = p;
    for (int64_t b = b0; b < b1; b++) {
        const int n0 = (int)b * a->block, nc = a->n - n0 < a->block ? a->n - n0 : a->block;
        const int n1 = n0 + nc, next_cols = a->n - n1 < a->block ? a->n - n1 : a->block;
        column_block(a->x, a->ldx, a->w, a->y, a->ldy, a->m, n0, nc, a->k, (const char *)(a->w + (int64_t)n1 * a->k),
                     b + 1 < b1 ? (int64_t)next_cols * a->k * (int64_t)sizeof(float) : 0);
    }
}

/* y (row stride ldy) = x (row stride ldx) . w^T, w [n, k] contiguous. Threads split the columns. */
void linear_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int m, int n, int k) {
    if (m <= 0 || n <= 0) return;
    const int block = block_columns(k), blocks = (n + block - 1) / block;
    LinearArgs a = {x, w, y, ldx, ldy, m, n, k, block};
    if ((int64_t)m * n * k < 65536)
        column_blocks(&a, 0, blocks);
    else
        pool_for(blocks, LINEAR_GRAIN, column_blocks, &a);
}

#else /* neither AVX-512 nor AVX2 with FMA: callers keep torch's BLAS */

int linear_f32_available(void) { return 0; }

void linear_f32(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int m, int n, int k) {
    (void)x, (void)ldx, (void)w, (void)y, (void)ldy, (void)m, (void)n, (void)k;
}

#endif

#if !defined(PANEL)
/* No packed kernel in this build (AVX2: measured on a Xeon, a 6 x 16 tile gained 5-10% from 8 rows up and
 * lost 15-25% at 1-3 rows, a decode step's batch): callers keep linear_f32 on the weights as they are. */
int64_t linear_f32_packed_floats(int n, int k) {
    (void)n, (void)k;
    return 0;
}
void linear_f32_pack(const float *w, int n, int k, float *packed) { (void)w, (void)n, (void)k, (void)packed; }
void linear_f32_packed(const float *x, int64_t ldx, const float *packed, float *y, int64_t ldy, int m, int n, int k) {
    (void)x, (void)ldx, (void)packed, (void)y, (void)ldy, (void)m, (void)n, (void)k;
}
#endif
