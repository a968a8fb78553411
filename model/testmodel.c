/*
 * testmodel.c — writes synthetic model directories (config.json + model.safetensors in BF16) with
 * deterministic pseudo-random weights, and the named presets built on them (presets.h).
 *
 * They exist so that everything downstream of the loader (daemon, benchmarks, end-to-end tests)
 * runs without downloading a checkpoint, and so that transformers can load the very same directory
 * to produce reference logits. Hence config.json uses the HF field names, and writing it is
 * followed by reading it back with rs_model_config_load: a cfg that would not round-trip (a
 * Qwen3 without qk_norm, MoE layers that decoder_sparse_step cannot express, eos ids outside the
 * vocabulary) is refused before any weight is written.
 *
 * Weights come from a counter-based generator: element j of tensor t is a pure function of
 * (seed, t, j), computed with integer operations and one exact float scaling, so any chunk can be
 * produced independently and the bytes do not depend on the machine. Tensors are streamed to disk
 * in 4 MiB chunks (rs_st_write), so a 0.6B-parameter model is written in seconds without holding
 * it in memory. Distributions: matrices uniform(-a, a) with a = sqrt(3) * 0.02 (std 0.02), norm
 * weights 1 + uniform(-0.05, 0.05), biases uniform(-0.02, 0.02).
 */
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../core/pool.h"
#include "model.h"
#include "presets.h"
#include "safetensors.h"

#define TM_NAME_MAX 128

typedef enum tm_kind { TM_MATRIX, TM_NORM, TM_BIAS } tm_kind;

typedef struct tm_gen {
    uint64_t key;   /* per-tensor stream key derived from (seed, tensor index) */
    tm_kind kind;
} tm_gen;

typedef struct tm_list {
    rs_st_wtensor *t;   /* [n] */
    tm_gen *gen;        /* [n] */
    char (*names)[TM_NAME_MAX];
    size_t n, cap;
    uint64_t seed;
} tm_list;

/* splitmix64's finalizer: a bijective 64-bit mix. */
static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Element j of a stream as a float in [-1, 1): a 24-bit integer scaled by a power of two (exact). */
static float tm_uniform(uint64_t key, uint64_t j) {
    uint64_t x = mix64(key + (j + 1) * 0x9e3779b97f4a7c15ull);
    return (float)((int32_t)(x >> 40) - (1 << 23)) * (1.0f / (float)(1 << 23));
}

/* base + a * u: the product of two 24-bit significands is exact in double, so the result does
 * not depend on whether a compiler contracts the expression into an fma. */
static float tm_value(float base, float a, float u) { return (float)((double)base + (double)a * (double)u); }

/* One chunk of a tensor: elements j0 + [0, n) into out (BF16, little-endian). */
typedef struct tm_chunk {
    const tm_gen *g;
    uint8_t *out;
    uint64_t j0;
} tm_chunk;

static void tm_fill_range(void *ctx, int64_t begin, int64_t end, int tid) {
    (void)tid;
    const tm_chunk *c = ctx;
    const float a = c->g->kind == TM_MATRIX ? 0.034641016f : c->g->kind == TM_NORM ? 0.05f : 0.02f;
    const float base = c->g->kind == TM_NORM ? 1.0f : 0.0f;
    for (int64_t i = begin; i < end; i++) {
        uint16_t h = rs_f32_to_bf16(tm_value(base, a, tm_uniform(c->g->key, c->j0 + (uint64_t)i)));
        c->out[2 * i] = (uint8_t)(h & 0xff);
        c->out[2 * i + 1] = (uint8_t)(h >> 8);
    }
}

/* Elements are pure functions of (key, index), so a chunk splits over threads without changing a
 * byte: large models (the 8B preset is 16 GB) are written at disk speed. The writer fills one chunk
 * at a time, so one pool serves every write of the process (guarded for concurrent writers). */
static int tm_fill(void *ctx, void *dst, uint64_t byte_offset, size_t nbytes, rs_error *err) {
    (void)err;
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static rs_pool *pool;
    tm_chunk c = {.g = ctx, .out = dst, .j0 = byte_offset / 2};
    const int64_t n = (int64_t)(nbytes / 2);
    if (n < (1 << 18)) {
        tm_fill_range(&c, 0, n, 0);
        return RS_OK;
    }
    pthread_mutex_lock(&mu);
    if (!pool) pool = rs_pool_init(0);
    rs_pool_run(pool, n, 4096, tm_fill_range, &c);
    pthread_mutex_unlock(&mu);
    return RS_OK;
}

static void tm_add(tm_list *L, tm_kind kind, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Appends a BF16 tensor [d0] (d1 == 0) or [d0][d1]. Pointers into the arrays are fixed up at the end. */
static void tm_add(tm_list *L, tm_kind kind, int64_t d0, int64_t d1, const char *fmt, ...) {
    if (L->n == L->cap) {
        L->cap = L->cap ? 2 * L->cap : 64;
        L->t = rs_xrealloc(L->t, L->cap * sizeof *L->t);
        L->gen = rs_xrealloc(L->gen, L->cap * sizeof *L->gen);
        L->names = rs_xrealloc(L->names, L->cap * sizeof *L->names);
    }
    size_t i = L->n++;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->names[i], TM_NAME_MAX, fmt, ap);
    va_end(ap);
    L->gen[i] = (tm_gen){.key = mix64(L->seed ^ mix64(0x5851f42d4c957f2dull + i)), .kind = kind};
    L->t[i] = (rs_st_wtensor){.dtype = RS_DTYPE_BF16, .ndim = d1 ? 2 : 1, .shape = {d0, d1}, .fill = tm_fill};
}

/* Every tensor of the architecture, in the order of the model's modules. */
static void tm_build(tm_list *L, const rs_model_config *c) {
    const int64_t h = c->hidden, hd = c->head_dim, q = (int64_t)c->n_heads * hd, kv = (int64_t)c->n_kv_heads * hd;
    tm_add(L, TM_MATRIX, c->vocab_size, h, "model.embed_tokens.weight");
    for (int l = 0; l < c->n_layers; l++) {
        tm_add(L, TM_NORM, h, 0, "model.layers.%d.input_layernorm.weight", l);
        tm_add(L, TM_MATRIX, q, h, "model.layers.%d.self_attn.q_proj.weight", l);
        tm_add(L, TM_MATRIX, kv, h, "model.layers.%d.self_attn.k_proj.weight", l);
        tm_add(L, TM_MATRIX, kv, h, "model.layers.%d.self_attn.v_proj.weight", l);
        tm_add(L, TM_MATRIX, h, q, "model.layers.%d.self_attn.o_proj.weight", l);
        if (c->qkv_bias) {
            tm_add(L, TM_BIAS, q, 0, "model.layers.%d.self_attn.q_proj.bias", l);
            tm_add(L, TM_BIAS, kv, 0, "model.layers.%d.self_attn.k_proj.bias", l);
            tm_add(L, TM_BIAS, kv, 0, "model.layers.%d.self_attn.v_proj.bias", l);
        }
        if (c->qk_norm) {
            tm_add(L, TM_NORM, hd, 0, "model.layers.%d.self_attn.q_norm.weight", l);
            tm_add(L, TM_NORM, hd, 0, "model.layers.%d.self_attn.k_norm.weight", l);
        }
        tm_add(L, TM_NORM, h, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        if (c->layer_is_moe[l]) {
            tm_add(L, TM_MATRIX, c->n_experts, h, "model.layers.%d.mlp.gate.weight", l);
            for (int e = 0; e < c->n_experts; e++) {
                tm_add(L, TM_MATRIX, c->moe_intermediate, h, "model.layers.%d.mlp.experts.%d.gate_proj.weight", l, e);
                tm_add(L, TM_MATRIX, c->moe_intermediate, h, "model.layers.%d.mlp.experts.%d.up_proj.weight", l, e);
                tm_add(L, TM_MATRIX, h, c->moe_intermediate, "model.layers.%d.mlp.experts.%d.down_proj.weight", l, e);
            }
        } else {
            tm_add(L, TM_MATRIX, c->intermediate, h, "model.layers.%d.mlp.gate_proj.weight", l);
            tm_add(L, TM_MATRIX, c->intermediate, h, "model.layers.%d.mlp.up_proj.weight", l);
            tm_add(L, TM_MATRIX, h, c->intermediate, "model.layers.%d.mlp.down_proj.weight", l);
        }
    }
    tm_add(L, TM_NORM, h, 0, "model.norm.weight");
    if (!c->tie_embeddings) tm_add(L, TM_MATRIX, c->vocab_size, h, "lm_head.weight");
    for (size_t i = 0; i < L->n; i++) {
        L->t[i].name = L->names[i];
        L->t[i].fill_ctx = &L->gen[i];
    }
}

/* The shortest decimal that reads back as the same float, so config.json says 1e-06, not
 * 9.99999997e-07 (both transformers and rs_model_config_load read it as the same float32). */
static double float_as_decimal(float f) {
    char buf[32];
    for (int prec = 6; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)f);
        if (strtof(buf, NULL) == f) break;
    }
    return strtod(buf, NULL);
}

static json_t *config_json(const rs_model_config *c) {
    json_t *o = json_pack("{s:[s], s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:b, s:s, s:s, s:f}",
                          "architectures", rs_arch_name(c->arch), "model_type", rs_arch_model_type(c->arch), "vocab_size",
                          c->vocab_size, "hidden_size", c->hidden, "intermediate_size", c->intermediate,
                          "num_hidden_layers", c->n_layers, "num_attention_heads", c->n_heads,
                          "num_key_value_heads", c->n_kv_heads, "head_dim", c->head_dim,
                          "max_position_embeddings", c->max_position, "rms_norm_eps", float_as_decimal(c->rms_eps),
                          "rope_theta", c->rope_theta, "tie_word_embeddings", c->tie_embeddings, "hidden_act",
                          "silu", "torch_dtype", "bfloat16", "initializer_range", 0.02);
    if (c->arch != RS_ARCH_QWEN2) json_object_set_new(o, "attention_bias", json_false());
    if (c->rope_scaling == RS_ROPE_SCALING_LLAMA3)
        json_object_set_new(o, "rope_scaling",
                            json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor", c->rope_factor,
                                      "low_freq_factor", c->rope_low_freq_factor, "high_freq_factor",
                                      c->rope_high_freq_factor, "original_max_position_embeddings",
                                      c->rope_original_max_position));
    else
        json_object_set_new(o, "rope_scaling", json_null());
    if (c->arch == RS_ARCH_QWEN3_MOE) {
        int step = c->decoder_sparse_step > 0 ? c->decoder_sparse_step : 1;
        json_t *mlp_only = json_array();
        for (int l = 0; l < c->n_layers; l++)
            if (!c->layer_is_moe[l] && (l + 1) % step == 0) json_array_append_new(mlp_only, json_integer(l));
        json_object_set_new(o, "num_experts", json_integer(c->n_experts));
        json_object_set_new(o, "num_experts_per_tok", json_integer(c->n_experts_per_tok));
        json_object_set_new(o, "moe_intermediate_size", json_integer(c->moe_intermediate));
        json_object_set_new(o, "norm_topk_prob", json_boolean(c->norm_topk_prob));
        json_object_set_new(o, "decoder_sparse_step", json_integer(step));
        json_object_set_new(o, "mlp_only_layers", mlp_only);
    }
    json_object_set_new(o, "bos_token_id", c->bos_token_id >= 0 ? json_integer(c->bos_token_id) : json_null());
    if (c->n_eos == 1) {
        json_object_set_new(o, "eos_token_id", json_integer(c->eos_token_ids[0]));
    } else if (c->n_eos > 1) {
        json_t *eos = json_array();
        for (int i = 0; i < c->n_eos; i++) json_array_append_new(eos, json_integer(c->eos_token_ids[i]));
        json_object_set_new(o, "eos_token_id", eos);
    } else {
        json_object_set_new(o, "eos_token_id", json_null());
    }
    return o;
}

/* Names the first field where the config read back differs from the one written, or NULL. */
static const char *config_diff(const rs_model_config *a, const rs_model_config *b) {
#define TM_SAME(f) if (a->f != b->f) return #f
    TM_SAME(arch); TM_SAME(vocab_size); TM_SAME(hidden); TM_SAME(intermediate); TM_SAME(n_layers);
    TM_SAME(n_heads); TM_SAME(n_kv_heads); TM_SAME(head_dim); TM_SAME(max_position); TM_SAME(rms_eps);
    TM_SAME(rope_theta); TM_SAME(rope_scaling); TM_SAME(tie_embeddings); TM_SAME(qk_norm); TM_SAME(qkv_bias);
    TM_SAME(n_experts); TM_SAME(bos_token_id); TM_SAME(n_eos);
    if (a->rope_scaling == RS_ROPE_SCALING_LLAMA3) {
        TM_SAME(rope_factor); TM_SAME(rope_low_freq_factor); TM_SAME(rope_high_freq_factor);
        TM_SAME(rope_original_max_position);
    }
    if (a->n_experts > 0) {
        TM_SAME(n_experts_per_tok); TM_SAME(moe_intermediate); TM_SAME(norm_topk_prob);
    }
    for (int l = 0; l < a->n_layers; l++) TM_SAME(layer_is_moe[l]);
    for (int i = 0; i < a->n_eos; i++) TM_SAME(eos_token_ids[i]);
#undef TM_SAME
    return NULL;
}

static int mkdir_p(const char *dir, rs_error *err) {
    char buf[4096];
    if (dir[0] == '\0') return rs_error_set(err, RS_EINVAL, NULL, "empty model directory name");
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf)
        return rs_error_set(err, RS_EINVAL, NULL, "path too long: %.200s", dir);
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char saved = *p;
            *p = '\0';
            if (mkdir(buf, 0755) != 0 && errno != EEXIST)
                return rs_error_set(err, RS_EIO, NULL, "cannot create directory %s: %s", buf, strerror(errno));
            *p = saved;
            if (saved == '\0') break;
        }
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return rs_error_set(err, RS_EIO, NULL, "%s is not a directory", dir);
    return RS_OK;
}

/* Writes JSON text with a trailing newline. */
static int write_text_file(const char *path, const json_t *js, rs_error *err) {
    char *text = json_dumps(js, JSON_INDENT(2));
    FILE *fp = text ? fopen(path, "w") : NULL;
    int ok = fp && fputs(text, fp) >= 0 && fputc('\n', fp) != EOF;
    if (fp && fclose(fp) != 0) ok = 0;
    free(text);
    if (!ok) return rs_error_set(err, RS_EIO, NULL, "cannot write %s: %s", path, strerror(errno));
    return RS_OK;
}

int rs_testmodel_write(const char *dir, const rs_model_config *cfg, uint64_t seed, rs_error *err) {
    char path[4096];
    tm_list L = {.seed = seed};
    json_t *js = NULL;
    int rc;
    if ((rc = mkdir_p(dir, err)) != RS_OK) return rc;
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
        return rs_error_set(err, RS_EINVAL, NULL, "path too long: %.200s", dir);
    js = config_json(cfg);
    if ((rc = write_text_file(path, js, err)) != RS_OK) goto fail;
    rs_model_config back;
    if ((rc = rs_model_config_load(dir, &back, err)) != RS_OK) goto fail;
    const char *diff = config_diff(cfg, &back);
    if (diff) {
        rc = rs_error_set(err, RS_EINVAL, diff, "%s: config field %s does not survive config.json (inconsistent "
                          "with the architecture or the other fields)", dir, diff);
        goto fail;
    }
    tm_build(&L, &back);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    double t0 = rs_now_s();
    if ((rc = rs_st_write(path, L.t, L.n, err)) != RS_OK) goto fail;
    RS_INFO("testmodel | wrote %s | %s, %zu tensors, seed %llu | %.2f s", dir, rs_arch_name(cfg->arch), L.n,
            (unsigned long long)seed, rs_now_s() - t0);
fail:
    json_decref(js);
    free(L.t);
    free(L.gen);
    free(L.names);
    return rc;
}

/* ---- presets ---- */

typedef struct tm_preset {
    const char *name;
    uint64_t seed;
    rs_model_config cfg;
} tm_preset;

static const tm_preset presets[] = {
    {"default", 1,
     {.arch = RS_ARCH_QWEN3, .vocab_size = 8192, .hidden = 512, .intermediate = 1536, .n_layers = 8, .n_heads = 8,
      .n_kv_heads = 4, .head_dim = 64, .max_position = 4096, .rms_eps = 1e-6f, .rope_theta = 1e6,
      .tie_embeddings = true, .qk_norm = true, .decoder_sparse_step = 1, .bos_token_id = 1,
      .eos_token_ids = {2}, .n_eos = 1}},
    {"qwen3-0.6b", 2,
     {.arch = RS_ARCH_QWEN3, .vocab_size = 151936, .hidden = 1024, .intermediate = 3072, .n_layers = 28,
      .n_heads = 16, .n_kv_heads = 8, .head_dim = 128, .max_position = 40960, .rms_eps = 1e-6f, .rope_theta = 1e6,
      .tie_embeddings = true, .qk_norm = true, .decoder_sparse_step = 1, .bos_token_id = 151643,
      .eos_token_ids = {151645, 151643}, .n_eos = 2}},
    {"qwen3-8b", 3,
     {.arch = RS_ARCH_QWEN3, .vocab_size = 151936, .hidden = 4096, .intermediate = 12288, .n_layers = 36,
      .n_heads = 32, .n_kv_heads = 8, .head_dim = 128, .max_position = 40960, .rms_eps = 1e-6f, .rope_theta = 1e6,
      .tie_embeddings = false, .qk_norm = true, .decoder_sparse_step = 1, .bos_token_id = 151643,
      .eos_token_ids = {151645, 151643}, .n_eos = 2}},
};

static const tm_preset *find_preset(const char *name) {
    for (size_t i = 0; i < RS_ARRAY_LEN(presets); i++)
        if (name && strcmp(presets[i].name, name) == 0) return &presets[i];
    return NULL;
}

int rs_model_preset(const char *name, rs_model_config *cfg) {
    const tm_preset *p = find_preset(name);
    if (!p) return RS_ENOTFOUND;
    *cfg = p->cfg;
    cfg->rope_scaling = RS_ROPE_SCALING_NONE;
    cfg->rope_factor = cfg->rope_low_freq_factor = cfg->rope_high_freq_factor = 1.0;
    cfg->rope_original_max_position = cfg->max_position;
    return RS_OK;
}

uint64_t rs_model_preset_seed(const char *name) {
    const tm_preset *p = find_preset(name);
    return p ? p->seed : 0;
}

int rs_model_preset_write(const char *name, const char *dir, rs_error *err) {
    rs_model_config cfg;
    if (rs_model_preset(name, &cfg) != RS_OK)
        return rs_error_set(err, RS_ENOTFOUND, "preset", "unknown model preset \"%s\" (%s)", name ? name : "(null)",
                            RS_MODEL_PRESET_NAMES);
    return rs_testmodel_write(dir, &cfg, rs_model_preset_seed(name), err);
}
