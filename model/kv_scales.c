/*
 * kv_scales.c — static FP8 KV scales from a checkpoint or a weight push (see kv_scales.h).
 */
#include "kv_scales.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "safetensors.h"

bool rs_kv_scale_name(const char *name, int n_layers, int *layer, bool *is_v) {
    static const char pre[] = "model.layers.", mid[] = ".self_attn.";
    if (strncmp(name, pre, sizeof pre - 1) != 0) return false;
    const char *p = name + sizeof pre - 1;
    if (p[0] < '0' || p[0] > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return false;
    long l = 0;
    while (*p >= '0' && *p <= '9' && l < n_layers) l = 10 * l + (*p++ - '0');
    if (l >= n_layers || strncmp(p, mid, sizeof mid - 1) != 0) return false;
    p += sizeof mid - 1;
    if (strcmp(p, "k_scale") != 0 && strcmp(p, "v_scale") != 0) return false;
    *layer = (int)l;
    *is_v = p[0] == 'v';
    return true;
}

int rs_kv_scale_parse(const char *name, rs_dtype dtype, int ndim, const int64_t *shape, const void *data,
                      int n_kv_heads, float *out, rs_error *err) {
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    if ((n != 1 && n != n_kv_heads) || ndim > 1 || (dtype != RS_DTYPE_F32 && dtype != RS_DTYPE_BF16 && dtype != RS_DTYPE_F16))
        return rs_error_set(err, RS_EFORMAT, name,
                            "'%s' must be an F32/BF16/F16 scalar or [%d] (one per KV head), got %s with %lld values",
                            name, n_kv_heads, dtype < RS_DTYPE_COUNT ? rs_dtype_name(dtype) : "an unsupported dtype",
                            (long long)n);
    for (int h = 0; h < n_kv_heads; h++) {
        int64_t i = n == 1 ? 0 : h;
        float x;
        if (dtype == RS_DTYPE_F32) {
            memcpy(&x, (const char *)data + 4 * i, 4);
        } else {
            uint16_t u;
            memcpy(&u, (const char *)data + 2 * i, 2);
            x = dtype == RS_DTYPE_BF16 ? rs_bf16_to_f32(u) : rs_f16_to_f32(u);
        }
        if (!(isfinite(x) && x > 0))
            return rs_error_set(err, RS_EINVAL, name, "'%s' holds %g; scales must be finite and > 0", name, (double)x);
        out[h] = x;
    }
    return RS_OK;
}

static int read_scales(const rs_st_dir *d, const rs_model_config *c, int layer, const char *which, float *out,
                       rs_error *err) {
    char name[128];
    snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", layer, which);
    const rs_st_tensor *t = rs_st_dir_find(d, name, NULL, NULL);
    if (!t) return rs_error_set(err, RS_ENOTFOUND, name, "--kv-scale-mode static: the checkpoint has no '%s'", name);
    return rs_kv_scale_parse(name, t->dtype, t->ndim, t->shape, t->data, c->n_kv_heads,
                             out + (size_t)layer * c->n_kv_heads, err);
}

int rs_model_load_kv_scales(const char *dir, const rs_model_config *cfg, float *k, float *v, rs_error *err) {
    rs_st_dir *d = NULL;
    int rc = rs_st_dir_open(&d, dir, err);
    if (rc != RS_OK) return rc;
    for (int l = 0; l < cfg->n_layers && rc == RS_OK; l++) {
        rc = read_scales(d, cfg, l, "k_scale", k, err);
        if (rc == RS_OK) rc = read_scales(d, cfg, l, "v_scale", v, err);
    }
    rs_st_dir_close(d);
    return rc;
}
