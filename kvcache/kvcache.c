/*
 * kvcache.c — the block manager behind kvcache.h: page allocation, refcounts, the prefix-cache
 * hash table, the LRU list of evictable blocks, fork and copy-on-write.
 *
 * All bookkeeping is sized at init: per-block info [n_blocks], the free-list stack [n_blocks], the
 * hash table [table_cap] (open addressing, linear probing, backward-shift deletion so there are
 * no tombstones; load <= 1/2) and an intrusive doubly linked LRU list threaded through the block
 * info. The only allocations after init are the sequences' block tables, grown geometrically.
 *
 * Backend memory per layer: the pages, and for E4M3 either one [2][n_kv_heads] f32 allocation of
 * per-head scales (k_scale, then v_scale) or the per-token scales [n_blocks][2][16][n_kv_heads] f32,
 * which are addressed by block like the pages so a block copy is two contiguous copies.
 */
#include "kvcache.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rs.h"

typedef struct rs_kv_block_info {
    int32_t ref;                    /* block-table entries naming this block */
    int32_t lru_prev, lru_next;     /* neighbours on the LRU list while evictable, -1 at the ends */
    bool registered;                /* in the prefix-cache table */
    uint64_t id;                    /* cache entry id while registered, else 0 */
    uint64_t parent_id;             /* key part 1: entry id of the previous block's prefix */
    uint64_t hash;                  /* hash of the key, masked by pool.hash_mask */
    int32_t tokens[RS_KV_BLOCK];    /* key part 2: the block's token ids */
} rs_kv_block_info;

#define RS_KV_NONE (-1)

/* ---- sizes ----------------------------------------------------------------------------------- */

/* One layer's page of one block: [2][RS_KV_BLOCK][n_kv_heads][head_dim] of dtype. */
static size_t page_bytes(const rs_kv_pool *p) {
    return 2 * RS_KV_BLOCK * (size_t)p->n_kv_heads * (size_t)p->head_dim * rs_dtype_size(p->dtype);
}

/* One layer's per-token scales of one block: [2][RS_KV_BLOCK][n_kv_heads] f32, or 0. */
static size_t token_scale_bytes(const rs_kv_pool *p) {
    return p->scale_mode == RS_KV_SCALE_PER_TOKEN ? 2 * RS_KV_BLOCK * (size_t)p->n_kv_heads * sizeof(float) : 0;
}

/* One layer's per-head scales: [2][n_kv_heads] f32, or 0. Fixed, not per block. */
static size_t head_scale_bytes(const rs_kv_pool *p) {
    return p->scale_mode == RS_KV_SCALE_PER_HEAD ? 2 * (size_t)p->n_kv_heads * sizeof(float) : 0;
}

size_t rs_kv_bytes_per_block(const rs_kv_pool *p) {
    return (size_t)p->n_layers * (page_bytes(p) + token_scale_bytes(p));
}

int rs_kv_available_blocks(const rs_kv_pool *p) { return p->n_free + p->n_evictable; }

void rs_kv_pool_stats(const rs_kv_pool *p, rs_kv_stats *out) {
    *out = (rs_kv_stats){
        .n_blocks = p->n_blocks,
        .n_free = p->n_free,
        .n_evictable = p->n_evictable,
        .n_used = p->n_blocks - p->n_free - p->n_evictable,
        .hit_tokens = p->hit_tokens,
        .query_tokens = p->query_tokens,
        .evictions = p->evictions,
    };
}

/* ---- hash table: key (parent_id, tokens[16]) -> registered block ----------------------------- */

static uint64_t mix64(uint64_t x) { /* splitmix64 finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static uint64_t key_hash(const rs_kv_pool *p, uint64_t parent_id, const int32_t *tokens) {
    uint64_t h = mix64(parent_id + 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < RS_KV_BLOCK; i += 2) {
        uint64_t w = (uint64_t)(uint32_t)tokens[i] | (uint64_t)(uint32_t)tokens[i + 1] << 32;
        h = mix64(h ^ w) + 0x9e3779b97f4a7c15ull;
    }
    return h & p->hash_mask;
}

static uint32_t home_slot(const rs_kv_pool *p, uint64_t hash) {
    return (uint32_t)(hash ^ hash >> 32) & (p->table_cap - 1);
}

static bool key_equal(const rs_kv_block_info *bi, uint64_t hash, uint64_t parent_id, const int32_t *tokens) {
    return bi->hash == hash && bi->parent_id == parent_id &&
           memcmp(bi->tokens, tokens, sizeof bi->tokens) == 0;
}

/* The registered block with exactly this key, or -1. */
static int32_t table_find(const rs_kv_pool *p, uint64_t hash, uint64_t parent_id, const int32_t *tokens) {
    uint32_t mask = p->table_cap - 1;
    for (uint32_t i = home_slot(p, hash);; i = (i + 1) & mask) {
        int32_t b = p->table[i];
        if (b == RS_KV_NONE) return RS_KV_NONE;
        if (key_equal(&p->info[b], hash, parent_id, tokens)) return b;
    }
}

static void table_insert(rs_kv_pool *p, int32_t b) {
    uint32_t mask = p->table_cap - 1;
    uint32_t i = home_slot(p, p->info[b].hash);
    while (p->table[i] != RS_KV_NONE) i = (i + 1) & mask;
    p->table[i] = b;
}

/* Removes b and shifts back the entries after it whose probe path crossed its slot. */
static void table_remove(rs_kv_pool *p, int32_t b) {
    uint32_t mask = p->table_cap - 1;
    uint32_t i = home_slot(p, p->info[b].hash);
    while (p->table[i] != b) {
        RS_ASSERT(p->table[i] != RS_KV_NONE);
        i = (i + 1) & mask;
    }
    for (;;) {
        p->table[i] = RS_KV_NONE;
        uint32_t j = i;
        for (;;) {
            j = (j + 1) & mask;
            if (p->table[j] == RS_KV_NONE) return;
            uint32_t k = home_slot(p, p->info[p->table[j]].hash);
            bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j); /* k cyclically in (i, j] */
            if (!stays) break;
        }
        p->table[i] = p->table[j];
        i = j;
    }
}

static void block_register(rs_kv_pool *p, int32_t b, uint64_t hash, uint64_t parent_id, const int32_t *tokens) {
    rs_kv_block_info *bi = &p->info[b];
    RS_ASSERT(!bi->registered);
    bi->registered = true;
    bi->id = ++p->next_entry_id;
    bi->parent_id = parent_id;
    bi->hash = hash;
    memcpy(bi->tokens, tokens, sizeof bi->tokens);
    table_insert(p, b);
}

static void block_unregister(rs_kv_pool *p, int32_t b) {
    table_remove(p, b);
    p->info[b].registered = false;
    p->info[b].id = 0;
}

/* ---- LRU list of evictable blocks: head = least recently released ---------------------------- */

static void lru_push_tail(rs_kv_pool *p, int32_t b) {
    rs_kv_block_info *bi = &p->info[b];
    bi->lru_prev = p->lru_tail;
    bi->lru_next = RS_KV_NONE;
    if (p->lru_tail != RS_KV_NONE) p->info[p->lru_tail].lru_next = b;
    else p->lru_head = b;
    p->lru_tail = b;
    p->n_evictable++;
}

static void lru_remove(rs_kv_pool *p, int32_t b) {
    rs_kv_block_info *bi = &p->info[b];
    if (bi->lru_prev != RS_KV_NONE) p->info[bi->lru_prev].lru_next = bi->lru_next;
    else p->lru_head = bi->lru_next;
    if (bi->lru_next != RS_KV_NONE) p->info[bi->lru_next].lru_prev = bi->lru_prev;
    else p->lru_tail = bi->lru_prev;
    bi->lru_prev = bi->lru_next = RS_KV_NONE;
    p->n_evictable--;
}

/* ---- block lifetime -------------------------------------------------------------------------- */

/* A block with refcount 1 for the caller: a free one, else the least recently released cached one
 * (unregistered). -1 when neither exists. */
static int32_t block_take(rs_kv_pool *p) {
    int32_t b;
    if (p->n_free > 0) {
        b = p->free_list[--p->n_free];
    } else if (p->lru_head != RS_KV_NONE) {
        b = p->lru_head;
        lru_remove(p, b);
        block_unregister(p, b);
        p->evictions++;
    } else {
        return RS_KV_NONE;
    }
    RS_ASSERT(p->info[b].ref == 0 && !p->info[b].registered);
    p->info[b].ref = 1;
    return b;
}

static void block_ref(rs_kv_pool *p, int32_t b) {
    if (p->info[b].ref++ == 0) lru_remove(p, b); /* only cached blocks are found with ref 0 */
}

static void block_unref(rs_kv_pool *p, int32_t b) {
    rs_kv_block_info *bi = &p->info[b];
    RS_ASSERT(bi->ref > 0);
    if (--bi->ref > 0) return;
    if (bi->registered) {
        lru_push_tail(p, b);
    } else {
        RS_ASSERT(p->n_free < p->n_blocks);
        p->free_list[p->n_free++] = b;
    }
}

/* ---- pool ------------------------------------------------------------------------------------ */

static bool opts_valid(const rs_kv_cache_opts *o) {
    switch (o->dtype) {
    case RS_DTYPE_F32:
    case RS_DTYPE_BF16: return o->scale_mode == RS_KV_SCALE_NONE;
    case RS_DTYPE_E4M3: return o->scale_mode == RS_KV_SCALE_PER_HEAD || o->scale_mode == RS_KV_SCALE_PER_TOKEN;
    default: return false;
    }
}

/* The backend memory of layer l: pages, then its scales. RS_OK or RS_ENOMEM. */
static int layer_alloc(rs_kv_pool *p, int l) {
    rs_kv_layer *L = &p->layers[l];
    *L = (rs_kv_layer){.dtype = p->dtype, .n_blocks = p->n_blocks, .n_kv_heads = p->n_kv_heads,
                       .head_dim = p->head_dim, .scale_mode = p->scale_mode};
    size_t bytes = (size_t)p->n_blocks * page_bytes(p);
    if (!(L->pages = rs_backend_alloc(p->backend, bytes))) goto fail;
    if (p->scale_mode == RS_KV_SCALE_PER_HEAD) {
        size_t n = 2 * (size_t)p->n_kv_heads;
        bytes = n * sizeof(float);
        if (!(L->k_scale = rs_backend_alloc(p->backend, bytes))) goto fail;
        L->v_scale = L->k_scale + p->n_kv_heads;
        float *ones = rs_xmalloc(bytes);
        for (size_t i = 0; i < n; i++) ones[i] = 1.0f;
        rs_backend_upload(p->backend, L->k_scale, ones, bytes);
        free(ones);
    } else if (p->scale_mode == RS_KV_SCALE_PER_TOKEN) {
        bytes = (size_t)p->n_blocks * token_scale_bytes(p);
        if (!(L->token_scales = rs_backend_alloc(p->backend, bytes))) goto fail;
    }
    return RS_OK;
fail:
    RS_ERROR("kv cache: cannot allocate %zu bytes for layer %d", bytes, l);
    return RS_ENOMEM;
}

int rs_kv_pool_init_ex(rs_kv_pool *p, rs_backend *b, int n_layers, int n_kv_heads, int head_dim,
                       const rs_kv_cache_opts *o, size_t budget_bytes) {
    memset(p, 0, sizeof *p);
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || !opts_valid(o)) {
        RS_ERROR("kv cache: invalid shape (layers %d, kv heads %d, head dim %d) or dtype %s with scale mode %d",
                 n_layers, n_kv_heads, head_dim, rs_dtype_name(o->dtype), (int)o->scale_mode);
        return RS_EINVAL;
    }
    p->backend = b;
    p->n_layers = n_layers;
    p->n_kv_heads = n_kv_heads;
    p->head_dim = head_dim;
    p->dtype = o->dtype;
    p->scale_mode = o->scale_mode;
    size_t per_block = rs_kv_bytes_per_block(p), fixed = (size_t)n_layers * head_scale_bytes(p);
    size_t n = budget_bytes > fixed ? (budget_bytes - fixed) / per_block : 0;
    if (n < 1) n = 1;
    if (n > INT32_MAX / RS_KV_BLOCK) n = INT32_MAX / RS_KV_BLOCK;
    p->n_blocks = (int)n;
    p->layers = rs_xcalloc((size_t)n_layers, sizeof *p->layers);
    for (int l = 0; l < n_layers; l++) {
        if (layer_alloc(p, l) != RS_OK) {
            rs_kv_pool_free(p);
            return RS_ENOMEM;
        }
    }
    p->bytes = (size_t)p->n_blocks * per_block + fixed;
    p->free_list = rs_xmalloc(sizeof(int32_t) * (size_t)p->n_blocks);
    /* pop order 0, 1, 2, ... */
    for (int i = 0; i < p->n_blocks; i++) p->free_list[i] = p->n_blocks - 1 - i;
    p->n_free = p->n_blocks;
    p->info = rs_xcalloc((size_t)p->n_blocks, sizeof *p->info);
    for (int i = 0; i < p->n_blocks; i++) p->info[i].lru_prev = p->info[i].lru_next = RS_KV_NONE;
    p->table_cap = 16;
    while (p->table_cap < 2u * (uint32_t)p->n_blocks) p->table_cap *= 2;
    p->table = rs_xmalloc(sizeof(int32_t) * p->table_cap);
    memset(p->table, 0xff, sizeof(int32_t) * p->table_cap); /* all RS_KV_NONE */
    p->lru_head = p->lru_tail = RS_KV_NONE;
    p->hash_mask = ~0ull;
    return RS_OK;
}

int rs_kv_pool_init(rs_kv_pool *p, rs_backend *b, int n_layers, int n_kv_heads, int head_dim,
                    rs_dtype dtype, size_t budget_bytes) {
    rs_kv_cache_opts o = {.dtype = dtype, .scale_mode = RS_KV_SCALE_NONE};
    return rs_kv_pool_init_ex(p, b, n_layers, n_kv_heads, head_dim, &o, budget_bytes);
}

void rs_kv_pool_free(rs_kv_pool *p) {
    if (p->layers) {
        for (int l = 0; l < p->n_layers; l++) {
            rs_kv_layer *L = &p->layers[l];
            if (L->pages) rs_backend_free_mem(p->backend, L->pages);
            if (L->k_scale) rs_backend_free_mem(p->backend, L->k_scale); /* v_scale shares it */
            if (L->token_scales) rs_backend_free_mem(p->backend, L->token_scales);
        }
    }
    free(p->layers);
    free(p->free_list);
    free(p->info);
    free(p->table);
    memset(p, 0, sizeof *p);
}

rs_kv_scale_mode rs_kv_scales_storage(rs_kv_scales src) {
    switch (src) {
    case RS_KV_SCALES_DYNAMIC: return RS_KV_SCALE_PER_TOKEN;
    case RS_KV_SCALES_CALIBRATE:
    case RS_KV_SCALES_STATIC: return RS_KV_SCALE_PER_HEAD;
    case RS_KV_SCALES_NONE: break;
    }
    return RS_KV_SCALE_NONE;
}

const char *rs_kv_scales_name(rs_kv_scales src) {
    static const char *const names[] = {"none", "dynamic", "calibrate", "static"};
    return (unsigned)src < sizeof names / sizeof names[0] ? names[src] : "?";
}

bool rs_kv_scales_valid(const float *k_scales, const float *v_scales, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!(isfinite(k_scales[i]) && k_scales[i] > 0.0f && isfinite(v_scales[i]) && v_scales[i] > 0.0f)) return false;
    return true;
}

int rs_kv_pool_set_scales(rs_kv_pool *p, const float *k_scales, const float *v_scales) {
    if (p->scale_mode != RS_KV_SCALE_PER_HEAD) {
        RS_ERROR("kv cache: per-head scales given to a pool without them (dtype %s)", rs_dtype_name(p->dtype));
        return RS_EINVAL;
    }
    size_t n = (size_t)p->n_kv_heads;
    if (!rs_kv_scales_valid(k_scales, v_scales, (size_t)p->n_layers * n)) {
        RS_ERROR("kv cache: a per-head scale is not finite and positive; the scales in service stay");
        return RS_EINVAL;
    }
    for (int l = 0; l < p->n_layers; l++) {
        rs_kv_layer *L = &p->layers[l];
        rs_backend_upload(p->backend, L->k_scale, k_scales + (size_t)l * n, n * sizeof(float));
        rs_backend_upload(p->backend, L->v_scale, v_scales + (size_t)l * n, n * sizeof(float));
    }
    rs_kv_pool_flush_cache(p);
    return RS_OK;
}

int rs_kv_pool_get_scales(const rs_kv_pool *p, float *k_scales, float *v_scales) {
    if (p->scale_mode != RS_KV_SCALE_PER_HEAD) return RS_EINVAL;
    size_t n = (size_t)p->n_kv_heads;
    for (int l = 0; l < p->n_layers; l++) {
        const rs_kv_layer *L = &p->layers[l];
        rs_backend_download(p->backend, k_scales + (size_t)l * n, L->k_scale, n * sizeof(float));
        rs_backend_download(p->backend, v_scales + (size_t)l * n, L->v_scale, n * sizeof(float));
    }
    return RS_OK;
}

void rs_kv_pool_flush_cache(rs_kv_pool *p) {
    for (int b = 0; b < p->n_blocks; b++) {
        rs_kv_block_info *bi = &p->info[b];
        if (!bi->registered) continue;
        bi->registered = false;
        bi->id = 0;
        if (bi->ref == 0) {
            bi->lru_prev = bi->lru_next = RS_KV_NONE;
            p->free_list[p->n_free++] = b;
        }
    }
    memset(p->table, 0xff, sizeof(int32_t) * p->table_cap);
    p->lru_head = p->lru_tail = RS_KV_NONE;
    p->n_evictable = 0;
    p->epoch++;
}

/* ---- sequences ------------------------------------------------------------------------------- */

static void seq_grow(rs_kv_seq *s, int need) {
    if (need <= s->cap) return;
    int cap = s->cap ? s->cap : 4;
    while (cap < need) cap *= 2;
    s->blocks = rs_xrealloc(s->blocks, sizeof(int32_t) * (size_t)cap);
    s->cap = cap;
}

static void seq_append(rs_kv_pool *p, rs_kv_seq *s, int32_t b) {
    if (s->n_blocks == 0) s->epoch = p->epoch;
    s->blocks[s->n_blocks++] = b;
}

int rs_kv_seq_match_prefix(rs_kv_pool *p, rs_kv_seq *s, const int32_t *tokens, int n_tokens) {
    RS_ASSERT(s->n_blocks == 0 && n_tokens >= 0);
    p->query_tokens += (uint64_t)n_tokens;
    int max_blocks = n_tokens > 0 ? (n_tokens - 1) / RS_KV_BLOCK : 0;
    uint64_t parent = 0;
    int n = 0;
    for (; n < max_blocks; n++) {
        const int32_t *t = tokens + (size_t)n * RS_KV_BLOCK;
        int32_t b = table_find(p, key_hash(p, parent, t), parent, t);
        if (b == RS_KV_NONE) break;
        block_ref(p, b);
        seq_grow(s, n + 1);
        seq_append(p, s, b);
        parent = p->info[b].id;
    }
    s->n_hashed = n;
    s->chain_id = parent;
    p->hit_tokens += (uint64_t)n * RS_KV_BLOCK;
    return n * RS_KV_BLOCK;
}

void rs_kv_seq_unmatch(rs_kv_pool *p, rs_kv_seq *s, int n_tokens) {
    RS_ASSERT(s->n_blocks == s->n_hashed && n_tokens >= 0); /* nothing but the matched blocks */
    RS_ASSERT(p->query_tokens >= (uint64_t)n_tokens && p->hit_tokens >= (uint64_t)s->n_hashed * RS_KV_BLOCK);
    p->query_tokens -= (uint64_t)n_tokens;
    p->hit_tokens -= (uint64_t)s->n_hashed * RS_KV_BLOCK;
    rs_kv_seq_release(p, s);
}

void rs_kv_seq_commit(rs_kv_pool *p, rs_kv_seq *s, const int32_t *tokens, int n_computed) {
    int n_full = RS_MIN(n_computed / RS_KV_BLOCK, s->n_blocks);
    if (s->epoch != p->epoch) return; /* computed against weights the cache has since dropped */
    for (int i = s->n_hashed; i < n_full; i++) {
        /* A block s shares may already be registered, by a sharer whose chain took another path to
         * the same prefix (it found a duplicate entry that has since been evicted): its id names
         * exactly the prefix s holds, so s continues from it. */
        int32_t found = s->blocks[i];
        if (!p->info[found].registered) {
            const int32_t *t = tokens + (size_t)i * RS_KV_BLOCK;
            uint64_t hash = key_hash(p, s->chain_id, t);
            found = table_find(p, hash, s->chain_id, t);
            if (found == RS_KV_NONE) {
                found = s->blocks[i];
                block_register(p, found, hash, s->chain_id, t);
            }
        }
        s->chain_id = p->info[found].id;
        s->n_hashed = i + 1;
    }
}

int rs_kv_seq_reserve(rs_kv_pool *p, rs_kv_seq *s, int n_tokens) {
    int need = (n_tokens + RS_KV_BLOCK - 1) / RS_KV_BLOCK;
    if (need <= s->n_blocks) return RS_OK;
    if (need - s->n_blocks > rs_kv_available_blocks(p)) return RS_ENOMEM;
    seq_grow(s, need);
    while (s->n_blocks < need) seq_append(p, s, block_take(p));
    return RS_OK;
}

void rs_kv_seq_fork(rs_kv_pool *p, const rs_kv_seq *parent, rs_kv_seq *child) {
    RS_ASSERT(child->n_blocks == 0 && child != parent);
    seq_grow(child, parent->n_blocks);
    for (int i = 0; i < parent->n_blocks; i++) {
        block_ref(p, parent->blocks[i]);
        child->blocks[i] = parent->blocks[i];
    }
    child->n_blocks = parent->n_blocks;
    child->n_hashed = parent->n_hashed;
    child->chain_id = parent->chain_id;
    child->epoch = parent->epoch;
}

int rs_kv_seq_prepare_write(rs_kv_pool *p, rs_kv_seq *s, int pos) {
    int i = pos / RS_KV_BLOCK;
    RS_ASSERT(pos >= 0 && i < s->n_blocks);
    RS_ASSERT(i >= s->n_hashed); /* committed blocks are complete: nobody writes into them */
    int32_t old = s->blocks[i];
    RS_ASSERT(!p->info[old].registered);
    if (p->info[old].ref == 1) return RS_OK;
    int32_t b = block_take(p);
    if (b == RS_KV_NONE) return RS_ENOMEM;
    size_t bytes = page_bytes(p), ts_bytes = token_scale_bytes(p);
    for (int l = 0; l < p->n_layers; l++) {
        char *pages = p->layers[l].pages;
        rs_backend_copy(p->backend, pages + (size_t)b * bytes, pages + (size_t)old * bytes, bytes);
        if (ts_bytes) {
            char *ts = (char *)p->layers[l].token_scales;
            rs_backend_copy(p->backend, ts + (size_t)b * ts_bytes, ts + (size_t)old * ts_bytes, ts_bytes);
        }
    }
    block_unref(p, old);
    s->blocks[i] = b;
    return RS_OK;
}

void rs_kv_seq_release(rs_kv_pool *p, rs_kv_seq *s) {
    /* Last block first, so a prefix's first block ends at the MRU end and is evicted last. */
    for (int i = s->n_blocks - 1; i >= 0; i--) block_unref(p, s->blocks[i]);
    free(s->blocks);
    memset(s, 0, sizeof *s);
}

/* ---- invariant check ------------------------------------------------------------------------- */

enum { CHECK_FREE = 1, CHECK_LRU = 2 };

static void check_lists(const rs_kv_pool *p, uint8_t *where) {
    RS_ASSERT(p->n_free >= 0 && p->n_free <= p->n_blocks);
    for (int i = 0; i < p->n_free; i++) {
        int32_t b = p->free_list[i];
        RS_ASSERT(b >= 0 && b < p->n_blocks && where[b] == 0);
        where[b] = CHECK_FREE;
    }
    int n = 0;
    int32_t prev = RS_KV_NONE;
    for (int32_t b = p->lru_head; b != RS_KV_NONE; b = p->info[b].lru_next) {
        RS_ASSERT(b >= 0 && b < p->n_blocks && where[b] == 0 && n < p->n_blocks);
        RS_ASSERT(p->info[b].lru_prev == prev);
        where[b] = CHECK_LRU;
        prev = b;
        n++;
    }
    RS_ASSERT(p->lru_tail == prev && n == p->n_evictable);
}

static void check_table(const rs_kv_pool *p, int n_registered) {
    uint32_t mask = p->table_cap - 1;
    int n = 0;
    for (uint32_t s = 0; s < p->table_cap; s++) {
        int32_t b = p->table[s];
        if (b == RS_KV_NONE) continue;
        RS_ASSERT(b >= 0 && b < p->n_blocks);
        const rs_kv_block_info *bi = &p->info[b];
        RS_ASSERT(bi->registered && bi->id > 0 && bi->parent_id < bi->id && bi->id <= p->next_entry_id);
        RS_ASSERT(bi->hash == key_hash(p, bi->parent_id, bi->tokens));
        /* reachable: no hole between its home slot and its slot; and its key is unique */
        for (uint32_t i = home_slot(p, bi->hash); i != s; i = (i + 1) & mask) RS_ASSERT(p->table[i] != RS_KV_NONE);
        RS_ASSERT(table_find(p, bi->hash, bi->parent_id, bi->tokens) == b);
        n++;
    }
    RS_ASSERT(n == n_registered);
}

void rs_kv_pool_check(const rs_kv_pool *p, const rs_kv_seq *const *seqs, int n_seqs) {
    int32_t *refs = rs_xcalloc((size_t)p->n_blocks, sizeof *refs);
    uint8_t *where = rs_xcalloc((size_t)p->n_blocks, 1);
    for (int k = 0; k < n_seqs; k++) {
        const rs_kv_seq *s = seqs[k];
        RS_ASSERT(s->n_blocks >= 0 && s->n_blocks <= s->cap && s->n_hashed >= 0 && s->n_hashed <= s->n_blocks);
        RS_ASSERT(s->epoch <= p->epoch);
        for (int i = 0; i < s->n_blocks; i++) {
            RS_ASSERT(s->blocks[i] >= 0 && s->blocks[i] < p->n_blocks);
            refs[s->blocks[i]]++;
        }
    }
    check_lists(p, where);
    int n_registered = 0;
    for (int b = 0; b < p->n_blocks; b++) {
        const rs_kv_block_info *bi = &p->info[b];
        RS_ASSERT(bi->ref == refs[b]);
        if (bi->ref > 0) RS_ASSERT(where[b] == 0);
        else if (bi->registered) RS_ASSERT(where[b] == CHECK_LRU);
        else RS_ASSERT(where[b] == CHECK_FREE);
        if (where[b] != CHECK_LRU) RS_ASSERT(bi->lru_prev == RS_KV_NONE && bi->lru_next == RS_KV_NONE);
        if (!bi->registered) RS_ASSERT(bi->id == 0);
        n_registered += bi->registered;
    }
    check_table(p, n_registered);
    free(refs);
    free(where);
}
