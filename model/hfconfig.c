/*
 * hfconfig.c — reads a Hugging Face config.json (and generation_config.json) into rs_model_config.
 *
 * The rules follow transformers 5.x, which is what the trainer side runs, so a directory that
 * transformers loads one way is never read another way here:
 *   - defaults are the config classes' own (LlamaConfig, Qwen2Config, Qwen3Config,
 *     Qwen3MoeConfig): num_key_value_heads = num_attention_heads, head_dim = hidden / heads except
 *     Qwen3Config's 128, tie_word_embeddings false, rms_norm_eps 1e-6, rope_theta 10000;
 *   - RoPE parameters come from "rope_scaling" when it is a non-empty object, else from
 *     "rope_parameters" (the newer layout); rope_theta inside that dict wins over the top-level
 *     key (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict); for llama3 scaling a top-level
 *     original_max_position_embeddings wins over the dict's (standardize_rope_params);
 *   - Qwen3-MoE's num_experts may be spelled num_local_experts (its attribute_map; transformers 5
 *     saves that name); a layer is sparse iff l is not in mlp_only_layers, num_experts > 0 and
 *     (l + 1) % decoder_sparse_step == 0 (Qwen3MoeDecoderLayer.__init__).
 *   - "quantization_config" is read as vLLM's Fp8Config reads it: quant_method "fp8" with
 *     weight_block_size [128, 128] (the DeepSeek-V3 / Qwen3-FP8 layout), activation_scheme
 *     "dynamic" (the default), fmt "e4m3" / "float8_e4m3fn" if given, and the optional
 *     modules_to_not_convert (transformers) / ignored_layers (vLLM, SGLang) lists of modules kept
 *     unquantized; dequantize and scale_fmt only at their neutral values (false, "float"). Other
 *     keys of the object are allowed and ignored.
 *   - model_type, when given, must be the architecture's own (transformers builds from it);
 *   - an absent sliding_window is 4096 when use_sliding_window is true (the config classes'
 *     default), which Qwen3-MoE applies to every layer (it has no layer_types).
 * Anything the forward pass does not implement (sliding-window layers, attention/MLP biases on
 * Llama/Qwen3, partial rotary, other RoPE types, activations other than SiLU, quantization methods
 * other than blockwise FP8, per-tensor or other block sizes, static activation scales) is
 * RS_EUNSUPPORTED naming the key, never silently ignored. Values out of range are RS_EFORMAT
 * naming the key.
 */
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "model.h"
#include "quant.h"

#define CFG_MAX_BYTES (16u << 20)

typedef struct cfg_reader {
    const char *path;   /* for messages */
    json_t *root;       /* borrowed */
    rs_error *err;
} cfg_reader;

static int cfg_fail(const cfg_reader *r, int code, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int cfg_fail(const cfg_reader *r, int code, const char *key, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return rs_error_set(r->err, code, key, "%s: %s", r->path, msg);
}

/* A key that is absent or JSON null reads as absent, as transformers treats it. */
static json_t *cfg_get(const json_t *o, const char *key) {
    json_t *v = json_is_object(o) ? json_object_get(o, key) : NULL;
    return json_is_null(v) ? NULL : v;
}

/* Integer key in [lo, hi]; `def` is used when absent unless `required`. */
static int cfg_int(const cfg_reader *r, const json_t *o, const char *key, bool required, long long def,
                   long long lo, long long hi, int *out) {
    json_t *v = cfg_get(o, key);
    if (!v) {
        if (required) return cfg_fail(r, RS_EFORMAT, key, "missing required key \"%s\"", key);
        *out = (int)def;
        return RS_OK;
    }
    if (!json_is_integer(v)) return cfg_fail(r, RS_EFORMAT, key, "\"%s\" must be an integer", key);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return cfg_fail(r, RS_EFORMAT, key, "\"%s\" = %lld is outside [%lld, %lld]", key, x, lo, hi);
    *out = (int)x;
    return RS_OK;
}

/* Number key (integer or real) in (lo, hi]; `def` when absent unless `required`. */
static int cfg_num(const cfg_reader *r, const json_t *o, const char *key, bool required, double def, double lo,
                   double hi, double *out) {
    json_t *v = cfg_get(o, key);
    if (!v) {
        if (required) return cfg_fail(r, RS_EFORMAT, key, "missing required key \"%s\"", key);
        *out = def;
        return RS_OK;
    }
    if (!json_is_number(v)) return cfg_fail(r, RS_EFORMAT, key, "\"%s\" must be a number", key);
    double x = json_number_value(v);
    if (!(x > lo && x <= hi)) return cfg_fail(r, RS_EFORMAT, key, "\"%s\" = %g is outside (%g, %g]", key, x, lo, hi);
    *out = x;
    return RS_OK;
}

static int cfg_bool(const cfg_reader *r, const json_t *o, const char *key, bool def, bool *out) {
    json_t *v = cfg_get(o, key);
    if (!v) {
        *out = def;
        return RS_OK;
    }
    if (!json_is_boolean(v)) return cfg_fail(r, RS_EFORMAT, key, "\"%s\" must be true or false", key);
    *out = json_is_true(v);
    return RS_OK;
}

/* Loads a JSON object from a file of bounded size. RS_ENOTFOUND when the file does not exist,
 * with err left alone when the file is `optional`. */
static int load_json(const char *path, bool optional, json_t **out, rs_error *err) {
    struct stat st;
    if (stat(path, &st) != 0)
        return optional ? RS_ENOTFOUND : rs_error_set(err, RS_ENOTFOUND, NULL, "%s: no such file", path);
    if ((unsigned long long)st.st_size > CFG_MAX_BYTES)
        return rs_error_set(err, RS_EFORMAT, NULL, "%s: %lld bytes, over the %u-byte limit", path,
                            (long long)st.st_size, CFG_MAX_BYTES);
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return rs_error_set(err, RS_EFORMAT, NULL, "%s: %s (line %d, column %d)", path, jerr.text, jerr.line,
                            jerr.column);
    if (!json_is_object(root)) {
        json_decref(root);
        return rs_error_set(err, RS_EFORMAT, NULL, "%s: not a JSON object", path);
    }
    *out = root;
    return RS_OK;
}

const char *rs_arch_name(rs_arch a) {
    switch (a) {
    case RS_ARCH_QWEN3: return "Qwen3ForCausalLM";
    case RS_ARCH_QWEN2: return "Qwen2ForCausalLM";
    case RS_ARCH_LLAMA: return "LlamaForCausalLM";
    case RS_ARCH_QWEN3_MOE: return "Qwen3MoeForCausalLM";
    }
    return "?";
}

/* transformers' model_type of each architecture: what AutoConfig builds the model from. */
const char *rs_arch_model_type(rs_arch a) {
    switch (a) {
    case RS_ARCH_QWEN3: return "qwen3";
    case RS_ARCH_QWEN2: return "qwen2";
    case RS_ARCH_LLAMA: return "llama";
    case RS_ARCH_QWEN3_MOE: return "qwen3_moe";
    }
    return "?";
}

static int parse_arch(const cfg_reader *r, rs_model_config *c) {
    json_t *a = cfg_get(r->root, "architectures");
    if (!json_is_array(a) || json_array_size(a) == 0 || !json_is_string(json_array_get(a, 0)))
        return cfg_fail(r, RS_EFORMAT, "architectures", "\"architectures\" must be a non-empty list of strings");
    const char *name = json_string_value(json_array_get(a, 0));
    for (int i = RS_ARCH_QWEN3; i <= RS_ARCH_QWEN3_MOE; i++) {
        if (strcmp(name, rs_arch_name((rs_arch)i)) == 0) {
            c->arch = (rs_arch)i;
            /* transformers builds the model from model_type (vLLM and SGLang from architectures):
             * when the two name different models, the trainer and rolloutd would run different ones */
            json_t *mt = cfg_get(r->root, "model_type");
            if (mt && !json_is_string(mt))
                return cfg_fail(r, RS_EFORMAT, "model_type", "\"model_type\" must be a string");
            if (mt && strcmp(json_string_value(mt), rs_arch_model_type(c->arch)) != 0)
                return cfg_fail(r, RS_EUNSUPPORTED, "model_type",
                                "\"model_type\" \"%.64s\" does not match architectures[0] %s (model_type \"%s\"): "
                                "transformers would build another model from it", json_string_value(mt), name,
                                rs_arch_model_type(c->arch));
            return RS_OK;
        }
    }
    return cfg_fail(r, RS_EUNSUPPORTED, "architectures",
                    "architecture \"%.100s\" is not supported (Qwen3ForCausalLM, Qwen2ForCausalLM, "
                    "LlamaForCausalLM, Qwen3MoeForCausalLM)",
                    name);
}

/* Rejects configurations whose forward pass rolloutd does not implement. */
static int check_unsupported(const cfg_reader *r, const rs_model_config *c) {
    const json_t *root = r->root;
    int rc;
    json_t *v;
    if ((v = cfg_get(root, "hidden_act")) && (!json_is_string(v) || strcmp(json_string_value(v), "silu") != 0))
        return cfg_fail(r, RS_EUNSUPPORTED, "hidden_act", "\"hidden_act\" must be \"silu\"");
    if ((v = cfg_get(root, "partial_rotary_factor")) && (!json_is_number(v) || json_number_value(v) != 1.0))
        return cfg_fail(r, RS_EUNSUPPORTED, "partial_rotary_factor", "partial rotary embeddings are not supported");
    bool b;
    if (c->arch != RS_ARCH_QWEN2) { /* Qwen2 hard-codes q/k/v bias and ignores attention_bias */
        if ((rc = cfg_bool(r, root, "attention_bias", false, &b)) != RS_OK) return rc;
        if (b) return cfg_fail(r, RS_EUNSUPPORTED, "attention_bias", "\"attention_bias\": true is not supported");
    }
    if ((rc = cfg_bool(r, root, "mlp_bias", false, &b)) != RS_OK) return rc;
    if (b) return cfg_fail(r, RS_EUNSUPPORTED, "mlp_bias", "\"mlp_bias\": true is not supported");

    /* Sliding-window attention: layer l slides iff use_sliding_window, sliding_window is set and
     * l >= max_window_layers (Qwen2Config / Qwen3Config); an explicit layer_types list wins there.
     * Qwen3MoeConfig has no layer_types: with use_sliding_window every layer slides. An absent
     * sliding_window is the config classes' default, 4096 (a window); only null is none. Llama has
     * no sliding window. */
    if (c->arch == RS_ARCH_LLAMA) return RS_OK;
    json_t *lt = c->arch == RS_ARCH_QWEN3_MOE ? NULL : cfg_get(root, "layer_types");
    if (lt) {
        if (!json_is_array(lt)) return cfg_fail(r, RS_EFORMAT, "layer_types", "\"layer_types\" must be a list");
        size_t i;
        json_t *e;
        json_array_foreach(lt, i, e) {
            if (!json_is_string(e) || strcmp(json_string_value(e), "full_attention") != 0)
                return cfg_fail(r, RS_EUNSUPPORTED, "layer_types",
                                "layer_types[%zu] is not \"full_attention\"; only full attention is supported", i);
        }
        return RS_OK;
    }
    if ((rc = cfg_bool(r, root, "use_sliding_window", false, &b)) != RS_OK) return rc;
    if (b && !json_is_null(json_object_get(root, "sliding_window"))) { /* set, or absent: 4096 */
        int max_window_layers = 28;
        if (c->arch != RS_ARCH_QWEN3_MOE &&
            (rc = cfg_int(r, root, "max_window_layers", false, 28, 0, 1 << 30, &max_window_layers)) != RS_OK)
            return rc;
        if (c->arch == RS_ARCH_QWEN3_MOE || max_window_layers < c->n_layers)
            return cfg_fail(r, RS_EUNSUPPORTED, "use_sliding_window", "sliding-window attention is not supported");
    }
    return RS_OK;
}

/* RoPE: theta, and llama3 scaling when configured. */
static int parse_rope(const cfg_reader *r, rs_model_config *c) {
    const json_t *root = r->root;
    int rc;
    json_t *rs = cfg_get(root, "rope_scaling");
    json_t *rp = cfg_get(root, "rope_parameters");
    const char *dict_key = "rope_scaling";
    json_t *d = rs;
    if (d && !json_is_object(d)) return cfg_fail(r, RS_EFORMAT, dict_key, "\"rope_scaling\" must be an object");
    if (!d || json_object_size(d) == 0) {
        d = rp;
        dict_key = "rope_parameters";
        if (d && !json_is_object(d))
            return cfg_fail(r, RS_EFORMAT, dict_key, "\"rope_parameters\" must be an object");
    }
    if (d) {
        const char *k;
        json_t *v;
        json_object_foreach(d, k, v) {
            if (json_is_object(v))
                return cfg_fail(r, RS_EUNSUPPORTED, dict_key, "per-layer-type %s (\"%.64s\") are not supported",
                                dict_key, k);
        }
    }
    double top_theta;
    if ((rc = cfg_num(r, root, "rope_theta", false, 10000.0, 0.0, 1e12, &top_theta)) != RS_OK) return rc;
    if ((rc = cfg_num(r, d, "rope_theta", false, top_theta, 0.0, 1e12, &c->rope_theta)) != RS_OK) return rc;
    json_t *prf = cfg_get(d, "partial_rotary_factor");
    if (prf && (!json_is_number(prf) || json_number_value(prf) != 1.0))
        return cfg_fail(r, RS_EUNSUPPORTED, dict_key, "partial rotary embeddings are not supported");

    const char *type = "default";
    json_t *t = cfg_get(d, "rope_type");
    if (!t) t = cfg_get(d, "type");
    if (t) {
        if (!json_is_string(t)) return cfg_fail(r, RS_EFORMAT, dict_key, "%s.rope_type must be a string", dict_key);
        type = json_string_value(t);
    }
    c->rope_scaling = RS_ROPE_SCALING_NONE;
    c->rope_factor = 1.0;
    c->rope_low_freq_factor = 1.0;
    c->rope_high_freq_factor = 1.0;
    c->rope_original_max_position = c->max_position;
    if (strcmp(type, "default") == 0) return RS_OK;
    if (strcmp(type, "llama3") != 0)
        return cfg_fail(r, RS_EUNSUPPORTED, dict_key, "RoPE type \"%.64s\" is not supported (default, llama3)",
                        type);
    c->rope_scaling = RS_ROPE_SCALING_LLAMA3;
    if ((rc = cfg_num(r, d, "factor", true, 0, 0.0, 1e6, &c->rope_factor)) != RS_OK) return rc;
    if ((rc = cfg_num(r, d, "low_freq_factor", true, 0, 0.0, 1e6, &c->rope_low_freq_factor)) != RS_OK) return rc;
    if ((rc = cfg_num(r, d, "high_freq_factor", true, 0, 0.0, 1e6, &c->rope_high_freq_factor)) != RS_OK) return rc;
    if (!(c->rope_low_freq_factor < c->rope_high_freq_factor))
        return cfg_fail(r, RS_EFORMAT, dict_key, "%s: low_freq_factor %g must be below high_freq_factor %g",
                        dict_key, c->rope_low_freq_factor, c->rope_high_freq_factor);
    int omp = c->max_position;
    if ((rc = cfg_int(r, d, "original_max_position_embeddings", false, omp, 1, 1 << 30, &omp)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "original_max_position_embeddings", false, omp, 1, 1 << 30, &omp)) != RS_OK)
        return rc;
    c->rope_original_max_position = omp;
    return RS_OK;
}

/* Appends the entries of quantization_config[key] (a list of strings, or absent) to
 * c->fp8_not_converted, '\n'-separated. */
static int add_not_converted(const cfg_reader *r, const json_t *qc, const char *key, rs_model_config *c) {
    json_t *v = cfg_get(qc, key);
    if (!v) return RS_OK;
    if (!json_is_array(v))
        return cfg_fail(r, RS_EFORMAT, key, "quantization_config.%s must be a list of module names", key);
    size_t i, used = strlen(c->fp8_not_converted);
    json_t *e;
    json_array_foreach(v, i, e) {
        const char *s = json_is_string(e) ? json_string_value(e) : NULL;
        if (!s || strchr(s, '\n') || rs_quant_check_list_entry(s) != RS_OK)
            return cfg_fail(r, RS_EFORMAT, key,
                            "quantization_config.%s[%zu] is not a module name or a valid \"re:\" pattern", key, i);
        size_t len = strlen(s);
        if (used + (used > 0) + len + 1 > sizeof c->fp8_not_converted)
            return cfg_fail(r, RS_EUNSUPPORTED, key, "quantization_config.%s: more than %zu bytes of module names",
                            key, sizeof c->fp8_not_converted - 1);
        if (used) c->fp8_not_converted[used++] = '\n';
        memcpy(c->fp8_not_converted + used, s, len + 1);
        used += len;
    }
    return RS_OK;
}

/* quantization_config: absent, or blockwise FP8 (see the top of this file). */
static int parse_quant(const cfg_reader *r, rs_model_config *c) {
    c->fp8_checkpoint = false;
    c->fp8_not_converted[0] = '\0';
    json_t *qc = cfg_get(r->root, "quantization_config");
    if (!qc) return RS_OK;
    if (!json_is_object(qc))
        return cfg_fail(r, RS_EFORMAT, "quantization_config", "\"quantization_config\" must be an object");
    json_t *v = cfg_get(qc, "quant_method");
    if (!json_is_string(v))
        return cfg_fail(r, RS_EFORMAT, "quant_method", "quantization_config.quant_method must be a string");
    if (strcmp(json_string_value(v), "fp8") != 0)
        return cfg_fail(r, RS_EUNSUPPORTED, "quant_method",
                        "quantization_config.quant_method \"%.64s\" is not supported (only \"fp8\" with "
                        "weight_block_size [128, 128]; or load the BF16 checkpoint and let rolloutd quantize it)",
                        json_string_value(v));
    v = cfg_get(qc, "weight_block_size");
    if (!v)
        return cfg_fail(r, RS_EUNSUPPORTED, "weight_block_size",
                        "quantization_config.weight_block_size is missing: per-tensor FP8 checkpoints are not "
                        "supported, only 128x128 blocks");
    if (!json_is_array(v) || json_array_size(v) != 2 || !json_is_integer(json_array_get(v, 0)) ||
        !json_is_integer(json_array_get(v, 1)))
        return cfg_fail(r, RS_EFORMAT, "weight_block_size",
                        "quantization_config.weight_block_size must be a list of two integers");
    long long b0 = json_integer_value(json_array_get(v, 0)), b1 = json_integer_value(json_array_get(v, 1));
    if (b0 != 128 || b1 != 128)
        return cfg_fail(r, RS_EUNSUPPORTED, "weight_block_size",
                        "quantization_config.weight_block_size [%lld, %lld] is not supported, only [128, 128]", b0,
                        b1);
    v = cfg_get(qc, "activation_scheme");
    if (v && (!json_is_string(v) || strcmp(json_string_value(v), "dynamic") != 0))
        return cfg_fail(r, RS_EUNSUPPORTED, "activation_scheme",
                        "quantization_config.activation_scheme must be \"dynamic\" (static activation scales "
                        "are not supported)");
    v = cfg_get(qc, "fmt");
    if (v && (!json_is_string(v) || (strcmp(json_string_value(v), "e4m3") != 0 &&
                                     strcmp(json_string_value(v), "float8_e4m3fn") != 0)))
        return cfg_fail(r, RS_EUNSUPPORTED, "fmt",
                        "quantization_config.fmt must be \"e4m3\" (float8_e4m3fn); other FP8 formats are not "
                        "supported");
    /* keys of transformers' FineGrainedFP8Config that change the arithmetic, accepted only at their
     * neutral values: dequantize (serve the weights dequantized, unquantized activations) and
     * scale_fmt (ue8m0: power-of-two activation scales) */
    v = json_object_get(qc, "dequantize");
    if (v && !json_is_null(v) && !json_is_false(v))
        return cfg_fail(r, RS_EUNSUPPORTED, "dequantize",
                        "quantization_config.dequantize must be false: serving the weights dequantized (BF16 "
                        "matmuls, unquantized activations) is not supported; load a BF16 checkpoint instead");
    v = cfg_get(qc, "scale_fmt");
    if (v && (!json_is_string(v) || strcmp(json_string_value(v), "float") != 0))
        return cfg_fail(r, RS_EUNSUPPORTED, "scale_fmt",
                        "quantization_config.scale_fmt must be \"float\": rolloutd's activation scales are "
                        "amax / 448 in fp32 (ue8m0 power-of-two scales are not supported)");
    int rc;
    if ((rc = add_not_converted(r, qc, "modules_to_not_convert", c)) != RS_OK) return rc;
    if ((rc = add_not_converted(r, qc, "ignored_layers", c)) != RS_OK) return rc;
    c->fp8_checkpoint = true;
    return RS_OK;
}

static int parse_moe(const cfg_reader *r, rs_model_config *c) {
    const json_t *root = r->root;
    int rc;
    for (int l = 0; l < c->n_layers; l++) c->layer_is_moe[l] = false;
    c->decoder_sparse_step = 1;
    if (c->arch != RS_ARCH_QWEN3_MOE) {
        c->n_experts = 0;
        return RS_OK;
    }
    /* transformers 5 writes num_experts under its attribute_map name, num_local_experts */
    const char *key = cfg_get(root, "num_experts") || !cfg_get(root, "num_local_experts") ? "num_experts"
                                                                                          : "num_local_experts";
    if ((rc = cfg_int(r, root, key, true, 0, 0, 4096, &c->n_experts)) != RS_OK) return rc;
    int alias;
    if ((rc = cfg_int(r, root, "num_local_experts", false, c->n_experts, 0, 4096, &alias)) != RS_OK) return rc;
    if (alias != c->n_experts)
        return cfg_fail(r, RS_EFORMAT, "num_local_experts", "num_experts %d and num_local_experts %d disagree",
                        c->n_experts, alias);
    if (c->n_experts > 0) {
        if ((rc = cfg_int(r, root, "num_experts_per_tok", true, 0, 1, c->n_experts, &c->n_experts_per_tok)) != RS_OK)
            return rc;
        if ((rc = cfg_int(r, root, "moe_intermediate_size", true, 0, 1, 1 << 20, &c->moe_intermediate)) != RS_OK)
            return rc;
    }
    if ((rc = cfg_bool(r, root, "norm_topk_prob", false, &c->norm_topk_prob)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "decoder_sparse_step", false, 1, 1, 1 << 20, &c->decoder_sparse_step)) != RS_OK)
        return rc;
    bool mlp_only[RS_MAX_LAYERS] = {false};
    json_t *m = cfg_get(root, "mlp_only_layers");
    if (m) {
        if (!json_is_array(m))
            return cfg_fail(r, RS_EFORMAT, "mlp_only_layers", "\"mlp_only_layers\" must be a list of integers");
        size_t i;
        json_t *e;
        json_array_foreach(m, i, e) {
            if (!json_is_integer(e) || json_integer_value(e) < 0)
                return cfg_fail(r, RS_EFORMAT, "mlp_only_layers", "mlp_only_layers[%zu] is not a layer index", i);
            if (json_integer_value(e) < c->n_layers) mlp_only[json_integer_value(e)] = true;
        }
    }
    for (int l = 0; l < c->n_layers; l++)
        c->layer_is_moe[l] = !mlp_only[l] && c->n_experts > 0 && (l + 1) % c->decoder_sparse_step == 0;
    return RS_OK;
}

/* Adds eos ids from `v` (int, list of ints, or absent) to c, deduplicated. */
static int add_eos(const cfg_reader *r, rs_model_config *c, const json_t *v) {
    if (!v) return RS_OK;
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= c->vocab_size)
            return cfg_fail(r, RS_EFORMAT, "eos_token_id",
                            "\"eos_token_id\" must be a token id in [0, %d) or a list of them", c->vocab_size);
        int id = (int)json_integer_value(e);
        bool seen = false;
        for (int k = 0; k < c->n_eos; k++) seen |= c->eos_token_ids[k] == id;
        if (seen) continue;
        if (c->n_eos == RS_MAX_EOS)
            return cfg_fail(r, RS_EUNSUPPORTED, "eos_token_id", "more than %d distinct eos token ids", RS_MAX_EOS);
        c->eos_token_ids[c->n_eos++] = id;
    }
    return RS_OK;
}

static int parse_special_tokens(const cfg_reader *r, const cfg_reader *gen, rs_model_config *c) {
    int rc;
    c->n_eos = 0;
    if ((rc = cfg_int(r, r->root, "bos_token_id", false, -1, 0, c->vocab_size - 1, &c->bos_token_id)) != RS_OK)
        return rc;
    if ((rc = add_eos(r, c, cfg_get(r->root, "eos_token_id"))) != RS_OK) return rc;
    if (gen) {
        if (c->bos_token_id < 0 &&
            (rc = cfg_int(gen, gen->root, "bos_token_id", false, -1, 0, c->vocab_size - 1, &c->bos_token_id)) !=
                RS_OK)
            return rc;
        if ((rc = add_eos(gen, c, cfg_get(gen->root, "eos_token_id"))) != RS_OK) return rc;
    }
    return RS_OK;
}

static int parse_config(const cfg_reader *r, const cfg_reader *gen, rs_model_config *c) {
    const json_t *root = r->root;
    int rc;
    if ((rc = parse_arch(r, c)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "vocab_size", true, 0, 1, 1 << 24, &c->vocab_size)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "hidden_size", true, 0, 1, 1 << 16, &c->hidden)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "intermediate_size", true, 0, 1, 1 << 20, &c->intermediate)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "num_hidden_layers", true, 0, 1, RS_MAX_LAYERS, &c->n_layers)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "num_attention_heads", true, 0, 1, 1024, &c->n_heads)) != RS_OK) return rc;
    if ((rc = cfg_int(r, root, "num_key_value_heads", false, c->n_heads, 1, c->n_heads, &c->n_kv_heads)) != RS_OK)
        return rc;
    if (c->n_heads % c->n_kv_heads != 0)
        return cfg_fail(r, RS_EFORMAT, "num_key_value_heads",
                        "num_attention_heads %d is not a multiple of num_key_value_heads %d", c->n_heads,
                        c->n_kv_heads);
    int def_hd = c->arch == RS_ARCH_QWEN3 ? 128 : c->hidden / c->n_heads;
    if ((rc = cfg_int(r, root, "head_dim", false, def_hd, 2, 1024, &c->head_dim)) != RS_OK) return rc;
    if (c->head_dim < 2 || c->head_dim % 2 != 0)
        return cfg_fail(r, RS_EFORMAT, "head_dim", "head_dim %d must be even and at least 2", c->head_dim);
    if ((rc = cfg_int(r, root, "max_position_embeddings", true, 0, 1, 1 << 28, &c->max_position)) != RS_OK)
        return rc;
    double eps;
    if ((rc = cfg_num(r, root, "rms_norm_eps", false, 1e-6, 0.0, 1.0, &eps)) != RS_OK) return rc;
    c->rms_eps = (float)eps;
    if ((rc = cfg_bool(r, root, "tie_word_embeddings", false, &c->tie_embeddings)) != RS_OK) return rc;
    c->qk_norm = c->arch == RS_ARCH_QWEN3 || c->arch == RS_ARCH_QWEN3_MOE;
    c->qkv_bias = c->arch == RS_ARCH_QWEN2;
    if ((rc = check_unsupported(r, c)) != RS_OK) return rc;
    if ((rc = parse_rope(r, c)) != RS_OK) return rc;
    if ((rc = parse_moe(r, c)) != RS_OK) return rc;
    if ((rc = parse_quant(r, c)) != RS_OK) return rc;
    return parse_special_tokens(r, gen, c);
}

int rs_model_config_load(const char *dir, rs_model_config *cfg, rs_error *err) {
    char path[4096], gen_path[4096];
    json_t *root = NULL, *gen_root = NULL;
    int rc;
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path ||
        snprintf(gen_path, sizeof gen_path, "%s/generation_config.json", dir) >= (int)sizeof gen_path)
        return rs_error_set(err, RS_EINVAL, NULL, "model path too long: %.200s", dir);
    if ((rc = load_json(path, false, &root, err)) != RS_OK) goto fail;
    rc = load_json(gen_path, true, &gen_root, err);
    if (rc == RS_ENOTFOUND) gen_root = NULL;
    else if (rc != RS_OK) goto fail;

    rs_model_config c;
    memset(&c, 0, sizeof c);
    cfg_reader r = {path, root, err}, g = {gen_path, gen_root, err};
    if ((rc = parse_config(&r, gen_root ? &g : NULL, &c)) != RS_OK) goto fail;
    *cfg = c;
    rc = RS_OK;
fail:
    json_decref(gen_root);
    json_decref(root);
    return rc;
}
