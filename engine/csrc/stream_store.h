/* Output stores that go around the caches for big GEMM outputs, shared by the GEMMs
 * (packed_gemm.c, avx512_bf16_gemm.c, amx_gemm.c).
 *
 * A prefill chunk's linear writes megabytes (2,048 rows x 1,536 bf16 columns: 6 MB). Written
 * through the caches, each output line is first read in (the core owns a line before it
 * writes part of it), and the lines pushed out of L2 take the row block of x and the weight
 * panel the GEMM is reading with them: a 2,048-row bf16 GEMM (576 -> 1,536) ran 8-10% slower
 * than the same GEMM writing every row to one place. Non-temporal stores of whole 64-byte
 * lines skip both: 396-401 -> 417-418 GFLOP/s on two threads (Zen 4, 2026-11-26). Small
 * outputs stay cached: the next op reads them at once, and below a few hundred rows the gain
 * was nil. Only whole lines are streamed: a bf16 SwiGLU panel gives a row 16 outputs, half a
 * line, and stays cached (staging panel pairs to stream whole lines measured no faster: the
 * 2,048-row gate/up GEMM ran at 416 GFLOP/s either way).
 *
 * Non-temporal stores are weakly ordered: a thread that issued them runs stream_fence()
 * after each panel it wrote, so its last lines are ordered before its threads join (one
 * sfence a panel: a few dozen a GEMM).
 */
#ifndef PDSERVE_STREAM_STORE_H
#define PDSERVE_STREAM_STORE_H

#include <stdint.h>

/* Outputs of this many bytes or more are streamed (twice an L2 of 1 MB). */
enum { STREAM_BYTES = 2 << 20 };

static inline int streams_output(int64_t rows, int64_t width, int64_t element_bytes) {
    return rows * width * element_bytes >= STREAM_BYTES;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* Whether a 64-byte store at dst can be streamed: a whole line. */
static inline int whole_line(const void *dst) { return ((uintptr_t)dst & 63) == 0; }

static inline void stream_fence(void) { _mm_sfence(); }
#else
static inline void stream_fence(void) {}
#endif

#endif
