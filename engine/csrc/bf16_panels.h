/* What the two bf16 GEMMs share (amx_gemm.c on AMX tiles, avx512_bf16_gemm.c on AVX-512 BF16
 * vectors): the packed weight layout, and the epilogue that adds the bias, applies the op and
 * rounds each output to bf16 once.
 *
 * Layout: W [N][K] becomes panels of 32 output columns, K in pairs:
 *     packed[p][i][j][e] = W[p * 32 + j][2 * i + e]   (zero where p * 32 + j >= N),
 * so a panel is K / 2 rows of 128 bytes. It is AMX's bf16 B-tile layout, and also what
 * vdpbf16ps takes: a 64-byte half-row holds 16 columns, each with its two values of K,
 * multiplied by one pair of x's values broadcast to every lane. K must be even.
 */
#ifndef PDSERVE_BF16_PANELS_H
#define PDSERVE_BF16_PANELS_H

#include <stdint.h>

#include "exp_poly.h"
#include "stream_store.h"

enum { PANEL = 32 };
enum { OP_NONE = 0, OP_SILU = 1, OP_MUL = 2, OP_ADD = 3, OP_SWIGLU = 4 };

/* Exported from each library that includes this file (they are loaded separately). */
void pdserve_bf16_pack(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                       uint16_t *packed) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t i = 0; i < k / 2; ++i)
            for (int64_t j = 0; j < PANEL; ++j) {
                const int64_t col = p * PANEL + j;
                uint16_t *dst = packed + ((p * (k / 2) + i) * PANEL + j) * 2;
                dst[0] = col < n ? w[col * w_stride + 2 * i] : 0;
                dst[1] = col < n ? w[col * w_stride + 2 * i + 1] : 0;
            }
}

typedef struct {
    const uint16_t *bias;  /* [n] or NULL */
    const uint16_t *other; /* [rows][n], other_stride apart, for OP_MUL / OP_ADD */
    int64_t other_stride;
    int op;
    int stream; /* write whole output lines around the caches (stream_store.h) */
} Epilogue;

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* The bf16 values at src whose lanes are set in `live`, widened to float (0 elsewhere). */
static inline v16 load_bf16(const uint16_t *src, __mmask16 live) {
    const __m256i bits = _mm256_maskz_loadu_epi16(live, src);
    return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

static inline v16 silu(v16 v) { return v / (1.0f + exp_poly_v16(-v)); }

/* One row's 32 sums, columns [0, 16) in lo and [16, 32) in hi (+ bias, then the op), rounded
 * to bf16 (nearest even) into y's columns [col, col + count) (half as many for SwiGLU: 16
 * gate sums, then the matching 16 up). Vector code throughout: element by element it cost a
 * quarter of a 2,048-row AMX GEMM. */
static inline void finish_row(v16 lo, v16 hi, const Epilogue *ep, int64_t row, int64_t col,
                              int64_t count, uint16_t *y) {
    const uint32_t live = (uint32_t)((1ull << count) - 1);
    const __mmask16 live_lo = (__mmask16)live, live_hi = (__mmask16)(live >> 16);
    if (ep->bias) {
        lo += load_bf16(ep->bias + col, live_lo);
        hi += load_bf16(ep->bias + col + 16, live_hi);
    }
    const uint16_t *other = ep->other ? ep->other + row * ep->other_stride + col : NULL;
    if (ep->op == OP_SWIGLU) {
        const __m256bh out = _mm512_cvtneps_pbh((__m512)(silu(lo) * hi));
        _mm256_mask_storeu_epi16(y, (__mmask16)((1u << (count / 2)) - 1), (__m256i)out);
        return;
    }
    if (ep->op == OP_SILU) {
        lo = silu(lo);
        hi = silu(hi);
    } else if (ep->op == OP_MUL) {
        lo *= load_bf16(other, live_lo);
        hi *= load_bf16(other + 16, live_hi);
    } else if (ep->op == OP_ADD) {
        lo += load_bf16(other, live_lo);
        hi += load_bf16(other + 16, live_hi);
    }
    const __m512bh out = _mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
    if (ep->stream && live == UINT32_MAX && whole_line(y))
        _mm512_stream_si512((__m512i *)y, (__m512i)out);
    else
        _mm512_mask_storeu_epi16(y, (__mmask32)live, (__m512i)out);
}
#endif

#endif
