/* The next-panel prefetch that the fp32 GEMM (packed_gemm.c) and the AVX-512 BF16 GEMM
 * (avx512_bf16_gemm.c) share: both walk a panel row tile by row tile.
 *
 * The first tile of a panel reads the panel from memory; the others read it from L2 while the
 * memory idles, so a GEMM on a few rows took the weights' read time plus their arithmetic.
 * Now those other tiles fetch the next panel, one line every few k steps (bursts of
 * prefetches stall on the core's few fill buffers): fp32, 64 rows 15% faster, 32 and 16 rows
 * 4-5% (python -m bench.packed_gemm, 2026-11-23). Only up to a few tiles: beyond, the read is
 * small against the arithmetic and 2,048 rows measured no gain.
 */
#ifndef PDSERVE_PANEL_PREFETCH_H
#define PDSERVE_PANEL_PREFETCH_H

#include <stdint.h>

/* Lines of the next panel one tile prefetches into L2: `count` lines from `first`, one every
 * `every` steps of its k loop. */
typedef struct {
    const char *first;
    int64_t count, every;
} NextPanel;

/* Tile `tile` of `tiles` over a panel of `steps` k steps of two 64-byte lines each: its share
 * of prefetching the next panel, which starts at `next` (NULL: there is none), when there are
 * at most `max_tiles` tiles. */
static inline NextPanel next_panel_share(const char *next, int64_t steps, int64_t tile,
                                         int64_t tiles, int64_t max_tiles) {
    const int64_t lines = 2 * steps;
    if (next == NULL || tile == 0 || tiles > max_tiles) return (NextPanel){0, 0, steps};
    const int64_t every = (tiles - 1) / 2 > 1 ? (tiles - 1) / 2 : 1; /* 2 lines, steps each */
    const int64_t share = (steps + every - 1) / every, first = (tile - 1) * share;
    const int64_t count = first >= lines ? 0 : (lines - first < share ? lines - first : share);
    return (NextPanel){next + first * 64, count, every};
}

#endif
