/*
 * setup.c — settings -> engine options (see setup.h).
 */
#include "setup.h"

#include <string.h>

void rs_setup_engine_opts(const rs_config *c, int max_position, rs_engine_opts *eo) {
    int max_context = c->max_context ? c->max_context : max_position;
    if (max_context > max_position) {
        RS_WARN("max-context %d exceeds the model's max_position_embeddings %d; using %d", max_context, max_position,
                max_position);
        max_context = max_position;
    }
    *eo = (rs_engine_opts){
        .kv_cache_bytes = (size_t)c->kv_cache_mb << 20,
        .max_running = c->max_running,
        .max_step_tokens = c->max_step_tokens,
        .limits = {.max_context = max_context, .max_new_tokens = c->max_new_tokens, .max_n = c->max_n,
                   .max_batch = c->max_batch, .max_top_logprobs = c->max_top_logprobs},
        .weight_version = c->weight_version,
        .admission_new_token_ratio = (float)c->admission_new_token_ratio,
        .prefix_cache = c->prefix_cache,
        .kv_dtype = c->kv_cache_dtype == RS_CFG_KV_FP8    ? RS_DTYPE_E4M3
                    : c->kv_cache_dtype == RS_CFG_KV_BF16 ? RS_DTYPE_BF16 : RS_DTYPE_F32,
        .kv_scales = c->kv_scale_mode == RS_CFG_KV_SCALES_DYNAMIC  ? RS_KV_SCALES_DYNAMIC
                     : c->kv_scale_mode == RS_CFG_KV_SCALES_STATIC ? RS_KV_SCALES_STATIC : RS_KV_SCALES_CALIBRATE,
        .kv_calib_margin = (float)c->kv_calib_margin,
        .kv_calib_percentile = (float)c->kv_calib_percentile,
        .kv_calib_tokens = c->kv_calib_tokens,
    };
}
