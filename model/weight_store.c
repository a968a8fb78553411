/*
 * weight_store.c — weight slots by HF name, conversion into a slot's served format, and the
 * weight store (see weight_store.h).
 *
 * The store tracks its allocations in an open-addressing hash table keyed by address (linear
 * probing, backward-shift deletion), so releasing one allocation during a commit is O(1) even for
 * a MoE model with tens of thousands of expert tensors.
 *
 * Conversion happens on the host. A matrix to quantize is processed in bands of 128 rows (one row
 * of weight blocks), in parallel on the store's pool when it has one: each band is copied into an
 * aligned buffer when it must be (F16 as F32; BF16 and F32 are read where they lie) and quantized
 * by rs_fp8_quantize_weight into
 * its rows of codes and its row of block scales. Blocks never span bands, so the result is bit for
 * bit that of quantizing the whole matrix at once. Only codes and scales are uploaded; peak host
 * memory is the matrix's codes and scales plus one band per thread. On a host-memory backend (the
 * CPU's) the codes and scales are written straight into the store's allocations, with no host copy
 * to upload (a BF16 push into an FP8 daemon: 0.137 -> 0.121 s of service time for 1.19 GB on the
 * reference VM). Everything else is uploaded
 * in the slot's dtype, converted element by element when the source dtype differs (F32 -> BF16
 * rounds to nearest even, exactly as rs_f32_to_bf16).
 *
 * Checks in the same pass. Every tensor converted is refused (RS_EFORMAT, 400) when it holds a
 * NaN or an infinity, and, when the source came with a CRC-32C (rs_weight_src.has_crc32c), when
 * its bytes do not have that CRC. Both are computed where the bytes are read anyway: the
 * quantizer's amax already tells a non-finite block (cpu_fp8_wquant.c), and each band's CRC is
 * taken right after its quantization, while the band is in L2; tensors that are copied or
 * converted go in 256 Ki-element chunks on the store's pool, each chunk copied (or converted), then
 * scanned for non-finite values (kernels/scan.h) and checksummed while in L2. What is
 * scanned is what will be served: the destination on a host-memory backend, the converted host
 * buffer, and otherwise (codes uploaded to a device) the source right after its upload. The CRC
 * is of the bytes as they arrived; the chunks' and bands' CRCs combine into the tensor's
 * (core/crc32c.h). A tensor refused this way leaves nothing allocated.
 */
#include "weight_store.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/crc32c.h"
#include "../kernels/scan.h"
#include "../kernels/fp8.h"
#include "quant.h"

/* ---------------------------------------------------------------- the weight store */

typedef struct ws_entry {
    void *p;                            /* NULL = empty */
    size_t bytes;
} ws_entry;

struct rs_weight_store {
    rs_backend *backend;                /* borrowed */
    ws_entry *tab;                      /* [cap], cap a power of two, at most half full */
    size_t cap, n;
    size_t bytes;                       /* sum of the owned allocations' sizes */
    rs_pool *pool;                      /* borrowed; NULL = quantize on the caller's thread */
    rs_tensor *experts;                 /* [n_experts_total] host descriptors, owned */
    /* recycling (rs_weight_store_keep_released / rs_weight_store_set_donor) */
    bool keep_released;                 /* release parks allocations in `spare` instead of freeing */
    pthread_mutex_t spare_mu;           /* guards spare*: the engine thread parks, the sync thread takes */
    ws_entry *spare;                    /* [n_spare] parked allocations, owned, not counted in bytes */
    size_t n_spare, cap_spare, spare_bytes;
    rs_weight_store *donor;             /* borrowed: alloc takes a parked allocation of its spares */
};

static size_t ws_hash(const void *p, size_t cap) {
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (size_t)x & (cap - 1);
}

static void ws_insert(rs_weight_store *ws, void *p, size_t bytes);

static void ws_grow(rs_weight_store *ws) {
    ws_entry *old = ws->tab;
    size_t old_cap = ws->cap;
    ws->cap = old_cap ? 2 * old_cap : 256;
    ws->tab = rs_xcalloc(ws->cap, sizeof *ws->tab);
    ws->n = 0;
    ws->bytes = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].p) ws_insert(ws, old[i].p, old[i].bytes);
    free(old);
}

static void ws_insert(rs_weight_store *ws, void *p, size_t bytes) {
    if (2 * (ws->n + 1) > ws->cap) ws_grow(ws);
    size_t i = ws_hash(p, ws->cap);
    while (ws->tab[i].p) {
        RS_ASSERT(ws->tab[i].p != p);
        i = (i + 1) & (ws->cap - 1);
    }
    ws->tab[i] = (ws_entry){p, bytes};
    ws->n++;
    ws->bytes += bytes;
}

/* Removes p from the table (it must be there) and returns its size. */
static size_t ws_remove(rs_weight_store *ws, void *p) {
    RS_ASSERT(ws->cap > 0);
    size_t i = ws_hash(p, ws->cap);
    while (ws->tab[i].p != p) {
        RS_ASSERT(ws->tab[i].p != NULL); /* not owned by this store: a bug in the caller */
        i = (i + 1) & (ws->cap - 1);
    }
    size_t bytes = ws->tab[i].bytes;
    ws->tab[i] = (ws_entry){0};
    /* backward shift: move later entries of the probe run into the hole when their home allows */
    for (size_t j = (i + 1) & (ws->cap - 1); ws->tab[j].p; j = (j + 1) & (ws->cap - 1)) {
        size_t home = ws_hash(ws->tab[j].p, ws->cap);
        bool movable = i <= j ? (home <= i || home > j) : (home <= i && home > j);
        if (movable) {
            ws->tab[i] = ws->tab[j];
            ws->tab[j] = (ws_entry){0};
            i = j;
        }
    }
    ws->n--;
    ws->bytes -= bytes;
    return bytes;
}

rs_weight_store *rs_weight_store_new(rs_backend *b) {
    rs_weight_store *ws = rs_xcalloc(1, sizeof *ws);
    ws->backend = b;
    pthread_mutex_init(&ws->spare_mu, NULL);
    return ws;
}

/* Parks allocation p of `bytes` in ws's spares. */
static void spare_push(rs_weight_store *ws, void *p, size_t bytes) {
    pthread_mutex_lock(&ws->spare_mu);
    if (ws->n_spare == ws->cap_spare) {
        ws->cap_spare = ws->cap_spare ? 2 * ws->cap_spare : 64;
        ws->spare = rs_xrealloc(ws->spare, ws->cap_spare * sizeof *ws->spare);
    }
    ws->spare[ws->n_spare++] = (ws_entry){.p = p, .bytes = bytes};
    ws->spare_bytes += bytes;
    pthread_mutex_unlock(&ws->spare_mu);
}

/* A parked allocation of exactly `bytes` taken out of ws's spares, or NULL. */
static void *spare_take(rs_weight_store *ws, size_t bytes) {
    void *p = NULL;
    pthread_mutex_lock(&ws->spare_mu);
    for (size_t i = ws->n_spare; i-- > 0;) { /* newest first: a commit parks in model order */
        if (ws->spare[i].bytes != bytes) continue;
        p = ws->spare[i].p;
        ws->spare[i] = ws->spare[--ws->n_spare];
        ws->spare_bytes -= bytes;
        break;
    }
    pthread_mutex_unlock(&ws->spare_mu);
    return p;
}

void rs_weight_store_trim(rs_weight_store *ws) {
    pthread_mutex_lock(&ws->spare_mu);
    for (size_t i = 0; i < ws->n_spare; i++) rs_backend_free_mem(ws->backend, ws->spare[i].p);
    ws->n_spare = 0;
    ws->spare_bytes = 0;
    pthread_mutex_unlock(&ws->spare_mu);
}

void rs_weight_store_free(rs_weight_store *ws) {
    if (!ws) return;
    for (size_t i = 0; i < ws->cap; i++) {
        if (!ws->tab[i].p) continue;
        if (ws->donor && ws->donor->keep_released) /* an aborted update's staging: reusable by the next */
            spare_push(ws->donor, ws->tab[i].p, ws->tab[i].bytes);
        else rs_backend_free_mem(ws->backend, ws->tab[i].p);
    }
    rs_weight_store_trim(ws);
    pthread_mutex_destroy(&ws->spare_mu);
    free(ws->spare);
    free(ws->tab);
    free(ws->experts);
    free(ws);
}

void *rs_weight_store_alloc(rs_weight_store *ws, size_t bytes) {
    if (!bytes) bytes = 1;
    void *p = ws->donor ? spare_take(ws->donor, bytes) : NULL;
    if (!p && !(p = rs_backend_alloc(ws->backend, bytes))) return NULL;
    ws_insert(ws, p, bytes);
    return p;
}

void rs_weight_store_release(rs_weight_store *ws, void *p) {
    if (!p) return;
    size_t bytes = ws_remove(ws, p);
    if (ws->keep_released) spare_push(ws, p, bytes);
    else rs_backend_free_mem(ws->backend, p);
}

void rs_weight_store_keep_released(rs_weight_store *ws, bool keep) {
    ws->keep_released = keep;
    if (!keep) rs_weight_store_trim(ws);
}

void rs_weight_store_set_donor(rs_weight_store *ws, rs_weight_store *donor) {
    RS_ASSERT(!donor || donor->backend == ws->backend);
    ws->donor = donor;
}

size_t rs_weight_store_spare_bytes(rs_weight_store *ws) {
    pthread_mutex_lock(&ws->spare_mu);
    size_t b = ws->spare_bytes;
    pthread_mutex_unlock(&ws->spare_mu);
    return b;
}

void rs_weight_store_adopt(rs_weight_store *ws, rs_weight_store *from, void *p) {
    if (!p) return;
    RS_ASSERT(ws->backend == from->backend);
    size_t bytes = ws_remove(from, p);
    ws_insert(ws, p, bytes);
}

size_t rs_weight_store_bytes(const rs_weight_store *ws) { return ws->bytes; }
void rs_weight_store_set_pool(rs_weight_store *ws, rs_pool *pool) { ws->pool = pool; }
size_t rs_weight_store_count(const rs_weight_store *ws) { return ws->n; }

rs_tensor *rs_weight_store_experts(rs_weight_store *ws, size_t n) {
    RS_ASSERT(!ws->experts);
    ws->experts = rs_xcalloc(n ? n : 1, sizeof *ws->experts);
    return ws->experts;
}

/* ---------------------------------------------------------------- slots */

/* The parameters of one decoder layer, in model order: the fixed ones, then (sparse layers) each
 * expert's gate, up and down projections. */
typedef enum lk {
    LK_IN_NORM = 0, LK_Q, LK_K, LK_V, LK_O, LK_BQ, LK_BK, LK_BV, LK_QN, LK_KN, LK_POST_NORM,
    LK_GATE, LK_UP, LK_DOWN, LK_ROUTER, LK_COUNT
} lk;

static const char *const lk_suffix[LK_COUNT] = {
    [LK_IN_NORM] = "input_layernorm.weight",
    [LK_Q] = "self_attn.q_proj.weight",
    [LK_K] = "self_attn.k_proj.weight",
    [LK_V] = "self_attn.v_proj.weight",
    [LK_O] = "self_attn.o_proj.weight",
    [LK_BQ] = "self_attn.q_proj.bias",
    [LK_BK] = "self_attn.k_proj.bias",
    [LK_BV] = "self_attn.v_proj.bias",
    [LK_QN] = "self_attn.q_norm.weight",
    [LK_KN] = "self_attn.k_norm.weight",
    [LK_POST_NORM] = "post_attention_layernorm.weight",
    [LK_GATE] = "mlp.gate_proj.weight",
    [LK_UP] = "mlp.up_proj.weight",
    [LK_DOWN] = "mlp.down_proj.weight",
    [LK_ROUTER] = "mlp.gate.weight",
};

static const char *const expert_suffix[3] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};

/* Fills kinds[] with layer l's fixed parameters; returns how many. */
static int layer_kinds(const rs_model_config *c, int l, lk kinds[LK_COUNT]) {
    int n = 0;
    kinds[n++] = LK_IN_NORM;
    kinds[n++] = LK_Q, kinds[n++] = LK_K, kinds[n++] = LK_V, kinds[n++] = LK_O;
    if (c->qkv_bias) kinds[n++] = LK_BQ, kinds[n++] = LK_BK, kinds[n++] = LK_BV;
    if (c->qk_norm) kinds[n++] = LK_QN, kinds[n++] = LK_KN;
    kinds[n++] = LK_POST_NORM;
    if (c->layer_is_moe[l]) kinds[n++] = LK_ROUTER;
    else kinds[n++] = LK_GATE, kinds[n++] = LK_UP, kinds[n++] = LK_DOWN;
    return n;
}

static int layer_param_count(const rs_model_config *c, int l) {
    lk kinds[LK_COUNT];
    return layer_kinds(c, l, kinds) + (c->layer_is_moe[l] ? 3 * c->n_experts : 0);
}

/* A parameter of layer l: kind k, or expert e's projection `which` (0 gate, 1 up, 2 down) when
 * k == LK_COUNT. Fills info's kind, shape and fp8_eligible; returns the slot. */
static rs_tensor *layer_slot(rs_model *m, int l, lk k, int e, int which, rs_slot_info *info) {
    const rs_model_config *c = &m->cfg;
    const int64_t h = c->hidden, hd = c->head_dim, q = (int64_t)c->n_heads * hd, kv = (int64_t)c->n_kv_heads * hd;
    rs_layer_weights *w = &m->layers[l];
    info->layer = l;
    info->kind = RS_SLOT_MATRIX;
    info->fp8_eligible = true;
    int64_t d0 = 0, d1 = 0;
    rs_tensor *t = NULL;
    if (k == LK_COUNT) {
        const int64_t mi = c->moe_intermediate;
        rs_tensor *arr[3] = {w->e_gate, w->e_up, w->e_down};
        t = &arr[which][e];
        d0 = which == 2 ? h : mi;
        d1 = which == 2 ? mi : h;
    } else {
        switch (k) {
        case LK_IN_NORM: t = &w->attn_norm, d0 = h; break;
        case LK_POST_NORM: t = &w->mlp_norm, d0 = h; break;
        case LK_Q: t = &w->wq, d0 = q, d1 = h; break;
        case LK_K: t = &w->wk, d0 = kv, d1 = h; break;
        case LK_V: t = &w->wv, d0 = kv, d1 = h; break;
        case LK_O: t = &w->wo, d0 = h, d1 = q; break;
        case LK_BQ: t = &w->bq, d0 = q; break;
        case LK_BK: t = &w->bk, d0 = kv; break;
        case LK_BV: t = &w->bv, d0 = kv; break;
        case LK_QN: t = &w->q_norm, d0 = hd; break;
        case LK_KN: t = &w->k_norm, d0 = hd; break;
        case LK_GATE: t = &w->w_gate, d0 = c->intermediate, d1 = h; break;
        case LK_UP: t = &w->w_up, d0 = c->intermediate, d1 = h; break;
        case LK_DOWN: t = &w->w_down, d0 = h, d1 = c->intermediate; break;
        case LK_ROUTER: t = &w->router, d0 = c->n_experts, d1 = h; break;
        case LK_COUNT: break;
        }
        if (d1 == 0) info->kind = RS_SLOT_VECTOR;
        info->fp8_eligible = k == LK_Q || k == LK_K || k == LK_V || k == LK_O || k == LK_GATE || k == LK_UP ||
                             k == LK_DOWN;
    }
    info->ndim = d1 ? 2 : 1;
    info->shape[0] = d0;
    info->shape[1] = d1;
    return t;
}

/* Parses a decimal index in [0, limit) written without leading zeros; advances *s. */
static bool parse_index(const char **s, int limit, int *out) {
    const char *p = *s;
    if (*p < '0' || *p > '9') return false;
    if (*p == '0' && p[1] >= '0' && p[1] <= '9') return false;
    long v = 0;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (*p++ - '0');
        if (v >= limit) return false;
    }
    *out = (int)v;
    *s = p;
    return true;
}

static int layer_base(const rs_model_config *c, int l) {
    int base = 1; /* embed_tokens */
    for (int i = 0; i < l; i++) base += layer_param_count(c, i);
    return base;
}

static int layers_total(const rs_model_config *c) { return layer_base(c, c->n_layers) - 1; }

int rs_model_param_count(const rs_model *m) {
    return 1 + layers_total(&m->cfg) + 1 + (m->cfg.tie_embeddings ? 0 : 1);
}

/* The slot of a parameter name (no _scale_inv suffix), with info filled (index included). */
static rs_tensor *param_slot(rs_model *m, const char *name, rs_slot_info *info) {
    const rs_model_config *c = &m->cfg;
    memset(info, 0, sizeof *info);
    info->layer = -1;
    const int n_layer_params = layers_total(c);
    if (strcmp(name, "model.embed_tokens.weight") == 0 || strcmp(name, "lm_head.weight") == 0) {
        bool lm = name[0] == 'l';
        info->kind = RS_SLOT_MATRIX;
        info->ndim = 2;
        info->shape[0] = c->vocab_size;
        info->shape[1] = c->hidden;
        info->tied = lm && c->tie_embeddings;
        info->index = !lm ? 0 : info->tied ? -1 : 2 + n_layer_params;
        return lm ? &m->lm_head : &m->embed;
    }
    if (strcmp(name, "model.norm.weight") == 0) {
        info->kind = RS_SLOT_VECTOR;
        info->ndim = 1;
        info->shape[0] = c->hidden;
        info->index = 1 + n_layer_params;
        return &m->final_norm;
    }
    static const char pre[] = "model.layers.";
    if (strncmp(name, pre, sizeof pre - 1) != 0) return NULL;
    const char *p = name + sizeof pre - 1;
    int l;
    if (!parse_index(&p, c->n_layers, &l) || *p++ != '.') return NULL;
    lk kinds[LK_COUNT];
    const int n_fixed = layer_kinds(c, l, kinds);
    const int base = layer_base(c, l);
    static const char ex[] = "mlp.experts.";
    if (c->layer_is_moe[l] && strncmp(p, ex, sizeof ex - 1) == 0) {
        p += sizeof ex - 1;
        int e;
        if (!parse_index(&p, c->n_experts, &e) || *p++ != '.') return NULL;
        for (int which = 0; which < 3; which++) {
            if (strcmp(p, expert_suffix[which]) != 0) continue;
            info->index = base + n_fixed + 3 * e + which;
            return layer_slot(m, l, LK_COUNT, e, which, info);
        }
        return NULL;
    }
    for (int i = 0; i < n_fixed; i++) {
        if (strcmp(p, lk_suffix[kinds[i]]) != 0) continue;
        info->index = base + i;
        return layer_slot(m, l, kinds[i], 0, 0, info);
    }
    return NULL;
}

rs_tensor *rs_model_slot(rs_model *m, const char *name, rs_slot_info *info) {
    rs_slot_info tmp;
    if (!info) info = &tmp;
    static const char sfx[] = "_scale_inv";
    const size_t len = strlen(name), sl = sizeof sfx - 1;
    rs_tensor *t;
    if (len > sl && strcmp(name + len - sl, sfx) == 0) {
        char base[512];
        if (len - sl >= sizeof base) return NULL;
        memcpy(base, name, len - sl);
        base[len - sl] = '\0';
        t = param_slot(m, base, info);
        if (!t || info->kind != RS_SLOT_MATRIX) return NULL;
        info->is_scale = true;
        info->shape[0] = rs_fp8_blocks(info->shape[0]);
        info->shape[1] = rs_fp8_blocks(info->shape[1]);
    } else {
        t = param_slot(m, name, info);
        if (!t) return NULL;
    }
    info->served_fp8 = t->dtype == RS_DTYPE_E4M3 && t->ndim == 2;
    return t;
}

rs_tensor *rs_model_param_at(rs_model *m, int i, char *name, size_t cap, rs_slot_info *info) {
    const rs_model_config *c = &m->cfg;
    rs_slot_info tmp;
    if (!info) info = &tmp;
    const int n_layer_params = layers_total(c);
    RS_ASSERT(i >= 0 && i < rs_model_param_count(m));
    const char *fixed = i == 0 ? "model.embed_tokens.weight"
                        : i == 1 + n_layer_params ? "model.norm.weight"
                        : i == 2 + n_layer_params ? "lm_head.weight" : NULL;
    if (fixed) {
        snprintf(name, cap, "%s", fixed);
        return rs_model_slot(m, fixed, info);
    }
    int k = i - 1, l = 0;
    while (k >= layer_param_count(c, l)) k -= layer_param_count(c, l++);
    lk kinds[LK_COUNT];
    const int n_fixed = layer_kinds(c, l, kinds);
    if (k < n_fixed) snprintf(name, cap, "model.layers.%d.%s", l, lk_suffix[kinds[k]]);
    else snprintf(name, cap, "model.layers.%d.mlp.experts.%d.%s", l, (k - n_fixed) / 3, expert_suffix[(k - n_fixed) % 3]);
    rs_tensor *t = rs_model_slot(m, name, info);
    RS_ASSERT(t && info->index == i);
    return t;
}

/* ---------------------------------------------------------------- conversion */

size_t rs_fp8_served_bytes(int64_t out, int64_t in) {
    return (size_t)(out * in) + (size_t)(rs_fp8_blocks(out) * rs_fp8_blocks(in)) * sizeof(float);
}

/* Element i of an unaligned BF16/F16/F32 array, as f32 (exact). */
static float load_f32(rs_dtype dt, const uint8_t *p, size_t i) {
    if (dt == RS_DTYPE_F32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    return dt == RS_DTYPE_BF16 ? rs_bf16_to_f32(h) : rs_f16_to_f32(h);
}

/* dst[i] = src[i] converted from `from` to `to` (both BF16, F16 or F32), n elements; src may be
 * unaligned, dst is an aligned host buffer. */
static void convert_elems(void *dst, rs_dtype to, const void *src, rs_dtype from, size_t n) {
    const uint8_t *s = src;
    if (to == from) {
        memcpy(dst, src, n * rs_dtype_size(to));
        return;
    }
    for (size_t i = 0; i < n; i++) {
        float f = load_f32(from, s, i);
        if (to == RS_DTYPE_F32) ((float *)dst)[i] = f;
        else if (to == RS_DTYPE_BF16) ((uint16_t *)dst)[i] = rs_f32_to_bf16(f);
        else ((uint16_t *)dst)[i] = rs_f32_to_f16(f);
    }
}

static bool is_float_dtype(rs_dtype dt) { return dt == RS_DTYPE_BF16 || dt == RS_DTYPE_F16 || dt == RS_DTYPE_F32; }

/* A new store allocation holding `bytes` bytes uploaded from host memory. */
static int upload_new(rs_weight_store *ws, const char *name, const void *host, size_t bytes, void **out,
                      rs_error *err) {
    void *p = rs_weight_store_alloc(ws, bytes);
    if (!p)
        return rs_error_set(err, RS_ENOMEM, name, "backend out of memory allocating %zu bytes for tensor '%s'", bytes,
                            name);
    rs_backend_upload(ws->backend, p, host, bytes);
    *out = p;
    return RS_OK;
}

int rs_weight_convert_scales(rs_weight_store *ws, const char *name, const void *scales, rs_dtype scale_dtype,
                             int64_t rows, int64_t cols, float **out, rs_error *err) {
    if (scale_dtype != RS_DTYPE_F32 && scale_dtype != RS_DTYPE_BF16)
        return rs_error_set(err, RS_EUNSUPPORTED, name, "scale tensor '%s' has dtype %s, expected F32 or BF16", name,
                            rs_dtype_name(scale_dtype));
    const size_t n = (size_t)(rows * cols);
    float *host = rs_xmalloc((n ? n : 1) * sizeof *host); /* [rows][cols] f32 */
    for (size_t i = 0; i < n; i++) host[i] = load_f32(scale_dtype, scales, i);
    int rc = RS_OK;
    for (size_t i = 0; i < n; i++) {
        if (!(host[i] >= 0.0f) || isinf(host[i])) {
            rc = rs_error_set(err, RS_EFORMAT, name, "scale tensor '%s' holds %g at [%zu][%zu]", name,
                              (double)host[i], i / (size_t)cols, i % (size_t)cols);
            break;
        }
    }
    void *p = NULL;
    if (rc == RS_OK) rc = upload_new(ws, name, host, n * sizeof *host, &p, err);
    free(host);
    if (rc == RS_OK) *out = p;
    return rc;
}

typedef struct quant_job {
    const rs_weight_src *src;
    int64_t rows, cols;
    rs_backend *backend;                /* packs the codes when layout is not RS_LAYOUT_ROWS */
    rs_layout layout;
    uint8_t *codes;                     /* [rows][cols] e4m3, in layout */
    float *scales;                      /* [ceil(rows/128)][ceil(cols/128)] f32 */
    atomic_int rc;                      /* the first failure, RS_OK when none */
    atomic_bool nonfinite;              /* some band holds a NaN or an infinity */
    uint32_t *band_crc;                 /* [bands] CRC-32C of each band's source bytes, or NULL */
    void **buf, **band_codes;           /* [pool threads]: each thread's scratch, made on first use */
} quant_job;

/* Bands [b0, b1) of 128 rows. BF16 and F32 sources aligned to their element size are quantized
 * where they lie (the kernel reads a band row by row, front to back, so a push reads it straight
 * out of the trainer's segment: a BF16 push into an FP8 daemon spent a quarter of its service time
 * copying bands before); F16 goes through an aligned F32 copy. */
static void quantize_bands(void *ctx, int64_t b0, int64_t b1, int tid) {
    quant_job *j = ctx;
    const rs_dtype host_dt = j->src->dtype == RS_DTYPE_BF16 ? RS_DTYPE_BF16 : RS_DTYPE_F32;
    const size_t esz = rs_dtype_size(j->src->dtype), hsz = rs_dtype_size(host_dt);
    const bool in_place = j->src->dtype == host_dt && (uintptr_t)j->src->data % esz == 0;
    if (!in_place && !j->buf[tid]) j->buf[tid] = rs_xmalloc((size_t)RS_FP8_BLOCK * (size_t)j->cols * hsz);
    /* a band's row-major codes, packed from here into the backend's layout (bands are whole groups) */
    if (j->layout != RS_LAYOUT_ROWS && !j->band_codes[tid])
        j->band_codes[tid] = rs_xmalloc((size_t)RS_FP8_BLOCK * (size_t)j->cols);
    void *buf = j->buf[tid]; /* [128][cols] */
    uint8_t *band_codes = j->band_codes[tid];
    for (int64_t b = b0; b < b1; b++) {
        const int64_t r0 = b * RS_FP8_BLOCK, r1 = RS_MIN(r0 + RS_FP8_BLOCK, j->rows);
        const size_t n = (size_t)(r1 - r0) * (size_t)j->cols;
        const uint8_t *src = (const uint8_t *)j->src->data + (size_t)r0 * (size_t)j->cols * esz;
        if (!in_place) convert_elems(buf, host_dt, src, j->src->dtype, n);
        rs_tensor band = {.dtype = host_dt, .ndim = 2, .shape = {r1 - r0, j->cols},
                          .data = in_place ? (void *)src : buf};
        uint8_t *dst = j->codes + (size_t)r0 * (size_t)j->cols;
        int rc = rs_fp8_quantize_weight(&band, band_codes ? band_codes : dst,
                                        j->scales + (size_t)b * (size_t)rs_fp8_blocks(j->cols));
        if (rc == RS_EFORMAT) { /* a NaN or an infinity: the caller finds where and refuses the tensor */
            atomic_store(&j->nonfinite, true);
            rc = RS_OK;
        }
        if (rc == RS_OK && band_codes) rs_backend_fp8_pack(j->backend, j->layout, dst, band_codes, r1 - r0, j->cols);
        if (j->band_crc) j->band_crc[b] = rs_crc32c(0, src, n * esz); /* still in L2 */
        int ok = RS_OK;
        if (rc != RS_OK) atomic_compare_exchange_strong(&j->rc, &ok, rc);
    }
}

/* FP8 codes as they arrived (row-major) into the backend's layout, 128-row bands [b0, b1) at a
 * time (bands are whole groups of any layout), on the store's pool like quantization. */
typedef struct pack_job {
    rs_backend *backend;
    rs_layout layout;
    uint8_t *dst;
    const uint8_t *src;
    int64_t rows, cols;
} pack_job;

static void pack_bands(void *ctx, int64_t b0, int64_t b1, int tid) {
    (void)tid;
    const pack_job *j = ctx;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t r0 = b * RS_FP8_BLOCK, r1 = RS_MIN(r0 + RS_FP8_BLOCK, j->rows);
        const size_t off = (size_t)r0 * (size_t)j->cols;
        rs_backend_fp8_pack(j->backend, j->layout, j->dst + off, j->src + off, r1 - r0, j->cols);
    }
}

/* The refusal of a tensor holding a non-finite value at element i (p: its elements, dtype dt). */
static int nonfinite_error(const char *name, rs_dtype dt, const void *p, int64_t i, int ndim, const int64_t *shape,
                           rs_error *err) {
    const float v = dt == RS_DTYPE_E4M3 ? NAN : dt == RS_DTYPE_F32 ? ((const float *)p)[i]
                  : dt == RS_DTYPE_BF16 ? rs_bf16_to_f32(((const uint16_t *)p)[i])
                                        : rs_f16_to_f32(((const uint16_t *)p)[i]);
    char at[64];
    if (ndim == 2) snprintf(at, sizeof at, "[%lld][%lld]", (long long)(i / shape[1]), (long long)(i % shape[1]));
    else snprintf(at, sizeof at, "[%lld]", (long long)i);
    return rs_error_set(err, RS_EFORMAT, name,
                        "tensor '%s' holds %s at %s (element %lld): non-finite weights are refused, and the weights "
                        "in service are unchanged", name, isnan(v) ? "NaN" : v > 0 ? "+inf" : "-inf", at, (long long)i);
}

static int crc_error(const char *name, uint32_t got, uint32_t want, uint64_t bytes, rs_error *err) {
    return rs_error_set(err, RS_EFORMAT, name,
                        "tensor '%s': the CRC-32C of its %llu bytes as read is 0x%08x, the manifest says 0x%08x: its "
                        "bytes changed while rolloutd read them (or the checksum is wrong); the weights in service "
                        "are unchanged", name, (unsigned long long)bytes, got, want);
}

/* Copies (or converts) a tensor of n elements in chunks, checking each chunk in the same pass:
 * the first non-finite element of what is served, and the CRC-32C of the source bytes. */
#define CHUNK_ELEMS ((size_t)1 << 18)

typedef struct chunk_job {
    const uint8_t *src;                 /* [n] of src_dt, as arrived */
    rs_dtype src_dt, dst_dt;
    uint8_t *dst;                       /* [n] of dst_dt, or NULL: src is only checked */
    size_t n;
    bool crc;                           /* take the source's CRC */
    int64_t *bad;                       /* [chunks] the first non-finite element, -1 for none */
    uint32_t *chunk_crc;                /* [chunks] */
} chunk_job;

static void check_chunks(void *ctx, int64_t c0, int64_t c1, int tid) {
    (void)tid;
    const chunk_job *j = ctx;
    const size_t ssz = rs_dtype_size(j->src_dt), dsz = rs_dtype_size(j->dst_dt);
    for (int64_t c = c0; c < c1; c++) {
        const size_t i0 = (size_t)c * CHUNK_ELEMS, m = RS_MIN(j->n - i0, CHUNK_ELEMS);
        const uint8_t *src = j->src + i0 * ssz;
        uint8_t *dst = j->dst ? j->dst + i0 * dsz : NULL;
        if (dst && j->src_dt == j->dst_dt) memcpy(dst, src, m * ssz);
        else if (dst) convert_elems(dst, j->dst_dt, src, j->src_dt, m);
        const int64_t t = rs_cpu_first_nonfinite(dst ? j->dst_dt : j->src_dt, dst ? (const void *)dst : src, m);
        j->bad[c] = t < 0 ? -1 : (int64_t)i0 + t;
        /* the served copy when it is the same bytes, else the source (read a moment ago) */
        if (j->crc) j->chunk_crc[c] = rs_crc32c(0, dst && j->src_dt == j->dst_dt ? dst : src, m * ssz);
    }
}

/* Runs a chunk_job on ws's pool; refuses a non-finite value (reported in dst's dtype at its index)
 * or a CRC that is not src->crc32c. */
static int run_checked(rs_weight_store *ws, const char *name, const rs_weight_src *src, rs_dtype dst_dt, void *dst,
                       size_t n, rs_error *err) {
    const int64_t chunks = (int64_t)((n + CHUNK_ELEMS - 1) / CHUNK_ELEMS);
    chunk_job j = {.src = src->data, .src_dt = src->dtype, .dst_dt = dst ? dst_dt : src->dtype, .dst = dst, .n = n,
                   .crc = src->has_crc32c, .bad = rs_xmalloc(sizeof(int64_t) * (size_t)RS_MAX(chunks, 1)),
                   .chunk_crc = rs_xmalloc(sizeof(uint32_t) * (size_t)RS_MAX(chunks, 1))};
    if (ws->pool && chunks > 1) rs_pool_run_dynamic(ws->pool, chunks, 1, check_chunks, &j);
    else if (chunks > 0) check_chunks(&j, 0, chunks, 0);
    int rc = RS_OK;
    if (src->has_crc32c) {
        const size_t ssz = rs_dtype_size(src->dtype);
        uint32_t crc = 0;
        for (int64_t c = 0; c < chunks; c++)
            crc = rs_crc32c_combine(crc, j.chunk_crc[c], RS_MIN(n - (size_t)c * CHUNK_ELEMS, CHUNK_ELEMS) * ssz);
        if (crc != src->crc32c) rc = crc_error(name, crc, src->crc32c, (uint64_t)(n * ssz), err);
    }
    for (int64_t c = 0; c < chunks && rc == RS_OK; c++)
        if (j.bad[c] >= 0)
            rc = nonfinite_error(name, j.dst_dt, dst ? dst : src->data, j.bad[c], src->ndim, src->shape, err);
    free(j.bad);
    free(j.chunk_crc);
    return rc;
}

/* BF16/F16/F32 [out][in] -> E4M3 codes + block scales (kernels/fp8.h), uploaded. */
static int quantize_into(rs_weight_store *ws, const char *name, const rs_weight_src *src, rs_tensor *out,
                         rs_error *err) {
    const int64_t rows = src->shape[0], cols = src->shape[1];
    const size_t n = (size_t)rows * (size_t)cols;
    const size_t n_scales = (size_t)(rs_fp8_blocks(rows) * rs_fp8_blocks(cols));
    quant_job j = {.src = src, .rows = rows, .cols = cols, .backend = ws->backend,
                   .layout = rs_backend_fp8_layout(ws->backend, rows, cols)};
    atomic_init(&j.rc, RS_OK);
    /* A host-memory backend takes the codes where they will be served: no second copy. (Only a
     * host-memory backend has a layout of its own.) */
    const bool direct = rs_backend_host_memory(ws->backend);
    RS_ASSERT(direct || j.layout == RS_LAYOUT_ROWS);
    void *d = NULL, *s = NULL;
    if (direct) {
        d = rs_weight_store_alloc(ws, n);
        s = d ? rs_weight_store_alloc(ws, n_scales * sizeof(float)) : NULL;
        if (!s) {
            rs_weight_store_release(ws, d);
            return rs_error_set(err, RS_ENOMEM, name, "backend out of memory allocating %zu bytes for tensor '%s'",
                                n + n_scales * sizeof(float), name);
        }
        j.codes = d;
        j.scales = s;
    } else {
        j.codes = rs_xmalloc(n ? n : 1);
        j.scales = rs_xmalloc((n_scales ? n_scales : 1) * sizeof *j.scales);
    }
    const int64_t bands = rs_fp8_blocks(rows);
    const int threads = ws->pool ? rs_pool_threads(ws->pool) : 1;
    atomic_init(&j.nonfinite, false);
    if (src->has_crc32c) j.band_crc = rs_xmalloc(sizeof(uint32_t) * (size_t)RS_MAX(bands, 1));
    j.buf = rs_xcalloc((size_t)threads, sizeof *j.buf);
    j.band_codes = rs_xcalloc((size_t)threads, sizeof *j.band_codes);
    /* a band at a time to whichever thread is free: a push shares the CPUs with the trainer packing
     * the next bucket, and a fixed split would wait for a descheduled thread's whole share */
    if (ws->pool && bands > 1) rs_pool_run_dynamic(ws->pool, bands, 1, quantize_bands, &j);
    else if (n) quantize_bands(&j, 0, bands, 0);
    for (int t = 0; t < threads; t++) {
        free(j.buf[t]);
        free(j.band_codes[t]);
    }
    free(j.buf);
    free(j.band_codes);
    int rc = atomic_load(&j.rc);
    if (rc == RS_OK && src->has_crc32c) { /* the bands' CRCs, in order, are the tensor's */
        const uint64_t band_bytes = (uint64_t)RS_FP8_BLOCK * (uint64_t)cols * rs_dtype_size(src->dtype);
        uint32_t crc = 0;
        for (int64_t b = 0; b < bands; b++)
            crc = rs_crc32c_combine(crc, j.band_crc[b], b + 1 < bands ? band_bytes
                                                        : (uint64_t)(rows - b * RS_FP8_BLOCK) * (uint64_t)cols *
                                                              rs_dtype_size(src->dtype));
        if (crc != src->crc32c) rc = crc_error(name, crc, src->crc32c, (uint64_t)n * rs_dtype_size(src->dtype), err);
    }
    if (rc == RS_OK && atomic_load(&j.nonfinite)) {
        const int64_t at = rs_cpu_first_nonfinite(src->dtype, src->data, n);
        rc = at >= 0 ? nonfinite_error(name, src->dtype, src->data, at, 2, src->shape, err)
                     : rs_error_set(err, RS_EFORMAT, name,
                                    "tensor '%s' held a non-finite value when it was quantized and none when searched "
                                    "again: its bytes changed while rolloutd read them; the weights in service are "
                                    "unchanged", name);
    }
    free(j.band_crc);
    if (rc == RS_EFORMAT) {
        if (direct) {
            rs_weight_store_release(ws, d);
            rs_weight_store_release(ws, s);
        }
    } else if (rc != RS_OK) {
        rc = rs_error_set(err, RS_EINTERNAL, name, "cannot quantize tensor '%s' (%s)", name, rs_err_name(rc));
        if (direct) {
            rs_weight_store_release(ws, d);
            rs_weight_store_release(ws, s);
        }
    } else if (!direct && (rc = upload_new(ws, name, j.codes, n, &d, err)) == RS_OK &&
               (rc = upload_new(ws, name, j.scales, n_scales * sizeof *j.scales, &s, err)) != RS_OK) {
        rs_weight_store_release(ws, d);
    }
    if (!direct) {
        free(j.codes);
        free(j.scales);
    }
    if (rc != RS_OK) return rc;
    out->dtype = RS_DTYPE_E4M3;
    out->data = d;
    out->scale_inv = s;
    out->layout = j.layout;
    return RS_OK;
}

/* A new allocation of `bytes` holding src's n elements in dtype `dt` (converted when src's dtype
 * differs), checked (run_checked). On a host-memory backend the chunks go straight into the
 * allocation; otherwise same-dtype data is uploaded as it lies and checked right after, and
 * converted data goes through a host buffer. */
static int store_checked(rs_weight_store *ws, const char *name, const rs_weight_src *src, rs_dtype dt, size_t n,
                         void **out, rs_error *err) {
    const size_t bytes = n * rs_dtype_size(dt);
    int rc;
    void *p = NULL;
    if (rs_backend_host_memory(ws->backend)) {
        if (!(p = rs_weight_store_alloc(ws, bytes)))
            return rs_error_set(err, RS_ENOMEM, name, "backend out of memory allocating %zu bytes for tensor '%s'",
                                bytes, name);
        rc = run_checked(ws, name, src, dt, p, n, err);
    } else if (dt == src->dtype) {
        if ((rc = upload_new(ws, name, src->data, bytes, &p, err)) != RS_OK) return rc;
        rc = run_checked(ws, name, src, dt, NULL, n, err);
    } else {
        void *host = rs_xmalloc(bytes ? bytes : 1);
        rc = run_checked(ws, name, src, dt, host, n, err);
        if (rc == RS_OK) rc = upload_new(ws, name, host, bytes, &p, err);
        free(host);
        if (rc != RS_OK) return rc;
    }
    if (rc != RS_OK) {
        rs_weight_store_release(ws, p);
        return rc;
    }
    *out = p;
    return RS_OK;
}

int rs_weight_convert(rs_weight_store *ws, const char *name, rs_dtype served, const rs_weight_src *src,
                      rs_tensor *out, rs_error *err) {
    memset(out, 0, sizeof *out);
    out->ndim = src->ndim;
    out->shape[0] = src->shape[0];
    out->shape[1] = src->ndim == 2 ? src->shape[1] : 0;
    const size_t n = (size_t)rs_tensor_numel(out);
    if (served == RS_DTYPE_E4M3) {
        RS_ASSERT(src->ndim == 2);
        if (is_float_dtype(src->dtype)) return quantize_into(ws, name, src, out, err);
        if (src->dtype != RS_DTYPE_E4M3)
            return rs_error_set(err, RS_EUNSUPPORTED, name, "tensor '%s' has dtype %s; an FP8 weight takes BF16, F16, "
                                "F32 or F8_E4M3 with its scale_inv", name, rs_dtype_name(src->dtype));
        void *codes = NULL;
        float *scales = NULL;
        const rs_layout layout = rs_backend_fp8_layout(ws->backend, out->shape[0], out->shape[1]);
        int rc = RS_OK;
        if (layout == RS_LAYOUT_ROWS) {
            rc = store_checked(ws, name, src, RS_DTYPE_E4M3, n, &codes, err);
        } else if (!(codes = rs_weight_store_alloc(ws, n))) {
            rc = rs_error_set(err, RS_ENOMEM, name, "backend out of memory allocating %zu bytes for tensor '%s'", n,
                              name);
        } else {
            pack_job pj = {.backend = ws->backend, .layout = layout, .dst = codes, .src = src->data,
                           .rows = out->shape[0], .cols = out->shape[1]};
            const int64_t bands = rs_fp8_blocks(pj.rows);
            if (ws->pool && bands > 1) rs_pool_run_dynamic(ws->pool, bands, 1, pack_bands, &pj);
            else pack_bands(&pj, 0, bands, 0);
            if ((rc = run_checked(ws, name, src, RS_DTYPE_E4M3, NULL, n, err)) != RS_OK) /* the codes packed */
                rs_weight_store_release(ws, codes);
        }
        if (rc != RS_OK) return rc;
        if (src->scale_inv) {
            char sname[300];
            snprintf(sname, sizeof sname, "%s_scale_inv", name);
            rc = rs_weight_convert_scales(ws, sname, src->scale_inv, src->scale_dtype, rs_fp8_blocks(out->shape[0]),
                                          rs_fp8_blocks(out->shape[1]), &scales, err);
            if (rc != RS_OK) {
                rs_weight_store_release(ws, codes);
                return rc;
            }
        }
        out->dtype = RS_DTYPE_E4M3;
        out->data = codes;
        out->scale_inv = scales;
        out->layout = layout;
        return RS_OK;
    }
    if (src->dtype == RS_DTYPE_E4M3)
        return rs_error_set(err, RS_EUNSUPPORTED, name, "tensor '%s' is served as %s and cannot take FP8 (float8_e4m3fn) "
                            "data; send it as bfloat16, float16 or float32", name, rs_dtype_name(served));
    if (!is_float_dtype(src->dtype) || !is_float_dtype(served))
        return rs_error_set(err, RS_EUNSUPPORTED, name, "tensor '%s' has dtype %s, expected bfloat16, float16 or float32",
                            name, rs_dtype_name(src->dtype));
    out->dtype = served;
    return store_checked(ws, name, src, served, n, &out->data, err);
}
