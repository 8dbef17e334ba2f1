/* RMSNorm and rotary embedding on CPU, each in one pass over its rows.
 *
 * Built at first use by engine/model/fused_ops.py (see engine/native_build.py) and called
 * through ctypes. Why: torch runs RoPE as six element-wise kernels and a concatenation, and
 * a bf16 RMSNorm as a norm and a weight multiply, each a pass over memory with bf16 widened
 * per element. Measured per layer (bench/fused_ops.py): on 2,048 tokens 1.0-1.5 ms for
 * RoPE and 0.7-1.0 ms per norm in torch, 2-5x that of one pass; on 64 tokens 2.2-3.2x.
 *
 * Rounding follows the torch code these replace, operation by operation: every product, sum
 * and difference is rounded to the element type where torch rounds it (bf16 arithmetic in
 * torch computes in fp32 and rounds each result). Built without FMA contraction
 * (-ffp-contract=off), so RoPE is bit-identical to engine/model/rope.py's torch path; the
 * norm sums its squares in double, in its own order, so it can differ from torch's in the
 * last bit of fp32.
 */
#include <math.h>
#include <stdint.h>

enum { FO_FLOAT32 = 0, FO_BFLOAT16 = 1 };

static inline float bf16_to_f32(uint16_t bits) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)bits) << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float x) { /* branch-free, so that loops vectorize */
    union { uint32_t u; float f; } v;
    v.f = x;
    const uint32_t nearest_even = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (v.u >> 16) | 0x40u;
    return (uint16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest_even);
}

/* x rounded to bf16 and back: what a bf16 torch op stores. */
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* Elements per thread below which a parallel region costs more than it saves. */
enum { MIN_ELEMENTS_PER_THREAD = 16384 };

static inline int threads_for(int64_t elements, int num_threads) {
    const int64_t useful = elements / MIN_ELEMENTS_PER_THREAD;
    return useful < 1 ? 1 : (useful < num_threads ? (int)useful : num_threads);
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight for rows r of `cols` elements.
 * fp32: as F.rms_norm(x, weight); bf16: as weight * F.rms_norm(x) (the norm rounded to bf16,
 * then the product rounded again). x rows are x_stride elements apart, out is dense. */
void pdserve_rms_norm(const void *x, int64_t x_stride, int64_t rows, int64_t cols,
                      const void *weight, float eps, void *out, int dtype, int num_threads) {
    const int threads = threads_for(rows * cols, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        if (dtype == FO_FLOAT32) {
            const float *xr = (const float *)x + r * x_stride, *w = weight;
            float *o = (float *)out + r * cols;
            double squares = 0.0;
#pragma omp simd reduction(+ : squares)
            for (int64_t c = 0; c < cols; ++c) squares += (double)xr[c] * xr[c];
            const float inv = 1.0f / sqrtf((float)(squares / (double)cols) + eps);
            for (int64_t c = 0; c < cols; ++c) o[c] = (xr[c] * inv) * w[c];
        } else {
            const uint16_t *xr = (const uint16_t *)x + r * x_stride, *w = weight;
            uint16_t *o = (uint16_t *)out + r * cols;
            double squares = 0.0;
#pragma omp simd reduction(+ : squares)
            for (int64_t c = 0; c < cols; ++c) {
                const float v = bf16_to_f32(xr[c]);
                squares += (double)v * v;
            }
            const float inv = 1.0f / sqrtf((float)(squares / (double)cols) + eps);
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c)
                o[c] = f32_to_bf16(bf16_to_f32(w[c]) * round_bf16(bf16_to_f32(xr[c]) * inv));
        }
    }
}

/* Rotary embedding, "rotate half" layout, for `heads` heads of head_dim elements per token:
 * with h = head_dim / 2, c = cos[t][i], s = sin[t][i] (i < h):
 *     out[i]     = x[i] * c - x[i + h] * s
 *     out[i + h] = x[i + h] * c + x[i] * s
 * x: token t's heads start at x + t * x_stride (heads dense, head_dim apart); cos, sin:
 * [tokens][h] dense; out: [tokens][heads][head_dim] dense. */
void pdserve_rope(const void *x, int64_t x_stride, int64_t tokens, int64_t heads,
                  int64_t head_dim, const void *cos, const void *sin, void *out, int dtype,
                  int num_threads) {
    const int64_t h = head_dim / 2;
    const int threads = threads_for(tokens * heads * head_dim, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t n = 0; n < heads; ++n) {
            const int64_t src = t * x_stride + n * head_dim, dst = (t * heads + n) * head_dim;
            if (dtype == FO_FLOAT32) {
                const float *xs = (const float *)x + src, *cs = (const float *)cos + t * h;
                const float *ss = (const float *)sin + t * h;
                float *o = (float *)out + dst;
#pragma omp simd
                for (int64_t i = 0; i < h; ++i) {
                    const float a = xs[i], b = xs[i + h], c = cs[i], s = ss[i];
                    o[i] = a * c - b * s;
                    o[i + h] = b * c + a * s;
                }
            } else {
                const uint16_t *xs = (const uint16_t *)x + src;
                const uint16_t *cs = (const uint16_t *)cos + t * h;
                const uint16_t *ss = (const uint16_t *)sin + t * h;
                uint16_t *o = (uint16_t *)out + dst;
#pragma omp simd
                for (int64_t i = 0; i < h; ++i) {
                    const float a = bf16_to_f32(xs[i]), b = bf16_to_f32(xs[i + h]);
                    const float c = bf16_to_f32(cs[i]), s = bf16_to_f32(ss[i]);
                    o[i] = f32_to_bf16(round_bf16(a * c) - round_bf16(b * s));
                    o[i + h] = f32_to_bf16(round_bf16(b * c) + round_bf16(a * s));
                }
            }
        }
    }
}
