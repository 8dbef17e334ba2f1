/* Where K and V of a (block, layer, position, kv head) sit in the paged KV pool, for the C
 * attention kernels (paged_decode.c, paged_prefill.c). The pool layout (the project-wide
 * contract):
 *
 *     pool[num_blocks][num_layers][2 (K, V)][block_size][num_kv_heads][head_dim]
 *
 * so K of (block b, layer l, offset o, kv head h) starts at element
 *     b * block_stride + layer_offset + o * token_stride + h * head_dim
 * and V is kv_stride elements further on. Built with the rest of its includer (engine/
 * native_build.py rebuilds every library that includes it when it changes).
 */
#ifndef PDSERVE_POOL_GEOMETRY_H
#define PDSERVE_POOL_GEOMETRY_H

#include <stdint.h>

typedef struct {
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    int64_t token_stride; /* elements from one position to the next inside a block */
    int64_t kv_stride;    /* elements from K to V of one (block, layer) */
    int64_t block_stride; /* elements from one block to the next */
    int64_t layer_offset; /* elements from a block's start to this layer's K */
} Geometry;

static inline Geometry pool_geometry(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                     int64_t num_layers, int64_t block_size, int64_t layer) {
    Geometry geo = {num_heads, num_kv_heads, head_dim, block_size, 0, 0, 0, 0};
    geo.token_stride = num_kv_heads * head_dim;
    geo.kv_stride = block_size * geo.token_stride;
    geo.block_stride = num_layers * 2 * geo.kv_stride;
    geo.layer_offset = layer * 2 * geo.kv_stride;
    return geo;
}

#endif
