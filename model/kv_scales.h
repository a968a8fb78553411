/*
 * kv_scales.h — FP8 KV-cache scales stored in a checkpoint (the "static" KV scale mode).
 *
 * FP8 checkpoints made for vLLM/SGLang (llm-compressor, ModelOpt) carry per-layer scales
 * `model.layers.N.self_attn.k_scale` and `.v_scale`: a scalar (one scale for every KV head of the
 * layer) or one value per KV head. A stored E4M3 code c means c * scale, as in rolloutd's pages.
 */
#ifndef RS_KV_SCALES_H
#define RS_KV_SCALES_H

#include "model.h"

/* Reads every layer's k_scale and v_scale from the model directory `dir` into k, v
 * [n_layers][n_kv_heads] (scalars broadcast over heads). RS_ENOTFOUND naming the first missing
 * tensor, RS_EFORMAT for a wrong shape or dtype, RS_EINVAL for a value that is not finite and > 0. */
int rs_model_load_kv_scales(const char *dir, const rs_model_config *cfg, float *k, float *v, rs_error *err);

#endif /* RS_KV_SCALES_H */
