/*
 * kvcache.c — page allocation for the paged KV cache (see kvcache.h).
 */
#include "kvcache.h"

#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"

size_t rs_kv_bytes_per_block(const rs_kv_pool *p) {
    return (size_t)p->n_layers * 2 * RS_KV_BLOCK * (size_t)p->n_kv_heads * (size_t)p->head_dim *
           rs_dtype_size(p->dtype);
}

int rs_kv_pool_init(rs_kv_pool *p, rs_backend *b, int n_layers, int n_kv_heads, int head_dim,
                    rs_dtype dtype, size_t budget_bytes) {
    memset(p, 0, sizeof *p);
    p->backend = b;
    p->n_layers = n_layers;
    p->n_kv_heads = n_kv_heads;
    p->head_dim = head_dim;
    p->dtype = dtype;
    size_t per_block = rs_kv_bytes_per_block(p);
    size_t n = budget_bytes / per_block;
    if (n < 1) n = 1;
    if (n > INT32_MAX / RS_KV_BLOCK) n = INT32_MAX / RS_KV_BLOCK;
    p->n_blocks = (int)n;
    size_t layer_bytes = (size_t)p->n_blocks * per_block / (size_t)n_layers;
    p->layers = rs_xcalloc((size_t)n_layers, sizeof *p->layers);
    for (int l = 0; l < n_layers; l++) {
        void *pages = rs_backend_alloc(b, layer_bytes);
        if (!pages) {
            RS_ERROR("kv cache: cannot allocate %zu bytes for layer %d", layer_bytes, l);
            rs_kv_pool_free(p);
            return RS_ENOMEM;
        }
        p->layers[l] = (rs_kv_layer){.pages = pages, .dtype = dtype, .n_blocks = p->n_blocks,
                                     .n_kv_heads = n_kv_heads, .head_dim = head_dim};
    }
    p->bytes = layer_bytes * (size_t)n_layers;
    p->free_list = rs_xmalloc(sizeof(int32_t) * (size_t)p->n_blocks);
    /* pop order 0, 1, 2, ... */
    for (int i = 0; i < p->n_blocks; i++) p->free_list[i] = p->n_blocks - 1 - i;
    p->n_free = p->n_blocks;
    return RS_OK;
}

void rs_kv_pool_free(rs_kv_pool *p) {
    if (p->layers) {
        for (int l = 0; l < p->n_layers; l++) rs_backend_free_mem(p->backend, p->layers[l].pages);
    }
    free(p->layers);
    free(p->free_list);
    memset(p, 0, sizeof *p);
}

int rs_kv_seq_reserve(rs_kv_pool *p, rs_kv_seq *seq, int n_tokens) {
    int need = (n_tokens + RS_KV_BLOCK - 1) / RS_KV_BLOCK;
    if (need <= seq->n_blocks) return RS_OK;
    if (need - seq->n_blocks > p->n_free) return RS_ENOMEM;
    if (need > seq->cap) {
        int cap = seq->cap ? seq->cap : 4;
        while (cap < need) cap *= 2;
        seq->blocks = rs_xrealloc(seq->blocks, sizeof(int32_t) * (size_t)cap);
        seq->cap = cap;
    }
    while (seq->n_blocks < need) seq->blocks[seq->n_blocks++] = p->free_list[--p->n_free];
    return RS_OK;
}

void rs_kv_seq_release(rs_kv_pool *p, rs_kv_seq *seq) {
    for (int i = seq->n_blocks - 1; i >= 0; i--) {
        RS_ASSERT(p->n_free < p->n_blocks);
        p->free_list[p->n_free++] = seq->blocks[i];
    }
    free(seq->blocks);
    memset(seq, 0, sizeof *seq);
}
