/*
 * quant.h — the weight quantization policy: which of a checkpoint's matrices are served in FP8.
 *
 * The FP8 recipe (docs/design.md "Numerics"; NVIDIA FP8-RL, arXiv 2601.18150) quantizes the linear layers of
 * attention and MLP to E4M3 with one fp32 scale per 128x128 block, and keeps everything whose
 * precision matters more than its size in the checkpoint's dtype:
 *
 *   FP8-eligible  model.layers.L.self_attn.{q,k,v,o}_proj.weight
 *                 model.layers.L.mlp.{gate,up,down}_proj.weight              (dense MLP)
 *                 model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight    (MoE experts)
 *   never         model.embed_tokens.weight, lm_head.weight, every norm, every bias,
 *                 the MoE router model.layers.L.mlp.gate.weight
 *
 * Eligibility is decided by parsing the whole name, never by substring, so the router
 * (`mlp.gate.weight`) cannot pass for a gate projection and an expert whose name lacks `.weight`
 * is not silently taken for something else (verl #7443 shipped an entire run with unquantized
 * experts that way). On top of eligibility the policy can keep tensors in their stored dtype: the
 * user's ignore globs, the first/last N decoder layers, and, for an FP8 checkpoint, the modules its
 * quantization_config lists as not converted.
 *
 * One opt-in leaves the recipe (--quantize-lm-head): the output projection in FP8 too, same
 * 128x128 blocks, for users who trade its accuracy for decode speed (with a large vocabulary it
 * is a third of what a batch-1 step reads). For an untied model that is lm_head.weight; for a
 * tied one the table embed_tokens serves both ends, so it is the embedding table, and the
 * embedding lookups read the FP8 rows too (the CPU backend dequantizes them; build/fp8-mismatch
 * --quantize-lm-head measures what it costs against BF16).
 *
 * The loader asks rs_quant_should_quantize for every matrix it loads from a BF16/F16/F32
 * checkpoint. A matrix stored as F8_E4M3 in an FP8 checkpoint is always served FP8, whatever the
 * policy says (see model.h).
 */
#ifndef RS_QUANT_H
#define RS_QUANT_H

#include <stdbool.h>

#include "../core/rs.h"
#include "model.h"

typedef enum rs_quant_mode {
    RS_QUANT_BF16 = 0,  /* keep matrices as stored (BF16, F16 or F32) */
    RS_QUANT_FP8,       /* E4M3, 128x128 blocks (W8A8 with 1x128 dynamic activations) */
} rs_quant_mode;

#define RS_QUANT_IGNORE_MAX 1024 /* bytes of the ignore list, with its NUL */

typedef struct rs_quant_policy {
    rs_quant_mode mode;
    /* Comma-separated fnmatch(3) globs. A glob matches a tensor when it matches its full name
     * ("model.layers.0.self_attn.q_proj.weight") or its module name (the same without ".weight");
     * matched tensors stay as stored. Blanks around commas are ignored. */
    char ignore[RS_QUANT_IGNORE_MAX];
    int bf16_first_layers;  /* layers l < this stay as stored */
    int bf16_last_layers;   /* layers l >= n_layers - this stay as stored */
    bool quantize_lm_head;  /* FP8 mode: the output projection in FP8 too (see the top); init: false */
} rs_quant_policy;

/* "fp8" / "bf16" and back. rs_quant_mode_parse answers RS_EINVAL for anything else. */
const char *rs_quant_mode_name(rs_quant_mode m);
int rs_quant_mode_parse(const char *s, rs_quant_mode *out);

/* Fills *p from settings text (mode "fp8" | "bf16", ignore list, layer counts >= 0). RS_EINVAL
 * with param = "quantization", "quant-ignore", "bf16-first-layers" or "bf16-last-layers". */
int rs_quant_policy_init(rs_quant_policy *p, const char *mode, const char *ignore, int bf16_first_layers,
                         int bf16_last_layers, rs_error *err);

/* True when `tensor_name` is one of the FP8-eligible matrices listed at the top of this file;
 * *layer (if non-NULL) receives its decoder layer. */
bool rs_quant_eligible(const char *tensor_name, int *layer);

/* True when `tensor_name` belongs to a module that `list` names. `list` holds '\n'-separated
 * entries of a checkpoint's quantization_config.modules_to_not_convert / ignored_layers:
 *   "lm_head", "model.layers.3.mlp", "mlp.gate"  a module path: matches when it occurs in the
 *       tensor's module name (the name without ".weight") or its full name on '.' boundaries, so
 *       "model.layers.3" does not match layer 30 and "mlp.gate" does not match mlp.gate_proj
 *       (transformers' plain substring test would);
 *   "re:PATTERN"  POSIX extended regex matched from the start of the module or full name
 *       (Python's re.match); patterns were checked by rs_quant_check_list_entry when the config
 *       was read. */
bool rs_quant_listed(const char *list, const char *tensor_name);
/* RS_OK when a list entry is usable (a non-empty name, or a "re:" pattern that compiles). */
int rs_quant_check_list_entry(const char *entry);

/* True when `tensor_name` is the model's output projection: lm_head.weight, or for a tied model
 * (cfg->tie_embeddings) model.embed_tokens.weight. */
bool rs_quant_is_head(const rs_model_config *cfg, const char *tensor_name);

/* The policy's decision for one matrix at load: true = store it as E4M3 + block scales.
 * `layer` is the decoder layer the tensor belongs to, or -1 for tensors outside the layers.
 * False when qp is NULL or in BF16 mode, for tensors that are not FP8-eligible, for tensors the
 * ignore globs match, in the first/last bf16 layers, and for modules the checkpoint's
 * quantization_config keeps unconverted (cfg->fp8_not_converted). The output projection
 * (rs_quant_is_head) follows qp->quantize_lm_head alone. */
bool rs_quant_should_quantize(const rs_quant_policy *qp, const rs_model_config *cfg, const char *tensor_name,
                              int layer);

#endif /* RS_QUANT_H */
