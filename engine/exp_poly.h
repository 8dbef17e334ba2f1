/* exp(x) for float x in [-87, 88] (clamped there), shared by the engine's C sources.
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

static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 split in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
