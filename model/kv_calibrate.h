/*
 * kv_calibrate.h — per-layer, per-KV-head FP8 KV scales measured by running the model.
 *
 * rs_kv_calibrate runs the model over a fixed calibration sequence with an fp32 KV cache of its
 * own, reads back exactly what the forward pass wrote into the cache (K after RoPE, and after the
 * q/k RMSNorm for Qwen3 — what attention reads), and sets for every layer l and KV head h, over K
 * and over V separately,
 *
 *     stat  = the percentile-th |x| over all positions and head_dim lanes of (l, h)   (1 = amax)
 *     scale = max(stat * margin, 1e-6) / 448, raised by an ulp where needed so that
 *             stat * margin / scale <= 448 holds in fp32.
 *
 * The fp32 guarantee means that with margin >= 1 every calibration value x with |x| <= stat
 * quantizes without saturating (|x / scale| <= 448), and with percentile 1 none saturates at all.
 * The floor keeps an all-zero head finite. Serving with an FP8 cache perturbs what layers after
 * the first see, and other prompts reach other values; a margin above 1 is the headroom for both.
 *
 * This is the NeMo-RL recipe (percentile of |x| with a margin, / 448) made per head and
 * deterministic: the same weights, tokens and options give the same scales bit for bit on a given
 * backend (the CPU backend's forward does not depend on the thread count). Re-run after every
 * weight update; install with rs_kv_pool_set_scales.
 */
#ifndef RS_KV_CALIBRATE_H
#define RS_KV_CALIBRATE_H

#include <stdint.h>

#include "../core/rs.h"
#include "model.h"

#define RS_KV_CALIB_DEFAULT_TOKENS 512 /* length of the default calibration sequence */
#define RS_KV_CALIB_SCALE_FLOOR 1e-6f  /* stat * margin below this is raised to it */

typedef struct rs_kv_calib_opts {
    const int32_t *tokens; /* [n_tokens] ids in [0, vocab), host (borrowed); NULL = the default set:
                              rs_kv_calib_default_tokens, with the model's BOS id (if any) first */
    int n_tokens;          /* 1..max_position; with tokens NULL, <= 0 means RS_KV_CALIB_DEFAULT_TOKENS
                              (capped at max_position) */
    float percentile;      /* in (0, 1]: 1 = amax, 0.999 = the 99.9th percentile (nearest rank) */
    float margin;          /* finite, > 0; typically 1..2 (< 1 deliberately clips the top values) */
} rs_kv_calib_opts;

/* Writes k_scales, v_scales [n_layers][n_kv_heads] f32 (host; untouched on failure). RS_OK;
 * RS_EINVAL for bad options or a model whose K/V come out non-finite on the calibration tokens
 * (err names the layer and head); RS_ENOMEM when the temporary KV cache or activations do not fit
 * on the backend. Runs on m's backend and uses it exclusively while it runs (call it from the
 * engine thread); costs one prefill of n_tokens plus an fp32 KV cache of n_tokens for its
 * duration. */
int rs_kv_calibrate(const rs_model *m /* borrowed */, const rs_kv_calib_opts *o /* borrowed */,
                    float *k_scales, float *v_scales, rs_error *err);

/* The fixed calibration token set: n ids in [0, vocab), the same on every machine. There is no
 * tokenizer in the server (it sees ids only), so the set cannot be text; and it must not change
 * between calibrations, or scales would move for reasons other than the weights. Layout, in
 * 128-token segments: 96 pseudo-random ids (splitmix64 of a fixed seed: every part of the
 * embedding table, no structure), then a copy of a 24-token span from earlier in the sequence
 * (induction / copy patterns: sharp attention, the regime real text and long rollouts drive the
 * deeper layers into, where K/V differ from noise), then one id repeated 8 times (the degenerate
 * repetition loops of RL rollouts). The first segment copies from its own random part. */
void rs_kv_calib_default_tokens(int vocab, int32_t *out /* [n] */, int n);

#endif /* RS_KV_CALIBRATE_H */
