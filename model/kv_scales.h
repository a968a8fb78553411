/*
 * kv_scales.h — FP8 KV-cache scales stored in a checkpoint or pushed with weights (the "static" KV
 * scale mode).
 *
 * FP8 checkpoints made for vLLM/SGLang (llm-compressor, ModelOpt) carry per-layer scales
 * `model.layers.N.self_attn.k_scale` and `.v_scale`: a scalar (one scale for every KV head of the
 * layer) or one value per KV head. A stored E4M3 code c means c * scale, as in rolloutd's pages.
 * Trainers that calibrate KV scales themselves (NeMo-RL) stream the same names with the weights;
 * sync/transaction.c takes them through rs_kv_scale_name and rs_kv_scale_parse.
 */
#ifndef RS_KV_SCALES_H
#define RS_KV_SCALES_H

#include <stdbool.h>
#include <stdint.h>

#include "model.h"

/* Reads every layer's k_scale and v_scale from the model directory `dir` into k, v
 * [n_layers][n_kv_heads] (scalars broadcast over heads). RS_ENOTFOUND naming the first missing
 * tensor, RS_EFORMAT for a wrong shape or dtype, RS_EINVAL for a value that is not finite and > 0. */
int rs_model_load_kv_scales(const char *dir, const rs_model_config *cfg, float *k, float *v, rs_error *err);

/* True when `name` is exactly `model.layers.L.self_attn.k_scale` or `.v_scale` with L in
 * [0, n_layers) written without leading zeros; sets *layer and *is_v. */
bool rs_kv_scale_name(const char *name, int n_layers, int *layer, bool *is_v);

/* One scale tensor (F32, BF16 or F16; a scalar, [1] or [n_kv_heads]; data unaligned) into
 * out[n_kv_heads], a scalar broadcast. RS_EFORMAT for a wrong shape or dtype, RS_EINVAL for a value
 * that is not finite and > 0; err->param is `name`. */
int rs_kv_scale_parse(const char *name, rs_dtype dtype, int ndim, const int64_t *shape, const void *data,
                      int n_kv_heads, float *out, rs_error *err);

#endif /* RS_KV_SCALES_H */
