/* Where K and V of a (block, layer, position, kv head) sit in the paged KV pool, for the C
 * attention kernels (paged_decode.c, paged_prefill.c). The pool layout (the project-wide
 * contract):
 *
 *     pool[num_blocks][num_layers][2 (K, V)][block_size][num_kv_heads][head_stride]
 *
 * where a kv head's row holds head_dim values (head_stride == head_dim), or in an int8 pool
 * head_dim int8 values and then their bf16 scale (head_stride == head_dim + 2 bytes; see
 * kv_codec/int8_rows.py). So K of (block b, layer l, offset o, kv head h) starts at element
 *     b * block_stride + layer_offset + o * token_stride + h * head_stride
 * and V is kv_stride elements further on. Built with the rest of its includer (engine/
 * native_build.py rebuilds every library that includes it when it changes).
 */
#ifndef PDSERVE_POOL_GEOMETRY_H
#define PDSERVE_POOL_GEOMETRY_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Element formats of the pool (engine/attention/kv_format.py: KVFormat.kernel_code) and of
 * queries and outputs (float32 or bfloat16 only). */
enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_INT8 = 2 };
enum { KV_INT8_SCALE_BYTES = 2 };

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    int64_t head_stride;  /* elements from one kv head's row to the next */
    int64_t token_stride; /* elements from one position to the next inside a block */
    int64_t kv_stride;    /* elements from K to V of one (block, layer) */
    int64_t block_stride; /* elements from one block to the next */
    int64_t layer_offset; /* elements from a block's start to this layer's K */
} Geometry;

static inline Geometry pool_geometry(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int kv_format, int64_t num_layers, int64_t block_size,
                                     int64_t layer) {
    Geometry geo = {num_heads, num_kv_heads, head_dim, block_size, 0, 0, 0, 0, 0};
    geo.head_stride = head_dim + (kv_format == KV_INT8 ? KV_INT8_SCALE_BYTES : 0);
    geo.token_stride = num_kv_heads * geo.head_stride;
    geo.kv_stride = block_size * geo.token_stride;
    geo.block_stride = num_layers * 2 * geo.kv_stride;
    geo.layer_offset = layer * 2 * geo.kv_stride;
    return geo;
}

/* Bytes of one pool element. */
static inline int64_t kv_element_bytes(int kv_format) {
    return kv_format == KV_FLOAT32 ? 4 : kv_format == KV_BFLOAT16 ? 2 : 1;
}

/* The scale of an int8 row of head_dim values: the bf16 right after them. */
static inline float int8_row_scale(const int8_t *row, int64_t head_dim) {
    uint16_t bits;
    memcpy(&bits, row + head_dim, sizeof bits);
    return bf16_to_f32(bits);
}

#endif
