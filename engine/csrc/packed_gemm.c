/* fp32 linear layers against a weight packed once: y = x W^T (+ bias), then an element-wise
 * op (none, SiLU, times another tensor, plus another tensor, SwiGLU), for any number of rows.
 *
 * Built at first use by engine/model/packed_gemm.py and called through ctypes. Why: a decode
 * step runs every linear on 1-64 rows. oneDNN's packed fp32 GEMM reaches 55-60% of this
 * CPU's peak there (SmolLM2's layer linears, 64 rows, two threads: 61-64 ms), while this
 * plain register-blocked loop, prefetching the next panel while it works on this one, reaches
 * 80% (46 ms); at 2,048 rows (prefill chunks) it is level with oneDNN to 9% behind
 * (python -m bench.packed_gemm).
 *
 * Layout: W [N][K] (out x in, torch's) becomes panels of 32 output columns,
 *     packed[p][k][j] = W[p * 32 + j][k]   (zero where p * 32 + j >= N),
 * so one panel is read front to back while 8 rows of x times its 32 columns accumulate in
 * 16 vector registers. The vectors are GCC vector types, not intrinsics: the compiler maps
 * them to AVX-512 here and to whatever the build machine has elsewhere.
 *
 * Work: blocks of up to 512 rows; inside a block the threads share out the panels, so each
 * panel is read once per block (512-row blocks measured 2-3% faster than 128 at ~2,000 rows;
 * 12-row tiles were no faster than 8).
 */
#include <stdint.h>
#include <string.h>

#include "exp_poly.h"
#include "panel_prefetch.h"
#include "stream_store.h"

enum { PANEL = 32, MAX_ROWS = 8, ROW_BLOCK = 512, PREFETCH_TILES = 16 };
enum { OP_NONE = 0, OP_SILU = 1, OP_MUL = 2, OP_ADD = 3, OP_SWIGLU = 4 };

static inline v16 load16(const float *src) {
    v16 v;
    memcpy(&v, src, sizeof v);
    return v;
}

static inline void store16(float *dst, v16 v) { memcpy(dst, &v, sizeof v); }

/* The packed copy of w ([n][k], rows w_stride apart): ceil(n / 32) * k * 32 floats. */
void pdserve_pack_weight(const float *w, int64_t w_stride, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t j = 0; j < PANEL; ++j) {
            const int64_t col = p * PANEL + j;
            for (int64_t i = 0; i < k; ++i)
                packed[(p * k + i) * PANEL + j] = col < n ? w[col * w_stride + i] : 0.0f;
        }
}

typedef struct {
    const float *bias;  /* [n] or NULL */
    const float *other; /* [rows][n], other_stride apart, for OP_MUL / OP_ADD */
    int64_t other_stride;
    int op;
    int stream; /* write whole output lines around the caches (stream_store.h) */
} Epilogue;

/* The first n (< 16: the rest are 0) or 16 floats at src; and the store of as many. */
static inline v16 load_part(const float *src, int64_t n) {
    if (n >= 16) return load16(src);
    float part[16] = {0};
    if (n > 0) memcpy(part, src, (size_t)n * sizeof(float));
    return load16(part);
}

static inline void store_part(float *dst, v16 v, int64_t n) {
    if (n >= 16)
        store16(dst, v);
    else if (n > 0)
        memcpy(dst, &v, (size_t)n * sizeof(float));
}

/* store_part, streamed when the epilogue says so and the 16 floats are a whole line */
static inline void store_out(float *dst, v16 v, int64_t n, const Epilogue *ep) {
#ifdef __AVX512F__
    if (ep->stream && n >= 16 && whole_line(dst)) {
        _mm512_stream_ps(dst, (__m512)v);
        return;
    }
#endif
    store_part(dst, v, n);
}

static inline v16 silu(v16 v) { return v / (1.0f + exp_poly_v16(-v)); }

/* acc + bias, then the op, stored to y's columns [col, col + count). Vector code: as loops
 * over the 32 values, the epilogue cost 18% of the layer linears at 2,048 rows. */
static inline void finish_row(v16 lo, v16 hi, const Epilogue *ep, int64_t row, int64_t col,
                              int64_t count, float *y) {
    if (ep->bias) {
        lo += load_part(ep->bias + col, count);
        hi += load_part(ep->bias + col + 16, count - 16);
    }
    const float *other = ep->other ? ep->other + row * ep->other_stride + col : NULL;
    if (ep->op == OP_SWIGLU) { /* 16 gate columns, then the same 16 of up */
        store_out(y, silu(lo) * hi, count / 2, ep);
        return;
    }
    if (ep->op == OP_SILU) {
        lo = silu(lo);
        hi = silu(hi);
    } else if (ep->op == OP_MUL) {
        lo *= load_part(other, count);
        hi *= load_part(other + 16, count - 16);
    } else if (ep->op == OP_ADD) {
        lo += load_part(other, count);
        hi += load_part(other + 16, count - 16);
    }
    store_out(y, lo, count, ep);
    store_out(y + 16, hi, count - 16, ep);
}

/* One k step of a tile: the panel's row i (prefetching 1 KB ahead) times x's column i. */
#define TILE_STEP(MR)                                                                          \
    do {                                                                                       \
        const v16 b_lo = load16(panel + i * PANEL), b_hi = load16(panel + i * PANEL + 16);     \
        __builtin_prefetch(panel + (i + 8) * PANEL, 0, 3);                                     \
        __builtin_prefetch(panel + (i + 8) * PANEL + 16, 0, 3);                                \
        _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {                                 \
            const float a = x[r * x_stride + i];                                               \
            lo[r] += a * b_lo;                                                                 \
            hi[r] += a * b_hi;                                                                 \
        }                                                                                      \
    } while (0)

/* MR rows of x (x_stride apart) times one panel: y's 32 columns of those rows. */
#define DEFINE_TILE(MR)                                                                        \
    static void tile_##MR(const float *x, int64_t x_stride, const float *panel, int64_t k,     \
                          const NextPanel *next, const Epilogue *ep, int64_t row, int64_t col, \
                          int64_t count, float *y, int64_t y_stride) {                         \
        v16 lo[MR], hi[MR];                                                                    \
        for (int r = 0; r < MR; ++r) lo[r] = hi[r] = (v16){0};                                 \
        /* k in runs of `every` steps, a prefetch before each run, so the steps stay one */    \
        /* tight loop: a test or a division in it, or NextPanel passed by value, slowed */     \
        /* 2,048-row GEMMs by 10-20%. */                                                       \
        for (int64_t start = 0, line = 0; start < k; start += next->every, ++line) {           \
            if (line < next->count) __builtin_prefetch(next->first + 64 * line, 0, 2);         \
            const int64_t stop = start + next->every < k ? start + next->every : k;            \
            for (int64_t i = start; i < stop; ++i) TILE_STEP(MR);                              \
        }                                                                                      \
        for (int r = 0; r < MR; ++r)                                                           \
            finish_row(lo[r], hi[r], ep, row + r, col, count, y + r * y_stride);               \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)

typedef void (*TileFn)(const float *, int64_t, const float *, int64_t, const NextPanel *,
                       const Epilogue *, int64_t, int64_t, int64_t, float *, int64_t);
static const TileFn TILES[MAX_ROWS + 1] = {0,      tile_1, tile_2, tile_3, tile_4,
                                           tile_5, tile_6, tile_7, tile_8};

/* y[rows][n] (y_stride apart) = op(x[rows][k] (x_stride apart) W^T + bias, other).
 * OP_SWIGLU: W's rows alternate 16 gate rows and the matching 16 up rows (n a multiple of
 * 32), and y gets n / 2 columns, silu(gate) * up: the MLP's two GEMMs in one, without
 * writing the gate out and reading it back. */
void pdserve_linear(const float *x, int64_t x_stride, int64_t rows, int64_t k,
                    const float *packed, int64_t n, const float *bias, int op,
                    const float *other, int64_t other_stride, float *y, int64_t y_stride,
                    int num_threads) {
    const int64_t width = op == OP_SWIGLU ? n / 2 : n;
    const Epilogue ep = {bias, other, other_stride, op, streams_output(rows, width, 4)};
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        const int64_t r1 = r0 + ROW_BLOCK < rows ? r0 + ROW_BLOCK : rows;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t col = p * PANEL, count = n - col < PANEL ? n - col : PANEL;
            for (int64_t r = r0; r < r1; r += MAX_ROWS) {
                const int64_t mr = r1 - r < MAX_ROWS ? r1 - r : MAX_ROWS;
                const char *next_panel =
                    p + 1 < panels ? (const char *)(packed + (p + 1) * k * PANEL) : NULL;
                const NextPanel next =
                    next_panel_share(next_panel, k, (r - r0) / MAX_ROWS,
                                     (r1 - r0 + MAX_ROWS - 1) / MAX_ROWS, PREFETCH_TILES);
                const int64_t y_col = op == OP_SWIGLU ? col / 2 : col;
                TILES[mr](x + r * x_stride, x_stride, packed + p * k * PANEL, k, &next, &ep, r,
                          col, count, y + r * y_stride + y_col, y_stride);
            }
            if (ep.stream) stream_fence(); /* this thread's streamed lines, before the join */
        }
    }
}
