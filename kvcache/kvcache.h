/*
 * kvcache.h — the engine's block manager: a paged KV pool of RS_KV_BLOCK-token pages, per-sequence
 * block tables, reference-counted sharing (fork for n > 1 samples, copy-on-write of the partial
 * last block) and a prefix cache of full blocks with LRU eviction.
 *
 * A page id indexes the same page in every layer, so one block table serves the whole model.
 *
 * Block states. Every block is in exactly one of
 *   free       refcount 0, not registered, on the free list;
 *   in use     refcount >= 1 (one ref per block-table entry that names it);
 *   evictable  refcount 0 but registered in the prefix cache, on the LRU list; reclaimed (and
 *              unregistered) oldest first when an allocation finds the free list empty.
 *
 * Prefix cache (vLLM's hash-chained blocks, made collision-proof). A full block is registered
 * under the key (parent entry id, its 16 token ids), where the parent entry id names the cache
 * entry of the previous block of the same sequence (0 for the first block). Entry ids come from a
 * pool counter and are never reused, so by induction equal keys mean equal whole prefixes: the
 * lookup compares the stored key exactly and the 64-bit hash of the key only picks the bucket. A
 * hash collision can cost a probe, never share wrong KV. The price: when a parent entry is evicted
 * its cached children become unreachable until they are evicted in turn (release order puts a
 * sequence's first block at the MRU end, so parents outlive their children in the LRU list).
 *
 * Write rule (what makes sharing safe). The engine writes the K/V of position pos of a sequence
 * only when pos >= the number of tokens already computed for it, and calls
 * rs_kv_seq_prepare_write() first. Registered blocks are full and fully computed, so writes only
 * ever reach the partial last block, or a fresh one; a shared one is copied first. A write into a
 * registered or committed block is a bug and asserts.
 *
 * Weight updates make every cached block stale: rs_kv_pool_flush_cache() unregisters them all and
 * starts a new cache epoch; a sequence that took its first block in an older epoch never
 * registers anything again (its KV was computed, at least in part, with the old weights).
 *
 * FP8 pages (kernels/backend.h). An E4M3 pool stores a code c meaning c * scale, with either
 *   PER_HEAD   one K and one V scale per layer and KV head ([n_kv_heads] f32 each, backend memory,
 *              1.0 until rs_kv_pool_set_scales installs calibrated or pushed ones), or
 *   PER_TOKEN  one K and one V scale per token and KV head, computed by kv_store from the token's
 *              own amax and kept beside the pages ([n_blocks][2][RS_KV_BLOCK][n_kv_heads] f32 per
 *              layer). They belong to the block like its codes: copy-on-write copies them too, and
 *              they count in rs_kv_bytes_per_block.
 * F32 and BF16 pools have no scales.
 *
 * Single-threaded: the engine thread owns the pool and every rs_kv_seq.
 */
#ifndef RS_KVCACHE_H
#define RS_KVCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "../kernels/backend.h"

struct rs_kv_block_info; /* private: per-block refcount, LRU links and cache key (kvcache.c) */

typedef struct rs_kv_pool {
    rs_backend *backend;     /* borrowed */
    int n_layers;
    int n_blocks;
    int n_kv_heads, head_dim;
    rs_dtype dtype;          /* F32, BF16 or E4M3 */
    rs_kv_scale_mode scale_mode; /* NONE for F32/BF16; PER_HEAD or PER_TOKEN for E4M3 */
    rs_kv_layer *layers;     /* [n_layers], pages [n_blocks][2][RS_KV_BLOCK][n_kv_heads][head_dim] in backend
                                memory; E4M3: k_scale, v_scale [n_kv_heads] (one allocation [2][n_kv_heads],
                                k_scale first) or token_scales [n_blocks][2][RS_KV_BLOCK][n_kv_heads] f32 */
    int32_t *free_list;      /* [n_blocks] stack of free page ids, top at n_free - 1 */
    int n_free;
    int n_evictable;         /* blocks on the LRU list */
    size_t bytes;            /* backend bytes held by all pages and their scales */

    /* private to kvcache.c */
    struct rs_kv_block_info *info; /* [n_blocks] */
    int32_t *table;          /* [table_cap] open-addressed, linear probing: block id or -1 */
    uint32_t table_cap;      /* power of two >= 2 * n_blocks */
    int32_t lru_head;        /* least recently released evictable block, -1 when none */
    int32_t lru_tail;        /* most recently released, -1 when none */
    uint64_t next_entry_id;  /* last cache entry id handed out; ids start at 1 */
    uint64_t epoch;          /* bumped by rs_kv_pool_flush_cache */
    uint64_t hash_mask;      /* ANDed into every key hash: ~0; tests set 0 (right after init)
                                to force every key into one bucket */
    uint64_t hit_tokens, query_tokens, evictions;
} rs_kv_pool;

/* Per-sequence block table: pages in position order; the table owns one ref on each. A zeroed
 * struct is an empty sequence. */
typedef struct rs_kv_seq {
    int32_t *blocks;         /* [cap], first n_blocks valid */
    int n_blocks;
    int cap;
    int n_hashed;            /* leading full blocks committed (registered, or found registered) */
    uint64_t chain_id;       /* cache entry id of block n_hashed - 1's prefix; 0 = empty prefix */
    uint64_t epoch;          /* the pool's epoch when this sequence took its first block */
} rs_kv_seq;

typedef struct rs_kv_stats {
    int n_blocks, n_free, n_evictable, n_used;
    uint64_t hit_tokens;     /* tokens covered by rs_kv_seq_match_prefix */
    uint64_t query_tokens;   /* prompt tokens passed to rs_kv_seq_match_prefix */
    uint64_t evictions;      /* cached blocks reclaimed for new allocations */
} rs_kv_stats;

/* Where the scales of E4M3 KV pages come from (--kv-scale-mode; docs/design.md "Numerics"). The
 * storage follows from it: DYNAMIC keeps a scale per token and head beside the pages
 * (RS_KV_SCALE_PER_TOKEN), CALIBRATE and STATIC one per layer and KV head (RS_KV_SCALE_PER_HEAD).
 *   NONE       F32 / BF16 pages: no scales
 *   DYNAMIC    each token's own amax, as it is written
 *   CALIBRATE  computed from a fixed calibration set at start and after every weight update
 *   STATIC     from the checkpoint (self_attn.k_scale / v_scale) or pushed with the weights */
typedef enum rs_kv_scales {
    RS_KV_SCALES_NONE = 0,
    RS_KV_SCALES_DYNAMIC,
    RS_KV_SCALES_CALIBRATE,
    RS_KV_SCALES_STATIC,
} rs_kv_scales;

/* The page format a scale source stores: NONE, PER_TOKEN or PER_HEAD. */
rs_kv_scale_mode rs_kv_scales_storage(rs_kv_scales src);
const char *rs_kv_scales_name(rs_kv_scales src); /* "none", "dynamic", "calibrate", "static" */

/* What the pages hold: dtype F32 or BF16 with scale_mode NONE, or E4M3 with PER_HEAD or PER_TOKEN. */
typedef struct rs_kv_cache_opts {
    rs_dtype dtype;
    rs_kv_scale_mode scale_mode;
} rs_kv_cache_opts;

/* Sizes the pool from a byte budget: the per-head scales (a fixed [n_layers][2][n_kv_heads] f32)
 * come off the top, the rest is divided by rs_kv_bytes_per_block; at least one block. Per-head
 * scales start at 1.0. RS_OK, RS_EINVAL (a dtype/scale-mode pair other than the above, or a
 * non-positive dimension; *p zeroed) or RS_ENOMEM. */
int rs_kv_pool_init_ex(rs_kv_pool *p, rs_backend *b, int n_layers, int n_kv_heads, int head_dim,
                       const rs_kv_cache_opts *o /* borrowed */, size_t budget_bytes);
/* rs_kv_pool_init_ex with {dtype, RS_KV_SCALE_NONE}: F32 or BF16 pages. */
int rs_kv_pool_init(rs_kv_pool *p, rs_backend *b, int n_layers, int n_kv_heads, int head_dim,
                    rs_dtype dtype, size_t budget_bytes);
void rs_kv_pool_free(rs_kv_pool *p);
/* Backend bytes of one block across all layers: its pages, plus its per-token scales (PER_TOKEN).
 * Reads only n_layers, n_kv_heads, head_dim, dtype and scale_mode of p. */
size_t rs_kv_bytes_per_block(const rs_kv_pool *p);
/* Whether each of k_scales[0..n), v_scales[0..n) is finite and > 0: usable as per-head scales. */
bool rs_kv_scales_valid(const float *k_scales, const float *v_scales, size_t n);
/* Installs per-head scales (PER_HEAD pools): k_scales, v_scales [n_layers][n_kv_heads] f32, host
 * memory (borrowed), each finite and > 0 (rs_kv_scales_valid) — else RS_EINVAL and nothing changes; RS_EINVAL too for a
 * pool that is not PER_HEAD. Codes already in the pages were written with the old scales and would
 * be misread with the new ones, so this also flushes the prefix cache (rs_kv_pool_flush_cache);
 * the caller installs scales when no running sequence's KV still matters (at start-up, or after a
 * weight update, which makes that KV stale anyway). */
int rs_kv_pool_set_scales(rs_kv_pool *p, const float *k_scales, const float *v_scales);
/* Copies the per-head scales out (PER_HEAD pools; RS_EINVAL otherwise): k_scales, v_scales
 * [n_layers][n_kv_heads] f32, host memory. For logs and telemetry. */
int rs_kv_pool_get_scales(const rs_kv_pool *p, float *k_scales, float *v_scales);
/* Blocks an allocation can get right now: free + evictable. */
int rs_kv_available_blocks(const rs_kv_pool *p);
void rs_kv_pool_stats(const rs_kv_pool *p, rs_kv_stats *out);
/* Unregisters every cached block (after a weight update): evictable ones go to the free list,
 * in-use ones go there when released. Starts a new cache epoch. */
void rs_kv_pool_flush_cache(rs_kv_pool *p);
/* Debug invariant check, RS_ASSERT on violation: every block in exactly one state, refcounts
 * equal the number of table entries among the live sequences seqs[0..n_seqs) (borrowed; must be
 * all of them), free list without duplicates, LRU list well formed, hash table consistent with
 * the registered blocks. O(n_blocks + table_cap + total table length). */
void rs_kv_pool_check(const rs_kv_pool *p, const rs_kv_seq *const *seqs, int n_seqs);

/* For a new, empty sequence: takes a ref on each cached block that continues the prefix of
 * tokens[0..n_tokens) (whole blocks, in order, stopping at the first miss), appends them to s's
 * table and returns the number of tokens they cover: a multiple of RS_KV_BLOCK, at most
 * floor((n_tokens - 1) / RS_KV_BLOCK) * RS_KV_BLOCK, so the caller always computes at least the
 * last token (it needs its logits). Counts hit and query tokens in the stats. */
int rs_kv_seq_match_prefix(rs_kv_pool *p, rs_kv_seq *s, const int32_t *tokens, int n_tokens);
/* Takes back a match that will not be used now (s holds only what rs_kv_seq_match_prefix gave it,
 * over n_tokens): its blocks are released (cached and evictable again, not pinned by a sequence that
 * waits) and its hit and query tokens leave the stats, so that a sequence matched again on a later
 * try counts once. s is empty afterwards. */
void rs_kv_seq_unmatch(rs_kv_pool *p, rs_kv_seq *s, int n_tokens);
/* Registers in the prefix cache every full block among s's first n_computed tokens that is not
 * committed yet (tokens: s's token ids, at least n_computed). A block whose key is already
 * registered (another sequence computed the same prefix) stays unregistered: one entry per key.
 * Incremental: O(new full blocks). */
void rs_kv_seq_commit(rs_kv_pool *p, rs_kv_seq *s, const int32_t *tokens, int n_computed);
/* Grows s's table so it covers n_tokens positions, taking free blocks, then evicting the least
 * recently released cached ones. RS_OK, or RS_ENOMEM with nothing changed. */
int rs_kv_seq_reserve(rs_kv_pool *p, rs_kv_seq *s, int n_tokens);
/* child (empty) gets parent's table, a ref on every block and its commit state. */
void rs_kv_seq_fork(rs_kv_pool *p, const rs_kv_seq *parent, rs_kv_seq *child);
/* Call before writing the K/V of position pos (inside s's table, pos >= the tokens already
 * computed). If pos's block is shared, copies the whole page of every layer (and its per-token
 * scales) into a fresh block that replaces it in s's table: RS_OK, or RS_ENOMEM (nothing changed)
 * when no block is available. O(1) when the block is exclusive; after it returns RS_OK, s's block for pos stays
 * exclusive until s is forked again. */
int rs_kv_seq_prepare_write(rs_kv_pool *p, rs_kv_seq *s, int pos);
/* Drops s's ref on each of its blocks, last block first, and empties s (frees its table).
 * Blocks reaching refcount 0 go to the LRU list (MRU end) if registered, else to the free list. */
void rs_kv_seq_release(rs_kv_pool *p, rs_kv_seq *s);

static inline int32_t rs_kv_slot(const rs_kv_seq *s, int pos) {
    return s->blocks[pos / RS_KV_BLOCK] * RS_KV_BLOCK + pos % RS_KV_BLOCK;
}

#endif /* RS_KVCACHE_H */
