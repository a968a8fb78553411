/*
 * kv_scales.c — reads a checkpoint's static FP8 KV scales (see kv_scales.h).
 */
#include "kv_scales.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "safetensors.h"

static int read_scales(const rs_st_dir *d, const rs_model_config *c, int layer, const char *which, float *out,
                       rs_error *err) {
    char name[128];
    snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", layer, which);
    const rs_st_tensor *t = rs_st_dir_find(d, name, NULL, NULL);
    if (!t) return rs_error_set(err, RS_ENOTFOUND, name, "--kv-scale-mode static: the checkpoint has no '%s'", name);
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    if ((n != 1 && n != c->n_kv_heads) || t->ndim > 1 ||
        (t->dtype != RS_DTYPE_F32 && t->dtype != RS_DTYPE_BF16 && t->dtype != RS_DTYPE_F16))
        return rs_error_set(err, RS_EFORMAT, name,
                            "'%s' must be an F32/BF16/F16 scalar or [%d] (one per KV head), got %s with %lld values",
                            name, c->n_kv_heads, t->st_dtype, (long long)n);
    for (int h = 0; h < c->n_kv_heads; h++) {
        int64_t i = n == 1 ? 0 : h;
        float x;
        if (t->dtype == RS_DTYPE_F32) {
            memcpy(&x, (const char *)t->data + 4 * i, 4);
        } else {
            uint16_t u;
            memcpy(&u, (const char *)t->data + 2 * i, 2);
            x = t->dtype == RS_DTYPE_BF16 ? rs_bf16_to_f32(u) : rs_f16_to_f32(u);
        }
        if (!(isfinite(x) && x > 0))
            return rs_error_set(err, RS_EINVAL, name, "'%s' holds %g; scales must be finite and > 0", name, (double)x);
        out[(size_t)layer * c->n_kv_heads + h] = x;
    }
    return RS_OK;
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
