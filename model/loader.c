/*
 * loader.c — loads a Hugging Face model directory onto a backend: config, every weight the
 * architecture needs, and the RoPE frequency table. The memory lives in a weight store and every
 * tensor goes through rs_weight_convert (weight_store.h), the code weight updates use as well.
 *
 * The loader is a checklist driven by the config: for each tensor the forward pass will read it
 * knows the HF name, the shape and the dtypes it accepts, and it fails on the first tensor that is
 * missing, mis-shaped or of a dtype the kernels cannot read, with a message naming the tensor, its
 * file, and the expected and actual shapes. Matrices (embeddings, projections, router, experts)
 * stay as stored in BF16, F16 or F32 unless the quantization policy (quant.h) makes them FP8;
 * 1-D tensors (norms, biases) are converted to F32 here so no kernel ever reads a half-precision
 * vector. Tensors the checklist does not name (rotary inv_freq buffers, a tied lm_head) are
 * skipped with a debug line.
 *
 * FP8. A matrix the policy quantizes is read into host memory (F16 widened to F32), quantized with
 * rs_fp8_quantize_weight, and only its E4M3 codes [out][in] and fp32 block scales
 * [ceil(out/128)][ceil(in/128)] are uploaded: no BF16 copy stays resident. A matrix an FP8
 * checkpoint stores as F8_E4M3 is copied as it is, with its `<name>_scale_inv` (F32 or BF16,
 * widened to F32), after checking the scale exists, has the block-grid shape and holds finite,
 * non-negative values. Both kinds count in rs_model.n_quantized / quantized_bytes, and one info
 * line reports them against their BF16 size. Two things are warned about rather than refused:
 * an FP8 checkpoint loaded with --quantization bf16 (its FP8 matrices stay FP8), and an FP8
 * checkpoint with attention/MLP matrices stored unquantized that its quantization_config does not
 * list as unconverted (the verl #7443 pattern: a writer that silently skipped the experts); those
 * follow the policy.
 *
 * The checkpoint is mmap'ed (safetensors.c); each tensor is copied straight from the mapping to its
 * backend allocation, and the mapping is dropped before returning, so peak host memory is the page
 * cache plus the largest 1-D tensor, or with FP8 quantization at load the largest matrix's codes
 * and scales plus one 128-row band per thread (matrices are quantized band by band on a pool of
 * every core, which is bit-identical to quantizing them whole: weight_store.h).
 *
 * rope_inv_freq reproduces transformers' float32 arithmetic (modeling_rope_utils.py, 5.x):
 *   inv_freq = 1 / theta ** (arange(0, dim, 2).float() / dim)
 * with `scalar / tensor` evaluated as torch does it, tensor.reciprocal() * scalar, and the llama3
 * smoothing term by term in float32. Given the same base frequencies the llama3 step matches
 * torch bit for bit; the base frequencies use libm powf where torch's CPU kernels use SLEEF's
 * 1-ulp powf, so an occasional entry differs by 1-2 ulp (tests/unit/test_model_load.c).
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernels/fp8.h"
#include "model.h"
#include "quant.h"
#include "safetensors.h"
#include "weight_store.h"

typedef struct loader {
    const char *dir;
    const rs_model_config *cfg;     /* borrowed */
    const rs_quant_policy *qp;      /* borrowed; NULL = matrices as stored */
    rs_st_dir *st;          /* owned while loading */
    bool *used;             /* [rs_st_dir_count] tensors consumed so far */
    rs_weight_store *ws;
    int64_t params;
    /* FP8 matrices: quantized here or stored FP8, their resident bytes and their BF16 size */
    int n_quantized, n_stored_fp8;
    size_t quantized_bytes, quantized_bf16_bytes;
    int n_fp8_against_policy;       /* stored FP8 where the policy would keep the stored dtype */
    int n_unlisted;                 /* FP8 checkpoint: eligible, stored unquantized, not listed */
    char first_unlisted[256];
    rs_error *err;
} loader;

enum { KIND_MATRIX, KIND_VECTOR };

static void fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* A safetensors tensor as a conversion source (weight_store.h); its data may be unaligned. */
static rs_weight_src st_src(const rs_st_tensor *t) {
    rs_weight_src s = {.dtype = t->dtype, .ndim = t->ndim, .data = t->data};
    s.shape[0] = t->ndim > 0 ? t->shape[0] : 1;
    s.shape[1] = t->ndim > 1 ? t->shape[1] : 0;
    return s;
}

/* Prefixes err's message with the file the tensor came from. */
static int in_file(rs_error *err, int rc, const char *file) {
    if (!err) return rc;
    char msg[sizeof err->message];
    const size_t cap = sizeof msg, fl = strlen(file), ml = strnlen(err->message, cap - 1);
    if (fl + 2 >= cap) return rc;
    const size_t keep = RS_MIN(ml, cap - 1 - fl - 2);
    memcpy(msg, file, fl);
    memcpy(msg + fl, ": ", 2);
    memcpy(msg + fl + 2, err->message, keep);
    msg[fl + 2 + keep] = '\0';
    memcpy(err->message, msg, cap);
    return rc;
}

static void count_fp8(loader *L, const rs_tensor *t) {
    const size_t n = (size_t)rs_tensor_numel(t);
    L->n_quantized++;
    L->quantized_bytes += n + (size_t)(rs_fp8_blocks(t->shape[0]) * rs_fp8_blocks(t->shape[1])) * sizeof(float);
    L->quantized_bf16_bytes += 2 * n;
}

/* Quantizes a BF16/F16/F32 matrix `t` ([out][in], shape already checked) on the host and uploads
 * its E4M3 codes and block scales into *out (rs_weight_convert, the same code weight updates use). */
static int load_quantized(loader *L, rs_tensor *out, const rs_st_tensor *t, const char *name) {
    rs_weight_src src = st_src(t);
    int rc = rs_weight_convert(L->ws, name, RS_DTYPE_E4M3, &src, out, L->err);
    if (rc == RS_OK) count_fp8(L, out);
    return rc;
}

/* Copies an F8_E4M3 matrix of an FP8 checkpoint ([out][in], shape already checked) and its
 * `<name>_scale_inv` into *out, unchanged (scales widened to F32 and checked finite, >= 0). */
static int load_stored_fp8(loader *L, rs_tensor *out, const rs_st_tensor *t, const char *name, const char *file) {
    const int64_t rows = out->shape[0], cols = out->shape[1];
    const int64_t want[2] = {rs_fp8_blocks(rows), rs_fp8_blocks(cols)};
    char sname[300], want_s[64], got_s[128];
    snprintf(sname, sizeof sname, "%s_scale_inv", name);
    fmt_shape(want_s, sizeof want_s, 2, want);
    size_t index;
    const char *sfile;
    const rs_st_tensor *s = rs_st_dir_find(L->st, sname, &index, &sfile);
    if (!s)
        return rs_error_set(L->err, RS_EFORMAT, sname,
                            "%s: FP8 tensor '%s' has no scale tensor '%s' (expected F32 %s, one scale per 128x128 "
                            "block)", file, name, sname, want_s);
    L->used[index] = true;
    fmt_shape(got_s, sizeof got_s, s->ndim, s->shape);
    if (s->ndim != 2 || s->shape[0] != want[0] || s->shape[1] != want[1])
        return rs_error_set(L->err, RS_EFORMAT, sname,
                            "%s: scale tensor '%s' has shape %s, expected %s = [ceil(%lld/128), ceil(%lld/128)]",
                            sfile, sname, got_s, want_s, (long long)rows, (long long)cols);
    if (s->dtype != RS_DTYPE_F32 && s->dtype != RS_DTYPE_BF16)
        return rs_error_set(L->err, RS_EUNSUPPORTED, sname, "%s: scale tensor '%s' has dtype %s, expected F32 or BF16",
                            sfile, sname, s->st_dtype);
    rs_weight_src src = st_src(t);
    src.scale_inv = s->data;
    src.scale_dtype = s->dtype;
    int rc = rs_weight_convert(L->ws, name, RS_DTYPE_E4M3, &src, out, L->err);
    if (rc != RS_OK) return in_file(L->err, rc, sfile);
    count_fp8(L, out);
    L->n_stored_fp8++;
    return RS_OK;
}

/* Loads the tensor named by fmt... with the expected shape ([d0] or [d0][d1]) into *out. `layer`
 * is the decoder layer it belongs to, -1 for none (for the quantization policy). */
static int load_tensor(loader *L, rs_tensor *out, int kind, int layer, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));

static int load_tensor(loader *L, rs_tensor *out, int kind, int layer, int64_t d0, int64_t d1, const char *fmt, ...) {
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    int ndim = kind == KIND_MATRIX ? 2 : 1;
    int64_t want[2] = {d0, d1};
    char want_s[64], got_s[128];
    fmt_shape(want_s, sizeof want_s, ndim, want);

    size_t index;
    const char *file;
    const rs_st_tensor *t = rs_st_dir_find(L->st, name, &index, &file);
    if (!t)
        return rs_error_set(L->err, RS_EFORMAT, name, "%s: missing tensor '%s' (expected shape %s)", L->dir, name,
                            want_s);
    L->used[index] = true;
    fmt_shape(got_s, sizeof got_s, t->ndim, t->shape);
    if (t->ndim != ndim || t->shape[0] != d0 || (ndim == 2 && t->shape[1] != d1))
        return rs_error_set(L->err, RS_EFORMAT, name, "%s: tensor '%s' has shape %s, expected %s", file, name, got_s,
                            want_s);

    memset(out, 0, sizeof *out);
    out->ndim = ndim;
    out->shape[0] = d0;
    out->shape[1] = ndim == 2 ? d1 : 0;
    const bool eligible = kind == KIND_MATRIX && rs_quant_eligible(name, NULL);
    if (t->dtype == RS_DTYPE_E4M3 && L->cfg->fp8_checkpoint && eligible) {
        L->params += rs_tensor_numel(out);
        if (!rs_quant_should_quantize(L->qp, L->cfg, name, layer)) L->n_fp8_against_policy++;
        return load_stored_fp8(L, out, t, name, file);
    }
    if (t->dtype == RS_DTYPE_E4M3 && L->cfg->fp8_checkpoint)
        return rs_error_set(L->err, RS_EUNSUPPORTED, name,
                            "%s: tensor '%s' has dtype F8_E4M3; only attention and MLP/expert projections may be "
                            "FP8 (embeddings, lm_head, norms, biases and the MoE router are BF16, F16 or F32)",
                            file, name);
    static const char fp8_hint[] = " (F8_E4M3 matrices need a config.json quantization_config "
                                   "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]})";
    if (t->dtype != RS_DTYPE_BF16 && t->dtype != RS_DTYPE_F16 && t->dtype != RS_DTYPE_F32)
        return rs_error_set(L->err, RS_EUNSUPPORTED, name, "%s: tensor '%s' has dtype %s, expected BF16, F16 or F32%s",
                            file, name, t->st_dtype, t->dtype == RS_DTYPE_E4M3 ? fp8_hint : "");
    L->params += rs_tensor_numel(out);
    if (eligible && L->cfg->fp8_checkpoint && !rs_quant_listed(L->cfg->fp8_not_converted, name) &&
        L->n_unlisted++ == 0)
        snprintf(L->first_unlisted, sizeof L->first_unlisted, "%s", name);
    if ((eligible || (kind == KIND_MATRIX && rs_quant_is_head(L->cfg, name))) &&
        rs_quant_should_quantize(L->qp, L->cfg, name, layer))
        return load_quantized(L, out, t, name);

    /* matrices as stored, vectors widened to F32 */
    rs_weight_src src = st_src(t);
    int rc = rs_weight_convert(L->ws, name, kind == KIND_MATRIX ? t->dtype : RS_DTYPE_F32, &src, out, L->err);
    return rc == RS_OK ? RS_OK : in_file(L->err, rc, file);
}

static int load_layer(loader *L, const rs_model_config *c, int l, rs_layer_weights *w, rs_tensor *experts) {
    const int64_t h = c->hidden, hd = c->head_dim, q = (int64_t)c->n_heads * hd, kv = (int64_t)c->n_kv_heads * hd;
    const char *pre = "model.layers";
    int rc;
    if ((rc = load_tensor(L, &w->attn_norm, KIND_VECTOR, l, h, 0, "%s.%d.input_layernorm.weight", pre, l))) return rc;
    if ((rc = load_tensor(L, &w->mlp_norm, KIND_VECTOR, l, h, 0, "%s.%d.post_attention_layernorm.weight", pre, l)))
        return rc;
    if ((rc = load_tensor(L, &w->wq, KIND_MATRIX, l, q, h, "%s.%d.self_attn.q_proj.weight", pre, l))) return rc;
    if ((rc = load_tensor(L, &w->wk, KIND_MATRIX, l, kv, h, "%s.%d.self_attn.k_proj.weight", pre, l))) return rc;
    if ((rc = load_tensor(L, &w->wv, KIND_MATRIX, l, kv, h, "%s.%d.self_attn.v_proj.weight", pre, l))) return rc;
    if ((rc = load_tensor(L, &w->wo, KIND_MATRIX, l, h, q, "%s.%d.self_attn.o_proj.weight", pre, l))) return rc;
    if (c->qkv_bias) {
        if ((rc = load_tensor(L, &w->bq, KIND_VECTOR, l, q, 0, "%s.%d.self_attn.q_proj.bias", pre, l))) return rc;
        if ((rc = load_tensor(L, &w->bk, KIND_VECTOR, l, kv, 0, "%s.%d.self_attn.k_proj.bias", pre, l))) return rc;
        if ((rc = load_tensor(L, &w->bv, KIND_VECTOR, l, kv, 0, "%s.%d.self_attn.v_proj.bias", pre, l))) return rc;
    }
    if (c->qk_norm) {
        if ((rc = load_tensor(L, &w->q_norm, KIND_VECTOR, l, hd, 0, "%s.%d.self_attn.q_norm.weight", pre, l)))
            return rc;
        if ((rc = load_tensor(L, &w->k_norm, KIND_VECTOR, l, hd, 0, "%s.%d.self_attn.k_norm.weight", pre, l)))
            return rc;
    }
    if (!c->layer_is_moe[l]) {
        const int64_t in = c->intermediate;
        if ((rc = load_tensor(L, &w->w_gate, KIND_MATRIX, l, in, h, "%s.%d.mlp.gate_proj.weight", pre, l))) return rc;
        if ((rc = load_tensor(L, &w->w_up, KIND_MATRIX, l, in, h, "%s.%d.mlp.up_proj.weight", pre, l))) return rc;
        if ((rc = load_tensor(L, &w->w_down, KIND_MATRIX, l, h, in, "%s.%d.mlp.down_proj.weight", pre, l))) return rc;
        return RS_OK;
    }
    const int64_t mi = c->moe_intermediate, ne = c->n_experts;
    w->e_gate = experts;
    w->e_up = experts + ne;
    w->e_down = experts + 2 * ne;
    if ((rc = load_tensor(L, &w->router, KIND_MATRIX, l, ne, h, "%s.%d.mlp.gate.weight", pre, l))) return rc;
    for (int e = 0; e < ne; e++) {
        const char *ex = "mlp.experts";
        if ((rc = load_tensor(L, &w->e_gate[e], KIND_MATRIX, l, mi, h, "%s.%d.%s.%d.gate_proj.weight", pre, l, ex, e)))
            return rc;
        if ((rc = load_tensor(L, &w->e_up[e], KIND_MATRIX, l, mi, h, "%s.%d.%s.%d.up_proj.weight", pre, l, ex, e)))
            return rc;
        if ((rc = load_tensor(L, &w->e_down[e], KIND_MATRIX, l, h, mi, "%s.%d.%s.%d.down_proj.weight", pre, l, ex, e)))
            return rc;
    }
    return RS_OK;
}

static int load_weights(loader *L, rs_model *m) {
    const rs_model_config *c = &m->cfg;
    int rc;
    if ((rc = load_tensor(L, &m->embed, KIND_MATRIX, -1, c->vocab_size, c->hidden, "model.embed_tokens.weight")))
        return rc;
    m->layers = rs_xcalloc((size_t)c->n_layers, sizeof *m->layers);
    int n_moe = 0;
    for (int l = 0; l < c->n_layers; l++) n_moe += c->layer_is_moe[l];
    rs_tensor *experts = n_moe ? rs_weight_store_experts(L->ws, (size_t)n_moe * 3 * (size_t)c->n_experts) : NULL;
    for (int l = 0, k = 0; l < c->n_layers; l++) {
        rs_tensor *ex = c->layer_is_moe[l] ? experts + (size_t)(k++) * 3 * (size_t)c->n_experts : NULL;
        if ((rc = load_layer(L, c, l, &m->layers[l], ex)) != RS_OK) return rc;
    }
    if ((rc = load_tensor(L, &m->final_norm, KIND_VECTOR, -1, c->hidden, 0, "model.norm.weight"))) return rc;
    if (c->tie_embeddings) {
        /* transformers (5.x) does not tie when the checkpoint holds an lm_head.weight that differs
         * from the embedding: it computes the logits with lm_head.weight. Serving the embedding
         * would silently be another model, and untying would leave a push of a tied trainer's
         * embed_tokens without its output projection: refuse, and say how to serve it. */
        size_t index;
        const char *file;
        const rs_st_tensor *lm = rs_st_dir_find(L->st, "lm_head.weight", &index, &file);
        const rs_st_tensor *em = rs_st_dir_find(L->st, "model.embed_tokens.weight", NULL, NULL);
        if (lm) {
            if (!em || lm->dtype != em->dtype || lm->nbytes != em->nbytes || lm->ndim != em->ndim ||
                memcmp(lm->shape, em->shape, sizeof lm->shape) != 0 || memcmp(lm->data, em->data, lm->nbytes) != 0)
                return rs_error_set(L->err, RS_EUNSUPPORTED, "tie_word_embeddings",
                                    "%s: config.json has tie_word_embeddings true, but the checkpoint's "
                                    "lm_head.weight differs from model.embed_tokens.weight (transformers computes "
                                    "the logits with lm_head.weight then): set tie_word_embeddings to false to "
                                    "serve it", file);
            L->used[index] = true; /* the same tensor, stored twice */
        }
        m->lm_head = m->embed;
        return RS_OK;
    }
    return load_tensor(L, &m->lm_head, KIND_MATRIX, -1, c->vocab_size, c->hidden, "lm_head.weight");
}

/* transformers' inverse frequencies in float32 (see the top of this file). Python's `a / t` for a
 * scalar a and float tensor t is t.reciprocal() * a, hence the reciprocals. */
static void rope_inv_freq(const rs_model_config *c, float *out /* [head_dim/2] */) {
    const int dim = c->head_dim;
    const float base = (float)c->rope_theta;
    for (int i = 0; i < dim / 2; i++) out[i] = 1.0f / powf(base, (float)(2 * i) / (float)dim);
    if (c->rope_scaling != RS_ROPE_SCALING_LLAMA3) return;

    const double ocl = (double)c->rope_original_max_position;
    const float factor = (float)c->rope_factor;
    const float low = (float)c->rope_low_freq_factor;
    const float low_wavelen = (float)(ocl / c->rope_low_freq_factor);   /* python float, compared as f32 */
    const float high_wavelen = (float)(ocl / c->rope_high_freq_factor);
    const float span = (float)(c->rope_high_freq_factor - c->rope_low_freq_factor);
    const float two_pi = (float)(2.0 * M_PI);
    for (int i = 0; i < dim / 2; i++) {
        const float inv = out[i];
        const float wavelen = (1.0f / inv) * two_pi;
        const float scaled = wavelen > low_wavelen ? inv / factor : inv;
        const float smooth = ((1.0f / wavelen) * (float)ocl - low) / span;
        const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
        const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        out[i] = medium ? smoothed : scaled;
    }
}

void rs_model_free(rs_model *m) {
    if (!m) return;
    rs_weight_store_free(m->store);
    free(m->layers);
    free(m->rope_inv_freq);
    free(m);
}

rs_model *rs_model_view(const rs_model *m, rs_backend *b) {
    const rs_model_config *c = &m->cfg;
    int n_moe = 0;
    for (int l = 0; l < c->n_layers; l++) n_moe += m->layers[l].e_gate != NULL;
    const size_t ne = (size_t)c->n_experts, layers = (size_t)c->n_layers * sizeof *m->layers;
    /* one allocation: the struct, the layers, then every MoE layer's expert arrays */
    rs_model *v = rs_xmalloc(sizeof *v + layers + (size_t)n_moe * 3 * ne * sizeof(rs_tensor));
    *v = *m;
    v->backend = b ? b : m->backend;
    v->layers = (rs_layer_weights *)(v + 1);
    memcpy(v->layers, m->layers, layers);
    rs_tensor *ex = (rs_tensor *)((char *)v->layers + layers);
    for (int l = 0; l < c->n_layers; l++) {
        rs_layer_weights *w = &v->layers[l];
        if (!w->e_gate) continue;
        memcpy(ex, m->layers[l].e_gate, ne * sizeof *ex);
        memcpy(ex + ne, m->layers[l].e_up, ne * sizeof *ex);
        memcpy(ex + 2 * ne, m->layers[l].e_down, ne * sizeof *ex);
        w->e_gate = ex, w->e_up = ex + ne, w->e_down = ex + 2 * ne;
        ex += 3 * ne;
    }
    return v;
}

void rs_model_view_free(rs_model *v) { free(v); }

/* The quantization summary: one info line, and the warnings described at the top of this file. */
static void log_quantization(const loader *L, rs_model *m) {
    m->n_quantized = L->n_quantized;
    m->quantized_bytes = L->quantized_bytes;
    m->quantized_bf16_bytes = L->quantized_bf16_bytes;
    const char *mode = L->qp ? rs_quant_mode_name(L->qp->mode) : "bf16";
    if (L->n_fp8_against_policy)
        RS_WARN("model | %s: the checkpoint is FP8 (quantization_config); %d of its F8_E4M3 matrices are served "
                "FP8 although the policy (--quantization %s, quant-ignore, bf16-first/last-layers) would keep "
                "them as stored",
                L->dir, L->n_fp8_against_policy, mode);
    if (L->n_unlisted)
        RS_WARN("model | %s: FP8 checkpoint with %d attention/MLP matrices stored unquantized and not listed in "
                "quantization_config.modules_to_not_convert / ignored_layers (first: %s); they follow "
                "--quantization %s", L->dir, L->n_unlisted, L->first_unlisted, mode);
    if (!L->n_quantized) {
        RS_INFO("model | quantization %s: no FP8 matrices, all as stored", mode);
        return;
    }
    const double mib = 1.0 / (1 << 20);
    char stored[64] = "";
    if (L->n_stored_fp8) snprintf(stored, sizeof stored, "; %d stored FP8 in the checkpoint", L->n_stored_fp8);
    RS_INFO("model | quantization fp8: %d tensors, %.1f MiB (BF16 would be %.1f MiB, ratio %.3f)%s", L->n_quantized,
            (double)L->quantized_bytes * mib, (double)L->quantized_bf16_bytes * mib,
            (double)L->quantized_bytes / (double)L->quantized_bf16_bytes, stored);
}

int rs_model_load(const char *dir, rs_backend *b, const rs_quant_policy *qp, rs_model **out, rs_error *err) {
    double t0 = rs_now_s();
    loader L = {.dir = dir, .qp = qp, .err = err};
    rs_pool *pool = NULL;
    rs_model *m = rs_xcalloc(1, sizeof *m);
    int rc;
    if (strlen(dir) >= sizeof m->path) {
        rc = rs_error_set(err, RS_EINVAL, NULL, "model path too long (%zu bytes)", strlen(dir));
        goto fail;
    }
    snprintf(m->path, sizeof m->path, "%s", dir);
    m->backend = b;
    if ((rc = rs_model_config_load(dir, &m->cfg, err)) != RS_OK) goto fail;
    L.cfg = &m->cfg;
    if ((rc = rs_st_dir_open(&L.st, dir, err)) != RS_OK) goto fail;
    m->store = L.ws = rs_weight_store_new(b);
    pool = rs_pool_init(0); /* start-up: quantize matrices on every core */
    rs_weight_store_set_pool(L.ws, pool);
    L.used = rs_xcalloc(rs_st_dir_count(L.st) + 1, sizeof *L.used);
    if ((rc = load_weights(&L, m)) != RS_OK) goto fail;

    for (size_t i = 0; i < rs_st_dir_count(L.st); i++) {
        const char *file;
        const rs_st_tensor *t = rs_st_dir_tensor_at(L.st, i, &file);
        if (!L.used[i]) RS_DEBUG("model | ignoring tensor '%s' in %s", t->name, file);
    }
    m->weight_bytes = rs_weight_store_bytes(m->store);
    log_quantization(&L, m);
    m->rope_inv_freq = rs_xcalloc((size_t)m->cfg.head_dim / 2, sizeof *m->rope_inv_freq);
    rope_inv_freq(&m->cfg, m->rope_inv_freq);

    const rs_model_config *c = &m->cfg;
    int n_moe = 0;
    for (int l = 0; l < c->n_layers; l++) n_moe += c->layer_is_moe[l];
    RS_INFO("model | %s | %s | layers %d (moe %d) hidden %d heads %d/%d head_dim %d vocab %d | params %.1fM | "
            "%.1f MiB on %s | %.2f s",
            dir, rs_arch_name(c->arch), c->n_layers, n_moe, c->hidden, c->n_heads, c->n_kv_heads, c->head_dim,
            c->vocab_size, (double)L.params / 1e6, (double)m->weight_bytes / (1 << 20), rs_backend_name(b),
            rs_now_s() - t0);
    rs_weight_store_set_pool(m->store, NULL);
    rs_pool_free(pool);
    rs_st_dir_close(L.st);
    free(L.used);
    *out = m;
    return RS_OK;

fail:
    rs_pool_free(pool);
    rs_st_dir_close(L.st);
    free(L.used);
    rs_model_free(m);
    return rc;
}
