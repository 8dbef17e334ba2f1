/* bf16 linear layers on AMX against a weight packed once: y = x W^T (+ bias), then an
 * element-wise op (none, SiLU, times another tensor, plus another tensor, SwiGLU), as in
 * packed_gemm.c (same ops, same argument list), with bf16 x, W, bias, other and y and fp32
 * accumulation; each output is rounded to bf16 once, after the op.
 *
 * Built at first use by engine/model/packed_gemm.py when this CPU has AMX (-march=native
 * defines __AMX_BF16__); elsewhere pdserve_amx_init fails and bf16 stays on oneDNN. Why: a
 * decode step runs every linear on 1-64 rows, where oneDNN's packed bf16 GEMM reads the
 * weights at ~13-17 GB/s here; these tiles, fetching the next panel while they work on this
 * one, read them at up to ~25 GB/s: 1.4x faster at 1-32 rows, level at 64-256, but 0.75-0.83x
 * at 2,048 (python -m bench.packed_gemm --dtype bf16, 2026-11-23).
 *
 * Layout: bf16_panels.h's (shared with avx512_bf16_gemm.c); 16 of a panel's rows (32 values
 * of K) make the two B tiles of one k step. K must be a multiple of 32 (the caller checks).
 *
 * Tiles: C 0-3 (2 x 2 blocks of 16 x 16 fp32: 32 rows of x by the panel's 32 columns),
 * A 4-5 (16 rows of x by 32 values of K each), B 6-7 (the panel's two halves).
 */
#define _DEFAULT_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <string.h>

#include "bf16_panels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { KSTEP = 32, TILE_ROWS = 32, PREFETCH_TILES = 8 };
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

/* Ask the kernel for the AMX tile state (once per process, any thread). 0 when granted. */
int pdserve_amx_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tile shapes for a row tile of rows0 (+ rows1) rows of x. */
static void configure(int rows0, int rows1) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)rows0;
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(rows1 ? rows1 : 1);
    cfg.rows[6] = cfg.rows[7] = 16;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* Lines of memory a row tile fetches while it works: `count` lines of the next panel from
 * `next` into L2, spread over its k steps (bursts stall the core's few fill buffers, as in
 * packed_gemm.c), and/or each step's B rows two steps ahead into L1. */
typedef struct {
    const char *next;
    int64_t count;
    int l1_ahead;
} Fetch;

/* One row tile (m <= 32 rows from row r) times one panel. */
static void row_tile(const uint16_t *x, int64_t x_stride, int64_t r, int m, int64_t k,
                     const uint16_t *panel, const Fetch *fetch, const Epilogue *ep,
                     int64_t col, int64_t n_count, uint16_t *y, int64_t y_stride, float *buf) {
    const char *next = fetch->next;
    const int64_t count = fetch->count;
    const int l1_ahead = fetch->l1_ahead;
    const int m0 = m < 16 ? m : 16, m1 = m - m0;
    const uint16_t *xa = x + r * x_stride, *xb = xa + 16 * x_stride;
    const int64_t steps = k / KSTEP, per_step = (count + steps - 1) / steps;
    _tile_zero(0);
    _tile_zero(1);
    if (m1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t s = 0, line = 0; s < steps; ++s) {
        for (int64_t q = 0; q < per_step && line < count; ++q, ++line)
            _mm_prefetch(next + line * 64, _MM_HINT_T1);
        const uint16_t *b = panel + s * 16 * PANEL * 2;
        if (l1_ahead) /* this step's B rows two steps ahead (2 KB), from L2 into L1 */
            for (int64_t l = 0; l < 2 * PANEL * 2 * 16 / 64; ++l)
                _mm_prefetch((const char *)(b + 2 * 16 * PANEL * 2) + 64 * l, _MM_HINT_T0);
        _tile_loadd(6, b, PANEL * 4);
        _tile_loadd(7, b + 32, PANEL * 4);
        _tile_loadd(4, xa + s * KSTEP, x_stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (m1) {
            _tile_loadd(5, xb + s * KSTEP, x_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, buf, PANEL * 4);
    _tile_stored(1, buf + 16, PANEL * 4);
    if (m1) {
        _tile_stored(2, buf + 16 * PANEL, PANEL * 4);
        _tile_stored(3, buf + 16 * PANEL + 16, PANEL * 4);
    }
    const int64_t y_col = ep->op == OP_SWIGLU ? col / 2 : col;
    for (int i = 0; i < m; ++i) {
        const float *sums = buf + i * PANEL;
        finish_row((v16)_mm512_loadu_ps(sums), (v16)_mm512_loadu_ps(sums + 16), ep, r + i, col,
                   n_count, y + (r + i) * y_stride + y_col);
    }
}

/* Sets the tile shapes for m rows unless they are set already. */
static void shape_for(int m, int *shape) {
    const int m0 = m < 16 ? m : 16, m1 = m - m0;
    if (m0 != shape[0] || m1 != shape[1]) {
        configure(m0, m1);
        shape[0] = m0;
        shape[1] = m1;
    }
}

/* y[rows][n] (y_stride apart) = op(x[rows][k] W^T + bias, other); see packed_gemm.c's
 * pdserve_linear for the ops (the same codes and arguments). Each thread takes a contiguous
 * range of panels. Two orders:
 * - up to PREFETCH_TILES row tiles (decode steps): panel by panel, each panel's row tiles
 *   fetching the thread's next panel into L2, so the weights stream from memory while the
 *   tiles work (the memory is the bound there);
 * - more rows (prefill chunks): row tile by row tile, its rows of x staying in L1 while the
 *   thread's panels come from L2, each step fetching B rows ahead into L1 (past a panel's
 *   end that is the next panel's start, the next one this order takes; a prefetch never
 *   faults). Still 0.75-0.83x oneDNN's speed at 2,048 rows (python -m bench.packed_gemm
 *   --dtype bf16); panel by panel there measured no faster (x came from L2 for every tile),
 *   nor did a contiguous copy of x per row tile. */
void pdserve_amx_linear(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k,
                        const uint16_t *packed, int64_t n, const uint16_t *bias, int op,
                        const uint16_t *other, int64_t other_stride, uint16_t *y,
                        int64_t y_stride, int num_threads) {
    /* stream 0: streaming stores (stream_store.h) were measured on Zen 4 only; no AMX here */
    const Epilogue ep = {bias, other, other_stride, op, 0};
    const int64_t panels = (n + PANEL - 1) / PANEL, panel_lines = k * PANEL * 2 / 64;
    const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t share = (panel_lines + tiles - 1) / tiles; /* lines of the next panel */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float buf[TILE_ROWS * PANEL] __attribute__((aligned(64)));
        int shape[2] = {-1, -1};
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t p0 = panels * t / threads, p1 = panels * (t + 1) / threads;
        if (tiles <= PREFETCH_TILES) {
            for (int64_t p = p0; p < p1; ++p) {
                const uint16_t *panel = packed + p * k * PANEL;
                const int64_t col = p * PANEL, count = n - col < PANEL ? n - col : PANEL;
                for (int64_t tile = 0; tile < tiles; ++tile) {
                    const int64_t r = tile * TILE_ROWS, first = tile * share;
                    const int m = rows - r < TILE_ROWS ? (int)(rows - r) : TILE_ROWS;
                    const int64_t left = p + 1 < p1 ? panel_lines - first : 0;
                    const Fetch fetch = {(const char *)(panel + k * PANEL) + first * 64,
                                         left <= 0 ? 0 : (left < share ? left : share), 0};
                    shape_for(m, shape);
                    row_tile(x, x_stride, r, m, k, panel, &fetch, &ep, col, count, y, y_stride,
                             buf);
                }
            }
        } else {
            const Fetch fetch = {NULL, 0, 1};
            for (int64_t r = 0; r < rows; r += TILE_ROWS) {
                const int m = rows - r < TILE_ROWS ? (int)(rows - r) : TILE_ROWS;
                shape_for(m, shape);
                for (int64_t p = p0; p < p1; ++p) {
                    const int64_t col = p * PANEL, count = n - col < PANEL ? n - col : PANEL;
                    row_tile(x, x_stride, r, m, k, packed + p * k * PANEL, &fetch, &ep, col,
                             count, y, y_stride, buf);
                }
            }
        }
        _tile_release();
    }
}

#else /* no AMX here: the caller keeps oneDNN */

int pdserve_amx_init(void) { return -1; }

#endif
