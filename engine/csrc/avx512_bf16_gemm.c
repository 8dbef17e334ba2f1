/* bf16 linear layers on AVX-512 BF16 vectors (vdpbf16ps) against a weight packed once, for
 * CPUs that have AVX-512 BF16 but no AMX (AMD Zen 4 and later): the same ops, arguments,
 * layout and rounding as amx_gemm.c (bf16 x, W, bias, other and y, fp32 sums, each output
 * rounded to bf16 once, after the op).
 *
 * Built at first use by engine/model/packed_gemm.py; where -march=native has no AVX-512 BF16,
 * pdserve_avx512_bf16_init fails and bf16 stays on oneDNN. Why: at the 1-64 rows of decode
 * steps oneDNN's bf16 GEMM ran well below this CPU's bf16 rate; and with its linears the
 * engine's greedy bf16 tokens depended on the batch (3 of 8 prompts differed alone and in a
 * batch, 2026-11-26; isolated, its linears gave the same bits for any leading rows we tried,
 * so the cause inside oneDNN is not pinned down). Here each output is one dot product in a
 * fixed order whatever the rows around it (batch-invariant), and those tokens agree.
 * Measured speed: the module docstring of engine/model/packed_linear.py.
 *
 * Layout: bf16_panels.h's. One k step multiplies a panel row (two vectors: 16 columns x a
 * pair of K values each) by one pair of x's values broadcast, for up to 12 rows of x: 24
 * vector sums in registers. Work: blocks of up to 512 rows; inside a block the threads share
 * out the panels, so each panel is read once per block; within a panel, row tile after row
 * tile, the later tiles fetching the next panel into L2 (panel_prefetch.h).
 */
#include <stdint.h>
#include <string.h>

#include "bf16_panels.h"
#include "panel_prefetch.h"

#if defined(__AVX512BF16__)

enum { MAX_ROWS = 12, ROW_BLOCK = 512, PREFETCH_TILES = 16 };

int pdserve_avx512_bf16_init(void) { return 0; }

/* x[r][2i], x[r][2i + 1] in every 32-bit lane. */
static inline __m512bh pair_of(const uint16_t *x_row, int64_t i) {
    int32_t pair;
    memcpy(&pair, x_row + 2 * i, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(pair);
}

/* One k step of a tile: the panel's row i (prefetching 1 KB ahead) times x's pair i. */
#define TILE_STEP(MR)                                                                          \
    do {                                                                                       \
        const uint16_t *b = panel + i * 2 * PANEL;                                             \
        const __m512bh b_lo = (__m512bh)_mm512_loadu_si512(b);                                 \
        const __m512bh b_hi = (__m512bh)_mm512_loadu_si512(b + PANEL);                         \
        __builtin_prefetch(b + 8 * 2 * PANEL, 0, 3);                                           \
        __builtin_prefetch(b + 8 * 2 * PANEL + PANEL, 0, 3);                                   \
        _Pragma("GCC unroll 12") for (int r = 0; r < MR; ++r) {                                \
            const __m512bh a = pair_of(x + r * x_stride, i);                                   \
            lo[r] = _mm512_dpbf16_ps(lo[r], a, b_lo);                                          \
            hi[r] = _mm512_dpbf16_ps(hi[r], a, b_hi);                                          \
        }                                                                                      \
    } while (0)

/* MR rows of x (x_stride apart) times one panel of `steps` pairs of K: y's 32 columns. */
#define DEFINE_TILE(MR)                                                                        \
    static void tile_##MR(const uint16_t *x, int64_t x_stride, const uint16_t *panel,          \
                          int64_t steps, const NextPanel *next, const Epilogue *ep,            \
                          int64_t row, int64_t col, int64_t count, uint16_t *y,                \
                          int64_t y_stride) {                                                  \
        __m512 lo[MR], hi[MR];                                                                 \
        for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm512_setzero_ps();                      \
        for (int64_t start = 0, line = 0; start < steps; start += next->every, ++line) {       \
            if (line < next->count) __builtin_prefetch(next->first + 64 * line, 0, 2);         \
            const int64_t stop = start + next->every < steps ? start + next->every : steps;    \
            for (int64_t i = start; i < stop; ++i) TILE_STEP(MR);                              \
        }                                                                                      \
        for (int r = 0; r < MR; ++r)                                                           \
            finish_row((v16)lo[r], (v16)hi[r], ep, row + r, col, count, y + r * y_stride);     \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)
DEFINE_TILE(9)
DEFINE_TILE(10)
DEFINE_TILE(11)
DEFINE_TILE(12)

typedef void (*TileFn)(const uint16_t *, int64_t, const uint16_t *, int64_t, const NextPanel *,
                       const Epilogue *, int64_t, int64_t, int64_t, uint16_t *, int64_t);
static const TileFn TILES[MAX_ROWS + 1] = {0,      tile_1, tile_2, tile_3,  tile_4,
                                           tile_5, tile_6, tile_7, tile_8,  tile_9,
                                           tile_10, tile_11, tile_12};

/* y[rows][n] (y_stride apart) = op(x[rows][k] W^T + bias, other); see packed_gemm.c's
 * pdserve_linear for the ops (the same codes and arguments). */
void pdserve_avx512_bf16_linear(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k,
                                const uint16_t *packed, int64_t n, const uint16_t *bias, int op,
                                const uint16_t *other, int64_t other_stride, uint16_t *y,
                                int64_t y_stride, int num_threads) {
    const int64_t width = op == OP_SWIGLU ? n / 2 : n;
    const Epilogue ep = {bias, other, other_stride, op, streams_output(rows, width, 2)};
    const int64_t panels = (n + PANEL - 1) / PANEL, steps = k / 2;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        const int64_t r1 = r0 + ROW_BLOCK < rows ? r0 + ROW_BLOCK : rows;
        const int64_t tiles = (r1 - r0 + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
        for (int64_t p = 0; p < panels; ++p) {
            const int64_t col = p * PANEL, count = n - col < PANEL ? n - col : PANEL;
            const uint16_t *panel = packed + p * k * PANEL;
            const char *next_panel = p + 1 < panels ? (const char *)(panel + k * PANEL) : NULL;
            const int64_t y_col = op == OP_SWIGLU ? col / 2 : col;
            for (int64_t r = r0; r < r1; r += MAX_ROWS) {
                const int64_t mr = r1 - r < MAX_ROWS ? r1 - r : MAX_ROWS;
                const NextPanel next =
                    next_panel_share(next_panel, steps, (r - r0) / MAX_ROWS, tiles, PREFETCH_TILES);
                TILES[mr](x + r * x_stride, x_stride, panel, steps, &next, &ep, r, col, count,
                          y + r * y_stride + y_col, y_stride);
            }
            if (ep.stream) stream_fence(); /* this thread's streamed lines, before the join */
        }
    }
}

#else /* no AVX-512 BF16 here: the caller keeps oneDNN */

int pdserve_avx512_bf16_init(void) { return -1; }

#endif
