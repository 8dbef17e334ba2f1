/* exp(x) for float x in [-87, 88] (clamped there), shared by the engine's C sources, one
 * float at a time and sixteen at a time.
 *
 * x = n ln2 + r with |r| <= ln2 / 2, then a degree-7 Taylor polynomial for exp(r): its error
 * (< 1e-8 relative) is below float rounding. Written out so loops calling it vectorize
 * without -ffast-math or libmvec (libm's expf is a call per element). Every source that
 * includes this file is rebuilt when it changes: engine/native_build.py keys a library on
 * the source and the local headers it includes.
 */
#ifndef PDSERVE_EXP_POLY_H
#define PDSERVE_EXP_POLY_H

#include <math.h>
#include <stdint.h>

/* exp(r) for |r| <= ln2 / 2 by Horner's rule, for a float r or a vector of them. */
#define TAYLOR7_EXP(r)                                                                         \
    ((((((((r) * (1.0f / 5040.0f) + 1.0f / 720.0f) * (r) + 1.0f / 120.0f) * (r) +              \
         1.0f / 24.0f) * (r) + 1.0f / 6.0f) * (r) + 0.5f) * (r) + 1.0f) * (r) + 1.0f)

static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 split in two parts */
    const float p = TAYLOR7_EXP(r);
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Sixteen floats (or int32s) as one vector: GCC vector types, mapped to AVX-512 where the
 * build has it and to narrower registers elsewhere. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline v16 splat16(float x) { return (v16){0} + x; }

/* Lane i of a where mask lane i is all ones, else of b (C has no vector ?:). */
static inline v16 select16(i16v mask, v16 a, v16 b) {
    return (v16)(((i16v)a & mask) | ((i16v)b & ~mask));
}

static inline v16 max16(v16 a, v16 b) { return select16(a > b, a, b); }

/* exp_poly on a whole vector: the same steps (n rounded to nearest even rather than half
 * up: either keeps |r| <= ln2 / 2), written with vector types so that they stay vector
 * instructions (a loop of exp_poly over 16 lanes ran as 16 scalar calls). */
static inline v16 exp_poly_v16(v16 x) {
    const v16 round = splat16(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    x = max16(splat16(-87.0f), select16(x > splat16(88.0f), splat16(88.0f), x));
    const v16 n = (x * 1.44269504f + round) - round;
    const v16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    const v16 p = TAYLOR7_EXP(r);
    const i16v scale = (__builtin_convertvector(n, i16v) + 127) << 23;
    return p * (v16)scale;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* exp_poly on 16 lanes for x <= 0 (softmax weights), the same polynomial in AVX-512
 * intrinsics: roundscale and scalef do in one op each what exp_poly_v16 spells out, and the
 * clamp is a single max (the generic vector code compiled to compare-and-blend sequences).
 * The decode kernel's lanes and the prefill kernel's softmax_keys use it. */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
