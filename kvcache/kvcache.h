/*
 * kvcache.h — the paged KV pool: fixed-size pages of RS_KV_BLOCK tokens for every layer, and the
 * per-sequence block tables that map a sequence's positions to pages.
 *
 * A page id indexes the same page in every layer, so one block table serves the whole model.
 * This is the walking skeleton's pool: exclusive pages, a free list, fp32 pages. Prefix sharing,
 * copy-on-write and FP8 pages come with the engine issue and keep this interface.
 */
#ifndef RS_KVCACHE_H
#define RS_KVCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "../kernels/backend.h"

typedef struct rs_kv_pool {
    rs_backend *backend;     /* borrowed */
    int n_layers;
    int n_blocks;
    int n_kv_heads, head_dim;
    rs_dtype dtype;
    rs_kv_layer *layers;     /* [n_layers], pages in backend memory */
    int32_t *free_list;      /* [n_blocks] stack of free page ids */
    int n_free;
    size_t bytes;            /* backend bytes held by all pages */
} rs_kv_pool;

/* Per-sequence block table: pages in position order. */
typedef struct rs_kv_seq {
    int32_t *blocks;
    int n_blocks;
    int cap;
} rs_kv_seq;

/* Sizes the pool from a byte budget (at least one block per layer). */
int rs_kv_pool_init(rs_kv_pool *p, rs_backend *b, int n_layers, int n_kv_heads, int head_dim,
                    rs_dtype dtype, size_t budget_bytes);
void rs_kv_pool_free(rs_kv_pool *p);
size_t rs_kv_bytes_per_block(const rs_kv_pool *p); /* all layers */

/* Grows seq's table so it covers n_tokens positions. RS_OK, or RS_ENOMEM (nothing taken) when
 * the pool has too few free pages. */
int rs_kv_seq_reserve(rs_kv_pool *p, rs_kv_seq *seq, int n_tokens);
/* Returns all of seq's pages to the pool. */
void rs_kv_seq_release(rs_kv_pool *p, rs_kv_seq *seq);
static inline int32_t rs_kv_slot(const rs_kv_seq *s, int pos) {
    return s->blocks[pos / RS_KV_BLOCK] * RS_KV_BLOCK + pos % RS_KV_BLOCK;
}

#endif /* RS_KVCACHE_H */
