/* Paged decode attention on CPU: one query token per sequence, K/V read in place from the pool.
 *
 * Built at first use by engine/attention/native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes. Why native code: a torch implementation must first gather each sequence's
 * blocks into a contiguous buffer (read the KV, write it, read it again in SDPA), which costs
 * about twice the bytes the attention itself needs; decode steps are bound by exactly those
 * bytes. Here every K/V row is read once, straight from its block.
 *
 * Pool layout (the project-wide contract): see pool_geometry.h. Queries and outputs are fp32 or
 * bf16; the pool holds the same dtype, or int8 rows with a scale each (an int8 pool, read by
 * the portable code: each score is the dot product with the int8 values times the key row's
 * scale, and each V row's weight is multiplied by its scale).
 *
 * Work is split over sequences (or (sequence, kv head) pairs when there are under two
 * sequences per thread). One item walks its block table once, prefetching the next block
 * while it works on this one (on its last, the first block of its thread's next item), and
 * keeps a running softmax per query head (see DEFINE_SEQ); the G = H / KVH query heads of a
 * kv head share its K and V rows.
 *
 * Measured on one core (fp32, 16 sequences of ~900 positions): 1.14x the time of merely
 * reading the same K/V bytes, against 2.1x for the gather + SDPA path it replaces.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_poly.h"
#include "pool_geometry.h"

/* Fold one block's n scores of a query row into its running softmax: scores become
 * exp(score - m) (the weights of the block's V rows); the max m, the sum l and the weighted
 * V sum acc (d floats) are rescaled first when the block raises the max. */
static inline void online_softmax_step(float *scores, int64_t n, float *m, float *l, float *acc,
                                       int64_t d) {
    float top = *m;
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < n; ++t) top = scores[t] > top ? scores[t] : top;
    if (top > *m) {
        const float shrink = exp_poly(*m - top);
        *l *= shrink;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[i] *= shrink;
        *m = top;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
        scores[t] = exp_poly(scores[t] - top);
        sum += scores[t];
    }
    *l += sum;
}

/* Ask for one row of the next block while working on a row of this one: spread out like
 * this the requests keep the memory busy without flooding the core's few fill buffers (one
 * burst of a head's rows before its dot products stalled the AVX-512 kernel: spread, it runs
 * 1.11-1.19x (bf16) and 1.04-1.25x (fp32) faster, two threads, 4-64 sequences of 200-2,000
 * positions). into_l1: prefetcht0, else prefetcht1 (L2), which the AVX-512 kernel uses (L1
 * was 1.2x slower there in fp32). */
static inline void prefetch_run(const void *start, int64_t run_bytes, int into_l1) {
    for (int64_t o = 0; o < run_bytes; o += 64) {
        if (into_l1)
            __builtin_prefetch((const char *)start + o, 0, 3);
        else
            __builtin_prefetch((const char *)start + o, 0, 2);
    }
}

/* What to prefetch while block j of a table is worked on: block j + 1; after the last, the
 * thread's next item (after), if any; else block j itself (a harmless re-fetch). */
#define NEXT_BLOCK(base, table, j, num_blocks, geo, after, this_block)                          \
    ((j) + 1 < (num_blocks) ? (base) + (table)[(j) + 1] * (geo)->block_stride                  \
     : (after)              ? (after)                                                          \
                            : (this_block))

/* The per-sequence work for element type ELEM (LOAD converts one element to float; ROW_SCALE
 * gives the scale of a kv head's row, 1 unless the pool is int8), as
 * three functions: NAME##_scores and NAME##_values handle the n positions of one block for
 * the kv heads [h0, h0 + nh) (rows = nh * G query heads), NAME runs them over a table.
 *
 * One pass over the blocks with a running ("online") softmax: for each block, the scores
 * of its positions, then the running max m, sum l and weighted V sum acc of every query
 * row are updated (acc and l rescaled by exp(m_old - m_new) when the max grows). K and V of
 * a block are neighbours in memory, so the block is read as one run. Each token row holds
 * every kv head side by side: taking all heads of a row together keeps the reads contiguous.
 *
 * q: rows query vectors (pre-scaled, float); acc: rows * D outputs (float); scores, m, l:
 * rows * block_size, rows and rows floats of scratch; after: where the thread reads next
 * (the next item's first block, prefetched during the last one), or NULL. */
#define DEFINE_SEQ(NAME, ELEM, LOAD, HEAD_DIM, ROW_SCALE)                                      \
    /* scores[r * BS + t] = q[r] . K[t] for this block; prefetches the next block's rows */    \
    static inline void NAME##_scores(const Geometry *geo, const ELEM *k_block,                 \
                                     const ELEM *k_next, int64_t n, int64_t nh,                \
                                     const float *q, float *scores) {                          \
        const int64_t D = HEAD_DIM, BS = geo->block_size, TS = geo->token_stride;              \
        const int64_t G = geo->num_heads / geo->num_kv_heads, HS = geo->head_stride;           \
        const int64_t run_bytes = nh * HS * (int64_t)sizeof(ELEM);                             \
        for (int64_t t = 0; t < n; ++t) {                                                      \
            prefetch_run(k_next + t * TS, run_bytes, 1);                                       \
            prefetch_run(k_next + geo->kv_stride + t * TS, run_bytes, 1);                      \
            for (int64_t h = 0; h < nh; ++h) {                                                 \
                const ELEM *k = k_block + t * TS + h * HS;                                     \
                const float k_scale = ROW_SCALE(k, D);                                         \
                for (int64_t r = h * G; r < (h + 1) * G; ++r) {                                \
                    const float *qr = q + r * D;                                               \
                    float dot = 0.0f;                                                          \
                    _Pragma("omp simd reduction(+ : dot)") for (int64_t d = 0; d < D; ++d)     \
                        dot += qr[d] * LOAD(k[d]);                                             \
                    scores[r * BS + t] = dot * k_scale;                                        \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* acc[r] += sum over the block's positions t of weight[r * BS + t] * V[t] */              \
    static inline void NAME##_values(const Geometry *geo, const ELEM *v_block, int64_t n,      \
                                     int64_t nh, const float *weights, float *acc) {           \
        const int64_t D = HEAD_DIM, BS = geo->block_size, TS = geo->token_stride;              \
        const int64_t G = geo->num_heads / geo->num_kv_heads, HS = geo->head_stride;           \
        for (int64_t t = 0; t < n; ++t) {                                                      \
            for (int64_t h = 0; h < nh; ++h) {                                                 \
                const ELEM *v = v_block + t * TS + h * HS;                                     \
                const float v_scale = ROW_SCALE(v, D);                                         \
                for (int64_t r = h * G; r < (h + 1) * G; ++r) {                                \
                    const float p = weights[r * BS + t] * v_scale;                             \
                    float *a = acc + r * D;                                                    \
                    _Pragma("omp simd") for (int64_t d = 0; d < D; ++d) a[d] += p * LOAD(v[d]); \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void NAME(const Geometry *geo, const ELEM *pool, const int32_t *table, int64_t len, \
                     int64_t h0, int64_t nh, const ELEM *after, const float *q, float *scores, \
                     float *acc, float *m, float *l) {                                         \
        const int64_t D = HEAD_DIM, BS = geo->block_size;                                      \
        const int64_t rows = nh * (geo->num_heads / geo->num_kv_heads);                        \
        const int64_t num_blocks = (len + BS - 1) / BS;                                        \
        const ELEM *base = pool + geo->layer_offset + h0 * geo->head_stride;                   \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            m[r] = -FLT_MAX;                                                                   \
            l[r] = 0.0f;                                                                       \
        }                                                                                      \
        memset(acc, 0, (size_t)(rows * D) * sizeof(float));                                    \
        for (int64_t j = 0; j < num_blocks; ++j) {                                             \
            const ELEM *k_block = base + table[j] * geo->block_stride;                         \
            const ELEM *k_next = NEXT_BLOCK(base, table, j, num_blocks, geo, after, k_block);  \
            const int64_t n = len - j * BS < BS ? len - j * BS : BS;                           \
            NAME##_scores(geo, k_block, k_next, n, nh, q, scores);                             \
            for (int64_t r = 0; r < rows; ++r)                                                 \
                online_softmax_step(scores + r * BS, n, m + r, l + r, acc + r * D, D);         \
            NAME##_values(geo, k_block + geo->kv_stride, n, nh, scores, acc);                  \
        }                                                                                      \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            const float inv = 1.0f / l[r];                                                     \
            _Pragma("omp simd") for (int64_t d = 0; d < D; ++d) acc[r * D + d] *= inv;         \
        }                                                                                      \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_INT8(x) ((float)(x))
#define NO_ROW_SCALE(row, D) 1.0f
#define INT8_ROW_SCALE(row, D) int8_row_scale(row, D)
/* head_dim 64 (SmolLM2, Llama 3.2 1B) gets its own copy: a constant trip count lets the
 * compiler unroll the dot products fully; any other head_dim takes the generic copy. */
DEFINE_SEQ(seq_f32_64, float, LOAD_F32, 64, NO_ROW_SCALE)
DEFINE_SEQ(seq_bf16_64, uint16_t, LOAD_BF16, 64, NO_ROW_SCALE)
DEFINE_SEQ(seq_int8_64, int8_t, LOAD_INT8, 64, INT8_ROW_SCALE)
DEFINE_SEQ(seq_f32_any, float, LOAD_F32, geo->head_dim, NO_ROW_SCALE)
DEFINE_SEQ(seq_bf16_any, uint16_t, LOAD_BF16, geo->head_dim, NO_ROW_SCALE)
DEFINE_SEQ(seq_int8_any, int8_t, LOAD_INT8, geo->head_dim, INT8_ROW_SCALE)

#ifdef __AVX512F__
/* head_dim 64 with positions in the 16 lanes of AVX-512 registers (this machine's
 * -march=native has AVX-512 and AVX-512 BF16).
 *
 * Why a second copy: the portable code above spends as long on its arithmetic as on its
 * reads, and the two add up rather than overlap (one thread, 64 sequences x ~900 positions:
 * bf16 145-165 ms with the K/V in cache, fp32 109 ms, where merely reading the bf16 K/V from
 * memory takes ~110 ms). Here 16 positions' dot products are summed by one
 * transpose-and-add tree, the softmax runs with positions in lanes, the running sum stays a
 * vector until the end, and each kv head's output rows stay in registers; in bf16,
 * vdpbf16ps multiplies bf16 pairs straight into fp32 sums, so K and V are never widened. In
 * cache: bf16 60 ms, fp32 62 ms; on the real pool with two threads 1.17x (bf16) and 1.15x
 * (fp32) faster. Products and sums are fp32 as above, in another order; bf16 rounds the
 * softmax weights to bf16 for P.V (values16_bf16).
 */
#include <immintrin.h>
#define PD_LANE_KERNELS 1

enum { PD_LANES = 16, PD_MAX_GROUP = 4 }; /* a kv head's output rows fit in registers */

/* Lane i of the result is the sum of the 16 lanes of x[i]. */
static inline __m512 sum_lanes16(const __m512 *x) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; ++i)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                                 _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; ++i)
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}

/* dots[t] holds 16 partial sums of q . K[t] for a chunk's first `rows` positions (those
 * in memory), zero for the others; `next` (or NULL): the next block's K rows to prefetch,
 * one per position. row16 loads 16 elements of a V row as floats. */
static inline void dots16_f32(const float *k, int64_t TS, int64_t rows, const float *q,
                              __m512 *dots, const float *next) {
    const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
    const __m512 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
#pragma GCC unroll 16
    for (int t = 0; t < PD_LANES; ++t) {
        const float *kt = k + t * TS;
        if (next && t < rows) prefetch_run(next + t * TS, 64 * sizeof(float), 0);
        dots[t] = t < rows ? _mm512_add_ps(
                                 _mm512_fmadd_ps(_mm512_loadu_ps(kt + 32), q2,
                                                 _mm512_mul_ps(_mm512_loadu_ps(kt), q0)),
                                 _mm512_fmadd_ps(_mm512_loadu_ps(kt + 48), q3,
                                                 _mm512_mul_ps(_mm512_loadu_ps(kt + 16), q1)))
                           : _mm512_setzero_ps();
    }
}

/* The V side of a chunk of n <= 16 positions: out[g] (a kv head's G output rows, four
 * vectors each, in the order ORDERED puts right at the end) += sum over t of p[g][t] * V[t],
 * where WEIGHTS stored p[g] (the chunk's 16 weights of query row g) at weights + 16 g, and
 * the next block's rows at v_ahead are prefetched. fp32: one V row at a time. */
static inline void weights_f32(__m512 p, float *dst) { _mm512_storeu_ps(dst, p); }

static inline void values16_f32(const float *v, int64_t TS, int64_t n, int64_t G,
                                const float *weights, __m512 (*out)[4], const float *v_ahead) {
    for (int64_t t = 0; t < n; ++t) {
        prefetch_run(v_ahead + t * TS, 64 * sizeof(float), 0);
        __m512 vr[4];
        for (int i = 0; i < 4; ++i) vr[i] = _mm512_loadu_ps(v + t * TS + 16 * i);
        for (int64_t g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(weights[g * PD_LANES + t]);
            for (int i = 0; i < 4; ++i) out[g][i] = _mm512_fmadd_ps(w, vr[i], out[g][i]);
        }
    }
}

static inline void ordered_f32(__m512 *x) { (void)x; }

#ifdef __AVX512BF16__
#define PD_LANE_BF16 1

/* A memcpy, not a vector cast: GCC 12 routes casts to __m512bh through the stack. */
static inline __m512bh load_bf16x32(const uint16_t *src) {
    __m512bh v;
    memcpy(&v, src, sizeof v);
    return v;
}

static inline void dots16_bf16(const uint16_t *k, int64_t TS, int64_t rows, const uint16_t *q,
                               __m512 *dots, const uint16_t *next) {
    const __m512bh qa = load_bf16x32(q), qb = load_bf16x32(q + 32);
#pragma GCC unroll 16
    for (int t = 0; t < PD_LANES; ++t) {
        const uint16_t *kt = k + t * TS;
        if (next && t < rows) prefetch_run(next + t * TS, 64 * sizeof(uint16_t), 0);
        dots[t] = t < rows ? _mm512_dpbf16_ps(
                                 _mm512_dpbf16_ps(_mm512_setzero_ps(), load_bf16x32(kt), qa),
                                 load_bf16x32(kt + 32), qb)
                           : _mm512_setzero_ps();
    }
}

/* bf16: two positions at a time on vdpbf16ps, as the prefill kernel and torch's flash
 * kernel do their P.V (the weights rounded to bf16, their sum l kept from the fp32 ones).
 * The rows of positions t and t + 1 are interleaved word by word (vpunpck[lh]wd, within
 * 128-bit lanes), so each 32-bit word pairs V[t][d] with V[t + 1][d], and one vdpbf16ps
 * against the broadcast weight pair (p[t], p[t + 1]) adds both products to 16 outputs.
 * Per position that is 6 multiply-adds and 2 shuffles where widening one row at a time
 * took 12 multiply-adds and 4 widening ops. Measured against that (Zen 4, 2026-11-26,
 * alternating runs): K/V in cache, two threads, 1.05-1.12x faster (8-32 sequences); from
 * memory 1.12x on one thread and level (0.97-1.03x) on two, where the reads bound it. */
static inline void weights_bf16(__m512 p, float *dst) {
    /* word i of the result is p[i] rounded: 32-bit word i holds the pair (p[2i], p[2i+1]) */
    const __m256bh pairs = _mm512_cvtneps_pbh(p);
    memcpy(dst, &pairs, sizeof pairs);
}

static inline __m512bh as_bf16x32(__m512i x) {
    __m512bh v;
    memcpy(&v, &x, sizeof v);
    return v;
}

static inline void values16_bf16(const uint16_t *v, int64_t TS, int64_t n, int64_t G,
                                 const float *weights, __m512 (*out)[4],
                                 const uint16_t *v_ahead) {
    for (int64_t t = 0; t < n; t += 2) {
        const int both = t + 1 < n; /* else the row past n is zeros (its weight is 0, and
                                       the memory there may hold anything, NaN included) */
        prefetch_run(v_ahead + t * TS, 64 * sizeof(uint16_t), 0);
        if (both) prefetch_run(v_ahead + (t + 1) * TS, 64 * sizeof(uint16_t), 0);
        __m512i rows[2][2];
        for (int i = 0; i < 2; ++i) {
            rows[0][i] = _mm512_loadu_si512(v + t * TS + 32 * i);
            rows[1][i] = both ? _mm512_loadu_si512(v + (t + 1) * TS + 32 * i)
                              : _mm512_setzero_si512();
        }
        __m512bh x[4];
        for (int i = 0; i < 2; ++i) {
            x[2 * i] = as_bf16x32(_mm512_unpacklo_epi16(rows[0][i], rows[1][i]));
            x[2 * i + 1] = as_bf16x32(_mm512_unpackhi_epi16(rows[0][i], rows[1][i]));
        }
        for (int64_t g = 0; g < G; ++g) {
            const __m512bh w = as_bf16x32(
                _mm512_castps_si512(_mm512_set1_ps(weights[g * PD_LANES + t / 2])));
            for (int i = 0; i < 4; ++i) out[g][i] = _mm512_dpbf16_ps(out[g][i], x[i], w);
        }
    }
}

/* Output vector 2j (j = 0, 1) holds, in 128-bit lane c, values 32j + 8c .. 32j + 8c + 3;
 * vector 2j + 1 the next four of each lane (the unpacks' order): back to 0 .. 63. */
static inline void ordered_bf16(__m512 *x) {
    const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    for (int i = 0; i < 4; i += 2) {
        const __m512 low = x[i], high = x[i + 1];
        x[i] = _mm512_permutex2var_ps(low, first, high);
        x[i + 1] = _mm512_permutex2var_ps(low, second, high);
    }
}
#endif

/* A query row's 16 scores (the unscaled sums; lanes outside `valid` ignored) into its running
 * softmax: its max m and 16-lane sum absorb them, the sum first rescaled by *shrink (1 unless
 * the max grows, which the row's output then needs too); returns the weights exp(s - m), 0
 * outside valid. */
static inline __m512 softmax_step16(__m512 sums16, float scale, __mmask16 valid, float *m,
                                    __m512 *sum, float *shrink) {
    const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-FLT_MAX),
                                          _mm512_mul_ps(sums16, _mm512_set1_ps(scale)));
    *shrink = 1.0f;
    if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(*m), _CMP_GT_OQ)) {
        const float top = _mm512_reduce_max_ps(s);
        *shrink = exp_poly(*m - top);
        *m = top;
        *sum = _mm512_mul_ps(*sum, _mm512_set1_ps(*shrink));
    }
    const __m512 p =
        _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(s, _mm512_set1_ps(*m))));
    *sum = _mm512_add_ps(*sum, p);
    return p;
}

/* A kv head's G output rows (64 floats each at acc) into registers, rescaled by shrink[g];
 * and back. */
static inline void load_outputs(const float *acc, int64_t G, const float *shrink,
                                __m512 (*out)[4]) {
    for (int64_t g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i)
            out[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * 64 + 16 * i),
                                      _mm512_set1_ps(shrink[g]));
}

static inline void store_outputs(__m512 (*out)[4], int64_t G, float *acc) {
    for (int64_t g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * 64 + 16 * i, out[g][i]);
}

/* Each row's output divided by its softmax sum, in the value order ORDERED puts right. */
static inline void finish_rows(float *acc, int64_t rows, const __m512 *sums,
                               void (*ordered)(__m512 *)) {
    for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sums[r]));
        __m512 x[4];
        for (int i = 0; i < 4; ++i) x[i] = _mm512_loadu_ps(acc + r * 64 + 16 * i);
        ordered(x);
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + r * 64 + 16 * i, x[i] * inv);
    }
}

/* One sequence's work for kv heads [h0, h0 + nh) with the K/V read in chunks of 16
 * positions. q: the rows' query vectors, unscaled (scale multiplies the scores); acc:
 * rows * 64 floats out (in VALUES16's order until the end); weights: G * 16 floats and sums:
 * rows vectors of scratch; m: rows floats; after: as in DEFINE_SEQ. */
#define DEFINE_LANE_SEQ(NAME, ELEM, DOTS16, WEIGHTS, VALUES16, ORDERED)                   \
    static void NAME(const Geometry *geo, const ELEM *pool, const int32_t *table, int64_t len, \
                     int64_t h0, int64_t nh, const ELEM *after, const ELEM *q, float scale,    \
                     float *weights, float *acc, float *m, __m512 *sums) {                     \
        const int64_t D = 64, BS = geo->block_size, TS = geo->token_stride;                    \
        const int64_t G = geo->num_heads / geo->num_kv_heads, rows = nh * G;                   \
        const int64_t num_blocks = (len + BS - 1) / BS;                                        \
        const ELEM *base = pool + geo->layer_offset + h0 * geo->head_stride;                   \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            m[r] = -FLT_MAX;                                                                   \
            sums[r] = _mm512_setzero_ps();                                                     \
        }                                                                                      \
        memset(acc, 0, (size_t)(rows * D) * sizeof(float));                                    \
        for (int64_t j = 0; j < num_blocks; ++j) {                                             \
            const ELEM *k_block = base + table[j] * geo->block_stride;                         \
            const ELEM *k_next = NEXT_BLOCK(base, table, j, num_blocks, geo, after, k_block);  \
            const int64_t in_block = len - j * BS < BS ? len - j * BS : BS;                    \
            for (int64_t t0 = 0; t0 < in_block; t0 += PD_LANES) {                              \
                const int64_t n = in_block - t0 < PD_LANES ? in_block - t0 : PD_LANES;         \
                const int64_t in_memory = BS - t0 < PD_LANES ? BS - t0 : PD_LANES;             \
                const __mmask16 valid = (__mmask16)((1u << n) - 1u);                           \
                for (int64_t h = 0; h < nh; ++h) {                                             \
                    const ELEM *k = k_block + t0 * TS + h * geo->head_stride;                  \
                    const ELEM *v = k + geo->kv_stride;                                        \
                    const ELEM *k_ahead = k_next + t0 * TS + h * geo->head_stride;             \
                    const ELEM *v_ahead = k_ahead + geo->kv_stride; /* the next block's */     \
                    float shrink[PD_MAX_GROUP];                                                \
                    for (int64_t g = 0; g < G; ++g) {                                          \
                        const int64_t r = h * G + g;                                           \
                        __m512 dots[PD_LANES];                                                 \
                        DOTS16(k, TS, in_memory, q + r * D, dots, g == 0 ? k_ahead : NULL);    \
                        const __m512 p = softmax_step16(sum_lanes16(dots), scale, valid,       \
                                                        m + r, sums + r, shrink + g);          \
                        WEIGHTS(p, weights + g * PD_LANES);                                    \
                    }                                                                          \
                    __m512 out[PD_MAX_GROUP][4];                                               \
                    load_outputs(acc + h * G * D, G, shrink, out);                             \
                    VALUES16(v, TS, n, G, weights, out, v_ahead);                              \
                    store_outputs(out, G, acc + h * G * D);                                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        finish_rows(acc, rows, sums, ORDERED);                                                 \
    }

DEFINE_LANE_SEQ(lane_seq_f32_64, float, dots16_f32, weights_f32, values16_f32, ordered_f32)

#ifdef PD_LANE_BF16
DEFINE_LANE_SEQ(lane_seq_bf16_64, uint16_t, dots16_bf16, weights_bf16, values16_bf16,
                ordered_bf16)
#endif

/* The first `rows` of 16 int8 rows of 64 values (TS bytes apart, each with its scale after
 * it) widened, unscaled, to 64 fp32 values each at dst (exact), and their scales at
 * scales[t] (0 past rows); the rows at next are prefetched. */
static inline void widen16_int8_f32(const int8_t *src, int64_t TS, int64_t rows, float *dst,
                                    float *scales, const int8_t *next) {
    for (int64_t t = 0; t < PD_LANES; ++t) {
        if (t >= rows) {
            scales[t] = 0.0f;
            continue;
        }
        const int8_t *row = src + t * TS;
        prefetch_run(next + t * TS, 64 + KV_INT8_SCALE_BYTES, 0);
        scales[t] = int8_row_scale(row, 64);
        for (int i = 0; i < 4; ++i) {
            const __m128i bytes = _mm_loadu_si128((const void *)(row + 16 * i));
            _mm512_storeu_ps(dst + t * 64 + 16 * i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
        }
    }
}

/* One int8 pool chunk's work, the way lane_seq_*_64 does a float pool's: per kv head, the
 * chunk's 16 K and V rows widened once into staging (WIDEN16: to the STAGED element type,
 * 8 KB or less, in L1), where DOTS16 and VALUES16 read them for each of the G query rows;
 * the row scales multiply the scores (K) and the softmax weights (V), after the weights'
 * sum. q: the rows' query vectors (QELEM), unscaled; staged: 2 * 16 * 64 STAGED elements
 * then 2 * 16 floats of scratch; the rest as in DEFINE_LANE_SEQ. */
#define DEFINE_LANE_SEQ_INT8(NAME, QELEM, STAGED, WIDEN16, DOTS16, WEIGHTS, VALUES16, ORDERED) \
    static void NAME(const Geometry *geo, const int8_t *pool, const int32_t *table,           \
                     int64_t len, int64_t h0, int64_t nh, const int8_t *after,                 \
                     const QELEM *q, float scale, float *weights, float *acc, float *m,        \
                     __m512 *sums, STAGED *staged) {                                           \
        const int64_t D = 64, BS = geo->block_size, TS = geo->token_stride;                    \
        const int64_t G = geo->num_heads / geo->num_kv_heads, rows = nh * G;                   \
        const int64_t num_blocks = (len + BS - 1) / BS;                                        \
        const int8_t *base = pool + geo->layer_offset + h0 * geo->head_stride;                 \
        STAGED *k_staged = staged, *v_staged = staged + PD_LANES * D;                          \
        float *k_scales = (float *)(staged + 2 * PD_LANES * D), *v_scales = k_scales + PD_LANES; \
        for (int64_t r = 0; r < rows; ++r) {                                                   \
            m[r] = -FLT_MAX;                                                                   \
            sums[r] = _mm512_setzero_ps();                                                     \
        }                                                                                      \
        memset(acc, 0, (size_t)(rows * D) * sizeof(float));                                    \
        for (int64_t j = 0; j < num_blocks; ++j) {                                             \
            const int8_t *k_block = base + table[j] * geo->block_stride;                       \
            const int8_t *k_next = NEXT_BLOCK(base, table, j, num_blocks, geo, after, k_block); \
            const int64_t in_block = len - j * BS < BS ? len - j * BS : BS;                    \
            for (int64_t t0 = 0; t0 < in_block; t0 += PD_LANES) {                              \
                const int64_t n = in_block - t0 < PD_LANES ? in_block - t0 : PD_LANES;         \
                const __mmask16 valid = (__mmask16)((1u << n) - 1u);                           \
                for (int64_t h = 0; h < nh; ++h) {                                             \
                    const int8_t *k = k_block + t0 * TS + h * geo->head_stride;                \
                    const int8_t *k_ahead = k_next + t0 * TS + h * geo->head_stride;           \
                    WIDEN16(k, TS, n, k_staged, k_scales, k_ahead);                            \
                    WIDEN16(k + geo->kv_stride, TS, n, v_staged, v_scales,                     \
                            k_ahead + geo->kv_stride);                                         \
                    const __m512 k_scale = _mm512_loadu_ps(k_scales);                          \
                    const __m512 v_scale = _mm512_loadu_ps(v_scales);                          \
                    float shrink[PD_MAX_GROUP];                                                \
                    for (int64_t g = 0; g < G; ++g) {                                          \
                        const int64_t r = h * G + g;                                           \
                        __m512 dots[PD_LANES];                                                 \
                        DOTS16(k_staged, D, n, q + r * D, dots, NULL);                         \
                        const __m512 s = _mm512_mul_ps(sum_lanes16(dots), k_scale);            \
                        const __m512 p =                                                       \
                            softmax_step16(s, scale, valid, m + r, sums + r, shrink + g);      \
                        WEIGHTS(_mm512_mul_ps(p, v_scale), weights + g * PD_LANES);            \
                    }                                                                          \
                    __m512 out[PD_MAX_GROUP][4];                                               \
                    load_outputs(acc + h * G * D, G, shrink, out);                             \
                    VALUES16(v_staged, D, n, G, weights, out, v_staged);                       \
                    store_outputs(out, G, acc + h * G * D);                                    \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        finish_rows(acc, rows, sums, ORDERED);                                                 \
    }

/* fp32 queries: fp32 products, as lane_seq_f32_64. */
DEFINE_LANE_SEQ_INT8(lane_seq_int8_f32_64, float, float, widen16_int8_f32, dots16_f32,
                     weights_f32, values16_f32, ordered_f32)
#ifdef PD_LANE_BF16
/* The rows widened to bf16 (exact: |value| <= 127), the products on vdpbf16ps as
 * lane_seq_bf16_64 does them. */
static inline void widen16_int8_bf16(const int8_t *src, int64_t TS, int64_t rows,
                                     uint16_t *dst, float *scales, const int8_t *next) {
    for (int64_t t = 0; t < PD_LANES; ++t) {
        if (t >= rows) {
            scales[t] = 0.0f;
            continue;
        }
        const int8_t *row = src + t * TS;
        prefetch_run(next + t * TS, 64 + KV_INT8_SCALE_BYTES, 0);
        scales[t] = int8_row_scale(row, 64);
        for (int i = 0; i < 2; ++i) {
            const __m128i low = _mm_loadu_si128((const void *)(row + 32 * i));
            const __m128i high = _mm_loadu_si128((const void *)(row + 32 * i + 16));
            const __m512bh words = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(high)),
                                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(low)));
            memcpy(dst + t * 64 + 32 * i, &words, sizeof words);
        }
    }
}

/* bf16 queries. Measured against the bf16 pool's kernel on the same sequences (Zen 4,
 * 2026-11-27; 32 sequences of 800 positions, 30 layers, medians of 7 alternating runs):
 * 0.79x its time on two threads, 0.82x on one, reading half its bytes; widened to fp32
 * (lane_seq_int8_f32_64) it was 0.97x and 1.2x, and the portable code 4.5x. */
DEFINE_LANE_SEQ_INT8(lane_seq_int8_bf16_64, uint16_t, uint16_t, widen16_int8_bf16, dots16_bf16,
                     weights_bf16, values16_bf16, ordered_bf16)
#endif
#endif

/* Scratch of one thread, carved from one 64-byte aligned allocation: rows 16-lane running
 * sums (first, so aligned for vector stores), rows query vectors, rows outputs, rows *
 * max(block_size, 16) scores, rows running maxima, rows running sums, and for an int8 pool
 * a chunk's K and V rows widened (2 * 16 * head_dim floats at most) and their scales (2 *
 * 16). */
typedef struct {
    float *lanes, *q, *acc, *scores, *m, *l, *staged;
} Scratch;

static float *scratch_alloc(Scratch *sc, int64_t rows, int64_t head_dim, int64_t block_size) {
    const int64_t score_width = block_size > 16 ? block_size : 16;
    const int64_t floats = rows * (16 + 2 * head_dim + score_width + 2) + 2 * 16 * (head_dim + 1);
    const size_t bytes = (size_t)floats * sizeof(float);
    float *base = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (base == NULL) return NULL;
    sc->lanes = base;
    sc->q = sc->lanes + rows * 16;
    sc->acc = sc->q + rows * head_dim;
    sc->scores = sc->acc + rows * head_dim;
    sc->m = sc->scores + rows * score_width;
    sc->l = sc->m + rows;
    sc->staged = sc->l + rows;
    return base;
}

/* The portable code for element type T on the scaled query rows in sc->q: its head_dim-64
 * copy or the generic one. */
#define RUN_PORTABLE(T)                                                                        \
    (geo->head_dim == 64 ? seq_##T##_64 : seq_##T##_any)(geo, pool, table, len, h0, nh, after, \
                                                          sc->q, sc->scores, sc->acc, sc->m,    \
                                                          sc->l)

/* An item over an int8 pool: for head_dim 64, the AVX-512 code where it is built (bf16
 * queries on vdpbf16ps where the CPU has it, else widened to fp32); otherwise the portable
 * code, on the query rows widened and scaled here; the output rounded to the query's dtype. */
static void run_int8_item(const Geometry *geo, int dtype, const void *q_src, const int8_t *pool,
                          const int32_t *table, int64_t len, int64_t h0, int64_t nh,
                          const int8_t *after, float scale, void *out_dst, Scratch *sc) {
    const int64_t D = geo->head_dim, n = nh * (geo->num_heads / geo->num_kv_heads) * D;
#ifdef PD_LANE_KERNELS
    const int lanes = D == 64 && geo->num_heads / geo->num_kv_heads <= PD_MAX_GROUP;
    __m512 *sums = (__m512 *)sc->lanes;
#ifdef PD_LANE_BF16
    if (lanes && dtype == KV_BFLOAT16)
        lane_seq_int8_bf16_64(geo, pool, table, len, h0, nh, after, q_src, scale, sc->scores,
                              sc->acc, sc->m, sums, (uint16_t *)sc->staged);
    else
#endif
#endif
    {
        for (int64_t i = 0; i < n; ++i)
            sc->q[i] = dtype == KV_FLOAT32 ? ((const float *)q_src)[i]
                                           : bf16_to_f32(((const uint16_t *)q_src)[i]);
#ifdef PD_LANE_KERNELS
        if (lanes)
            lane_seq_int8_f32_64(geo, pool, table, len, h0, nh, after, sc->q, scale, sc->scores,
                                 sc->acc, sc->m, sums, sc->staged);
        else
#endif
        {
            for (int64_t i = 0; i < n; ++i) sc->q[i] *= scale;
            RUN_PORTABLE(int8);
        }
    }
    if (dtype == KV_FLOAT32) {
        memcpy(out_dst, sc->acc, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *o = out_dst;
    for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(sc->acc[i]);
}

/* One work item: query rows in, attention out, converting from/to the element type (dtype:
 * the queries' and outputs'; the pool's is the same, or int8). */
static void run_item(const Geometry *geo, int dtype, int kv_format, const void *q_src,
                     const void *pool, const int32_t *table, int64_t len, int64_t h0, int64_t nh,
                     const void *after, float scale, void *out_dst, Scratch *sc) {
    const int64_t D = geo->head_dim, n = nh * (geo->num_heads / geo->num_kv_heads) * D;
    if (kv_format == KV_INT8) {
        run_int8_item(geo, dtype, q_src, pool, table, len, h0, nh, after, scale, out_dst, sc);
        return;
    }
#ifdef PD_LANE_KERNELS
    const int lanes = D == 64 && geo->num_heads / geo->num_kv_heads <= PD_MAX_GROUP;
#endif
    if (dtype == KV_FLOAT32) {
        const float *qs = q_src;
#ifdef PD_LANE_KERNELS
        if (lanes)
            lane_seq_f32_64(geo, pool, table, len, h0, nh, after, qs, scale, sc->scores, sc->acc,
                            sc->m, (__m512 *)sc->lanes);
        else
#endif
        {
            for (int64_t i = 0; i < n; ++i) sc->q[i] = qs[i] * scale;
            RUN_PORTABLE(f32);
        }
        memcpy(out_dst, sc->acc, (size_t)n * sizeof(float));
    } else {
        const uint16_t *qs = q_src;
#ifdef PD_LANE_BF16
        if (lanes)
            lane_seq_bf16_64(geo, pool, table, len, h0, nh, after, qs, scale, sc->scores, sc->acc,
                             sc->m, (__m512 *)sc->lanes);
        else
#endif
        {
            for (int64_t i = 0; i < n; ++i) sc->q[i] = bf16_to_f32(qs[i]) * scale;
            RUN_PORTABLE(bf16);
        }
        uint16_t *o = out_dst;
        for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(sc->acc[i]);
    }
}

/* Where work item (sequence b, kv heads from h0) starts reading: its first block's K rows. */
static const void *first_block(const Geometry *geo, const void *pool, const int32_t *tables,
                               int64_t table_width, int64_t b, int64_t h0, int64_t elem) {
    const int64_t offset = geo->layer_offset + h0 * geo->head_stride +
                           tables[b * table_width] * geo->block_stride;
    return (const char *)pool + offset * elem;
}

/* Attention of one query token per sequence over its cached positions 0 .. lens[b] - 1.
 *
 * q:      query of sequence b, head hq at q + q_rows[b] * q_row_stride + hq * head_dim
 *         (q_rows NULL: row b). Elements of `dtype` (KV_FLOAT32 or KV_BFLOAT16).
 * pool:   the KV pool (layout above), contiguous, in `kv_format`: `dtype`, or KV_INT8.
 * tables: [num_seqs][table_width] int32 block ids; lens: [num_seqs] int32 context lengths,
 *         each >= 1 and within the table.
 * out:    written at out + q_rows[b] * out_row_stride + hq * head_dim, elements of `dtype`.
 * Returns 0, or -1 when scratch memory cannot be allocated (out is then incomplete).
 */
int pdserve_paged_decode(const void *q, int64_t q_row_stride, const int32_t *q_rows,
                         const void *pool, const int32_t *tables, int64_t table_width,
                         const int32_t *lens, int64_t num_seqs, void *out, int64_t out_row_stride,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t num_layers, int64_t block_size, int64_t layer, float scale,
                         int dtype, int kv_format, int num_threads) {
    const Geometry geo = pool_geometry(num_heads, num_kv_heads, head_dim, kv_format, num_layers,
                                       block_size, layer);
    /* Work items are whole sequences (a token row holds all kv heads: read it in one run);
     * with under two sequences per thread, (sequence, kv head) pairs instead, so a few long
     * sequences still spread evenly over the threads. */
    const int64_t few = num_threads > 1 && num_seqs < 2 * (int64_t)num_threads;
    const int64_t split = few ? num_kv_heads : 1;
    const int64_t heads_per_item = num_kv_heads / split;
    const int64_t group = num_heads / num_kv_heads; /* query heads per kv head */
    const int64_t elem = kv_element_bytes(dtype), kv_elem = kv_element_bytes(kv_format);
    const int64_t items = num_seqs * split;
    int64_t claimed = 0; /* items handed out so far */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
    {
        Scratch sc;
        float *base = scratch_alloc(&sc, heads_per_item * group, head_dim, block_size);
        failed = base == NULL;
        /* Each thread claims its next item while it runs this one, so that this one's last
         * block can prefetch the next one's first: a sequence's first block is otherwise read
         * cold, once per sequence and layer. Items go out in plan order, as a dynamic
         * schedule would hand them; the cost: an item claimed ahead cannot go to a thread
         * that runs out of work, which the plan's longest-first order keeps to short ones. */
        int64_t w;
#pragma omp atomic capture
        w = claimed++;
        while (w < items) {
            int64_t w_next;
#pragma omp atomic capture
            w_next = claimed++;
            const void *after = w_next < items ? first_block(&geo, pool, tables, table_width,
                                                             w_next / split,
                                                             (w_next % split) * heads_per_item,
                                                             kv_elem)
                                               : NULL;
            if (!failed) {
                const int64_t b = w / split, h0 = (w % split) * heads_per_item;
                const int64_t row = q_rows ? q_rows[b] : b;
                const char *src =
                    (const char *)q + (row * q_row_stride + h0 * group * head_dim) * elem;
                char *dst = (char *)out + (row * out_row_stride + h0 * group * head_dim) * elem;
                run_item(&geo, dtype, kv_format, src, pool, tables + b * table_width, lens[b], h0,
                         heads_per_item, after, scale, dst, &sc);
            }
            w = w_next;
        }
        free(base);
    }
    return failed ? -1 : 0;
}

/* One kv head's head_dim values (float32 or bfloat16 at src) as an int8 pool row: int8
 * values, then the bf16 scale, by kv_codec/int8_rows.py's rules and bit for bit its result
 * (the scale absmax / 127 rounded up to bf16; values rounded to nearest even, as torch.round,
 * after an IEEE division). */
static void quantize_int8_row(const void *src, int dtype, int64_t head_dim, int8_t *dst) {
    float x[head_dim];
    float absmax = 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) {
        x[d] = dtype == KV_FLOAT32 ? ((const float *)src)[d]
                                   : bf16_to_f32(((const uint16_t *)src)[d]);
        absmax = fabsf(x[d]) > absmax ? fabsf(x[d]) : absmax;
    }
    const float exact = absmax / 127.0f;
    uint16_t bits = f32_to_bf16(exact);
    if (bf16_to_f32(bits) < exact) bits += 1; /* the next bf16 up: |x / scale| <= 127 */
    const float scale = bf16_to_f32(bits), divisor = scale > 0.0f ? scale : 1.0f;
    for (int64_t d = 0; d < head_dim; ++d) {
        const float q = nearbyintf(x[d] / divisor);
        dst[d] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
    }
    memcpy(dst + head_dim, &bits, sizeof bits);
}

/* One step row (one token's K or V, every kv head) into its pool row at dst. */
static void store_row(const char *src, int dtype, int kv_format, int64_t kv_heads,
                      int64_t head_dim, char *dst) {
    if (kv_format == KV_INT8) {
        const int64_t src_head_bytes = head_dim * kv_element_bytes(dtype);
        for (int64_t h = 0; h < kv_heads; ++h)
            quantize_int8_row(src + h * src_head_bytes, dtype, head_dim,
                              (int8_t *)dst + h * (head_dim + KV_INT8_SCALE_BYTES));
        return;
    }
    const int64_t row_bytes = kv_heads * head_dim * kv_element_bytes(dtype);
#ifdef __AVX512F__
    if (row_bytes % 64 == 0 && ((uintptr_t)dst & 63) == 0) {
        for (int64_t o = 0; o < row_bytes; o += 64)
            _mm512_stream_si512((void *)(dst + o), _mm512_loadu_si512(src + o));
        return;
    }
#endif
    memcpy(dst, src, (size_t)row_bytes);
}

/* This step's K and V into the pool, seen as rows of one token's kv heads (the write view of
 * engine/attention/cpu.py): token i's K row (at k + i * k_row_stride) goes to row rows[i] +
 * layer_add, its V row (at v + i * v_row_stride) to row rows[tokens + i] + layer_add. k and
 * v hold `dtype` elements (the strides count them); the pool is in `kv_format`: `dtype` (a
 * copy) or KV_INT8 (each kv head quantized on its way in).
 *
 * Why here rather than torch's index_copy_: the rows a decode step writes are scattered over
 * the pool and cold, so each store first reads its line in. Whole 64-byte lines go out with
 * non-temporal stores instead, which skip that read: 96 rows of 384 bytes (48 tokens, bf16)
 * after 256 MB streamed through the caches took 81 us against index_copy_'s 183 us (Zen 4).
 * Returns 0, or -1 (nothing written) when a row lies outside the pool's pool_rows. */
int pdserve_store_kv(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride,
                     int64_t tokens, const int64_t *rows, int64_t layer_add, void *pool,
                     int64_t pool_rows, int64_t kv_heads, int64_t head_dim, int dtype,
                     int kv_format, int num_threads) {
    for (int64_t i = 0; i < 2 * tokens; ++i)
        if (rows[i] < 0 || rows[i] + layer_add >= pool_rows) return -1;
    const int64_t elem = kv_element_bytes(dtype);
    const Geometry geo = pool_geometry(kv_heads, kv_heads, head_dim, kv_format, 1, 1, 0);
    const int64_t pool_row_bytes = geo.token_stride * kv_element_bytes(kv_format);
    /* a parallel region costs more than it saves below a few hundred KB */
    const int threads = 2 * tokens * kv_heads * head_dim * elem >= (256 << 10) ? num_threads : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < 2 * tokens; ++i) {
            const char *src = i < tokens ? (const char *)k + i * k_row_stride * elem
                                         : (const char *)v + (i - tokens) * v_row_stride * elem;
            store_row(src, dtype, kv_format, kv_heads, head_dim,
                      (char *)pool + (rows[i] + layer_add) * pool_row_bytes);
        }
#ifdef __AVX512F__
        _mm_sfence(); /* order this thread's streamed lines before the threads join */
#endif
    }
    return 0;
}
