/*
 * transaction.c — staging, validation and the commit of one weight update (see transaction.h).
 *
 * Staging is an array indexed by parameter number (model/weight_store.h's model order), so duplicate
 * detection, the completeness check and the commit are direct lookups. Each entry holds the
 * converted tensor in the slot's served format, in allocations of a private weight store (the
 * staging store); the commit releases each slot's old allocations from the model's store and
 * adopts the staged ones into it, so no byte is copied at the step boundary: the engine is held
 * only for pointer swaps and frees, then its own retract / cache flush / KV recalibration.
 *
 * Staged sizes equal served sizes, so with the default limit (the model's own resident bytes) a
 * complete update always fits, and an update that sends a tensor twice is caught as a duplicate
 * before it can grow staging.
 */
#include "transaction.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/crc32c.h"
#include "../kernels/fp8.h"
#include "../model/kv_scales.h"
#include "../model/weight_store.h"

typedef struct staged {
    rs_tensor *slot;                    /* the model's slot this entry replaces */
    rs_tensor t;                        /* dtype, shape, data / scale_inv in staging allocations */
    bool has_data;                      /* the matrix or vector itself */
    bool has_scale;                     /* FP8 slots: scale_inv (always with quantized float data) */
    bool from_float;                    /* an FP8 slot's data came as BF16/F16/F32 and was quantized */
} staged;

struct rs_txn {
    rs_model *m;                        /* borrowed */
    rs_weight_store *stage;             /* owns every staged allocation until the commit */
    staged *e;                          /* [n_params] */
    int n_params, n_complete;
    bool tied_seen;                     /* a tied lm_head.weight was sent (and ignored) */
    size_t limit;                       /* staging bytes */
    uint64_t received;
    double t_begin;
    char version[RS_TXN_VERSION_BYTES];
    bool applied;                       /* the swap ran (set on the engine thread) */
    /* pushed static FP8 KV scales (model.layers.N.self_attn.k_scale / v_scale): all or none */
    float *kv_k, *kv_v;                 /* [n_layers][n_kv_heads]; NULL until the first one */
    uint8_t *kv_seen;                   /* [n_layers]: bit 0 k_scale, bit 1 v_scale */
    int kv_count;                       /* scale tensors staged */
    rs_backend *calib;                  /* borrowed: calibrates KV scales before the commit, or NULL */
};

static void fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

int rs_txn_begin(rs_txn **out, rs_model *m, const char *version, size_t staging_limit, rs_error *err) {
    if (version && strlen(version) >= RS_TXN_VERSION_BYTES)
        return rs_error_set(err, RS_EINVAL, "weight_version", "weight_version is longer than %d bytes",
                            RS_TXN_VERSION_BYTES - 1);
    rs_txn *u = rs_xcalloc(1, sizeof *u);
    u->m = m;
    u->stage = rs_weight_store_new(m->backend);
    rs_weight_store_set_donor(u->stage, m->store); /* reuses what the last commit released, if kept */
    u->n_params = rs_model_param_count(m);
    u->e = rs_xcalloc((size_t)u->n_params, sizeof *u->e);
    u->limit = staging_limit ? staging_limit : m->weight_bytes;
    u->t_begin = rs_now_s();
    snprintf(u->version, sizeof u->version, "%s", version ? version : "");
    *out = u;
    return RS_OK;
}

void rs_txn_abort(rs_txn *u) {
    if (!u) return;
    rs_weight_store_free(u->stage); /* everything staged and not adopted */
    free(u->kv_k);
    free(u->kv_v);
    free(u->kv_seen);
    free(u->e);
    free(u);
}

void rs_txn_set_pool(rs_txn *u, rs_pool *pool) { rs_weight_store_set_pool(u->stage, pool); }
void rs_txn_set_calib_backend(rs_txn *u, rs_backend *b) { u->calib = b; }

void rs_txn_set_version(rs_txn *u, const char *version) {
    snprintf(u->version, sizeof u->version, "%s", version ? version : "");
}

const char *rs_txn_version(const rs_txn *u) { return u->version; }
int rs_txn_n_staged(const rs_txn *u) { return u->n_complete; }
int rs_txn_n_required(const rs_txn *u) { return u->n_params; }
size_t rs_txn_staged_bytes(const rs_txn *u) { return rs_weight_store_bytes(u->stage); }
uint64_t rs_txn_received_bytes(const rs_txn *u) { return u->received; }
double rs_txn_started_at(const rs_txn *u) { return u->t_begin; }
bool rs_txn_has_kv_scales(const rs_txn *u) { return u->kv_count > 0; }

bool rs_txn_complete(const rs_txn *u) {
    return u->n_complete == u->n_params && (u->kv_count == 0 || u->kv_count == 2 * u->m->cfg.n_layers);
}

static bool entry_complete(const staged *s) {
    return s->has_data && (s->t.dtype != RS_DTYPE_E4M3 || s->has_scale);
}

/* Refuses a conversion that would take staging past its limit. */
static int check_room(rs_txn *u, const char *name, size_t need, rs_error *err) {
    size_t have = rs_weight_store_bytes(u->stage);
    if (need <= u->limit && have <= u->limit - need) return RS_OK;
    return rs_error_set(err, RS_EINVAL, name,
                        "staging tensor '%s' (%zu bytes) would exceed the weight staging limit: %zu of %zu bytes "
                        "already staged (weight-staging-mb; 0 = the model's own %zu bytes); the update is dropped",
                        name, need, have, u->limit, u->m->weight_bytes);
}

static bool is_float(rs_dtype dt) { return dt == RS_DTYPE_BF16 || dt == RS_DTYPE_F16 || dt == RS_DTYPE_F32; }

/* A tensor converted outside rs_weight_convert (scales) with a CRC-32C to match. */
static int check_crc(const rs_txn_tensor *t, size_t bytes, rs_error *err) {
    if (!t->has_crc32c) return RS_OK;
    const uint32_t got = rs_crc32c(0, t->data, bytes);
    if (got == t->crc32c) return RS_OK;
    return rs_error_set(err, RS_EFORMAT, t->name,
                        "tensor '%s': the CRC-32C of its %zu bytes as read is 0x%08x, the manifest says 0x%08x: its "
                        "bytes changed while rolloutd read them (or the checksum is wrong); the weights in service are "
                        "unchanged", t->name, bytes, got, t->crc32c);
}

static const char *dtype_label(rs_dtype dt) {
    return dt < RS_DTYPE_COUNT ? rs_dtype_name(dt) : "an unsupported dtype";
}

/* `<matrix>_scale_inv` for an FP8 slot. */
static int add_scale(rs_txn *u, staged *s, const rs_txn_tensor *t, const rs_slot_info *info, rs_error *err) {
    const char *name = t->name;
    if (!info->served_fp8)
        return rs_error_set(err, RS_EINVAL, name,
                            "'%s' is a scale, but its weight is served as %s (not FP8), so it takes no scale_inv",
                            name, dtype_label(s->slot->dtype));
    if (t->dtype != RS_DTYPE_F32 && t->dtype != RS_DTYPE_BF16)
        return rs_error_set(err, RS_EUNSUPPORTED, name, "scale tensor '%s' has dtype %s, expected float32 or bfloat16",
                            name, dtype_label(t->dtype));
    if (s->has_scale)
        return rs_error_set(err, RS_EINVAL, name, "duplicate tensor '%s' in this update", name);
    if (s->from_float)
        return rs_error_set(err, RS_EINVAL, name,
                            "'%s' arrived after its weight was sent as a float tensor (quantized on arrival, with "
                            "its own scales); send either the float weight or the FP8 codes with their scale_inv",
                            name);
    const size_t need = (size_t)(info->shape[0] * info->shape[1]) * sizeof(float);
    int rc = check_room(u, name, need, err);
    if (rc == RS_OK) rc = check_crc(t, (size_t)(info->shape[0] * info->shape[1]) * rs_dtype_size(t->dtype), err);
    if (rc != RS_OK) return rc;
    float *scales = NULL;
    rc = rs_weight_convert_scales(u->stage, name, t->data, t->dtype, info->shape[0], info->shape[1], &scales, err);
    if (rc != RS_OK) return rc;
    s->t.scale_inv = scales;
    s->has_scale = true;
    return RS_OK;
}

/* `model.layers.L.self_attn.k_scale` / `v_scale`: staged beside the weights, handed to the
 * engine at the commit (it applies them under --kv-scale-mode static; other modes recompute or
 * need no scales). */
static int add_kv_scale(rs_txn *u, const rs_txn_tensor *t, int layer, bool is_v, rs_error *err) {
    const rs_model_config *c = &u->m->cfg;
    const size_t n = (size_t)c->n_layers * (size_t)c->n_kv_heads;
    const uint8_t bit = is_v ? 2 : 1;
    if (u->kv_seen && (u->kv_seen[layer] & bit))
        return rs_error_set(err, RS_EINVAL, t->name, "duplicate tensor '%s' in this update", t->name);
    if (!t->data) return rs_error_set(err, RS_EINVAL, t->name, "tensor '%s' has no data", t->name);
    if (t->has_crc32c && t->dtype < RS_DTYPE_COUNT) {
        size_t bytes = rs_dtype_size(t->dtype);
        for (int i = 0; i < t->ndim; i++) bytes *= (size_t)t->shape[i];
        int rc = check_crc(t, bytes, err);
        if (rc != RS_OK) return rc;
    }
    if (!u->kv_k) {
        u->kv_k = rs_xcalloc(n, sizeof(float));
        u->kv_v = rs_xcalloc(n, sizeof(float));
        u->kv_seen = rs_xcalloc((size_t)c->n_layers, 1);
    }
    /* a failure leaves the row half written but unmarked, and the sync service drops the update */
    int rc = rs_kv_scale_parse(t->name, t->dtype, t->ndim, t->shape, t->data, c->n_kv_heads,
                               (is_v ? u->kv_v : u->kv_k) + (size_t)layer * c->n_kv_heads, err);
    if (rc != RS_OK) return rc;
    u->kv_seen[layer] |= bit;
    u->kv_count++;
    u->received += (uint64_t)(t->dtype < RS_DTYPE_COUNT ? rs_dtype_size(t->dtype) : 0) *
                   (uint64_t)(t->ndim == 1 ? t->shape[0] : 1);
    return RS_OK;
}

static bool ends_with(const char *s, const char *sfx) {
    size_t n = strlen(s), k = strlen(sfx);
    return n >= k && strcmp(s + n - k, sfx) == 0;
}

int rs_txn_add(rs_txn *u, const rs_txn_tensor *t, rs_error *err) {
    const char *name = t->name;
    int kv_layer;
    bool kv_is_v;
    if (rs_kv_scale_name(name, u->m->cfg.n_layers, &kv_layer, &kv_is_v))
        return add_kv_scale(u, t, kv_layer, kv_is_v, err);
    rs_slot_info info;
    rs_tensor *slot = rs_model_slot(u->m, name, &info);
    if (!slot && ends_with(name, ".q_scale"))
        return rs_error_set(err, RS_EINVAL, name,
                            "'%s' is a query scale: rolloutd keeps attention queries in fp32 and has none; push only "
                            "self_attn.k_scale and v_scale (or no KV scales)", name);
    if (!slot)
        return rs_error_set(err, RS_EINVAL, name, "unknown tensor '%s': %s has no such parameter", name,
                            rs_arch_name(u->m->cfg.arch));
    char want[64], got[160];
    fmt_shape(want, sizeof want, info.ndim, info.shape);
    fmt_shape(got, sizeof got, RS_MIN(t->ndim, RS_TENSOR_MAX_DIMS), t->shape);
    bool shape_ok = t->ndim == info.ndim;
    for (int i = 0; shape_ok && i < info.ndim; i++) shape_ok = t->shape[i] == info.shape[i];
    if (!shape_ok)
        return rs_error_set(err, RS_EINVAL, name, "tensor '%s' has shape %s, expected %s", name, got, want);
    if (!t->data) return rs_error_set(err, RS_EINVAL, name, "tensor '%s' has no data", name);
    if (t->scale_inv && (t->dtype != RS_DTYPE_E4M3 || info.is_scale))
        return rs_error_set(err, RS_EINVAL, name, "tensor '%s' came with a scale_inv but is not an FP8 weight", name);
    const size_t elem = t->dtype < RS_DTYPE_COUNT ? rs_dtype_size(t->dtype) : 0;
    const uint64_t bytes = (uint64_t)(info.shape[0] * (info.ndim == 2 ? info.shape[1] : 1)) * elem;

    if (info.is_scale && !info.served_fp8)
        return rs_error_set(err, RS_EINVAL, name,
                            "'%s' is a scale, but its weight is served as %s (not FP8), so it takes no scale_inv",
                            name, dtype_label(slot->dtype));
    if (info.tied) { /* lm_head of a tied model: validated, then left to follow embed_tokens */
        if (!is_float(t->dtype))
            return rs_error_set(err, RS_EUNSUPPORTED, name, "tensor '%s' has dtype %s, expected bfloat16, float16 or "
                                "float32", name, dtype_label(t->dtype));
        if (u->tied_seen) return rs_error_set(err, RS_EINVAL, name, "duplicate tensor '%s' in this update", name);
        u->tied_seen = true;
        u->received += bytes;
        return RS_OK;
    }
    staged *s = &u->e[info.index];
    const bool was_complete = entry_complete(s);
    if (!s->slot) {
        s->slot = slot;
        s->t.dtype = slot->dtype;
        s->t.ndim = slot->ndim;
        s->t.shape[0] = slot->shape[0];
        s->t.shape[1] = slot->shape[1];
    }
    int rc;
    if (info.is_scale) {
        rc = add_scale(u, s, t, &info, err);
    } else if (s->has_data) {
        rc = rs_error_set(err, RS_EINVAL, name, "duplicate tensor '%s' in this update", name);
    } else {
        const rs_dtype served = slot->dtype; /* the format it was loaded in; never changes */
        size_t need = info.kind == RS_SLOT_VECTOR ? (size_t)info.shape[0] * sizeof(float)
                      : served == RS_DTYPE_E4M3 ? (t->dtype == RS_DTYPE_E4M3 ? (size_t)(info.shape[0] * info.shape[1])
                                                   : rs_fp8_served_bytes(info.shape[0], info.shape[1]))
                      : (size_t)(info.shape[0] * info.shape[1]) * rs_dtype_size(served);
        if (t->scale_inv) need += (size_t)(rs_fp8_blocks(info.shape[0]) * rs_fp8_blocks(info.shape[1])) * sizeof(float);
        if (served == RS_DTYPE_E4M3 && is_float(t->dtype) && s->has_scale) {
            rc = rs_error_set(err, RS_EINVAL, name,
                              "tensor '%s' arrived as %s after its %s_scale_inv: send either the float weight "
                              "(quantized on arrival) or the FP8 codes with their scale_inv", name,
                              rs_dtype_name(t->dtype), name);
        } else if (served == RS_DTYPE_E4M3 && t->scale_inv && s->has_scale) {
            rc = rs_error_set(err, RS_EINVAL, name, "duplicate tensor '%s_scale_inv' in this update", name);
        } else if (t->dtype >= RS_DTYPE_COUNT || (!is_float(t->dtype) && t->dtype != RS_DTYPE_E4M3)) {
            rc = rs_error_set(err, RS_EUNSUPPORTED, name, "tensor '%s' has dtype %s, expected bfloat16, float16, "
                              "float32 or (FP8 weights) float8_e4m3fn", name, dtype_label(t->dtype));
        } else if ((rc = check_room(u, name, need, err)) == RS_OK) {
            rs_weight_src src = {.dtype = t->dtype, .ndim = info.ndim, .shape = {info.shape[0], info.shape[1]},
                                 .data = t->data, .scale_inv = t->scale_inv, .scale_dtype = t->scale_dtype,
                                 .has_crc32c = t->has_crc32c, .crc32c = t->crc32c};
            rs_tensor conv;
            rc = rs_weight_convert(u->stage, name, info.kind == RS_SLOT_VECTOR ? RS_DTYPE_F32 : served, &src, &conv,
                                   err);
            if (rc == RS_OK) {
                RS_ASSERT(conv.dtype == slot->dtype); /* the served dtype of a slot never changes */
                s->t.data = conv.data;
                s->t.layout = conv.layout; /* the backend's choice for this weight */
                if (conv.scale_inv) {
                    s->t.scale_inv = conv.scale_inv;
                    s->has_scale = true;
                }
                s->from_float = served == RS_DTYPE_E4M3 && is_float(t->dtype);
                s->has_data = true;
            }
        }
    }
    if (rc != RS_OK) return rc;
    u->received += info.is_scale ? (uint64_t)(info.shape[0] * info.shape[1]) * elem : bytes;
    if (t->scale_inv)
        u->received += (uint64_t)(rs_fp8_blocks(info.shape[0]) * rs_fp8_blocks(info.shape[1])) *
                       rs_dtype_size(t->scale_dtype);
    if (!was_complete && entry_complete(s)) u->n_complete++;
    return RS_OK;
}

/* Engine thread, at a step boundary: swap every staged tensor into its slot. Cannot fail. */
static void apply(rs_model *m, void *ctx) {
    rs_txn *u = ctx;
    for (int i = 0; i < u->n_params; i++) {
        staged *s = &u->e[i];
        RS_ASSERT(s->slot && entry_complete(s));
        rs_tensor *slot = s->slot;
        rs_weight_store_release(m->store, slot->data);
        rs_weight_store_release(m->store, slot->scale_inv);
        rs_weight_store_adopt(m->store, u->stage, s->t.data);
        rs_weight_store_adopt(m->store, u->stage, s->t.scale_inv);
        slot->data = s->t.data;
        slot->scale_inv = s->t.scale_inv;
        slot->layout = s->t.layout;
    }
    if (m->cfg.tie_embeddings) m->lm_head = m->embed;
    /* read by /metrics and /get_server_info on HTTP threads (model.h) */
    __atomic_store_n(&m->weight_bytes, rs_weight_store_bytes(m->store), __ATOMIC_RELAXED);
    u->applied = true;
}

/* The first layer whose pushed KV scale pair is not whole, described for the 400 answer; RS_OK
 * when none was pushed or all are. */
static int kv_missing_error(const rs_txn *u, rs_error *err) {
    for (int l = 0; u->kv_count > 0 && l < u->m->cfg.n_layers; l++) {
        if (u->kv_seen[l] == 3) continue;
        char name[96];
        snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", l, (u->kv_seen[l] & 1) ? "v_scale" : "k_scale");
        return rs_error_set(err, RS_EINVAL, name,
                            "missing tensor '%s' at is_last: KV scales are pushed for every layer (k_scale and "
                            "v_scale) or not at all; %d of %d staged; the update is dropped", name, u->kv_count,
                            2 * u->m->cfg.n_layers);
    }
    return RS_OK;
}

/* The first parameter that is not staged whole, described for the 400 answer. */
static int missing_error(rs_txn *u, rs_error *err) {
    for (int i = 0; i < u->n_params; i++) {
        const staged *s = &u->e[i];
        if (entry_complete(s)) continue;
        char name[300];
        rs_slot_info info;
        rs_model_param_at(u->m, i, name, sizeof name, &info);
        if (s->has_data)
            return rs_error_set(err, RS_EINVAL, name,
                                "FP8 tensor '%s' came without '%s_scale_inv'; the update is dropped (%d of %d "
                                "parameters staged)", name, name, u->n_complete, u->n_params);
        if (s->has_scale)
            return rs_error_set(err, RS_EINVAL, name,
                                "'%s_scale_inv' came without its FP8 tensor '%s'; the update is dropped (%d of %d "
                                "parameters staged)", name, name, u->n_complete, u->n_params);
        return rs_error_set(err, RS_EINVAL, name,
                            "missing tensor '%s' at is_last: every parameter must be sent; the update is dropped "
                            "(%d of %d parameters staged)", name, u->n_complete, u->n_params);
    }
    int rc = kv_missing_error(u, err);
    if (rc != RS_OK) return rc;
    return rs_error_set(err, RS_EINTERNAL, NULL, "update incomplete but no parameter is missing");
}

/* The per-head KV scales the engine would calibrate for the staged weights, computed on backend
 * b over a view of the model that holds them (the served model is not touched). */
static int calibrate_staged(rs_txn *u, const rs_engine *e, rs_backend *b, float *k, float *v, rs_error *err) {
    rs_model *view = rs_model_view(u->m, b);
    char name[300];
    for (int i = 0; i < u->n_params; i++) {
        rs_tensor *t = rs_model_param_at(view, i, name, sizeof name, NULL);
        t->data = u->e[i].t.data;
        t->scale_inv = u->e[i].t.scale_inv;
        t->layout = u->e[i].t.layout;
    }
    if (view->cfg.tie_embeddings) view->lm_head = view->embed;
    rs_error why = {0};
    int rc = rs_engine_calibrate_kv_on(e, view, k, v, &why);
    rs_model_view_free(view);
    if (rc != RS_OK)
        rs_error_set(err, rc, "kv-cache-dtype", "the new weights cannot be served with an FP8 KV cache (%s); the "
                     "update is dropped and the weights in service are unchanged", why.message);
    return rc;
}

/* rs_weights_calibrate_fn for a service without a calibration backend of its own: the engine runs
 * it before the swap, on its thread, over the staged weights on the model's own backend. */
static int calibrate_on_engine(void *ctx, const rs_engine *e, float *k, float *v, rs_error *err) {
    rs_txn *u = ctx;
    return calibrate_staged(u, e, u->m->backend, k, v, err);
}

bool rs_txn_only_extras(const rs_txn *u) {
    for (int i = 0; i < u->n_params; i++)
        if (u->e[i].has_data || u->e[i].has_scale) return false;
    return u->tied_seen || u->kv_count > 0;
}

bool rs_txn_kv_scales_whole(const rs_txn *u) {
    return u->kv_count == 0 || u->kv_count == 2 * u->m->cfg.n_layers;
}

static void apply_nothing(rs_model *m, void *ctx) {
    (void)m;
    (void)ctx;
}

int rs_txn_commit_extras(rs_txn *u, rs_engine *e, bool *kv_installed, rs_error *err) {
    RS_ASSERT(rs_txn_only_extras(u));
    *kv_installed = false;
    int rc = kv_missing_error(u, err);
    if (rc == RS_OK && u->kv_count > 0 && e && rs_engine_kv_scales(e) == RS_KV_SCALES_STATIC) {
        /* the version in service stays; its KV, written with the old scales, is recomputed */
        char version[RS_TXN_VERSION_BYTES];
        snprintf(version, sizeof version, "%s", rs_engine_weight_version(e));
        rs_weight_swap w = {.apply = apply_nothing, .ctx = u, .k_scales = u->kv_k, .v_scales = u->kv_v,
                            .scales_param = "k_scale", .scales_what = "the pushed KV scales", .version = version};
        rc = rs_engine_swap_weights(e, &w, NULL, err);
        *kv_installed = rc == RS_OK;
    }
    rs_txn_abort(u);
    return rc;
}

/* The commit policy: the FP8 KV scales the new weights are served with, by the engine's scale
 * source (kvcache.h rs_kv_scales; docs/design.md "Numerics"):
 *   STATIC     the scales pushed with this update, else the ones in service stay;
 *   CALIBRATE  a calibration of the staged weights: on the service's own backend (u->calib) before
 *              the commit, while generation goes on; without one, by the engine before its swap,
 *              holding the step loop. A calibration that fails refuses the update;
 *   DYNAMIC, NONE  no per-head scales (pushed ones are unused).
 * Fills w's scales (ck/cv hold a precalibration, freed by the caller). */
static int kv_scales_policy(rs_txn *u, rs_engine *e, rs_weight_swap *w, float **ck, float **cv, rs_error *err) {
    switch (rs_engine_kv_scales(e)) {
    case RS_KV_SCALES_STATIC:
        w->k_scales = u->kv_k, w->v_scales = u->kv_v; /* NULL when none were pushed */
        w->scales_param = "k_scale", w->scales_what = "the pushed KV scales";
        return RS_OK;
    case RS_KV_SCALES_CALIBRATE:
        w->scales_param = "kv-cache-dtype", w->scales_what = "the calibrated KV scales of the new weights";
        if (!u->calib) {
            w->calibrate = calibrate_on_engine;
            return RS_OK;
        }
        const size_t n = (size_t)u->m->cfg.n_layers * (size_t)u->m->cfg.n_kv_heads;
        *ck = rs_xmalloc(n * sizeof **ck);
        *cv = rs_xmalloc(n * sizeof **cv);
        w->k_scales = *ck, w->v_scales = *cv;
        return calibrate_staged(u, e, u->calib, *ck, *cv, err);
    case RS_KV_SCALES_DYNAMIC:
    case RS_KV_SCALES_NONE:
        break;
    }
    return RS_OK;
}

int rs_txn_commit(rs_txn *u, rs_engine *e, bool abort_all, double *seconds_paused, rs_error *err) {
    if (seconds_paused) *seconds_paused = 0;
    if (!rs_txn_complete(u)) {
        int rc = missing_error(u, err);
        rs_txn_abort(u);
        return rc;
    }
    int rc = RS_OK;
    if (!e) {
        apply(u->m, u);
    } else {
        char version[RS_TXN_VERSION_BYTES];
        snprintf(version, sizeof version, "%s", u->version[0] ? u->version : rs_engine_weight_version(e));
        rs_weight_swap w = {.apply = apply, .ctx = u, .version = version};
        float *ck = NULL, *cv = NULL;
        rc = kv_scales_policy(u, e, &w, &ck, &cv, err);
        if (rc == RS_OK) {
            if (abort_all) rs_engine_abort(e, NULL);
            rc = rs_engine_swap_weights(e, &w, seconds_paused, err);
        }
        free(ck);
        free(cv);
    }
    /* After the swap the model owns every staged allocation and staging is empty; if the engine
     * refused (shutting down, or KV scales it could not use) nothing was swapped and staging is
     * freed here. */
    RS_ASSERT(!u->applied || rs_weight_store_count(u->stage) == 0);
    rs_txn_abort(u);
    return rc;
}
