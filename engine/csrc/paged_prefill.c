/* Paged prefill attention on CPU, fp32 or bf16: a chunk of n query tokens of one sequence, at
 * positions start .. start + n - 1, attends causally to every position up to its own, K/V
 * read in place from the pool (its layout: pool_geometry.h).
 *
 * Built at first use by engine/attention/paged_prefill.py and called through ctypes. Why:
 * torch's CPU flash kernel reaches only 90-120 GFLOP/s of useful (causal) work on fp32
 * chunks of 128-512 tokens here, and a chunk after a cached prefix first needs a gather of
 * that prefix plus a second call and a merge (cpu_prefill.py). This kernel: 1.5-1.8x faster
 * at 128-512 tokens, 1.1-1.4x at 1,024-2,048 and after a 1,024-token prefix, ~230 GFLOP/s
 * at best on two threads (python -m bench.prefill_attention, 2026-11-23).
 *
 * In bf16 (q, the pool and out in bf16) both products take vdpbf16ps where the CPU has
 * AVX-512 BF16. Scores: q is held as pairs of its bf16 values (qp[d / 2][g], a pair per lane)
 * and each key's pair of values is broadcast, so K is read in place, with half as many
 * multiply-adds and no widening; the scale multiplies the sums. Values: each step's V rows
 * are interleaved in pairs of keys, and the softmax weights rounded to bf16 in the same
 * pairs, as GPU flash attention rounds them (the running sums stay fp32). Each output is
 * rounded to bf16 once. On a CPU without AMX, where torch's bf16 flash kernel runs no faster
 * than its fp32 one, this is 1.9-3.0x faster than torch's (python -m bench.prefill_attention
 * --dtype bf16, Zen 4, 2026-11-26; with fp32 arithmetic on widened K and V, 1.1-2.0x;
 * with only the scores on vdpbf16ps, 1.6-2.3x). Built without AVX-512 BF16 the kernel takes
 * fp32 only (bf16 returns -2) and bf16 chunks stay on torch's kernel.
 *
 * An int8 pool (int8 rows with a scale each, pool_geometry.h) takes the fp32 arithmetic: each
 * softmax step's K and V rows are dequantized into fp32 scratch (one pass over rows the step's
 * products then read 16 * G times), with queries and outputs in fp32 or bf16.
 *
 * Work items are (kv head, 16 query tokens). An item's query rows are its G = H / KVH query
 * heads times its 16 tokens, held transposed, tokens in the 16 lanes of a vector:
 *
 *     qt[d][g] = q[token t0 + lane][head h * G + g][d] * D^-1/2     (one v16 per (d, g))
 *
 * so that every step is a vector FMA with one scalar broadcast: the scores of key j are
 * sum_d K[j][d] * qt[d][g]; the running softmax keeps a max and a sum per lane; the output
 * ot[d][g] += V[j][d] * p[j][g]. STEP_KEYS keys (any blocks) make one softmax step.
 * Causality is a per-lane mask in the steps that reach past the item's first token. In fp32,
 * products and sums are fp32 throughout. A token tree (speculative verification) replaces
 * causality inside the chunk by each row's ancestors: the mask of a chunk key is then the
 * lanes that descend from it (Tree), the prefix before the chunk being seen by all.
 *
 * The softmax was a third of the bf16 kernel's time (one thread, 2,048 tokens after 1,024:
 * 80.5 ms in all, 54.6 of them folding keys in, of which ~30 the weights x V); on AVX-512
 * intrinsics with the bf16 pairs made as the weights are (softmax_keys) and 128 keys a step
 * instead of 32 (fewer rescales of the outputs), python -m bench.prefill_attention ran
 * 1.2x faster in bf16 (239 -> 292 GFLOP/s) and 1.1x in fp32 (160 -> 176), 2026-11-26.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_poly.h"
#include "pool_geometry.h"

enum { LANES = 16, KEY_TILE = 8, MAX_VECS = 3, STEP_KEYS = 128, MAX_TREE_ROWS = 64 };

/* A token tree's visibility inside one item: lanes[c] has bit i set when lane i's row sees
 * chunk row c (at position start + c). Keys before start are seen by every lane. */
typedef struct {
    int64_t start;
    uint16_t lanes[MAX_TREE_ROWS];
} Tree;

static inline int in_tree(const Tree *tree, int64_t pos) {
    return tree != NULL && pos >= tree->start;
}

/* s[j][g] = sum_d k[j][d] * qt[d][g] for keys j0 .. j0 + nk - 1 (nk <= KEY_TILE) and
 * query vectors g0 .. g0 + NV - 1 of nv_all. */
#define DEFINE_SCORES(NV)                                                                      \
    static void scores_##NV(const float *const *keys, int64_t nk, const v16 *qt,               \
                            int64_t nv_all, int64_t g0, int64_t d_len, v16 *s) {               \
        v16 acc[KEY_TILE][NV];                                                                 \
        for (int j = 0; j < KEY_TILE; ++j)                                                     \
            for (int g = 0; g < NV; ++g) acc[j][g] = (v16){0};                                 \
        const float *rows[KEY_TILE];                                                           \
        for (int j = 0; j < KEY_TILE; ++j) rows[j] = keys[j < nk ? j : 0];                     \
        for (int64_t d = 0; d < d_len; ++d) {                                                  \
            v16 q[NV];                                                                         \
            for (int g = 0; g < NV; ++g) q[g] = qt[d * nv_all + g0 + g];                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < KEY_TILE; ++j) {                       \
                const float kj = rows[j][d];                                                   \
                for (int g = 0; g < NV; ++g) acc[j][g] += kj * q[g];                           \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < nk; ++j)                                                           \
            for (int g = 0; g < NV; ++g) s[j * nv_all + g0 + g] = acc[j][g];                   \
    }

/* ot[d][g] = ot[d][g] * shrink[g] + sum_j v[j][d] * p[j][g] for d in d0 .. d0 + 7 and
 * query vectors g0 .. g0 + NV - 1, over nk keys. */
#define DEFINE_VALUES(NV)                                                                      \
    static void values_##NV(const float *const *keys, int64_t kv, int64_t nk, const v16 *p,    \
                            int64_t nv_all, int64_t g0, int64_t d0, const v16 *shrink,         \
                            v16 *ot) {                                                         \
        v16 acc[8][NV];                                                                        \
        for (int dd = 0; dd < 8; ++dd)                                                         \
            for (int g = 0; g < NV; ++g)                                                       \
                acc[dd][g] = ot[(d0 + dd) * nv_all + g0 + g] * shrink[g0 + g];                 \
        for (int64_t j = 0; j < nk; ++j) {                                                     \
            v16 pj[NV];                                                                        \
            for (int g = 0; g < NV; ++g) pj[g] = p[j * nv_all + g0 + g];                       \
            const float *vj = keys[j] + kv + d0;                                               \
            _Pragma("GCC unroll 8") for (int dd = 0; dd < 8; ++dd) {                           \
                const float x = vj[dd];                                                        \
                for (int g = 0; g < NV; ++g) acc[dd][g] += x * pj[g];                          \
            }                                                                                  \
        }                                                                                      \
        for (int dd = 0; dd < 8; ++dd)                                                         \
            for (int g = 0; g < NV; ++g) ot[(d0 + dd) * nv_all + g0 + g] = acc[dd][g];         \
    }

DEFINE_SCORES(1)
DEFINE_SCORES(2)
DEFINE_SCORES(3)
DEFINE_VALUES(1)
DEFINE_VALUES(2)
DEFINE_VALUES(3)

typedef void (*ScoresFn)(const float *const *, int64_t, const v16 *, int64_t, int64_t, int64_t,
                         v16 *);
typedef void (*ValuesFn)(const float *const *, int64_t, int64_t, const v16 *, int64_t, int64_t,
                         int64_t, const v16 *, v16 *);
static const ScoresFn SCORES[MAX_VECS + 1] = {0, scores_1, scores_2, scores_3};
static const ValuesFn VALUES[MAX_VECS + 1] = {0, values_1, values_2, values_3};

#ifdef __AVX512BF16__
#include <immintrin.h>
#define PP_BF16_PAIRS 1

/* s[j][g] = scale * sum_d k[j][d] * q[d][g] for bf16 key rows and qp[d / 2][g] (16 lanes of
 * bf16 pairs), keys j0 .. j0 + nk - 1 (nk <= KEY_TILE), query vectors g0 .. g0 + NV - 1. */
#define DEFINE_SCORES_BF16(NV)                                                                 \
    static void scores_bf16_##NV(const uint16_t *const *keys, int64_t nk, const __m512bh *qp,   \
                                 int64_t nv_all, int64_t g0, int64_t pairs, float scale,       \
                                 v16 *s) {                                                     \
        __m512 acc[KEY_TILE][NV];                                                              \
        for (int j = 0; j < KEY_TILE; ++j)                                                     \
            for (int g = 0; g < NV; ++g) acc[j][g] = _mm512_setzero_ps();                      \
        const uint16_t *rows[KEY_TILE];                                                        \
        for (int j = 0; j < KEY_TILE; ++j) rows[j] = keys[j < nk ? j : 0];                     \
        for (int64_t d = 0; d < pairs; ++d) {                                                  \
            __m512bh q[NV];                                                                    \
            for (int g = 0; g < NV; ++g) q[g] = qp[d * nv_all + g0 + g];                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < KEY_TILE; ++j) {                       \
                int32_t pair;                                                                  \
                memcpy(&pair, rows[j] + 2 * d, sizeof pair);                                   \
                const __m512bh kj = (__m512bh)_mm512_set1_epi32(pair);                         \
                for (int g = 0; g < NV; ++g) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], kj, q[g]); \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < nk; ++j)                                                           \
            for (int g = 0; g < NV; ++g) s[j * nv_all + g0 + g] = (v16)acc[j][g] * scale;      \
    }

DEFINE_SCORES_BF16(1)
DEFINE_SCORES_BF16(2)
DEFINE_SCORES_BF16(3)

/* ot[d][g] = ot[d][g] * shrink[g] + sum_j v[j][d] * p[j][g] for d in d0 .. d0 + 7 and query
 * vectors g0 .. g0 + NV - 1, over `pairs` pairs of keys: vp[j2][d] holds the bf16 pair
 * (V[2 j2][d], V[2 j2 + 1][d]), pp[j2][g] the matching pair of weights in each lane. */
#define DEFINE_VALUES_BF16(NV)                                                                 \
    static void values_bf16_##NV(const uint32_t *vp, int64_t d_len, int64_t pairs,             \
                                 const __m512bh *pp, int64_t nv_all, int64_t g0, int64_t d0,   \
                                 const v16 *shrink, v16 *ot) {                                 \
        __m512 acc[8][NV];                                                                     \
        for (int dd = 0; dd < 8; ++dd)                                                         \
            for (int g = 0; g < NV; ++g)                                                       \
                acc[dd][g] = (__m512)(ot[(d0 + dd) * nv_all + g0 + g] * shrink[g0 + g]);       \
        for (int64_t j = 0; j < pairs; ++j) {                                                  \
            __m512bh pj[NV];                                                                   \
            for (int g = 0; g < NV; ++g) pj[g] = pp[j * nv_all + g0 + g];                      \
            const uint32_t *vj = vp + j * d_len + d0;                                          \
            _Pragma("GCC unroll 8") for (int dd = 0; dd < 8; ++dd) {                           \
                const __m512bh x = (__m512bh)_mm512_set1_epi32((int32_t)vj[dd]);               \
                for (int g = 0; g < NV; ++g) acc[dd][g] = _mm512_dpbf16_ps(acc[dd][g], x, pj[g]); \
            }                                                                                  \
        }                                                                                      \
        for (int dd = 0; dd < 8; ++dd)                                                         \
            for (int g = 0; g < NV; ++g) ot[(d0 + dd) * nv_all + g0 + g] = (v16)acc[dd][g];    \
    }

DEFINE_VALUES_BF16(1)
DEFINE_VALUES_BF16(2)
DEFINE_VALUES_BF16(3)

typedef void (*ScoresBf16Fn)(const uint16_t *const *, int64_t, const __m512bh *, int64_t,
                             int64_t, int64_t, float, v16 *);
typedef void (*ValuesBf16Fn)(const uint32_t *, int64_t, int64_t, const __m512bh *, int64_t,
                             int64_t, int64_t, const v16 *, v16 *);
static const ScoresBf16Fn SCORES_BF16[MAX_VECS + 1] = {0, scores_bf16_1, scores_bf16_2,
                                                       scores_bf16_3};
static const ValuesBf16Fn VALUES_BF16[MAX_VECS + 1] = {0, values_bf16_1, values_bf16_2,
                                                       values_bf16_3};
#endif

/* Scratch of one item, G vectors wide: qt and ot [D][G], s [STEP_KEYS][G], m, l, shrink [G];
 * for a bf16 pool one step's V rows in pairs of keys, vp [STEP_KEYS / 2][D] words (qt then
 * holds qp, and s the weights' pairs once they are computed); for an int8 pool one step's K
 * and V rows dequantized, kd and vd [STEP_KEYS][D] floats. */
typedef struct {
    v16 *qt, *ot, *s, *m, *l, *shrink;
    uint32_t *vp;
    float *kd, *vd;
} Scratch;

/* The scores of n keys into w->s: K rows at keys[j], fp32, or bf16 pairs (then w->qt holds
 * qp, and the sums are scaled here). */
static void score_keys(const Geometry *geo, const void *const *keys, int bf16, int64_t n,
                       Scratch *w) {
    const int64_t G = geo->num_heads / geo->num_kv_heads, D = geo->head_dim;
    for (int64_t j0 = 0; j0 < n; j0 += KEY_TILE) {
        const int64_t nk = n - j0 < KEY_TILE ? n - j0 : KEY_TILE;
        for (int64_t g0 = 0; g0 < G; g0 += MAX_VECS) {
            const int64_t nv = G - g0 < MAX_VECS ? G - g0 : MAX_VECS;
#ifdef PP_BF16_PAIRS
            if (bf16) {
                SCORES_BF16[nv]((const uint16_t *const *)keys + j0, nk, (const __m512bh *)w->qt,
                                G, g0, D / 2, 1.0f / sqrtf((float)D), w->s + j0 * G);
                continue;
            }
#endif
            (void)bf16;
            SCORES[nv]((const float *const *)keys + j0, nk, w->qt, G, g0, D, w->s + j0 * G);
        }
    }
}

/* The softmax step of n keys (positions first .. first + n - 1, scores in w->s): the running
 * max w->m and sum w->l of each query vector absorb them, w->shrink gets the factor that
 * rescales what came before, and the scores become the weights p = exp(score - max), 0 for
 * a key past a lane's own position (lane i is the token at position pos0 + i). For a bf16
 * pool the weights are left as bf16 pairs of keys: w->s[j2][g] holds (p[2 j2], p[2 j2 + 1])
 * in each lane (0 past n), rounded to nearest even. */
#ifdef __AVX512F__
/* AVX-512 intrinsics: a masked max and one mask per key instead of compare-and-blend
 * vectors, exp_nonpositive16, and for bf16 each pair of weights rounded and interleaved in
 * two ops (vcvtne2ps2bf16, vpermw) as it is made. */
static void softmax_keys(int64_t G, int bf16, int64_t n, int64_t first, int64_t pos0,
                         const Tree *tree, Scratch *w) {
    typedef int16_t i16x32 __attribute__((vector_size(64)));
    const __m512i lane_pos = _mm512_add_epi32(
        _mm512_set1_epi32((int32_t)pos0),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    /* word 2i of the result is word i of the low half, word 2i + 1 word i of the high half */
    const __m512i interleave = (__m512i)(i16x32){0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                 21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const int masked = first + n - 1 > pos0 || in_tree(tree, first + n - 1);
#define SEES(pos)                                                                              \
    (in_tree(tree, pos) ? (__mmask16)tree->lanes[(pos) - tree->start]                          \
                        : _mm512_cmpge_epi32_mask(lane_pos, _mm512_set1_epi32((int32_t)(pos))))
    for (int64_t g = 0; g < G; ++g) {
        __m512 *s = (__m512 *)w->s + g; /* key j's scores at s[j * G] */
        __m512 top = (__m512)w->m[g];
        for (int64_t j = 0; j < n; ++j)
            top = masked ? _mm512_mask_max_ps(top, SEES(first + j), top, s[j * G])
                         : _mm512_max_ps(top, s[j * G]);
        const __m512 shrink = exp_nonpositive16(_mm512_sub_ps((__m512)w->m[g], top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 2) {
            __m512 p0 = exp_nonpositive16(_mm512_sub_ps(s[j * G], top));
            __m512 p1 = j + 1 < n ? exp_nonpositive16(_mm512_sub_ps(s[(j + 1) * G], top))
                                  : _mm512_setzero_ps();
            if (masked) {
                p0 = _mm512_maskz_mov_ps(SEES(first + j), p0);
                p1 = _mm512_maskz_mov_ps(SEES(first + j + 1), p1);
            }
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
#ifdef PP_BF16_PAIRS
            if (bf16) { /* pair j / 2 lands at or before the entries it was made from */
                const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
                s[j / 2 * G] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(interleave, pair));
                continue;
            }
#endif
            s[j * G] = p0;
            if (j + 1 < n) s[(j + 1) * G] = p1;
        }
        w->l[g] = (v16)_mm512_fmadd_ps((__m512)w->l[g], shrink, sum);
        w->m[g] = (v16)top;
        w->shrink[g] = (v16)shrink;
    }
#undef SEES
    (void)bf16;
}
#else
/* -1 in the lanes that must not see the key at pos, 0 in the others. */
static i16v hidden_lanes(const Tree *tree, int64_t pos, i16v lane_pos) {
    if (!in_tree(tree, pos)) return (int32_t)pos > lane_pos;
    i16v hidden;
    const uint16_t bits = tree->lanes[pos - tree->start];
    for (int i = 0; i < LANES; ++i) hidden[i] = (bits >> i) & 1 ? 0 : -1;
    return hidden;
}

static void softmax_keys(int64_t G, int bf16, int64_t n, int64_t first, int64_t pos0,
                         const Tree *tree, Scratch *w) {
    (void)bf16; /* a bf16 pool needs AVX-512 BF16 (pdserve_paged_prefill refuses it here) */
    i16v lane_pos;
    for (int i = 0; i < LANES; ++i) lane_pos[i] = (int32_t)(pos0 + i);
    const int masked = first + n - 1 > pos0 || in_tree(tree, first + n - 1);
    for (int64_t g = 0; g < G; ++g) {
        v16 top = w->m[g];
        for (int64_t j = 0; j < n; ++j) {
            v16 *s = &w->s[j * G + g];
            if (masked) *s = select16(hidden_lanes(tree, first + j, lane_pos), splat16(-FLT_MAX), *s);
            top = max16(top, *s);
        }
        const v16 shrink = exp_poly_v16(w->m[g] - top);
        v16 sum = (v16){0};
        for (int64_t j = 0; j < n; ++j) {
            v16 *s = &w->s[j * G + g];
            v16 p = exp_poly_v16(*s - top);
            if (masked) p = select16(hidden_lanes(tree, first + j, lane_pos), (v16){0}, p);
            *s = p;
            sum += p;
        }
        w->l[g] = w->l[g] * shrink + sum;
        w->m[g] = top;
        w->shrink[g] = shrink;
    }
}
#endif

/* Fold n keys (positions first .. first + n - 1, scores in w->s, V rows at values[j] or, for
 * bf16, in w->vp) into the item's running softmax and output. */
static void fold_keys(const Geometry *geo, const float *const *values, int bf16, int64_t n,
                      int64_t first, int64_t pos0, const Tree *tree, Scratch *w) {
    const int64_t G = geo->num_heads / geo->num_kv_heads, D = geo->head_dim;
    softmax_keys(G, bf16, n, first, pos0, tree, w);
#ifdef PP_BF16_PAIRS
    if (bf16) {
        for (int64_t d0 = 0; d0 < D; d0 += 8)
            for (int64_t g0 = 0; g0 < G; g0 += MAX_VECS) {
                const int64_t nv = G - g0 < MAX_VECS ? G - g0 : MAX_VECS;
                VALUES_BF16[nv](w->vp, D, (n + 1) / 2,
                                (const __m512bh *)w->s, G, g0, d0, w->shrink, w->ot);
            }
        return;
    }
#endif
    for (int64_t d0 = 0; d0 < D; d0 += 8)
        for (int64_t g0 = 0; g0 < G; g0 += MAX_VECS) {
            const int64_t nv = G - g0 < MAX_VECS ? G - g0 : MAX_VECS;
            VALUES[nv](values, 0, n, w->s, G, g0, d0, w->shrink, w->ot);
        }
}

/* One int8 pool row (head_dim values and their scale) as floats. */
static void dequantize_row(const int8_t *row, int64_t head_dim, float *dst) {
    const float scale = int8_row_scale(row, head_dim);
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = (float)row[d] * scale;
}

/* The K and V rows of positions first .. first + n - 1: in place for an fp32 pool; for a
 * bf16 one, K in place and V in pairs of keys into w->vp; for an int8 one, dequantized into
 * w->kd and w->vd. */
static void step_rows(const Geometry *geo, const void *pool, int kv_format, const int32_t *table,
                      int64_t h, int64_t first, int64_t n, const void **keys,
                      const float **values, Scratch *w) {
    const int64_t D = geo->head_dim, BS = geo->block_size;
    const int bf16 = kv_format == KV_BFLOAT16;
    const uint16_t *v_rows[STEP_KEYS];
    for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = first + j;
        const int64_t at = geo->layer_offset + h * geo->head_stride +
                           table[pos / BS] * geo->block_stride + pos % BS * geo->token_stride;
        if (kv_format == KV_INT8) {
            dequantize_row((const int8_t *)pool + at, D, w->kd + j * D);
            dequantize_row((const int8_t *)pool + at + geo->kv_stride, D, w->vd + j * D);
            keys[j] = w->kd + j * D;
            values[j] = w->vd + j * D;
        } else if (bf16) {
            keys[j] = (const uint16_t *)pool + at;
            v_rows[j] = (const uint16_t *)pool + at + geo->kv_stride;
        } else {
            keys[j] = (const float *)pool + at;
            values[j] = (const float *)pool + at + geo->kv_stride;
        }
    }
    if (!bf16) return;
    for (int64_t j2 = 0; j2 < (n + 1) / 2; ++j2) {
        const uint16_t *a = v_rows[2 * j2], *b = 2 * j2 + 1 < n ? v_rows[2 * j2 + 1] : NULL;
        for (int64_t d = 0; d < D; ++d)
            w->vp[j2 * D + d] = (uint32_t)a[d] | (b ? (uint32_t)b[d] << 16 : 0u);
    }
}

/* The item's queries (q_bf16: bf16, else fp32): qt[d][g] = q * D^-1/2, tokens in lanes; for
 * the bf16 pairs of a bf16 pool, qp[d / 2][g] = the unscaled bf16 pair (q[.][d], q[.][d + 1])
 * in each 32-bit lane. */
static void load_queries(const Geometry *geo, const void *q, int64_t q_stride, int q_bf16,
                         int pairs, int64_t h, int64_t t0, int64_t live, Scratch *w) {
    const int64_t G = geo->num_heads / geo->num_kv_heads, D = geo->head_dim;
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (h * G + g) * D;
        if (pairs) {
            const uint16_t *q16 = q;
            for (int64_t d = 0; d < D / 2; ++d) {
                i16v pairs = (i16v){0};
                for (int64_t i = 0; i < live; ++i) {
                    const uint16_t *at = q16 + (t0 + i) * q_stride + head + 2 * d;
                    pairs[i] = (int32_t)((uint32_t)at[0] | (uint32_t)at[1] << 16);
                }
                w->qt[d * G + g] = (v16)pairs;
            }
            continue;
        }
        for (int64_t d = 0; d < D; ++d) {
            v16 x = (v16){0};
            for (int64_t i = 0; i < live; ++i) {
                const int64_t at = (t0 + i) * q_stride + head + d;
                x[i] = (q_bf16 ? bf16_to_f32(((const uint16_t *)q)[at]) : ((const float *)q)[at]) *
                       scale;
            }
            w->qt[d * G + g] = x;
        }
    }
}

/* One item: kv head h, tokens t0 .. t0 + 15 (those below n) of the chunk. */
static void run_item(const Geometry *geo, const void *q, int64_t q_stride, int64_t n,
                     int64_t start, const uint64_t *ancestors, const void *pool, int q_bf16,
                     int kv_format, const int32_t *table, int64_t h, int64_t t0, void *out,
                     int64_t out_stride, Scratch *w) {
    const int pairs = kv_format == KV_BFLOAT16; /* the bf16 pairs' arithmetic */
    const int64_t G = geo->num_heads / geo->num_kv_heads, D = geo->head_dim;
    const int64_t live = n - t0 < LANES ? n - t0 : LANES;
    Tree tree = {start, {0}};
    if (ancestors != NULL) /* lanes[c]: the lanes whose row is chunk row c or descends from it */
        for (int64_t c = 0; c < n; ++c)
            for (int64_t i = 0; i < live; ++i)
                tree.lanes[c] |= (uint16_t)(((ancestors[t0 + i] >> c) & 1u) << i);
    load_queries(geo, q, q_stride, q_bf16, pairs, h, t0, live, w);
    for (int64_t g = 0; g < G; ++g) {
        w->m[g] = splat16(-FLT_MAX);
        w->l[g] = (v16){0};
    }
    memset(w->ot, 0, (size_t)(D * G) * sizeof(v16));
    const int64_t pos0 = start + t0, keys_end = pos0 + live; /* positions 0 .. keys_end - 1 */
    const void *keys[STEP_KEYS];
    const float *values[STEP_KEYS];
    for (int64_t first = 0; first < keys_end; first += STEP_KEYS) {
        const int64_t n_keys = keys_end - first < STEP_KEYS ? keys_end - first : STEP_KEYS;
        step_rows(geo, pool, kv_format, table, h, first, n_keys, keys, values, w);
        score_keys(geo, keys, pairs, n_keys, w);
        fold_keys(geo, values, pairs, n_keys, first, pos0, ancestors ? &tree : NULL, w);
    }
    for (int64_t g = 0; g < G; ++g) {
        const v16 inv = 1.0f / w->l[g];
        const int64_t head = (h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) {
            const v16 x = w->ot[d * G + g] * inv;
            for (int64_t i = 0; i < live; ++i) {
                const int64_t at = (t0 + i) * out_stride + head + d;
                if (q_bf16)
                    ((uint16_t *)out)[at] = f32_to_bf16(x[i]);
                else
                    ((float *)out)[at] = x[i];
            }
        }
    }
}

/* out[t][h][:] for the chunk's n tokens (rows out_stride apart; q rows q_stride apart, heads
 * of D values side by side); q and out both fp32 (dtype KV_FLOAT32) or both bf16
 * (KV_BFLOAT16), the pool in kv_format: dtype, or KV_INT8. table: the sequence's block ids,
 * covering start + n positions. ancestors: NULL for a causal chunk; for a token tree (n <=
 * MAX_TREE_ROWS), bit c of ancestors[r] set when row r sees chunk row c. Returns 0; -1 when
 * scratch could not be allocated; -2 for a bf16 pool in a build without AVX-512 BF16; -3 for
 * a tree of more than MAX_TREE_ROWS rows. */
int pdserve_paged_prefill(const void *q, int64_t q_stride, int64_t n, int64_t start,
                          const uint64_t *ancestors, const void *pool, const int32_t *table,
                          void *out, int64_t out_stride, int64_t heads, int64_t kv_heads,
                          int64_t head_dim, int64_t num_layers, int64_t block_size, int64_t layer,
                          int dtype, int kv_format, int num_threads) {
    const int q_bf16 = dtype == KV_BFLOAT16, pairs = kv_format == KV_BFLOAT16;
#ifndef PP_BF16_PAIRS
    if (pairs) return -2;
#endif
    if (ancestors != NULL && n > MAX_TREE_ROWS) return -3;
    const Geometry geo =
        pool_geometry(heads, kv_heads, head_dim, kv_format, num_layers, block_size, layer);
    const int64_t G = heads / kv_heads, items_per_head = (n + LANES - 1) / LANES;
    const int64_t items = items_per_head * kv_heads;
    const size_t vec_floats = (size_t)((2 * head_dim + STEP_KEYS + 3) * G) * LANES;
    const size_t int8_floats = (size_t)(kv_format == KV_INT8 ? 2 * STEP_KEYS * head_dim : 0);
    const size_t pairs_words = (size_t)(pairs ? STEP_KEYS / 2 * head_dim : 0);
    const size_t floats = vec_floats + pairs_words + int8_floats;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && items > 1)
    {
        v16 *buffer = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (buffer == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            Scratch w = {buffer, buffer + head_dim * G, buffer + 2 * head_dim * G,
                         buffer + (2 * head_dim + STEP_KEYS) * G,
                         buffer + (2 * head_dim + STEP_KEYS + 1) * G,
                         buffer + (2 * head_dim + STEP_KEYS + 2) * G,
                         (uint32_t *)buffer + vec_floats,
                         (float *)buffer + vec_floats + pairs_words,
                         (float *)buffer + vec_floats + pairs_words + STEP_KEYS * head_dim};
            /* the last tokens attend to the most positions: hand those out first */
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < items; ++item) {
                const int64_t t0 = (items_per_head - 1 - item / kv_heads) * LANES;
                run_item(&geo, q, q_stride, n, start, ancestors, pool, q_bf16, kv_format, table,
                         item % kv_heads, t0, out, out_stride, &w);
            }
            free(buffer);
        }
    }
    return failed ? -1 : 0;
}
