/*
 * model.h — a loaded transformer: its configuration, its weights on a backend, and the forward
 * pass over one engine step's batch.
 *
 * Loading reads a Hugging Face model directory (config.json, optional generation_config.json,
 * model.safetensors or model.safetensors.index.json with shards), validates every tensor the
 * architecture needs (name, dtype, shape) and uploads it to the backend. Architectures:
 *   Qwen3      q/k RMSNorm per head, no bias
 *   Qwen2      q/k/v bias
 *   Llama      incl. rope_scaling {"rope_type": "llama3"}
 *   Qwen3-MoE  top-k router, norm_topk_prob, per-expert SwiGLU MLPs
 * Tied embeddings (tie_word_embeddings) reuse embed_tokens as lm_head.
 *
 * Precision (quant.h). Matrices are served in the checkpoint's dtype unless the quantization policy
 * passed to rs_model_load says FP8: then each eligible attention/MLP/expert matrix is quantized on
 * the host at load (128x128 blocks, kernels/fp8.h) and only its E4M3 codes and fp32 block scales
 * are uploaded. An FP8 checkpoint (config.json "quantization_config": {"quant_method": "fp8",
 * "weight_block_size": [128, 128]}, the DeepSeek-V3 / Qwen3-FP8 layout) stores those matrices as
 * F8_E4M3 with a companion `<name>_scale_inv` ([ceil(out/128)][ceil(in/128)], F32 or BF16); they
 * are copied as they are, never requantized, and served FP8 even when the policy asks for BF16
 * (dequantizing would not give back the trainer's weights, only a BF16 copy of the FP8 ones; the
 * loader logs a warning instead). Its other tensors load as usual.
 */
#ifndef RS_MODEL_H
#define RS_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/rs.h"
#include "../kernels/backend.h"

typedef enum rs_arch {
    RS_ARCH_QWEN3 = 0,
    RS_ARCH_QWEN2,
    RS_ARCH_LLAMA,
    RS_ARCH_QWEN3_MOE,
} rs_arch;

const char *rs_arch_name(rs_arch a); /* the HF architectures[] string, e.g. "Qwen3ForCausalLM" */
const char *rs_arch_model_type(rs_arch a); /* transformers' model_type, e.g. "qwen3" */

#define RS_MAX_EOS 8
#define RS_MAX_LAYERS 256
#define RS_MAX_NOT_CONVERTED 16384 /* bytes of an FP8 checkpoint's not-converted module list */

typedef struct rs_quant_policy rs_quant_policy; /* quant.h */

typedef enum rs_rope_scaling {
    RS_ROPE_SCALING_NONE = 0,
    RS_ROPE_SCALING_LLAMA3,
} rs_rope_scaling;

typedef struct rs_model_config {
    rs_arch arch;
    int vocab_size;
    int hidden;                 /* hidden_size */
    int intermediate;           /* intermediate_size (dense MLP) */
    int n_layers;
    int n_heads;
    int n_kv_heads;
    int head_dim;               /* head_dim, or hidden / n_heads when absent */
    int max_position;           /* max_position_embeddings */
    float rms_eps;              /* rms_norm_eps */
    double rope_theta;
    rs_rope_scaling rope_scaling;
    double rope_factor, rope_low_freq_factor, rope_high_freq_factor;
    int rope_original_max_position;
    bool tie_embeddings;
    bool qk_norm;               /* Qwen3, Qwen3-MoE */
    bool qkv_bias;              /* Qwen2 */
    /* MoE (Qwen3-MoE) */
    int n_experts;              /* num_experts; 0 for dense models */
    int n_experts_per_tok;      /* num_experts_per_tok */
    int moe_intermediate;       /* moe_intermediate_size */
    bool norm_topk_prob;
    int decoder_sparse_step;
    bool layer_is_moe[RS_MAX_LAYERS]; /* derived from decoder_sparse_step and mlp_only_layers */
    /* special tokens */
    int bos_token_id;           /* -1 when absent */
    int eos_token_ids[RS_MAX_EOS];
    int n_eos;
    /* quantization_config: an FP8 checkpoint (quant_method "fp8", weight_block_size [128, 128],
     * activation_scheme "dynamic"); eligible matrices may be stored F8_E4M3 + `<name>_scale_inv` */
    bool fp8_checkpoint;
    char fp8_not_converted[RS_MAX_NOT_CONVERTED]; /* modules_to_not_convert and ignored_layers
                                                   * entries, '\n'-separated; "" when none */
} rs_model_config;

typedef struct rs_layer_weights {
    rs_tensor attn_norm;        /* input_layernorm.weight [hidden] */
    /* Matrices below are BF16/F16/F32 as stored, or E4M3 codes with scale_inv [ceil(out/128)][ceil(in/128)]
     * f32 where the quantization policy or an FP8 checkpoint says so (never the norms, biases or router). */
    rs_tensor wq, wk, wv, wo;   /* q_proj [n_heads*hd][hidden], k/v_proj [n_kv*hd][hidden], o_proj [hidden][n_heads*hd] */
    rs_tensor bq, bk, bv;       /* Qwen2 biases, else ndim 0 */
    rs_tensor q_norm, k_norm;   /* Qwen3 per-head RMSNorm [head_dim], else ndim 0 */
    rs_tensor mlp_norm;         /* post_attention_layernorm.weight [hidden] */
    rs_tensor w_gate, w_up, w_down; /* dense MLP: [inter][hidden], [inter][hidden], [hidden][inter] */
    /* MoE layer: router [n_experts][hidden]; experts arrays of length n_experts */
    rs_tensor router;
    rs_tensor *e_gate, *e_up, *e_down;
} rs_layer_weights;

typedef struct rs_model {
    rs_model_config cfg;
    char path[4096];
    rs_backend *backend;            /* borrowed */
    rs_tensor embed;                /* model.embed_tokens.weight [vocab][hidden] */
    rs_tensor final_norm;           /* model.norm.weight [hidden] */
    rs_tensor lm_head;              /* lm_head.weight [vocab][hidden], or == embed when tied */
    rs_layer_weights *layers;       /* [n_layers] */
    float *rope_inv_freq;           /* [head_dim/2], host memory, scaling applied */
    size_t weight_bytes;            /* resident bytes of all weights on the backend (FP8: codes + scales);
                                     * a weight update sets it on the engine thread, so other threads
                                     * read it with __atomic_load_n */
    int n_quantized;                /* FP8 matrices, quantized at load or stored FP8 */
    size_t quantized_bytes;         /* their resident bytes: E4M3 codes + fp32 block scales */
    size_t quantized_bf16_bytes;    /* what the same matrices would take in BF16 */
    struct rs_weight_store *store;  /* owns the backend memory of every tensor above */
} rs_model;

/* Parses config.json (and generation_config.json for eos ids, if present) in `dir`. */
int rs_model_config_load(const char *dir, rs_model_config *cfg, rs_error *err);

/* Loads a model directory onto backend `b`, choosing each matrix's precision with `qp` (borrowed;
 * NULL = keep every matrix as stored; an FP8 checkpoint's E4M3 matrices are FP8 either way). On
 * failure returns a negative code with a message that names the file, key or tensor at fault, and
 * leaves *out untouched. *out is a new model, freed with rs_model_free. */
int rs_model_load(const char *dir, rs_backend *b, const rs_quant_policy *qp, rs_model **out, rs_error *err);
void rs_model_free(rs_model *m);

/* A view of m for running the forward pass over other weights: its own rs_model, layers and MoE
 * expert arrays, with every tensor, the store, the config and the RoPE table shared with m (so
 * repointing a tensor of the view, as rs_model_slot(view, ...) returns it, leaves m alone). It
 * runs on backend b (NULL: m's), which must be able to read m's weights: another CPU backend for
 * a CPU model. Free with rs_model_view_free, never rs_model_free; m must outlive it. */
rs_model *rs_model_view(const rs_model *m, rs_backend *b);
void rs_model_view_free(rs_model *v);

/* Writes a model directory (config.json + model.safetensors, BF16 weights) with deterministic
 * pseudo-random weights for `cfg` and `seed`: the embedded default model and the benchmark models.
 * Same cfg and seed give the same bytes on every machine. */
int rs_testmodel_write(const char *dir, const rs_model_config *cfg, uint64_t seed, rs_error *err);

/* ---- forward pass ---- */

typedef struct rs_forward_ctx rs_forward_ctx;

/* Activation buffers for up to max_tokens rows per step and max_logits rows of logits, allocated
 * once on the model's backend; nothing is allocated per step. */
rs_forward_ctx *rs_forward_ctx_init(const rs_model *m, int max_tokens, int max_logits);
void rs_forward_ctx_free(rs_forward_ctx *f);

/* Runs one step over `batch`, writing K/V into kv[layer] and the logits of the rows listed in
 * logit_rows ([n_logits], ascending row indices) into logits_host [n_logits][vocab] fp32 — or, with
 * logits_host NULL, leaving them on the backend for rs_forward_sample / rs_forward_logits_row. */
void rs_forward(rs_forward_ctx *f, const rs_batch *batch, rs_kv_layer *kv /* [n_layers] */,
                const int32_t *logit_rows, int n_logits, float *logits_host);

/* Whether the backend samples on the device (kernels/backend.h rs_sample_req), and the call over
 * the last step's logits (req[i].row indexes its n_logits rows); and one row of those logits to the
 * host (for a request the device left undone). */
bool rs_forward_samples(const rs_forward_ctx *f);
void rs_forward_sample(rs_forward_ctx *f, const rs_sample_req *req, int n, rs_sample_res *res);
void rs_forward_logits_row(rs_forward_ctx *f, int i, float *dst /* [vocab] */);

#endif /* RS_MODEL_H */
