/* One bf16 value to and from float, for the engine's C sources (bf16 is the top half of a
 * float's bits). Built with its includer (engine/native_build.py rebuilds every library that
 * includes it when it changes). */
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t bits) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)bits) << 16;
    return v.f;
}

/* Rounded to nearest even, as torch's .to(torch.bfloat16) does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float x) {
    union { uint32_t u; float f; } v;
    v.f = x;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

#endif
